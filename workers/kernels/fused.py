"""Fused Triton kernels for the decoder layer's small ops: residual add + RMSNorm, SiLU-and-mul, RoPE.

Owns three kernels and their launchers; knows nothing of the model beyond the math. Each launcher
runs its kernel when the tensor is on CUDA and otherwise a torch fallback that is the model's math
op for op (HF transformers': RMSNorm in fp32, SiLU in the input dtype, RoPE from an fp32 cos/sin
table cast to the input dtype), so the CPU path is exact. The kernels compute in fp32 and round to
the input dtype where torch rounds, so they agree with the fallback to a few ulps (under Triton's
interpreter, which truncates fp32 -> bf16 casts, bf16 results may be an ulp further off).
`USE_TRITON` overrides the choice (tests): True runs the kernels on CPU tensors too, under Triton's
interpreter; False runs the fallbacks on CUDA too.
- `add_rms_norm`: residual += x in place, then RMSNorm(residual); `rms_norm`: the same without the add.
  One program per row.
- `silu_mul`: [T, 2I] (gate then up, a merged gate/up GEMM's output) -> silu(gate) * up [T, I].
- `rope_`: neox-style rotary embedding of q [T, Hq, D] and k [T, Hkv, D] in place, one launch for
  both; any strides (q/k may be views into a merged qkv output). One program per token.
- `rope_write_kv_`: `rope_` and the K/V write into a paged pool that is not int8, in one launch (the Triton
  attention backend's; one launch fewer per layer). Triton only.
- `rope_rotate`: the rotation itself with torch's roundings, a Triton function the RoPE kernels here and
  workers/kernels/gemv.py's qkv GEMV call.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch fallbacks serve
    triton = None

# None: the kernels on CUDA tensors, the fallbacks elsewhere; True / False: always / never the kernels
# (tests; on CPU the kernels need TRITON_INTERPRET=1 set before triton's first import)
USE_TRITON: bool | None = None


def _interpreted() -> bool:
    """Triton's interpreter runs the kernels (TRITON_INTERPRET, read as Triton reads it)."""
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):  # (no triton, or one older than its knobs)
        return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")


# Under the interpreter (the CPU tests) launches take its variants (fp32 dots, small tiles). Not "the tensors are on
# the CPU": workers/tools/compile_check.py compiles the GPU's variants from CPU tensors.
INTERPRETED = _interpreted()


def triton_kernels(x: torch.Tensor) -> bool:
    """Whether the launchers here run their Triton kernels for x (else the torch fallbacks)."""
    if triton is None:
        return False
    return x.is_cuda if USE_TRITON is None else USE_TRITON


# --------------------------------------------------------------------------------------- torch fallbacks
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


