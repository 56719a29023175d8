"""Triton paged-attention kernels against a float64 torch reference, fresh random inputs each check.

On a GPU the kernels run for real (bf16); on CPU (CI) they run under Triton's interpreter, which
checks the same indexing, masking, partition and quantisation logic.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:  # must be set before triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from workers.kernels import paged_attention as pa  # noqa: E402
from workers.kernels.paged_attention import paged_decode, paged_prefill, write_kv  # noqa: E402
from workers.kv_cache import transpose_v_pages, v_rows  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
PAGE = 16


def reference_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale=None, v_scale=None, window=None):
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[2]
    for b, n in enumerate(seq_lens.tolist()):
        slots = torch.arange(max(0, n - window) if window else 0, n)
        blocks = block_tables[b].cpu()[slots // PAGE]
        k = k_cache.cpu()[blocks, slots % PAGE].double()  # [n, Hkv, D]
        v = v_cache.cpu()[blocks, slots % PAGE].double()
        if k_scale is not None:
            k = k * k_scale.cpu().double()[None, :, None]
            v = v * v_scale.cpu().double()[None, :, None]
        k = k.repeat_interleave(group, 1)
        v = v.repeat_interleave(group, 1)
        s = torch.einsum("hd,nhd->hn", q[b].cpu().double(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    return out


def rel_err(a, ref):
    return ((a.cpu().double() - ref).norm() / ref.norm()).item()


def make_case(batch, heads, kv_heads, dim, max_len, seed):
    g = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(1, max_len + 1, (batch,), generator=g, dtype=torch.int32)
    seq_lens[0] = max_len
    max_blocks = (max_len + PAGE - 1) // PAGE
    num_blocks = batch * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=g)[: batch * max_blocks].view(batch, max_blocks).to(torch.int32)
    q = torch.randn(batch, heads, dim, generator=g).to(DTYPE)
    k_cache = torch.randn(num_blocks, PAGE, kv_heads, dim, generator=g).to(DTYPE)
    v_cache = torch.randn(num_blocks, PAGE, kv_heads, dim, generator=g).to(DTYPE)
    return q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), perm.to(DEVICE), seq_lens.to(DEVICE)


CASES = [  # batch, q heads, kv heads, head dim, max context, partitions
    (3, 8, 2, 32, 37, 1),
    (2, 4, 4, 16, 70, 4),
    (2, 7, 1, 32, 50, 2),
]
if ON_GPU:
    CASES += [(16, 32, 8, 128, 1024, 1), (4, 32, 8, 128, 4000, 8), (8, 28, 4, 128, 777, 4)]


@pytest.mark.parametrize("batch,heads,kv_heads,dim,max_len,parts", CASES)
def test_paged_decode_matches_reference(batch, heads, kv_heads, dim, max_len, parts):
    for seed in range(2):  # fresh inputs each check
        q, kc, vc, bt, lens = make_case(batch, heads, kv_heads, dim, max_len, seed + 10 * batch)
        scale = dim ** -0.5
        out = torch.full_like(q, float("nan"))
        paged_decode(q, kc, vc, bt, lens, scale, num_parts=parts, out=out)
        ref = reference_decode(q, kc, vc, bt, lens, scale)
        assert not torch.isnan(out).any()
        assert rel_err(out, ref) < (1e-2 if ON_GPU else 1e-5)


def test_paged_decode_sliding_window():
    q, kc, vc, bt, lens = make_case(3, 8, 2, 32, 90, 5)
    for parts in (1, 2):
        out = paged_decode(q, kc, vc, bt, lens, 32 ** -0.5, num_parts=parts, window=40)
        ref = reference_decode(q, kc, vc, bt, lens, 32 ** -0.5, window=40)
        assert rel_err(out, ref) < (1e-2 if ON_GPU else 1e-5)


# ---------------------------------------------------------------------------------------- cascade decode
def shared_case(groups, heads, kv_heads, dim, seed):
    """Decodes in groups that share leading pages (groups: [(shared prefix tokens, [each member's context])]):
    each group's members take the same first blocks, then blocks of their own."""
    g = torch.Generator().manual_seed(seed)
    lens = [n for _, ns in groups for n in ns]
    width = max(-(-n // PAGE) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    free = iter(torch.randperm(len(lens) * width + 8, generator=g).tolist())
    row = 0
    for shared, ns in groups:
        common = [next(free) for _ in range(shared // PAGE)]
        for n in ns:
            own = [next(free) for _ in range(-(-n // PAGE) - len(common))]
            tables[row, :len(common) + len(own)] = torch.tensor(common + own, dtype=torch.int32)
            row += 1
    blocks = len(lens) * width + 8
    q = torch.randn(len(lens), heads, dim, generator=g).to(DTYPE)
    kc = torch.randn(blocks, PAGE, kv_heads, dim, generator=g).to(DTYPE)
    vc = torch.randn(blocks, PAGE, kv_heads, dim, generator=g).to(DTYPE)
    return (q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), tables.to(DEVICE),
            torch.tensor(lens, dtype=torch.int32).to(DEVICE))


CASCADE_CASES = [  # groups (shared tokens, member contexts), q heads, KV heads, head dim
    ([(320, [330, 400, 321, 500]), (0, [70]), (256, [300, 290])], 8, 2, 32),
    ([(384, [390] * 20), (0, [33, 17])], 4, 4, 16),  # 20 members of 4 heads: two work items of 16 and 4
    ([(512, [600, 513, 700])], 7, 1, 32),  # G 7: 9 members per item
]


@pytest.mark.parametrize("groups,heads,kv_heads,dim", CASCADE_CASES)
@pytest.mark.parametrize("parts", [1, 2])
def test_cascade_decode_matches_reference(groups, heads, kv_heads, dim, parts):
    """Shared prefixes computed once per group (_prefix_kernel) and merged with each member's own partitions;
    sequences outside a group and the CUDA-graph padding rows (planned as no group) as without cascade."""
    q, kc, vc, bt, lens = shared_case(groups, heads, kv_heads, dim, seed=len(groups) + heads)
    buffers = pa.CascadeBuffers(len(lens) + 3, heads // kv_heads, DEVICE)
    grouped = buffers.fill(bt.cpu().numpy(), lens.cpu().numpy(), PAGE, min_members=2, min_grouped=2)
    assert grouped == sum(len(ns) for shared, ns in groups if shared >= pa.CASCADE_MIN_PREFIX)
    out = torch.full_like(q, float("nan"))
    paged_decode(q, kc, vc, bt, lens, dim ** -0.5, num_parts=parts, out=out, cascade=buffers)
    ref = reference_decode(q, kc, vc, bt, lens, dim ** -0.5)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < (1e-2 if ON_GPU else 1e-5)
    with pytest.raises(ValueError, match="at most 2 decodes"):
        paged_decode(q, kc, vc, bt, lens, dim ** -0.5, cascade=pa.CascadeBuffers(2, heads // kv_heads, DEVICE))


def int8_pool(kc: torch.Tensor, vc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole pool kc / vc [blocks, page, Hkv, D] written to an int8 one by write_kv, with per-head scales of
    its absmax: (K pages, V pages transposed, k_scale, v_scale)."""
    k_scale = (kc.float().abs().amax(dim=(0, 1, 3)) / 127).to(DEVICE)
    v_scale = (vc.float().abs().amax(dim=(0, 1, 3)) / 127).to(DEVICE)
    kq = torch.zeros(kc.shape, dtype=torch.int8, device=DEVICE)
    vq = transpose_v_pages(torch.zeros_like(kq))
    slots = torch.arange(kc.shape[0] * PAGE, device=DEVICE)
    write_kv(kc.flatten(0, 1), vc.flatten(0, 1), kq, vq, slots, k_scale, v_scale)
    return kq, vq, k_scale, v_scale


@functools.cache
def shared_int8_case(case: int):
    """CASCADE_CASES[case]'s inputs on an int8 pool: (q, K pages, V pages, tables, lens, k_scale, v_scale). Made once
    for the variants below, which read it alone (write_kv over the whole pool: ~5 s interpreted)."""
    groups, heads, kv_heads, dim = CASCADE_CASES[case]
    q, kc, vc, bt, lens = shared_case(groups, heads, kv_heads, dim, seed=11 + case)
    kq, vq, k_scale, v_scale = int8_pool(kc, vc)
    return q, kq, vq, bt, lens, k_scale, v_scale


# (head_dim 32: int8 dots need it on a GPU; the merge in the reduce and in the decode kernel)
@pytest.mark.parametrize("case,variant,parts", [(2, "EXACT", 2), (2, "default", 1)])
def test_cascade_decode_on_an_int8_pool(case, variant, parts):
    """An int8 pool's scales and transposed V pages in the shared prefix too: the same function as the kernel
    without cascade, dequantised exactly (EXACT) or on int8 dots (q rounded per member's head, p in two digits)."""
    groups, heads, kv_heads, dim = CASCADE_CASES[case]
    config = EXACT if variant == "EXACT" else {}
    q, kq, vq, bt, lens, k_scale, v_scale = shared_int8_case(case)
    buffers = pa.CascadeBuffers(len(lens), heads // kv_heads, DEVICE)
    assert buffers.fill(bt.cpu().numpy(), lens.cpu().numpy(), PAGE, min_members=2, min_grouped=2)
    args = (q, kq, vq, bt, lens, dim ** -0.5)
    out = paged_decode(*args, num_parts=parts, k_scale=k_scale, v_scale=v_scale, config=config, cascade=buffers)
    plain = paged_decode(*args, num_parts=parts, k_scale=k_scale, v_scale=v_scale, config=config)
    ref = reference_decode(q, kq, v_rows(vq), bt, lens, dim ** -0.5, k_scale, v_scale)
    tol = (1e-2 if ON_GPU else 1e-5) if config is EXACT else 2e-2
    # on int8 dots the prefix kernel rounds as the decode kernel does: on the CPU the two agree to ~1e-4, where a
    # prefix dequantised exactly instead (INT8_QK / INT8_PV off in it alone) is 4-5e-3 from the plain kernel
    same = 1e-3 if config is not EXACT and not ON_GPU else tol
    assert rel_err(out, ref) < tol and rel_err(out, plain) < same


def plan(*args, **kwargs):
    """cascade_plan with groups of two members and up (the defaults' thresholds: the next test)."""
    return pa.cascade_plan(*args, **{"min_members": 2, "min_grouped": 2, **kwargs})


def test_cascade_plan_leaves_small_groups_and_batches_to_the_per_sequence_kernel():
    """With the defaults, a group of fewer than CASCADE_MIN_MEMBERS decodes is none (16 documents of 2 decodes:
    the RAG shape's batch, 0.70x on the H100), nor a plan with fewer than CASCADE_MIN_GROUPED decodes in groups."""
    def case(docs):  # [members of each document]: 1,536 shared keys (96 pages), then a page of each member's own
        rows = [list(range(d * 100, d * 100 + 96)) + [10_000 + 10 * d + i] for d, n in enumerate(docs)
                for i in range(n)]
        lens = np.full(len(rows), 97 * 16 - 5)
        return pa.cascade_plan(np.array(rows, dtype=np.int32), lens, 16, per_item=16, max_items=64)[0]

    assert pa.CASCADE_MIN_MEMBERS == 8 and pa.CASCADE_MIN_GROUPED == 32
    assert not case([2] * 16 + [1] * 8).any() and not case([7] * 8).any()  # groups too small
    assert not case([16] + [1] * 48).any() and not case([31]).any()  # too few grouped
    assert (case([8] * 4) == 1536).all() and (case([32]) == 1536).all()
    assert (case([16, 16] + [3] * 4) > 0).sum() == 32  # (the groups of 3 left out)


def test_cascade_plan_groups_decodes_by_their_shared_whole_pages():
    """The pages every member agrees on, before each one's last page, rounded down to 64 keys; groups of one, or
    with less than the minimum shared, left out; work items of at most per_item members; max_items respected."""
    t = np.array([[5, 6, 7, 8, 9, 40, 0],  # group of first page 5: pages 5-9 shared by the first two ...
                  [5, 6, 7, 8, 9, 41, 0],
                  [5, 6, 7, 8, 30, 31, 0],  # ... the third shares 5-8 only: the group's prefix is 4 pages
                  [3, 4, 0, 0, 0, 0, 0],  # alone
                  [1, 2, 10, 11, 12, 13, 14],  # group of first page 1: all its 5 pages before the last one ...
                  [1, 2, 10, 11, 12, 15, 0]], dtype=np.int32)  # ... shared, but this member's last page is its 6th
    lens = np.array([90, 85, 96, 20, 112, 81])
    prefix, members, items = plan(t, lens, 16, per_item=3, max_items=8, min_prefix=64)
    assert prefix.tolist() == [64, 64, 64, 0, 64, 64]  # (5 pages = 80 keys -> 64)
    # the three first: one work item reads 64 keys for three, 2 x 64 saved (rows 0-1 alone: 1 x 64)
    assert sorted(members[:3].tolist()) == [0, 1, 2] and sorted(members[3:].tolist()) == [4, 5]
    assert items.tolist() == [[0, 3, 64], [3, 2, 64]]
    prefix, members, items = plan(t, lens, 16, per_item=3, max_items=1, min_prefix=64)
    assert prefix.tolist() == [64, 64, 64, 0, 0, 0] and items.tolist() == [[0, 3, 64]]  # no room left
    prefix, _, items = plan(t, lens, 16, per_item=2, max_items=8, min_prefix=64)
    assert items[:, 1].tolist() == [2, 2, 1]  # (rows 4-5, then the three in two items: 1 x 64 saved each)
    for per_item, min_prefix in ((3, 128), (1, 64)):  # too short a prefix; one member an item (a head group > 32)
        prefix, _, items = plan(t, lens, 16, per_item=per_item, max_items=8, min_prefix=min_prefix)
        assert not prefix.any() and items.shape == (0, 3)


def test_cascade_plan_groups_by_documents_behind_a_prefix_every_decode_shares():
    """A chat template's page shared by every decode, then two documents shared by some: sharing only the template
    (16 keys) saves nothing worth a group, the documents' groups do; a shorter context is grouped as far as it goes
    (row 2 ends within document A's pages: A's group shares what all three have, 2 x 320 reads saved, more than
    1 x 448 for rows 0-1 alone)."""
    template, doc_a, doc_b = [100], list(range(1, 31)), list(range(40, 70))
    rows = [template + doc_a + [200 + i] for i in range(2)] + [template + doc_a[:20] + [210]]
    rows += [template + doc_b + [220 + i] for i in range(2)] + [template + [230]]
    t = np.zeros((len(rows), 33), dtype=np.int32)
    for i, r in enumerate(rows):
        t[i, :len(r)] = r
    lens = np.array([len(r) * 16 - 3 for r in rows])
    prefix, members, items = plan(t, lens, 16, per_item=16, max_items=8, min_prefix=256)
    assert prefix.tolist() == [320, 320, 320, 448, 448, 0]  # (21 pages: 336 keys -> 320; 31: 496 -> 448)
    assert sorted(members[:3].tolist()) == [0, 1, 2] and items[:, 1].tolist() == [3, 2]
    prefix, _, _ = plan(t[[0, 1, 3, 4]], lens[[0, 1, 3, 4]], 16, per_item=16, max_items=8, min_prefix=256)
    assert prefix.tolist() == [448] * 4  # (without row 2)


# ---------------------------------------------------------------------------------------- persistent decode
def persistent(q, kc, vc, bt, lens, scale, window=None, **kw):
    """plan, then decode: what the Triton backend runs once per step and once per layer."""
    buffers = pa.PersistentDecodeBuffers(q.shape[0], q.shape[1], q.shape[2], DEVICE,
                                         quant=kc.dtype == torch.int8, config=kw.get("config"))
    pa.plan_persistent_decode(lens, buffers, window)
    out = torch.full_like(q, float("nan"))
    pa.paged_decode_persistent(q, kc, vc, bt, lens, scale, buffers, num_sms=2, out=out, window=window, **kw)
    return out, buffers


SKEWED = [  # (q heads, kv heads, head dim, context lengths): one long context among short ones, and uniform ones
    (8, 2, 32, [600, 20, 33, 5, 17]),
    (4, 4, 16, [70, 70, 70]),
    (7, 1, 32, [1, 300, 2, 129]),
]


@pytest.mark.parametrize("heads,kv_heads,dim,lens", SKEWED)
@pytest.mark.parametrize("min_chunk", [64, 256])  # (64: the default)
def test_persistent_decode_matches_reference_on_skewed_batches(heads, kv_heads, dim, lens, min_chunk, monkeypatch):
    """The device-side plan splits each context into chunks of one length (min_chunk: long contexts into several,
    merged after); every sequence's output is the reference's."""
    monkeypatch.setattr(pa, "PERSISTENT_MIN_CHUNK", min_chunk)
    q, kc, vc, bt, _ = make_case(len(lens), heads, kv_heads, dim, max(lens), 3)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out, buffers = persistent(q, kc, vc, bt, lens_t, dim ** -0.5)
    assert not torch.isnan(out).any()
    assert rel_err(out, reference_decode(q, kc, vc, bt, lens_t, dim ** -0.5)) < (1e-2 if ON_GPU else 1e-5)
    plan = buffers.plan.cpu().tolist()
    chunk = plan[0]
    assert chunk % 64 == 0 and chunk >= min_chunk
    counts = [-(-n // chunk) for n in lens]
    assert plan[1:2 + len(lens)] == [sum(counts[:i]) for i in range(len(lens) + 1)]
    assert buffers.seq_of[:sum(counts)].cpu().tolist() == [b for b, c in enumerate(counts) for _ in range(c)]
    if min_chunk == 64 and max(lens) > 64:
        assert max(counts) > 1  # some context was split (the merge ran)


def test_persistent_decode_plans_whole_tiles_of_the_kernels_block_n():
    """A launch config with 128-key tiles: the plan's chunks are whole 128-key tiles too (a window that starts
    mid-tile included); a kernel launched with another BLOCK_N than the plan's is refused."""
    q, kc, vc, bt, _ = make_case(2, 8, 2, 32, 300, 6)
    lens = torch.tensor([300, 200], dtype=torch.int32, device=DEVICE)
    out, buffers = persistent(q, kc, vc, bt, lens, 32 ** -0.5, window=100, config={"BLOCK_N": 128})
    assert int(buffers.plan[0]) % 128 == 0
    assert rel_err(out, reference_decode(q, kc, vc, bt, lens, 32 ** -0.5, window=100)) < (1e-2 if ON_GPU else 1e-5)
    with pytest.raises(ValueError, match="BLOCK_N 64, planned for 128"):
        pa.paged_decode_persistent(q, kc, vc, bt, lens, 32 ** -0.5, buffers, num_sms=2)


def test_persistent_decode_sliding_window_and_int8(monkeypatch):
    monkeypatch.setattr(pa, "PERSISTENT_MIN_CHUNK", 64)
    q, kc, vc, bt, _ = make_case(3, 8, 2, 32, 300, 5)
    lens = torch.tensor([300, 90, 41], dtype=torch.int32, device=DEVICE)
    out, _ = persistent(q, kc, vc, bt, lens, 32 ** -0.5, window=100)
    assert rel_err(out, reference_decode(q, kc, vc, bt, lens, 32 ** -0.5, window=100)) < (1e-2 if ON_GPU else 1e-5)
    kq, vq, k_scale, v_scale = int8_pool(kc, vc)
    for variant, tol in ((EXACT, 1e-2 if ON_GPU else 1e-5), ({}, 2e-2)):  # dequantised exactly; int8 dots
        for window in (None, 100):
            out, _ = persistent(q, kq, vq, bt, lens, 32 ** -0.5, window=window, k_scale=k_scale, v_scale=v_scale,
                                config=variant)
            ref = reference_decode(q, kq, v_rows(vq), bt, lens, 32 ** -0.5, k_scale, v_scale, window=window)
            assert rel_err(out, ref) < tol, (variant, window)


EXACT = {"INT8_QK": False, "INT8_PV": False}


@pytest.mark.parametrize("variant,window", [(EXACT, None), ({}, None), ({"INT8_PV": False}, None),
                                            ({"INT8_QK": False}, None), (EXACT, 25), ({}, 25)])
def test_int8_write_then_decode_is_within_int8_rounding(variant, window):
    """variant: K/V dequantised to the q dtype for tl.dot (exact); the default: q.k^T and p.V on int8 tensor
    cores (q rounded per row, p in two int8 digits); or p.V with V converted. V pages are written
    transposed; a window starts mid-page."""
    batch, heads, kv_heads, dim, max_len = 2, 4, 2, 32, 40
    q, kc, vc, bt, lens = make_case(batch, heads, kv_heads, dim, max_len, 7)
    k_scale = (kc.float().abs().amax(dim=(0, 1, 3)) / 127).to(DEVICE)
    v_scale = (vc.float().abs().amax(dim=(0, 1, 3)) / 127).to(DEVICE)
    lens = torch.tensor([36, 12], dtype=torch.int32, device=DEVICE)
    slots = torch.cat([bt[b, p // PAGE].long() * PAGE + p % PAGE  # each context's tokens, nothing past its end
                       for b, n in enumerate(lens.tolist()) for p in [torch.arange(n, device=DEVICE)]])
    kq = torch.full(kc.shape, 99, dtype=torch.int8, device=DEVICE)  # stale values past the ends: masked
    vq = transpose_v_pages(torch.full_like(kq, 99))
    write_kv(kc.reshape(-1, kv_heads, dim)[slots], vc.reshape(-1, kv_heads, dim)[slots], kq, vq, slots,
             k_scale, v_scale)
    # the quantised pool equals round-half-away(x / scale)
    for stored, x, scale in ((kq, kc, k_scale), (v_rows(vq), vc, v_scale)):
        expect = x.float() / scale[None, None, :, None]
        expect = (torch.sign(expect) * torch.floor(expect.abs() + 0.5)).clamp(-127, 127)
        at = (slots // PAGE, slots % PAGE)
        assert torch.equal(stored[at].float(), expect[at])
    out = paged_decode(q, kq, vq, bt, lens, dim ** -0.5, num_parts=2, k_scale=k_scale, v_scale=v_scale,
                       config=variant, window=window)
    ref_exact = reference_decode(q, kc, vc, bt, lens, dim ** -0.5, window=window)
    ref_quant = reference_decode(q, kq, v_rows(vq), bt, lens, dim ** -0.5, k_scale, v_scale, window=window)
    # the kernel computes its function exactly, up to its own rounding (and, on the GPU, bf16 p / fp32 sums)
    if variant is EXACT:
        tol = 1e-2 if ON_GPU else 1e-5
    elif variant.get("INT8_QK") is False:  # p in two int8 digits: ~1e-5
        tol = 1e-2 if ON_GPU else 1e-4
    else:  # q rounded to int8 per row
        tol = 2e-2
    assert rel_err(out, ref_quant) < tol
    assert rel_err(out, ref_exact) < 0.03  # and int8 rounding costs little


def test_write_kv_skips_padding_slots():
    kv_heads, dim = 2, 16
    cache = torch.full((4, PAGE, kv_heads, dim), 7.0, dtype=DTYPE, device=DEVICE)
    vcache = cache.clone()
    k = torch.randn(3, kv_heads, dim).to(DTYPE).to(DEVICE)
    slots = torch.tensor([5, -1, 40], device=DEVICE)
    write_kv(k, k, cache, vcache, slots)
    flat = cache.view(-1, kv_heads, dim)
    assert torch.equal(flat[5], k[0]) and torch.equal(flat[40], k[2])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[[5, 40]] = False
    assert (flat[untouched.to(DEVICE)] == 7.0).all()


def reference_prefill(q, k_cache, v_cache, block_tables, seq_lens, qsl, first, scale, window=None,
                      k_scale=None, v_scale=None):
    """float64 causal attention of each sequence's chunk (its last nq positions) over its pages."""
    out = {}
    group = q.shape[1] // k_cache.shape[2]
    for b in range(first, len(seq_lens)):
        q0, q1, n = int(qsl[b]), int(qsl[b + 1]), int(seq_lens[b])
        pos = torch.arange(n)
        blocks = block_tables[b].cpu()[pos // PAGE]
        k = k_cache.cpu()[blocks, pos % PAGE].double().repeat_interleave(group, 1)  # [n, Hq, D]
        v = v_cache.cpu()[blocks, pos % PAGE].double().repeat_interleave(group, 1)
        if k_scale is not None:
            k = k * k_scale.cpu().double().repeat_interleave(group)[None, :, None]
            v = v * v_scale.cpu().double().repeat_interleave(group)[None, :, None]
        q_pos = pos[n - (q1 - q0):]
        s = torch.einsum("qhd,nhd->hqn", q[q0:q1].cpu().double(), k) * scale
        ok = pos[None, :] <= q_pos[:, None]
        if window:
            ok &= pos[None, :] > q_pos[:, None] - window
        s = s.masked_fill(~ok[None], float("-inf"))
        out[b] = torch.einsum("hqn,nhd->qhd", s.softmax(-1), v)
    return out


@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("quant", [False, True])
def test_paged_prefill_matches_reference(window, quant):
    """A packed step: 2 decodes (left alone), then chunks from 0, after a cached prefix, and single-token."""
    heads, kv_heads, dim = (32, 8, 128) if ON_GPU else (4, 2, 16)
    chunks = [(1, 9), (1, 30), (37, 37), (20, 53), (1, 1), (70, 70 + 45)] if not ON_GPU else \
        [(1, 900), (1, 30), (1000, 1000), (300, 2000), (1, 1), (700, 1400), (2048, 2048)]
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))  # fresh inputs each run
    q_lens = [nq for nq, _ in chunks]
    seq_lens = torch.tensor([n for _, n in chunks], dtype=torch.int32)
    max_blocks = -(-int(seq_lens.max()) // PAGE)
    num_blocks = len(chunks) * max_blocks + 5
    bt = torch.randperm(num_blocks, generator=g)[:len(chunks) * max_blocks].view(len(chunks), -1).to(torch.int32)
    kc = torch.randn(num_blocks, PAGE, kv_heads, dim, generator=g)
    vc = torch.randn(num_blocks, PAGE, kv_heads, dim, generator=g)
    ks = vs = None
    if quant:
        ks, vs = torch.rand(kv_heads, generator=g) * 0.02 + 0.01, torch.rand(kv_heads, generator=g) * 0.02 + 0.01
        kc, vc = (kc / ks[None, None, :, None]).round().clamp(-127, 127), (vc / vs[None, None, :, None]).round()
        kc, vc, ks, vs = kc.to(torch.int8), vc.clamp(-127, 127).to(torch.int8), ks.to(DEVICE), vs.to(DEVICE)
    else:
        kc, vc = kc.to(DTYPE), vc.to(DTYPE)
    v_pool = transpose_v_pages(vc) if quant else vc  # int8 pools store V pages transposed
    q = torch.randn(sum(q_lens), heads, dim, generator=g).to(DTYPE)
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    out = torch.full_like(q, float("nan")).to(DEVICE)
    first = 2  # the first two are the step's decodes: not the prefill kernel's rows
    paged_prefill(q.to(DEVICE), kc.to(DEVICE), v_pool.to(DEVICE), bt.to(DEVICE), seq_lens.to(DEVICE), qsl.to(DEVICE),
                  first, len(chunks) - first, max(q_lens[first:]), dim ** -0.5, out, ks, vs, window)
    ref = reference_prefill(q, kc, vc, bt, seq_lens, qsl, first, dim ** -0.5, window, ks, vs)
    assert torch.isnan(out[:int(qsl[first])]).all()  # decode rows untouched
    for b, r in ref.items():
        assert rel_err(out[int(qsl[b]):int(qsl[b + 1])], r) < (1e-2 if ON_GPU else 1e-5), b
