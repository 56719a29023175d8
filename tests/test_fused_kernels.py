"""The fused Triton kernels (workers/kernels/fused.py) against their torch fallbacks, which are the
model's HF math; fresh random inputs each run (the seed is in every failure message).

On a GPU the kernels run for real against the fallback on a CPU copy; on CPU (CI) both run on CPU,
the kernels under Triton's interpreter (fused.USE_TRITON). Plus the model's forward with the kernels
against the same forward with the fallbacks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:  # must be set before triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from laneserve.modelspec import TINY_CONFIG  # noqa: E402
from workers.kernels import fused  # noqa: E402
from workers.model.llama import RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
SEED = int.from_bytes(os.urandom(4), "little")
DTYPES = [torch.float32, torch.bfloat16]
# Triton's interpreter casts fp32 -> bf16 by truncation (the GPU rounds to nearest even, as torch):
# on CPU each bf16 rounding may be a whole ulp off
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2 if ON_GPU else 3e-2}


@contextlib.contextmanager
def use_triton(on: bool = True):
    """The Triton path (on CPU tensors too) or, with False, the fallbacks (on CUDA tensors too)."""
    fused.USE_TRITON = on
    try:
        yield
    finally:
        fused.USE_TRITON = None


def randn(*shape, dtype=torch.float32, salt=0):
    g = torch.Generator().manual_seed(SEED + salt)
    return torch.randn(*shape, generator=g).to(dtype)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.cpu().double(), ref.cpu().double()
    return ((a - ref).abs().max() / ref.abs().max()).item()


def strided_rows(t: torch.Tensor, pad: int = 5) -> torch.Tensor:
    """t's values as a view whose rows are `pad` elements further apart than its width."""
    big = torch.zeros(t.shape[0], t.shape[1] + pad, dtype=t.dtype, device=t.device)
    big[:, :t.shape[1]] = t
    return big[:, :t.shape[1]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden,tokens", [(96, 1), (96, 17), (4096, 3)])
def test_add_rms_norm_and_rms_norm(dtype, hidden, tokens):
    x = randn(tokens, hidden, dtype=dtype, salt=1)
    residual = randn(tokens, hidden, dtype=dtype, salt=2) * 4
    weight = (1 + 0.1 * randn(hidden, salt=3)).to(dtype)
    eps = 1e-5
    ref_res = residual.clone()
    ref = fused.add_rms_norm(x, ref_res, weight, eps)
    ref_plain = fused.rms_norm(x, weight, eps)
    res = strided_rows(residual.to(DEVICE))  # the residual stream updated in place through a strided view
    with use_triton():
        out = fused.add_rms_norm(strided_rows(x.to(DEVICE)), res, weight.to(DEVICE), eps)
        plain = fused.rms_norm(x.to(DEVICE), weight.to(DEVICE), eps)
    msg = f"seed {SEED}"
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    if ON_GPU or dtype == torch.float32:
        assert torch.equal(res.cpu(), ref_res), msg  # the add rounds once to dtype, as torch's
    assert rel_err(res, ref_res) < TOL[dtype], msg
    assert rel_err(out, ref) < TOL[dtype], msg
    assert rel_err(plain, ref_plain) < TOL[dtype], msg


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter,tokens", [(96, 1), (1376, 3), (40, 17)])
def test_silu_mul(dtype, inter, tokens):
    gate_up = randn(tokens, 2 * inter, dtype=dtype, salt=4) * 3
    ref = fused.silu_mul(gate_up)
    with use_triton():
        out = fused.silu_mul(strided_rows(gate_up.to(DEVICE)))
    assert out.shape == (tokens, inter) and out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype], f"seed {SEED}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [(1, 4, 2, 32), (3, 6, 2, 96), (17, 5, 5, 16)])
