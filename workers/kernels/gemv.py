"""Weight-streaming linear for small batches (issue 25): y = x @ w.T for x [M, K] with M <= 8, with the decoder
layer's small ops fused into it.

At batch 1-8 a decode step's GEMMs read every weight once and do almost no math, so their time is the weights'
bytes over the bandwidth the kernel reaches: cuBLAS reads the 7B's weights at 3.2-4.1 TB/s on the H200. This kernel
gives each program BLOCK_N rows of w (contiguous along K, so each row streams in wide loads) and multiplies them with
the M input rows padded to 16 on the tensor cores (the math is free here; the padding keeps registers for the loads),
accumulating in fp32. Each program reads all of x (a few KB, from L2), so the op that makes x can run inside it:
- `norm=(weight, eps)`: x is the residual stream and the product takes RMSNorm(x), rounded as
  workers/kernels/fused.py's norm rounds it: for one row in the GEMV (each program computes the row's rstd in a
  first pass over x), for more as fused.py's norm kernel first (NORM_PROLOGUE_ROWS);
- `silu=True`: w is a merged gate/up weight [2I, K]; each program owns matching gate and up rows and writes
  silu(gate) * up [M, I], rounded as `silu_mul` rounds the merged output (the down GEMV then reads half the bytes);
- `residual=r`: r += y in place (rounded in r's dtype, as `add_rms_norm` adds), returned instead of y;
- `bias`: added in fp32 before the one rounding.
`qkv_rope_gemv` is the norm + qkv GEMV that also does what the attention backend would do next: RoPE on the q and
k heads and the K/V write into the paged pool (each program owns matching columns of a head's two halves, the pairs
RoPE rotates together). So a decoder layer at batch 1 is four launches besides attention (o + residual, norm +
gate/up + silu, down + residual, the next layer's norm + qkv + RoPE + K/V write) instead of eight, and at batch 2-8
six (the two norms apart) (workers/model/llama.py, `--decode-gemv-rows`).

Launch configs: `GEMV_CONFIGS` holds the best config per weight shape measured on the H200 (2026-12-05,
`python -m workers.tools.kernel_bench --gemv`, docs/perf.md: 8% faster than cuBLAS over a batch-1 step's weights,
3.9-4.2 TB/s; no faster at batch 4-8; on another H200 on 2026-12-06 1.8% faster, and whole decode steps on the
fused path no faster at batch 1); an H100 takes its own (`GEMV_CONFIGS_BY_GPU`: with the H200's it was 1%
faster than cuBLAS at batch 1 and 1% slower at 4-8, with its own 3-5% faster: docs/perf.md, stop 42); other shapes
take `GEMV_CONFIG`. A GPU with less shared memory per block (an A100's 163 KB: the qkv and o shapes' configs lose
a stage; sm_86 / sm_89: 99 KB) runs them with fewer pipeline stages, as many as fit (`_launch`). The CPU tests run
it under Triton's interpreter.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl

    from triton.runtime.errors import OutOfResources

    from workers.kernels.fused import INTERPRETED, rms_norm, rope_rotate
except ImportError:  # CPU-only installs
    triton = None

MAX_M = 8
# The norm runs in the GEMV's prologue for at most this many rows, above as its own kernel first. Every program
# computes the rows' rstd before streaming its weights, and that pass grows with the rows: on an H100 (2026-12-06,
# kernel_bench --gemv, a step's layers) the fused path ran 1.02x cuBLAS at one row, 0.88x at 4 and 0.80x at 8, while
# the GEMV with the norm apart ran 1.02x at all three; with this split, 1.05x at 1, 4 and 8 (whole decode steps
# 1.07-1.08x at batch 1-8: docs/perf.md, stop 45).
NORM_PROLOGUE_ROWS = 1
# (BLOCK_N, BLOCK_K, num_warps, num_stages); the bench sweeps GEMV_GRID and prints the best per shape
GEMV_CONFIG = {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4}
GEMV_GRID = {"BLOCK_N": [16, 32, 64], "BLOCK_K": [128, 256, 512], "num_warps": [4], "num_stages": [3, 5]}
# (N, K) -> the best config at batch 1 on the H200: the Mistral-7B shape's qkv, o, gate/up, down and lm_head
GEMV_CONFIGS = {
    (6144, 4096): {"BLOCK_N": 64, "BLOCK_K": 512, "num_warps": 4, "num_stages": 3},
    (4096, 4096): {"BLOCK_N": 32, "BLOCK_K": 512, "num_warps": 4, "num_stages": 5},
    (28672, 4096): {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
    (4096, 14336): {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 5},
    (32000, 4096): {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
}
# the same shapes' best at batch 1 on an H100 80GB HBM3 (2026-12-05, stop 42: 4.864 ms for a batch-1 step's weights
# against 5.066 with the H200's configs and 5.131 with cuBLAS; gate/up from whole steps, 2026-12-07, stop 57: a
# batch-1 step 5.42-5.45 ms against 5.53 with stop 42's 32/512/5, batch 2-8 no slower); chosen by the device's name
GEMV_CONFIGS_BY_GPU = {"H100": {
    (6144, 4096): {"BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3},
    (4096, 4096): {"BLOCK_N": 32, "BLOCK_K": 512, "num_warps": 4, "num_stages": 5},
    (28672, 4096): {"BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3},
    (4096, 14336): {"BLOCK_N": 32, "BLOCK_K": 512, "num_warps": 4, "num_stages": 3},
    (32000, 4096): {"BLOCK_N": 32, "BLOCK_K": 512, "num_warps": 4, "num_stages": 3},
}}

if triton is not None:
    @triton.jit
    def _rstd(x_ptr, M, K, stride_xm, eps, RSTD_K: tl.constexpr):
        """RMSNorm's 1 / rms of each input row [16] (rows past M: 0), over all of K: a row at a time, RSTD_K of it per
        load (all of a hidden size up to 4,096 in one load; in the GEMV's BLOCK_K tiles of 16 rows, 2026-12-06, the
        gate/up config's 128 made it a chain of 32 loads before the weights streamed)."""
        ms = tl.arange(0, 16)
        rstd = tl.zeros((16,), tl.float32)
        for m in range(0, M):
            sq = tl.zeros((RSTD_K,), tl.float32)
            for k0 in range(0, K, RSTD_K):
                ks = k0 + tl.arange(0, RSTD_K)
                xf = tl.load(x_ptr + m * stride_xm + ks, mask=ks < K, other=0.0).to(tl.float32)
                sq += xf * xf
            rstd = tl.where(ms == m, tl.rsqrt(tl.sum(sq, 0) / K + eps), rstd)
        return rstd

    @triton.jit
    def _times_w(acc, x_ptr, w_ptr, nw_ptr, rows, row_ok, M, rstd, K, stride_xm, stride_wn, dtype,
                 BLOCK_K: tl.constexpr, NORMED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        """acc [16, len(rows)] += (x, normalised if NORMED) @ w[rows].T, streaming w along K. x's M rows are loaded
        as 16 (the tensor cores' least), the rows past M masked to zeros: a masked row reads no memory, and the
        prologue's arithmetic on it is small next to the dot's. (Broadcasting M rounded up to a power of two to 16
        instead, 2026-12-05, was slowest at M = 2-4: stop 43 in docs/perf.md.)"""
        ms = tl.arange(0, 16)
        m_ok = ms < M
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            w = tl.load(w_ptr + rows[:, None] * stride_wn + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptr + ms[:, None] * stride_xm + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if NORMED:  # normalised in fp32, cast to x's dtype, then * weight (fused.py's _rms_norm_kernel)
                y = (x.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)
                nw = tl.load(nw_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
                x = (nw[None, :] * y).to(dtype)
            if UPCAST:  # (Triton's interpreter: its bf16 dot is wrong)
                x, w = x.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        return acc

    @triton.jit
    def _gemv(x_ptr, w_ptr, b_ptr, nw_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, eps,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RSTD_K: tl.constexpr, NORMED: tl.constexpr,
              SILU: tl.constexpr, BIAS: tl.constexpr, RESIDUAL: tl.constexpr, UPCAST: tl.constexpr,
              PRECISION: tl.constexpr):
        """Program p owns BLOCK_N rows of w; with SILU (w a merged gate/up weight [2N, K]) BLOCK_N / 2 gate rows and
        the same up rows, and writes silu(gate) * up for those columns."""
        if SILU:
            HALF_N: tl.constexpr = BLOCK_N // 2
            i = tl.arange(0, BLOCK_N)
            cols = tl.program_id(0) * HALF_N + tl.arange(0, HALF_N)
            rows = tl.program_id(0) * HALF_N + i % HALF_N + i // HALF_N * N
            row_ok = tl.program_id(0) * HALF_N + i % HALF_N < N
        else:
            cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
            rows = cols
            row_ok = rows < N
        dtype = x_ptr.dtype.element_ty
        if NORMED:
            rstd = _rstd(x_ptr, M, K, stride_xm, eps, RSTD_K)
        else:
            rstd = tl.zeros((16,), tl.float32)
        acc = _times_w(tl.zeros((16, BLOCK_N), tl.float32), x_ptr, w_ptr, nw_ptr, rows, row_ok, M, rstd, K,
                       stride_xm, stride_wn, dtype, BLOCK_K, NORMED, UPCAST, PRECISION)
        if BIAS:
            acc += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
        out = acc.to(dtype)
        if SILU:  # silu(gate) * up, rounded as fused.py's _silu_mul_kernel rounds it
            gate, up = tl.split(tl.permute(tl.reshape(out, (16, 2, HALF_N)), (0, 2, 1)))
            g = gate.to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
            out = (act * up.to(tl.float32)).to(dtype)
        ms = tl.arange(0, 16)
        mask = (ms < M)[:, None] & (cols[None, :] < N)
        at = y_ptr + ms[:, None] * stride_ym + cols[None, :]
        if RESIDUAL:  # y is the residual: y += out, the sum in its dtype (as torch's `residual + x` rounds it)
            res = tl.load(at, mask=mask, other=0.0)
            out = (out.to(tl.float32) + res.to(tl.float32)).to(res.dtype)
        tl.store(at, out, mask=mask)

    @triton.jit
    def _qkv_rope(x_ptr, w_ptr, b_ptr, nw_ptr, y_ptr, pos_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr,
                  M, K, stride_xm, stride_wn, stride_ym, s_cos, s_cb, s_ct, s_ch, eps, HQ, HK,
                  D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  RSTD_K: tl.constexpr, NORMED: tl.constexpr, BIAS: tl.constexpr, UPCAST: tl.constexpr,
                  PRECISION: tl.constexpr):
        """RMSNorm (NORMED; else x comes normalised) + the qkv projection, then RoPE on the q and k heads and the
        K/V write into a paged pool that is not int8. Program p owns BLOCK_N / 2 columns of one head's first half
        and the same columns of its second half (the pairs RoPE rotates together)."""
        HALF_N: tl.constexpr = BLOCK_N // 2
        chunks: tl.constexpr = D // BLOCK_N
        head = tl.program_id(0) // chunks
        dl = tl.program_id(0) % chunks * HALF_N + tl.arange(0, HALF_N)  # this program's columns of the first half
        i = tl.arange(0, BLOCK_N)
        rows = head * D + tl.program_id(0) % chunks * HALF_N + i % HALF_N + i // HALF_N * (D // 2)
        ms = tl.arange(0, 16)
        m_ok = ms < M
        dtype = x_ptr.dtype.element_ty
        if NORMED:
            rstd = _rstd(x_ptr, M, K, stride_xm, eps, RSTD_K)
        else:
            rstd = tl.zeros((16,), tl.float32)
        acc = _times_w(tl.zeros((16, BLOCK_N), tl.float32), x_ptr, w_ptr, nw_ptr, rows, rows >= 0, M, rstd, K,
                       stride_xm, stride_wn, dtype, BLOCK_K, NORMED, UPCAST, PRECISION)
        if BIAS:
            acc += tl.load(b_ptr + rows).to(tl.float32)[None, :]
        lo, hi = tl.split(tl.permute(tl.reshape(acc.to(dtype), (16, 2, HALF_N)), (0, 2, 1)))
        if head < HQ + HK:  # a q or k head: RoPE (the tables cast to x's dtype, as fused.py's _rope_tables)
            row = tl.load(pos_ptr + ms, mask=m_ok, other=0).to(tl.int64)[:, None] * s_cos
            c1 = tl.load(cos_ptr + row + dl[None, :]).to(dtype).to(tl.float32)
            c2 = tl.load(cos_ptr + row + D // 2 + dl[None, :]).to(dtype).to(tl.float32)
            s1 = tl.load(sin_ptr + row + dl[None, :]).to(dtype).to(tl.float32)
            s2 = tl.load(sin_ptr + row + D // 2 + dl[None, :]).to(dtype).to(tl.float32)
            lo, hi = rope_rotate(lo, hi, c1, c2, s1, s2)
        at = y_ptr + ms[:, None] * stride_ym + head * D + dl[None, :]
        tl.store(at, lo, mask=m_ok[:, None])
        tl.store(at + D // 2, hi, mask=m_ok[:, None])
        if head >= HQ:  # a k or v head: into the pool at the token's slot (-1, a CUDA-graph padding row: not written)
            slot = tl.load(slot_ptr + ms, mask=m_ok, other=-1).to(tl.int64)
            ok = (slot >= 0)[:, None]
            off = ((slot // PAGE) * s_cb + (slot % PAGE) * s_ct + (head - HQ) % HK * s_ch)[:, None] + dl[None, :]
            if head < HQ + HK:
                tl.store(kc_ptr + off, lo.to(kc_ptr.dtype.element_ty), mask=ok)
                tl.store(kc_ptr + off + D // 2, hi.to(kc_ptr.dtype.element_ty), mask=ok)
            else:
                tl.store(vc_ptr + off, lo.to(vc_ptr.dtype.element_ty), mask=ok)
                tl.store(vc_ptr + off + D // 2, hi.to(vc_ptr.dtype.element_ty), mask=ok)


_STAGES: dict[tuple, int] = {}  # a launch's kernel, dtype and constexprs -> the pipeline stages that fit this GPU


def _launch(kernel, grid: tuple, args: tuple, config: dict, overrides: dict | None, dtype: torch.dtype,
            **constexprs) -> None:
    """kernel[grid](*args, **constexprs) with the dot's constexprs for x's dtype (UPCAST under the interpreter,
    PRECISION) and config's warps and pipeline stages (config: the shape's, the caller's overrides on top); fewer
    stages where the GPU has less shared memory per block than the one the configs were tuned on (GEMV_CONFIGS: the
    H200's 227 KB; an A100 has 163 KB, sm_86 / sm_89 99 KB): Triton refuses such a launch before it starts, so
    nothing ran. The first launch of each variant finds its stages (the runner's warm-up, before any CUDA graph
    capture). Overrides that name the stages (a benchmark's sweep) run them as given, and the refusal is raised."""
    constexprs.update(UPCAST=INTERPRETED, PRECISION="ieee" if dtype == torch.float32 else "tf32")
    if "num_stages" in (overrides or {}):
        kernel[grid](*args, **constexprs, num_warps=config["num_warps"], num_stages=config["num_stages"])
        return
    key = (kernel, dtype, config["num_stages"], config["num_warps"], *constexprs.items())
    stages = _STAGES.get(key, config["num_stages"])
    while True:
        try:
            kernel[grid](*args, **constexprs, num_warps=config["num_warps"], num_stages=stages)
            break
        except OutOfResources as exc:
            if exc.name != "shared memory" or stages <= 1:
                raise
            stages -= 1
    _STAGES[key] = stages


def _norm_first(x: torch.Tensor, norm: tuple[torch.Tensor, float] | None):
    """(x, norm) for a GEMV whose prologue may take the norm: as given at up to NORM_PROLOGUE_ROWS rows; above, x
    normalised by fused.py's kernel first (rounded to x's dtype, as the prologue rounds it) and no norm left."""
    if norm is None or x.shape[0] <= NORM_PROLOGUE_ROWS:
        return x, norm
    return rms_norm(x, *norm).to(x.dtype), None


def _rstd_k(k: int) -> int:
    """The norm's first pass reads this much of a row per load (_rstd)."""
    return min(triton.next_power_of_2(k), 4096)


@functools.cache
def _tuned_configs() -> dict:
    """GEMV_CONFIGS_BY_GPU's table for this process's GPU (by name), else GEMV_CONFIGS (the H200's; the CPU's)."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((t for gpu, t in GEMV_CONFIGS_BY_GPU.items() if gpu in name), GEMV_CONFIGS)


_OVERRIDES: dict = {}  # [n, k] -> config, before the tuned table's (use_configs)


def use_configs(overrides: dict | None) -> None:
    """For workers.tools.gemv_tune: launch configs for these [n, k] shapes instead of the tuned table's (None: the
    table's again). Read as each GEMV launches: CUDA graphs captured after the call run with them."""
    global _OVERRIDES
    _OVERRIDES = dict(overrides or {})


def gemv_config(n: int, k: int) -> dict:
    """The launch config for a weight of [n, k]: use_configs' for that shape, else the tuned table's entry
    (_tuned_configs), else GEMV_CONFIG."""
    return _OVERRIDES.get((n, k)) or _tuned_configs().get((n, k), GEMV_CONFIG)


def qkv_rope_config(n: int, k: int) -> dict:
    """qkv_rope_gemv's launch config for a merged qkv weight of [n, k]: gemv_config's with BLOCK_K <= 256 (at 512
    the RoPE epilogue spills registers, and ran slower on an H100)."""
    c = gemv_config(n, k)
    return {**c, "BLOCK_K": min(c["BLOCK_K"], 256)}


def gemv(x: torch.Tensor, w: torch.Tensor, config: dict | None = None, *, bias: torch.Tensor | None = None,
         norm: tuple[torch.Tensor, float] | None = None, silu: bool = False, residual: torch.Tensor | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M <= 8, K] (rows contiguous along K) @ w.T for w [N, K] contiguous: [M, N] in x's dtype (into out if
    given), with the prologue / epilogue the module docstring lists (silu: w is a merged gate/up weight [2I, K] and
    the result [M, I]); with residual, r += y in place and r is returned. config: launch-config overrides on top of
    gemv_config(N, K); pipeline stages it names run as given, others are shed where the GPU lacks the shared memory
    (_launch: a tile of fp32 weights needs twice a bf16 one's)."""
    M = x.shape[0]
    N, K = w.shape
    if (M > MAX_M or x.shape[1] != K or w.stride(1) != 1 or x.stride(1) != 1 or silu and N % 2
            or bias is not None and bias.shape != (N,)):
        raise ValueError(f"gemv takes x [M <= {MAX_M}, K], w [N, K] (silu: N even) contiguous along K and a bias [N], "
                         f"got {tuple(x.shape)}, {tuple(w.shape)} and "
                         f"{None if bias is None else tuple(bias.shape)}")
    n_out = N // 2 if silu else N
    if residual is not None and (residual.shape != (M, n_out) or residual.stride(1) != 1 or out is not None):
        raise ValueError(f"gemv: the residual must be [{M}, {n_out}] contiguous along N (and no out), got "
                         f"{tuple(residual.shape)}")
    x, norm = _norm_first(x, norm)
    c = {**gemv_config(N, K), **(config or {})}
    y = residual if residual is not None else (out if out is not None else
                                               torch.empty(M, n_out, dtype=x.dtype, device=x.device))
    norm_w, eps = norm if norm is not None else (None, 0.0)
    cols = c["BLOCK_N"] // 2 if silu else c["BLOCK_N"]  # output columns a program writes
    _launch(_gemv, (triton.cdiv(n_out, cols),),
            (x, w, bias if bias is not None else w, norm_w if norm_w is not None else w, y, M, n_out, K, x.stride(0),
             w.stride(0), y.stride(0), eps), c, config, x.dtype, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"],
            RSTD_K=_rstd_k(K) if norm is not None else 16, NORMED=norm is not None, SILU=silu, BIAS=bias is not None,
            RESIDUAL=residual is not None)
    return y


def qkv_rope_gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, norm: tuple[torch.Tensor, float],
                  num_heads: int, num_kv_heads: int, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                  out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """gemv(x, w, bias=bias, norm=norm) for a merged qkv weight [(Hq + 2 Hkv) D, K], then what the attention
    backend would do next in the same launch: neox RoPE on the q and k heads (fp32 cos / sin tables [max_len, D]
    whose halves repeat, at positions [M]; `fused.rope_`'s roundings) and the k / v heads written into a paged pool
    that is not int8 (k_cache / v_cache [num_blocks, page, Hkv, D] with the same strides) at slots [M] (-1: skip).
    Returns the qkv rows [M, N], q and k rotated (into out if given). config: as gemv's."""
    M, K = x.shape
    N = w.shape[0]
    D = N // (num_heads + 2 * num_kv_heads)
    if (M > MAX_M or w.shape[1] != K or w.stride(1) != 1 or x.stride(1) != 1 or D * (num_heads + 2 * num_kv_heads)
            != N or k_cache.dtype == torch.int8 or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1
            or cos.stride() != sin.stride() or cos.stride(-1) != 1):
        raise ValueError(f"qkv_rope_gemv takes x [M <= {MAX_M}, K] and a merged qkv weight of {num_heads} + 2 x "
                         f"{num_kv_heads} heads, contiguous along K, and a pool that is not int8, got {tuple(x.shape)} "
                         f"and {tuple(w.shape)}")
    x, norm = _norm_first(x, norm)
    c = {**qkv_rope_config(N, K), **(config or {})}
    block_n = next((b for b in (c["BLOCK_N"], 32, 16) if D % b == 0 and b <= D), None)
    if block_n is None:
        raise ValueError(f"qkv_rope_gemv: head_dim {D} is not a multiple of 16")
    y = out if out is not None else torch.empty(M, N, dtype=x.dtype, device=x.device)
    norm_w, eps = norm if norm is not None else (w, 0.0)
    _launch(_qkv_rope, (N // block_n,),
            (x, w, bias if bias is not None else w, norm_w, y, positions, cos, sin, k_cache, v_cache, slots, M, K,
             x.stride(0), w.stride(0), y.stride(0), cos.stride(0), k_cache.stride(0), k_cache.stride(1),
             k_cache.stride(2), eps, num_heads, num_kv_heads), c, config, x.dtype, D=D,
            PAGE=k_cache.shape[1], BLOCK_N=block_n, BLOCK_K=c["BLOCK_K"], RSTD_K=_rstd_k(K) if norm is not None else 16,
            NORMED=norm is not None, BIAS=bias is not None)
    return y