# --------------------------------------------------------------------------------------- kernels
if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, s_x, s_r, s_o, N, eps,
                         BLOCK: tl.constexpr, ADD: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        x = tl.load(x_ptr + row * s_x + offs, mask=mask, other=0.0)
        dtype = x.dtype
        if ADD:  # the sum in x's dtype, as torch's `residual + x` rounds it; the norm reads the rounded sum
            x = (x.to(tl.float32) + tl.load(res_ptr + row * s_r + offs, mask=mask, other=0.0).to(tl.float32)).to(dtype)
            tl.store(res_ptr + row * s_r + offs, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
        y = (xf * rstd).to(dtype).to(tl.float32)  # normalised in fp32, cast to the input dtype, then * weight
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * s_o + offs, (w * y).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, s_x, s_o, I, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < I
        gate = tl.load(x_ptr + row * s_x + offs, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * s_x + I + offs, mask=mask, other=0.0).to(tl.float32)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # F.silu rounds to the input dtype
        tl.store(out_ptr + row * s_o + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def rope_rotate(x1, x2, c1, c2, s1, s2):
        """RoPE of the halves x1, x2 (in their dtype) with cos / sin halves (fp32 holding values of x's dtype):
        x * cos + rotate_half(x) * sin, rounded as torch rounds (each product, then the sum, in x's dtype)."""
        dtype = x1.dtype
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        o1 = ((a1 * c1).to(dtype).to(tl.float32) + (-a2 * s1).to(dtype).to(tl.float32)).to(dtype)
        o2 = ((a2 * c2).to(dtype).to(tl.float32) + (a1 * s2).to(dtype).to(tl.float32)).to(dtype)
        return o1, o2

    @triton.jit
    def _rope_heads(ptr, s_h, s_d, H, c1, c2, s1, s2, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
                    BLOCK_HALF: tl.constexpr):
        """One token's H heads in place: out = x * cos + rotate_half(x) * sin, rounded as torch rounds
        (each product, then the sum, in x's dtype). ptr points at the token's row. Returns the two rotated
        halves [BLOCK_H, BLOCK_HALF] and their mask."""
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_HALF)
        mask = (offs_h < H)[:, None] & (offs_d < HALF)[None, :]
        p1 = ptr + offs_h[:, None] * s_h + offs_d[None, :] * s_d
        p2 = p1 + HALF * s_d
        o1, o2 = rope_rotate(tl.load(p1, mask=mask, other=0.0), tl.load(p2, mask=mask, other=0.0), c1, c2, s1, s2)
        tl.store(p1, o1, mask=mask)
        tl.store(p2, o2, mask=mask)
        return o1, o2, mask

    @triton.jit
    def _rope_tables(cos_ptr, sin_ptr, pos, s_cos, dtype, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
        """The token's cos/sin halves [1, BLOCK_HALF]: the fp32 table cast to q's dtype, as the reference's
        cos[positions].to(q.dtype)."""
        offs_d = tl.arange(0, BLOCK_HALF)
        mask_d = offs_d < HALF
        row_c, row_s = cos_ptr + pos * s_cos + offs_d, sin_ptr + pos * s_cos + offs_d
        c1 = tl.load(row_c, mask=mask_d, other=0.0).to(dtype).to(tl.float32)[None, :]
        c2 = tl.load(row_c + HALF, mask=mask_d, other=0.0).to(dtype).to(tl.float32)[None, :]
        s1 = tl.load(row_s, mask=mask_d, other=0.0).to(dtype).to(tl.float32)[None, :]
        s2 = tl.load(row_s + HALF, mask=mask_d, other=0.0).to(dtype).to(tl.float32)[None, :]
        return c1, c2, s1, s2

    @triton.jit
    def _rope_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, s_qt, s_qh, s_qd, s_kt, s_kh, s_kd, s_cos,
                     HQ, HK, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
                     BLOCK_HK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        c1, c2, s1, s2 = _rope_tables(cos_ptr, sin_ptr, pos, s_cos, q_ptr.dtype.element_ty, HALF, BLOCK_HALF)
        _rope_heads(q_ptr + t * s_qt, s_qh, s_qd, HQ, c1, c2, s1, s2, BLOCK_HQ, HALF, BLOCK_HALF)
        _rope_heads(k_ptr + t * s_kt, s_kh, s_kd, HK, c1, c2, s1, s2, BLOCK_HK, HALF, BLOCK_HALF)

    @triton.jit
    def _rope_write_kv_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr,
                              s_qt, s_qh, s_qd, s_kt, s_kh, s_kd, s_vt, s_vh, s_cos, s_cb, s_ct, s_ch,
                              HQ, HK, PAGE: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                              BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr):
        """_rope_kernel, and the token's rotated K and its V written into the paged pool at its slot (a
        non-int8 pool: [num_blocks, PAGE, Hkv, D] each; slot -1, a CUDA-graph padding row: not written)."""
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        c1, c2, s1, s2 = _rope_tables(cos_ptr, sin_ptr, pos, s_cos, q_ptr.dtype.element_ty, HALF, BLOCK_HALF)
        _rope_heads(q_ptr + t * s_qt, s_qh, s_qd, HQ, c1, c2, s1, s2, BLOCK_HQ, HALF, BLOCK_HALF)
        k1, k2, mask = _rope_heads(k_ptr + t * s_kt, s_kh, s_kd, HK, c1, c2, s1, s2, BLOCK_HK, HALF, BLOCK_HALF)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            offs_h = tl.arange(0, BLOCK_HK)
            offs_d = tl.arange(0, BLOCK_HALF)
            at = (slot // PAGE) * s_cb + (slot % PAGE) * s_ct + offs_h[:, None] * s_ch + offs_d[None, :]
            tl.store(kc_ptr + at, k1.to(kc_ptr.dtype.element_ty), mask=mask)
            tl.store(kc_ptr + at + HALF, k2.to(kc_ptr.dtype.element_ty), mask=mask)
            src = v_ptr + t * s_vt + offs_h[:, None] * s_vh + offs_d[None, :]
            vt = vc_ptr.dtype.element_ty
            tl.store(vc_ptr + at, tl.load(src, mask=mask, other=0.0).to(vt), mask=mask)
            tl.store(vc_ptr + at + HALF, tl.load(src + HALF, mask=mask, other=0.0).to(vt), mask=mask)


# --------------------------------------------------------------------------------------- launchers
def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res = residual.view(-1, n) if residual is not None else x2  # a view: the kernel updates it in place
    assert res.stride(-1) == 1, "add_rms_norm: residual must have a unit last stride"
    block = triton.next_power_of_2(n)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res, weight, out, x2.stride(0), res.stride(0), out.stride(0), n, eps,
            BLOCK=block, ADD=residual is not None, num_warps=min(16, max(1, block // 512)),
        )
    return out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32, cast to x's dtype, times weight."""
    if not triton_kernels(x):
        return rms_norm_ref(x, weight, eps)
    return _norm(x, None, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place, in their dtype), then returns rms_norm(residual)."""
    if not triton_kernels(x):
        residual.add_(x)
        return rms_norm_ref(residual, weight, eps)
    return _norm(x, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate columns, then up columns) -> silu(gate) * up [T, I], as HF's SwiGLU MLP."""
    if not triton_kernels(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    x = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(inter))
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(inter, block))](x, out, x.stride(0), out.stride(0), inter,
                                                              BLOCK=block, num_warps=4)
    return out


def rope_write_kv_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """rope_(q, k) and then write_kv(k, v) into a non-int8 paged pool, in one launch (issue 25: one launch
    fewer per layer). k_cache / v_cache [num_blocks, page, Hkv, D] with the same strides; slots [T] (-1: skip).
    Triton only (the attention backend's launch for bf16 / fp16 pools: 1.2-1.6x faster than the two launches on
    the H200, docs/perf.md)."""
    tokens, num_q, dim = q.shape
    num_k = k.shape[1]
    assert cos.stride() == sin.stride() and cos.stride(-1) == 1
    assert k_cache.dtype != torch.int8 and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert v.stride(-1) == 1
    if tokens:
        _rope_write_kv_kernel[(tokens,)](
            q, k, v, positions, cos, sin, k_cache, v_cache, slots, *q.stride(), *k.stride(), v.stride(0), v.stride(1),
            cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), num_q, num_k,
            PAGE=k_cache.shape[1], HALF=dim // 2, BLOCK_HALF=triton.next_power_of_2(dim // 2),
            BLOCK_HQ=triton.next_power_of_2(num_q), BLOCK_HK=triton.next_power_of_2(num_k), num_warps=4,
        )


def rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Neox-style RoPE in place on q [T, Hq, D] and k [T, Hkv, D] (any strides). cos/sin: fp32
    tables [max_len, D] whose halves repeat (RotaryEmbedding); positions [T]. Returns (q, k)."""
    if not triton_kernels(q):
        c = cos[positions].to(q.dtype)[:, None, :]  # [T, 1, D]
        s = sin[positions].to(q.dtype)[:, None, :]
        q.copy_(q * c + _rotate_half(q) * s)
        k.copy_(k * c + _rotate_half(k) * s)
        return q, k
    tokens, num_q, dim = q.shape
    num_k = k.shape[1]
    assert cos.stride() == sin.stride() and cos.stride(-1) == 1
    if tokens:
        _rope_kernel[(tokens,)](
            q, k, positions, cos, sin, *q.stride(), *k.stride(), cos.stride(0), num_q, num_k,
            HALF=dim // 2, BLOCK_HALF=triton.next_power_of_2(dim // 2), BLOCK_HQ=triton.next_power_of_2(num_q),
            BLOCK_HK=triton.next_power_of_2(num_k), num_warps=4,
        )
    return q, k