def test_rope_in_place_on_views_into_qkv(dtype, tokens, heads, kv_heads, dim):
    max_len = 300
    rope = RotaryEmbedding(dataclasses.replace(TINY_CONFIG, head_dim=dim, rope_theta=500000.0), max_len)
    positions = torch.randint(0, max_len, (tokens,), generator=torch.Generator().manual_seed(SEED))
    qkv = randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype, salt=5)
    sizes = [heads * dim, kv_heads * dim, kv_heads * dim]

    def views(t):
        q, k, v = t.split(sizes, dim=-1)
        return q.unflatten(-1, (heads, dim)), k.unflatten(-1, (kv_heads, dim)), v

    # the reference is the model's math before this kernel existed: out of place, rotate_half
    q, k, _ = views(qkv)
    cos = rope.cos[positions].to(dtype)[:, None, :]
    sin = rope.sin[positions].to(dtype)[:, None, :]
    rot = lambda x: torch.cat((-x[..., dim // 2:], x[..., :dim // 2]), -1)  # noqa: E731
    ref_q, ref_k = q * cos + rot(q) * sin, k * cos + rot(k) * sin

    fallback = qkv.clone()
    fq, fk, _ = views(fallback)
    fused.rope_(fq, fk, positions, rope.cos, rope.sin)
    assert torch.equal(fq, ref_q) and torch.equal(fk, ref_k)  # the CPU path is the old math, exactly

    got = qkv.to(DEVICE)
    gq, gk, gv = views(got)
    assert tokens == 1 or not (gq.is_contiguous() or gk.is_contiguous())
    with use_triton():
        fused.rope_(gq, gk, positions.to(DEVICE), rope.cos.to(DEVICE), rope.sin.to(DEVICE))
    msg = f"seed {SEED}"
    assert rel_err(gq, ref_q) < TOL[dtype], msg
    assert rel_err(gk, ref_k) < TOL[dtype], msg
    assert torch.equal(gv.cpu(), views(qkv)[2]), msg  # v's columns untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_tiny_model_with_kernels_matches_fallbacks(dtype):
    """The forward wiring on the Triton path (residual stream, RoPE on qkv views, merged GEMMs):
    prefill then one decode step of the tiny model, hidden states against the fallback path."""
    from workers.attention import AttentionMetadata, get_backend
    from workers.kv_cache import KVCache
    from workers.loader import load_model

    device = torch.device(DEVICE)
    cfg = dataclasses.replace(TINY_CONFIG, num_layers=2)
    model = load_model("tiny", cfg, dtype, device, seed=SEED % 1000)
    kv = KVCache(cfg.num_layers, 4, cfg.num_kv_heads, cfg.head_dim, dtype, device)
    backend = get_backend("torch", device, cfg.num_kv_heads)
    model.bind(kv.layer_caches(), backend, 64, kv.layer_scales())
    prompt = torch.randint(0, cfg.vocab_size, (7,), generator=torch.Generator().manual_seed(SEED))

    def run(tokens, start):
        n = len(tokens)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([start + n], dtype=torch.int32, device=device),
            block_tables=torch.tensor([[0]], dtype=torch.int32, device=device),
            slot_mapping=torch.arange(start, start + n, device=device), num_decodes=int(n == 1),
            query_lens_cpu=[n], seq_lens_cpu=[start + n])
        backend.prepare(meta, 16, None)
        positions = torch.arange(start, start + n, device=device)
        return model(tokens.to(device), positions, meta)

    outs = []
    for on in (False, True):
        with torch.inference_mode(), use_triton(on):
            outs.append((run(prompt, 0).cpu(), run(prompt[-1:], len(prompt)).cpu()))
    (ref_prefill, ref_decode), (prefill, decode) = outs
    tol = 1e-4 if dtype == torch.float32 else 5e-2  # two layers of bf16 rounding differences
    assert rel_err(prefill, ref_prefill) < tol, f"seed {SEED}"
    assert rel_err(decode, ref_decode) < tol, f"seed {SEED}"



@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [(1, 4, 2, 32), (5, 6, 2, 64), (9, 5, 5, 16), (4, 3, 3, 80)])
def test_rope_write_kv_is_rope_then_write_kv_in_one_launch(dtype, tokens, heads, kv_heads, dim):
    """rope_write_kv_ (issue 25's fused RoPE + K/V write) leaves q, k and the pool exactly as rope_ then the K/V
    write do (the pool's slot rows set to the rotated k and to v), on views into one qkv output, with a padding row
    (slot -1) written nowhere; also for a head size whose half is not a power of two."""
    max_len, page, blocks = 300, 16, 6
    rope = RotaryEmbedding(dataclasses.replace(TINY_CONFIG, head_dim=dim, rope_theta=10000.0), max_len)
    g = torch.Generator().manual_seed(SEED)
    positions = torch.randint(0, max_len, (tokens,), generator=g)
    slots = torch.randperm(blocks * page, generator=g)[:tokens]
    if tokens > 1:
        slots[tokens // 2] = -1
    qkv = randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype, salt=9).to(DEVICE)
    sizes = [heads * dim, kv_heads * dim, kv_heads * dim]

    def views(t):
        q, k, v = t.split(sizes, dim=-1)
        return q.unflatten(-1, (heads, dim)), k.unflatten(-1, (kv_heads, dim)), v.unflatten(-1, (kv_heads, dim))

    pools = [randn(blocks * page, kv_heads * dim, dtype=dtype, salt=s).to(DEVICE).view(blocks, page, kv_heads, dim)
             for s in (1, 2)]
    cos, sin, pos, sl = rope.cos.to(DEVICE), rope.sin.to(DEVICE), positions.to(DEVICE), slots.to(DEVICE)
    a, b = qkv.clone(), qkv.clone()
    ka, va = (p.clone() for p in pools)
    kb, vb = (p.clone() for p in pools)
    with use_triton():
        qa, k_a, v_a = views(a)
        fused.rope_(qa, k_a, pos, cos, sin)
        keep = sl >= 0
        ka.view(-1, kv_heads, dim)[sl[keep]] = k_a[keep]
        va.view(-1, kv_heads, dim)[sl[keep]] = v_a[keep]
        qb, k_b, v_b = views(b)
        fused.rope_write_kv_(qb, k_b, v_b, pos, cos, sin, kb, vb, sl)
    msg = f"seed {SEED}"
    assert torch.equal(a, b), msg
    assert torch.equal(ka, kb) and torch.equal(va, vb), msg
    assert not torch.equal(ka, pools[0]), msg  # (something was written)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,config", [(1, 96, 160, {}), (3, 40, 300, {"BLOCK_K": 128}),
                                          (8, 70, 520, {"BLOCK_K": 128, "BLOCK_N": 16}), (5, 33, 64, {})])
def test_gemv_is_the_linear_for_small_batches(dtype, m, n, k, config):
    """Ragged N and K (masks), M padded to 16."""
    from workers.kernels.gemv import gemv

    x = randn(m, k, dtype=dtype, salt=1).to(DEVICE)
    w = randn(n, k, dtype=dtype, salt=2).to(DEVICE)
    ref = (x.float() @ w.float().T).cpu()
    got = gemv(x, w, config).float().cpu()
    assert got.shape == (m, n)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got, ref, rtol=tol, atol=tol * ref.abs().max().item()), f"seed {SEED}"
    with pytest.raises(ValueError, match="gemv takes"):
        gemv(torch.zeros(9, k, dtype=dtype, device=DEVICE), w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fuse,config,m,prologue_rows", [  # (prologue_rows 8: the norm in the prologue at any M)
    (fuse, config, m, rows) for fuse, config in [
        ("norm", {}), ("silu", {}), ("residual", {}), ("bias+norm", {}), ("norm+silu", {}), ("bias+norm+silu", {}),
        ("bias+silu", {"BLOCK_N": 16}), ("silu+residual", {"BLOCK_N": 64})]
    for m in (1, 2, 3, 8) for rows in (None, 8) if rows is None or "norm" in fuse and m > 1])
def test_gemv_fuses_the_layers_small_ops(dtype, fuse, config, m, prologue_rows, monkeypatch):
    """Each prologue / epilogue the decoder layer's GEMV path uses, against the fallbacks then a linear (the model's
    math op for op): RMSNorm of x, silu(gate) * up of a merged gate/up weight's output (a program's gate and up rows:
    BLOCK_N / 2 of each), r += y in place, the bias. Ragged N and K; M of 1, 2, 3 and 8 (rows past M masked); the
    norm in the prologue for up to NORM_PROLOGUE_ROWS rows, apart above (prologue_rows 8: in the prologue always)."""
    from workers.kernels import gemv as gemv_module
    from workers.kernels.gemv import gemv

    if prologue_rows is not None:
        monkeypatch.setattr(gemv_module, "NORM_PROLOGUE_ROWS", prologue_rows)

    n, k = 70, 300  # (with silu: 35 gate and 35 up rows)
    eps = 1e-5
    x = randn(m, k, dtype=dtype, salt=1).to(DEVICE)
    w = randn(n, k, dtype=dtype, salt=2).to(DEVICE)
    nw = (1 + 0.1 * randn(k, dtype=dtype, salt=3)).to(DEVICE)
    b = randn(n, dtype=dtype, salt=4).to(DEVICE) if "bias" in fuse else None
    r = randn(m, n // 2 if "silu" in fuse else n, dtype=dtype, salt=5).to(DEVICE)
    with use_triton(False):  # the reference: torch's math on CPU copies
        xin = x.cpu()
        xin = fused.rms_norm(xin, nw.cpu(), eps) if "norm" in fuse else xin
        y = torch.nn.functional.linear(xin.float(), w.cpu().float(), None if b is None else b.cpu().float()).to(dtype)
        y = fused.silu_mul(y) if "silu" in fuse else y
        ref = (r.cpu() + y) if "residual" in fuse else y
    r_in = r.clone()
    got = gemv(x, w, config, bias=b, norm=(nw, eps) if "norm" in fuse else None, silu="silu" in fuse,
               residual=r if "residual" in fuse else None)
    if "residual" in fuse:
        assert got is r  # r += y in place
    else:
        assert torch.equal(r, r_in)
    assert got.shape == ref.shape
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    err = (got.float().cpu() - ref.float()).abs()
    assert torch.allclose(got.float().cpu(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item()), \
        f"seed {SEED}: max error {err.max().item():.3g} at {divmod(err.argmax().item(), ref.shape[1])} (row, column)"
    with pytest.raises(ValueError, match="the residual must be"):
        gemv(x, w, residual=r[:, :5])
    with pytest.raises(ValueError, match="gemv takes"):
        gemv(x, w[:-1], silu=True)  # (an odd merged gate/up)
    with pytest.raises(ValueError, match="gemv takes"):
        gemv(x, w, bias=randn(n // 2, dtype=dtype, salt=4).to(DEVICE), silu=True)  # (the bias is the merged one's)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,dim,bias,prologue_rows", [
    (1, 4, 2, 32, False, None), (5, 2, 1, 64, True, None), (3, 3, 3, 16, False, None), (8, 2, 2, 80, True, None),
    (5, 2, 1, 64, True, 8), (8, 2, 2, 80, True, 8)])  # (prologue_rows 8: the norm in the launch at any M)
def test_qkv_rope_gemv_is_the_norm_qkv_rope_and_kv_write_in_one_launch(dtype, tokens, heads, kv_heads, dim, bias,
                                                                        prologue_rows, monkeypatch):
    """The first layer's or the next layer's qkv at <= 8 tokens (--decode-gemv-rows): RMSNorm + the qkv GEMV + RoPE
    + the K/V write in one launch (above NORM_PROLOGUE_ROWS tokens the norm apart first; prologue_rows 8: in the
    launch always), against gemv then rope_write_kv_ (their own tests hold those to the model's math): the same qkv
    rows (q and k rotated) and pool, a padding row (slot -1) written nowhere; head sizes whose half is not a power
    of two or is under 16 columns."""
    from workers.kernels import gemv as gemv_module
    from workers.kernels.gemv import gemv, qkv_rope_gemv

    if prologue_rows is not None:
        monkeypatch.setattr(gemv_module, "NORM_PROLOGUE_ROWS", prologue_rows)

    max_len, page, blocks, hidden = 300, 16, 6, 96
    rope = RotaryEmbedding(dataclasses.replace(TINY_CONFIG, head_dim=dim, rope_theta=10000.0), max_len)
    g = torch.Generator().manual_seed(SEED)
    positions = torch.randint(0, max_len, (tokens,), generator=g).to(DEVICE)
    slots = torch.randperm(blocks * page, generator=g)[:tokens]
    if tokens > 1:
        slots[tokens // 2] = -1
    slots = slots.to(DEVICE)
    n = (heads + 2 * kv_heads) * dim
    x = randn(tokens, hidden, dtype=dtype, salt=1).to(DEVICE)
    w = (randn(n, hidden, dtype=dtype, salt=2) * hidden ** -0.5).to(dtype).to(DEVICE)
    b = randn(n, dtype=dtype, salt=3).to(DEVICE) if bias else None
    norm = ((1 + 0.1 * randn(hidden, dtype=dtype, salt=4)).to(DEVICE), 1e-5)
    pools = [randn(blocks * page, kv_heads * dim, dtype=dtype, salt=s).to(DEVICE).view(blocks, page, kv_heads, dim)
             for s in (5, 6)]
    cos, sin = rope.cos.to(DEVICE), rope.sin.to(DEVICE)
    ka, va = (p.clone() for p in pools)
    kb, vb = (p.clone() for p in pools)
    with use_triton():
        ref = gemv(x, w, bias=b, norm=norm)
        q, k, v = ref.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        fused.rope_write_kv_(q.unflatten(-1, (heads, dim)), k.unflatten(-1, (kv_heads, dim)),
                             v.unflatten(-1, (kv_heads, dim)), positions, cos, sin, ka, va, slots)
        got = qkv_rope_gemv(x, w, b, norm, heads, kv_heads, positions, cos, sin, kb, vb, slots)
    msg = f"seed {SEED}"
    # on the CPU to the last bit of the dtype (Triton 3.9's interpreter sums a dot's fp32 terms in another order for
    # another layout of the same columns: ~1e-6 apart in fp32, and so now and then a bf16 rounded the other way,
    # 2026-12-07); a GPU's tensor cores may sum another tile shape in another order
    tol = TOL[dtype] if ON_GPU else {torch.float32: 1e-6, torch.bfloat16: 2 ** -6}[dtype]
    same = lambda a, b: rel_err(a.float(), b.float()) < tol  # noqa: E731
    assert same(got, ref), msg
    assert same(kb, ka) and same(vb, va), msg
    assert not torch.equal(kb, pools[0]), msg  # (something was written)
    with pytest.raises(ValueError, match="qkv_rope_gemv takes"):
        qkv_rope_gemv(x, w, b, norm, heads + 1, kv_heads, positions, cos, sin, kb, vb, slots)
