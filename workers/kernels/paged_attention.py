"""Triton paged attention for decode, and the KV write into pages.

Owns two kernels and their launchers; knows nothing of requests or scheduling.
- `paged_decode`: one query token per sequence against its paged K/V. GQA-aware:
  a program serves one (sequence, KV head, partition) and all G query heads that
  share the KV head, so each K/V byte is read once (the G rows are padded to the
  16 that tl.dot needs; decode is bandwidth-bound, the padding costs no bytes).
  Long contexts split into `num_parts` partitions (flash-decoding), reduced by a
  second kernel; each sequence splits its own length, so the launch needs no
  host-side lengths and is CUDA-graph safe. int8 pools: q.k^T and p.V on int8 tensor
  cores (q rounded per row, p in two int8 digits; DECODE_CONFIG_INT8), whole pages per load.
- `paged_prefill`: the prefill chunks of a step, all sequences in one launch (varlen:
  packed query rows, each sequence's chunk at its own offset), flash-attention style
  over the same pages: causal from the chunk's start position, so a chunk after a
  cached prefix or an earlier chunk needs no gather and no mask tensor.
- `write_kv`: scatter new K/V rows into the pool by slot (= block * page + offset),
  quantising to int8 with per-head scales when the pool is int8.
Pool layout per layer: k [num_blocks, page, num_kv_heads, head_dim]; v the same, except in int8
pools, whose V pages are stored transposed, v [num_blocks, num_kv_heads, head_dim, page] (as vLLM's
paged-attention value cache): p.V's B operand wants the tokens contiguous, and int8 has no transposing
shared-memory load, so the standard layout cost a byte-wise shuffle per V element (workers/kv_cache.py).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from workers.kernels.fused import INTERPRETED

LOG2E = 1.4426950408889634
# Launch configs (H200-tuned with `python -m workers.tools.kernel_bench`, docs/perf.md); the interpreter
# (CPU tests) gets small tiles.
DECODE_CONFIG = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
# int8 pools: q.k^T and p.V on int8 tensor cores (q quantised per row, p split into two int8 digits, so
# neither K nor V is converted), 64-key tiles on 1 warp: 128 us at 128 x 2k, 4.2 TB/s of int8 (128-key
# tiles on 2 warps: 131 us; 4 warps pay cross-warp softmax reductions: docs/kv_int8.md). INT8_PV False:
# V converted to bf16 for p.V (133 us); INT8_QK False too: exact dequantisation, the tests' and the
# bench's reference (slower than bf16 KV)
DECODE_CONFIG_INT8 = {"BLOCK_N": 64, "num_warps": 1, "num_stages": 2, "INT8_QK": True, "INT8_PV": True}
PREFILL_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
PREFILL_CONFIG_CPU = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
MAX_PARTITIONS = 32


@triton.jit
def _load_kv(k_ptr, v_ptr, bt_row_ptr, n0, end, kvh, s_kb, s_kt, s_kh, s_vb, s_vh, s_vd,
             D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr):
    """K and V [BLOCK_N, D] of keys n0 .. n0+BLOCK_N-1 (n0 a multiple of PAGE); keys >= end read as 0 or
    as stale finite values that the caller masks out of q.k^T. bf16/fp32: one row per key, masked per
    key (a freed block's stale NaN must not reach p.V). int8: whole pages, masked per page (every int8
    is finite, so p = 0 cancels a stale value): 16-byte loads, and V's transposed pages load as [D, keys]."""
    offs_d = tl.arange(0, D)
    if QUANT:
        offs_b = n0 // PAGE + tl.arange(0, BLOCK_N // PAGE)
        page_ok = offs_b * PAGE < end
        blk = tl.load(bt_row_ptr + offs_b, mask=page_ok, other=0).to(tl.int64)
        offs_p = tl.arange(0, PAGE)
        k = tl.load(k_ptr + (blk * s_kb + kvh * s_kh)[:, None, None] + (offs_p * s_kt)[None, :, None]
                    + offs_d[None, None, :], mask=page_ok[:, None, None], other=0)
        vt = tl.load(v_ptr + (blk * s_vb + kvh * s_vh)[None, :, None] + (offs_d * s_vd)[:, None, None]
                     + offs_p[None, None, :], mask=page_ok[None, :, None], other=0)
        return tl.reshape(k, (BLOCK_N, D)), tl.trans(tl.reshape(vt, (D, BLOCK_N)))
    else:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        block = tl.load(bt_row_ptr + offs_n // PAGE, mask=mask_n, other=0)
        kv_off = block.to(tl.int64) * s_kb + (offs_n % PAGE) * s_kt + kvh * s_kh
        k = tl.load(k_ptr + kv_off[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        return k, v


@triton.jit
def _dot(a, b):
    """tl.dot, in IEEE fp32 for fp32 operands (an fp32 model: Triton's default for fp32 is TF32 on the GPU)."""
    if a.dtype == tl.float32:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _decode_tile(q, q_scale, m_i, l_i, acc, n0, lo, end, k_ptr, v_ptr, bt_row_ptr, kvh, s_kb, s_kt, s_kh, s_vb,
                 s_vh, s_vd, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr,
                 INT8_QK: tl.constexpr, INT8_PV: tl.constexpr, MASK: tl.constexpr, WINDOW: tl.constexpr,
                 DT: tl.constexpr):
    """Keys [n0, n0 + BLOCK_N) into the online softmax (exp2 domain: the logits are s * q_scale, q_scale
    > 0 per row, so the max is taken before scaling and the scale folds into exp2's argument).
    MASK: the tile holds keys >= end (or, WINDOW, < lo). INT8_PV: acc is in units of 1 / (127 * 254).
    DT: the output dtype, p.V's operand type otherwise."""
    k, v = _load_kv(k_ptr, v_ptr, bt_row_ptr, n0, end, kvh, s_kb, s_kt, s_kh, s_vb, s_vh, s_vd, D, PAGE, BLOCK_N,
                    QUANT)
    if INT8_QK:
        s = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32)
    else:
        s = _dot(q, tl.trans(k.to(q.dtype)))
    if MASK:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        ok = offs_n < end
        if WINDOW > 0:
            ok = ok & (offs_n >= lo)
        s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * q_scale)  # every tile holds a key >= lo: never -inf
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * q_scale[:, None] - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if INT8_PV:  # p.V on int8 tensor cores, p in two int8 digits: p * 127 = hi + lo / 254 (to 1.6e-5)
        # rounding by adding 1.5 * 2**23: the float's bits are then 0x4B400000 + the rounded integer, so
        # its low byte is the integer's, and lo's is that of round(p * 127 * 254) - 254 * hi
        t = (p * 127.0 + 12582912.0).to(tl.int32, bitcast=True)
        u = (p * 32258.0 + 12582912.0).to(tl.int32, bitcast=True)
        p_hi = t.to(tl.int8)
        p_lo = (u - t * 254).to(tl.int8)
        pv = tl.dot(p_hi, v, out_dtype=tl.int32) * 254 + tl.dot(p_lo, v, out_dtype=tl.int32)
        acc = acc * alpha[:, None] + pv.to(tl.float32)
    else:
        acc = acc * alpha[:, None] + _dot(p.to(DT), v.to(DT))
    return m_new, l_i, acc


@triton.jit
def _q_units(q, q_scale, ks_ptr, kvh, INT8_QK: tl.constexpr):
    """q for an int8 pool's K: K's scale folded into q_scale; with INT8_QK q's rows to int8 by each row's absmax
    (rounded half away from zero; q.k^T then on int8 tensor cores, no K conversion), that scale folded in too."""
    q_scale = q_scale * tl.load(ks_ptr + kvh)
    if INT8_QK:
        qf = q.to(tl.float32)
        row_scale = tl.maximum(tl.max(tl.abs(qf), 1), 1e-20) / 127.0
        qf = qf / row_scale[:, None]
        q = tl.where(qf >= 0, tl.floor(qf + 0.5), -tl.floor(0.5 - qf)).to(tl.int8)
        q_scale = q_scale * row_scale
    return q, q_scale


@triton.jit
def _v_units(acc, vs_ptr, kvh, INT8_PV: tl.constexpr):
    """An int8 pool's p.V accumulator in V's units: its scale, and INT8_PV's two digits of p undone."""
    return acc * (tl.load(vs_ptr + kvh) / (127.0 * 254.0) if INT8_PV else tl.load(vs_ptr + kvh))


@triton.jit
def _decode_span(q_ptr, k_ptr, v_ptr, bt_ptr, ks_ptr, vs_ptr, b, kvh, lo, start, end, sm_scale,
                 s_qb, s_qh, s_kb, s_kt, s_kh, s_vb, s_vh, s_vd, s_btb,
                 G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                 QUANT: tl.constexpr, WINDOW: tl.constexpr, INT8_QK: tl.constexpr, INT8_PV: tl.constexpr,
                 DT: tl.constexpr):
    """Sequence b's keys [start, end) (start a multiple of BLOCK_N; keys < lo masked with a WINDOW) for the G query
    heads of KV head kvh -> the online softmax's (m, l, acc), acc in V's units (an int8 pool's scale applied)."""
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    mask_g = offs_g < G
    heads = kvh * G + offs_g
    q = tl.load(q_ptr + b * s_qb + heads[:, None] * s_qh + offs_d[None, :], mask=mask_g[:, None], other=0.0)
    q_scale = tl.full([G_PAD], sm_scale * 1.4426950408889634, tl.float32)  # exp2 domain
    if QUANT:
        q, q_scale = _q_units(q, q_scale, ks_ptr, kvh, INT8_QK)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    bt_row_ptr = bt_ptr + b * s_btb
    # whole tiles need no key mask; the last, partial one (or, with a window, every one) does
    full_end = start if WINDOW > 0 else start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    for n0 in range(start, full_end, BLOCK_N):
        m_i, l_i, acc = _decode_tile(q, q_scale, m_i, l_i, acc, n0, lo, end, k_ptr, v_ptr, bt_row_ptr, kvh, s_kb,
                                     s_kt, s_kh, s_vb, s_vh, s_vd, D, PAGE, BLOCK_N, QUANT, INT8_QK, INT8_PV,
                                     False, WINDOW, DT)
    for n0 in range(full_end, end, BLOCK_N):
        m_i, l_i, acc = _decode_tile(q, q_scale, m_i, l_i, acc, n0, lo, end, k_ptr, v_ptr, bt_row_ptr, kvh, s_kb,
                                     s_kt, s_kh, s_vb, s_vh, s_vd, D, PAGE, BLOCK_N, QUANT, INT8_QK, INT8_PV,
                                     True, WINDOW, DT)
    if QUANT:
        acc = _v_units(acc, vs_ptr, kvh, INT8_PV)
    return m_i, l_i, acc


@triton.jit
def _window_start(seq_len, WINDOW: tl.constexpr):
    """The first key the query at seq_len - 1 sees: the last WINDOW positions with a sliding window."""
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(seq_len - WINDOW, 0)
    return lo


@triton.jit(do_not_specialize=["s_btb"])
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, ks_ptr, vs_ptr, pre_ptr,
    out_ptr, po_ptr, pm_ptr, pl_ptr,
    sm_scale,
    s_qb, s_qh, s_kb, s_kt, s_kh, s_vb, s_vh, s_vd, s_btb, s_ob, s_oh,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_PARTS: tl.constexpr, QUANT: tl.constexpr, WINDOW: tl.constexpr, INT8_QK: tl.constexpr,
    INT8_PV: tl.constexpr, CASCADE: tl.constexpr, SLOTS: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    lo = _window_start(seq_len, WINDOW)
    # Each sequence splits its own span into NUM_PARTS chunks of whole BLOCK_N tiles, from the tile that
    # holds lo (tiles start on page boundaries; keys before lo are masked). CASCADE: from the end of the shared
    # prefix that _prefix_kernel computed before this launch (pre_ptr[b] keys, a multiple of BLOCK_N; 0: none),
    # whose partial results fill slots NUM_PARTS .. SLOTS - 1 (a sequence without one: never written, never read):
    # with one part merged here into the output, else by the reduce.
    first = lo // BLOCK_N * BLOCK_N
    if CASCADE:
        first = tl.maximum(first, tl.load(pre_ptr + b))
    part_len = tl.cdiv(tl.cdiv(seq_len - first, NUM_PARTS), BLOCK_N) * BLOCK_N
    start = first + part * part_len
    end = tl.minimum(start + part_len, seq_len)
    m_i, l_i, acc = _decode_span(q_ptr, k_ptr, v_ptr, bt_ptr, ks_ptr, vs_ptr, b, kvh, lo, start, end, sm_scale,
                                 s_qb, s_qh, s_kb, s_kt, s_kh, s_vb, s_vh, s_vd, s_btb, G, G_PAD, D, PAGE, BLOCK_N,
                                 QUANT, WINDOW, INT8_QK, INT8_PV, out_ptr.dtype.element_ty)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    mask_g = offs_g < G
    heads = kvh * G + offs_g
    if NUM_PARTS == 1:
        if CASCADE:  # the shared prefix's chunks (none: masked loads, which change nothing)
            shared = mask_g & (tl.zeros([G_PAD], tl.int32) + tl.load(pre_ptr + b) > 0)
            row = (b * (tl.num_programs(1) * G) + heads) * SLOTS
            for slot in tl.static_range(NUM_PARTS, SLOTS):
                m_s = tl.load(pm_ptr + row + slot, mask=shared, other=float("-inf"))
                l_s = tl.load(pl_ptr + row + slot, mask=shared, other=0.0)
                acc_s = tl.load(po_ptr + (row + slot)[:, None] * D + offs_d[None, :], mask=shared[:, None],
                                other=0.0)
                m_new = tl.maximum(m_i, m_s)  # (m_i is finite: a decode's own span holds its new token)
                alpha = tl.exp2(m_i - m_new)
                beta = tl.where(l_s > 0, tl.exp2(m_s - m_new), 0.0)
                acc = acc * alpha[:, None] + acc_s * beta[:, None]
                l_i = l_i * alpha + l_s * beta
                m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptr + b * s_ob + heads[:, None] * s_oh + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=mask_g[:, None])
    else:
        # partials: po [B, Hq, SLOTS, D], pm/pl [B, Hq, SLOTS] (contiguous)
        row = (b * (tl.num_programs(1) * G) + heads) * SLOTS + part
        tl.store(pm_ptr + row, m_i, mask=mask_g)
        tl.store(pl_ptr + row, l_i, mask=mask_g)
        tl.store(po_ptr + row[:, None] * D + offs_d[None, :], acc, mask=mask_g[:, None])


@triton.jit(do_not_specialize=["s_btb"])
def _prefix_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, ks_ptr, vs_ptr, items_ptr, members_ptr, po_ptr, pm_ptr, pl_ptr,
                   sm_scale, s_qb, s_qh, s_kb, s_kt, s_kh, s_vb, s_vh, s_vd, s_btb, H,
                   G: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                   BLOCK_N: tl.constexpr, NUM_PARTS: tl.constexpr, SLOTS: tl.constexpr, QUANT: tl.constexpr,
                   INT8_QK: tl.constexpr, INT8_PV: tl.constexpr):
    """Cascade attention's shared part: work item i (items [i] = first member, members, prefix keys: a group of
    decodes whose first `prefix keys` K/V are the same pages; 0 members: nothing to do) x KV head x chunk c of that
    prefix. The members' query heads of the KV head are the rows of one tile (ROWS // G members of G heads), so each
    K/V tile is read once for all of them instead of once per sequence; the online softmax's partial result goes
    to slot NUM_PARTS + c of each member, beside the partitions over the rest of its context (_decode_kernel), in
    the same units as those (an int8 pool: q scaled, and rounded per row with INT8_QK, as _decode_span does)."""
    item = tl.program_id(0)
    kvh = tl.program_id(1)
    chunk = tl.program_id(2)
    first = tl.load(items_ptr + item * 3)
    count = tl.load(items_ptr + item * 3 + 1)
    plen = tl.load(items_ptr + item * 3 + 2)
    if count > 0:
        part_len = tl.cdiv(tl.cdiv(plen, tl.num_programs(2)), BLOCK_N) * BLOCK_N
        start = chunk * part_len
        end = tl.minimum(start + part_len, plen)
        r = tl.arange(0, ROWS)
        member = r // G
        ok = (member < count) & (r < ROWS // G * G)
        seq = tl.load(members_ptr + first + member, mask=ok, other=0)
        heads = kvh * G + r % G
        offs_d = tl.arange(0, D)
        q = tl.load(q_ptr + seq[:, None] * s_qb + heads[:, None] * s_qh + offs_d[None, :], mask=ok[:, None],
                    other=0.0)
        q_scale = tl.full([ROWS], sm_scale * 1.4426950408889634, tl.float32)  # exp2 domain
        if QUANT:  # (each row, a member's head, as the decode kernel rounds it)
            q, q_scale = _q_units(q, q_scale, ks_ptr, kvh, INT8_QK)
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D], tl.float32)
        bt_row_ptr = bt_ptr + tl.load(members_ptr + first) * s_btb  # (the members' tables agree over the prefix)
        for n0 in range(start, end, BLOCK_N):  # (whole tiles: the prefix is a multiple of BLOCK_N)
            m_i, l_i, acc = _decode_tile(q, q_scale, m_i, l_i, acc, n0, 0, end, k_ptr, v_ptr, bt_row_ptr, kvh, s_kb,
                                         s_kt, s_kh, s_vb, s_vh, s_vd, D, PAGE, BLOCK_N, QUANT, INT8_QK, INT8_PV,
                                         False, 0, q_ptr.dtype.element_ty)
        if QUANT:
            acc = _v_units(acc, vs_ptr, kvh, INT8_PV)
        row = (seq * H + heads) * SLOTS + NUM_PARTS + chunk
        tl.store(pm_ptr + row, m_i, mask=ok)
        tl.store(pl_ptr + row, l_i, mask=ok)
        tl.store(po_ptr + row[:, None] * D + offs_d[None, :], acc, mask=ok[:, None])


@triton.jit
def _reduce_kernel(po_ptr, pm_ptr, pl_ptr, pre_ptr, out_ptr, s_ob, s_oh, H, D: tl.constexpr,
                   NUM_PARTS: tl.constexpr, SLOTS: tl.constexpr, SLOTS_P2: tl.constexpr, CASCADE: tl.constexpr):
    """Merges a sequence's partitions and, CASCADE, its shared prefix's chunks (slots NUM_PARTS .. SLOTS - 1, read
    only where pre_ptr[b] > 0: a sequence outside a group has none written)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_p = tl.arange(0, SLOTS_P2)
    ok = offs_p < NUM_PARTS
    if CASCADE:
        ok = ok | ((offs_p < SLOTS) & (tl.zeros([SLOTS_P2], tl.int32) + tl.load(pre_ptr + b) > 0))
    offs_d = tl.arange(0, D)
    row = (b * H + h) * SLOTS + offs_p
    m = tl.load(pm_ptr + row, mask=ok, other=float("-inf"))
    l = tl.load(pl_ptr + row, mask=ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(l > 0, tl.exp2(m - m_max), 0.0)
    acc = tl.load(po_ptr + row[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + b * s_ob + h * s_oh + offs_d, out.to(out_ptr.dtype.element_ty))


# ---------------------------------------------------------------------------------------- persistent decode
# `paged_decode_persistent` (issue 25): a fixed grid of programs pulls work items (sequence, KV head, chunk) from a
# plan built on the device from the context lengths, so a batch that mixes one long context with many short ones
# splits the long one into chunks of the same size as the others' whole spans, and one capture serves any mix of
# lengths. The chunk length is chosen per step on the device: at least PERSISTENT_MIN_CHUNK keys, and long enough
# that the batch makes at most `target` chunks beyond one per sequence (which bounds the partial results' buffer);
# target_chunks() makes that about PERSISTENT_ITEMS_PER_SM work items per SM, the partitioned kernel's aim. Program
# i takes items i, i + PROGRAMS, ... (a static stride: the items are of one length, so it balances).
PERSISTENT_MIN_CHUNK = 64
PERSISTENT_ITEMS_PER_SM = 4
PERSISTENT_PROGRAMS_PER_SM = 2  # resident at once: a bf16 D 128 program takes ~96 KB of shared memory (to tune)


def target_chunks(num_sms: int, num_kv_heads: int) -> int:
    return max(16, PERSISTENT_ITEMS_PER_SM * num_sms // num_kv_heads)


@triton.jit(do_not_specialize=["B"])
def _plan_kernel(lens_ptr, plan_ptr, seq_of_ptr, B, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr,
                 MIN_CHUNK: tl.constexpr, TARGET: tl.constexpr, B_PAD: tl.constexpr):
    """One program: plan[0] = the chunk length (a multiple of BLOCK_N), plan[1 + i] = the chunks of sequences
    before i (i = 0..B: plan[1 + B] is the total), seq_of[c] = chunk c's sequence. A sequence's span starts at
    the tile that holds its window's first key."""
    offs = tl.arange(0, B_PAD)
    ok = offs < B
    lens = tl.load(lens_ptr + offs, mask=ok, other=0)
    lo = _window_start(lens, WINDOW)
    span = tl.where(ok, lens - lo // BLOCK_N * BLOCK_N, 0)
    chunk = tl.maximum(tl.cdiv(tl.cdiv(tl.sum(span, 0), TARGET), BLOCK_N), tl.cdiv(MIN_CHUNK, BLOCK_N)) * BLOCK_N
    counts = tl.where(ok, tl.cdiv(span, chunk), 0)
    ends = tl.cumsum(counts, 0)
    tl.store(plan_ptr, chunk)
    tl.store(plan_ptr + 1, 0)
    tl.store(plan_ptr + 2 + offs, ends, mask=ok)
    for j in range(tl.max(counts, 0)):  # at most TARGET + 1 rounds
        tl.store(seq_of_ptr + ends - counts + j, offs, mask=ok & (j < counts))


@triton.jit(do_not_specialize=["s_btb", "B"])
def _persistent_decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, ks_ptr, vs_ptr, plan_ptr, seq_of_ptr,
    out_ptr, po_ptr, pm_ptr, pl_ptr,
    sm_scale, B,
    s_qb, s_qh, s_kb, s_kt, s_kh, s_vb, s_vh, s_vd, s_btb, s_ob, s_oh,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    HKV: tl.constexpr, PROGRAMS: tl.constexpr, QUANT: tl.constexpr, WINDOW: tl.constexpr,
    INT8_QK: tl.constexpr, INT8_PV: tl.constexpr,
):
    """Work item w = (chunk c of the plan, KV head w % HKV), programs taking every PROGRAMS-th. A sequence of one
    chunk writes its output; one of several writes partials [chunk, Hq] for _merge_kernel."""
    chunk = tl.load(plan_ptr)
    total = tl.load(plan_ptr + 1 + B) * HKV
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    mask_g = offs_g < G
    for w in range(tl.program_id(0), total, PROGRAMS):
        c = w // HKV
        kvh = w % HKV
        b = tl.load(seq_of_ptr + c)
        first_chunk = tl.load(plan_ptr + 1 + b)
        chunks = tl.load(plan_ptr + 2 + b) - first_chunk
        seq_len = tl.load(lens_ptr + b)
        lo = _window_start(seq_len, WINDOW)
        start = lo // BLOCK_N * BLOCK_N + (c - first_chunk) * chunk
        end = tl.minimum(start + chunk, seq_len)
        m_i, l_i, acc = _decode_span(q_ptr, k_ptr, v_ptr, bt_ptr, ks_ptr, vs_ptr, b, kvh, lo, start, end, sm_scale,
                                     s_qb, s_qh, s_kb, s_kt, s_kh, s_vb, s_vh, s_vd, s_btb, G, G_PAD, D, PAGE,
                                     BLOCK_N, QUANT, WINDOW, INT8_QK, INT8_PV, out_ptr.dtype.element_ty)
        heads = kvh * G + offs_g
        if chunks == 1:
            tl.store(out_ptr + b * s_ob + heads[:, None] * s_oh + offs_d[None, :],
                     (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=mask_g[:, None])
        else:
            row = c * (HKV * G) + heads  # partials: po [chunks, Hq, D], pm / pl [chunks, Hq]
            tl.store(pm_ptr + row, m_i, mask=mask_g)
            tl.store(pl_ptr + row, l_i, mask=mask_g)
            tl.store(po_ptr + row[:, None] * D + offs_d[None, :], acc, mask=mask_g[:, None])


@triton.jit
def _merge_kernel(plan_ptr, po_ptr, pm_ptr, pl_ptr, out_ptr, s_ob, s_oh, H, D: tl.constexpr):
    """Program (b, h): sequence b's chunks' partials of query head h into its output (a one-chunk sequence's
    output is written already). Every chunk holds a key its query sees, so each l > 0."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    first = tl.load(plan_ptr + 1 + b)
    chunks = tl.load(plan_ptr + 2 + b) - first
    if chunks > 1:
        offs_d = tl.arange(0, D)
        row = first * H + h
        m_max = tl.load(pm_ptr + row)
        for i in range(1, chunks):
            m_max = tl.maximum(m_max, tl.load(pm_ptr + row + i * H))
        w = tl.exp2(tl.load(pm_ptr + row) - m_max)
        l_sum = tl.load(pl_ptr + row) * w
        acc = tl.load(po_ptr + row * D + offs_d) * w
        for i in range(1, chunks):
            r = row + i * H
            w = tl.exp2(tl.load(pm_ptr + r) - m_max)
            l_sum += tl.load(pl_ptr + r) * w
            acc += tl.load(po_ptr + r * D + offs_d) * w
        tl.store(out_ptr + b * s_ob + h * s_oh + offs_d, (acc / l_sum).to(out_ptr.dtype.element_ty))


class PersistentDecodeBuffers:
    """What paged_decode_persistent needs besides its inputs, allocated once (CUDA-graph safe): the plan and
    the partial results of at most target + max_batch chunks (target: target_chunks()). The plan's chunks are
    whole tiles of the decode config's BLOCK_N for this pool (int8 or not): the kernel must use the same."""

    def __init__(self, max_batch: int, num_heads: int, head_dim: int, device, target: int = 64,
                 quant: bool = False, config: dict | None = None):
        cap = target + max_batch
        self.max_batch, self.target = max_batch, target
        self.block_n = _decode_config(quant, config)["BLOCK_N"]
        self.plan = torch.zeros(2 + max_batch, dtype=torch.int32, device=device)
        self.seq_of = torch.zeros(cap, dtype=torch.int32, device=device)
        self.po = torch.empty(cap, num_heads, head_dim, dtype=torch.float32, device=device)
        self.pm = torch.empty(cap, num_heads, dtype=torch.float32, device=device)
        self.pl = torch.empty_like(self.pm)


def plan_persistent_decode(seq_lens: torch.Tensor, buffers: PersistentDecodeBuffers,
                           window: int | None = None) -> None:
    """Fill buffers.plan from the batch's context lengths (on the device: no host sync). Once per step: every
    layer's paged_decode_persistent reads it."""
    batch = seq_lens.shape[0]
    if batch > buffers.max_batch:
        raise ValueError(f"persistent decode: batch {batch} > the buffers' {buffers.max_batch}")
    _plan_kernel[(1,)](seq_lens, buffers.plan, buffers.seq_of, batch, WINDOW=window or 0,
                       BLOCK_N=buffers.block_n, MIN_CHUNK=PERSISTENT_MIN_CHUNK,
                       TARGET=buffers.target, B_PAD=max(16, triton.next_power_of_2(batch)))


def paged_decode_persistent(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
                            buffers: PersistentDecodeBuffers, num_sms: int = 132,
                            k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                            out: torch.Tensor | None = None, window: int | None = None,
                            config: dict | None = None) -> torch.Tensor:
    """paged_decode's arguments and result, over the work plan plan_persistent_decode() left in buffers (same
    seq_lens and window): a grid of PERSISTENT_PROGRAMS_PER_SM programs per SM, then the merge of split
    sequences. The launch config's BLOCK_N must be the buffers' (ValueError)."""
    batch, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    quant = k_cache.dtype == torch.int8
    if out is None:
        out = torch.empty_like(q)
    cfg = _decode_config(quant, config)
    if cfg["BLOCK_N"] != buffers.block_n:
        raise ValueError(f"persistent decode: BLOCK_N {cfg['BLOCK_N']}, planned for {buffers.block_n}")
    int8_qk = cfg.pop("INT8_QK") and quant
    int8_pv = cfg.pop("INT8_PV") and quant
    programs = PERSISTENT_PROGRAMS_PER_SM * num_sms
    dummy = seq_lens
    _persistent_decode_kernel[(programs,)](
        q, k_cache, v_cache, block_tables, seq_lens, k_scale if quant else dummy, v_scale if quant else dummy,
        buffers.plan, buffers.seq_of, out, buffers.po, buffers.pm, buffers.pl, sm_scale, batch,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *_v_strides(v_cache),
        block_tables.stride(0), out.stride(0), out.stride(1),
        G=num_heads // num_kv_heads, G_PAD=max(16, triton.next_power_of_2(num_heads // num_kv_heads)), D=head_dim,
        PAGE=page, HKV=num_kv_heads, PROGRAMS=programs, QUANT=quant,
        WINDOW=window or 0, INT8_QK=int8_qk, INT8_PV=int8_pv, **cfg,
    )
    _merge_kernel[(batch, num_heads)](buffers.plan, buffers.po, buffers.pm, buffers.pl, out, out.stride(0),
                                      out.stride(1), num_heads, D=head_dim, num_warps=1)
    return out


def _decode_config(quant: bool, config: dict | None) -> dict:
    """The decode launch config (INT8_QK / INT8_PV included), with the bench's overrides."""
    return {"INT8_QK": False, "INT8_PV": False, **(DECODE_CONFIG_INT8 if quant else DECODE_CONFIG), **(config or {})}


def num_partitions(batch: int, num_kv_heads: int, max_model_len: int, num_sms: int = 132) -> int:
    """Enough partitions for ~4 programs per SM at small batch; 1 when the batch fills the GPU (H200, in a
    CUDA graph: batch 1 x 1k is fastest at 16 partitions, 8 x 1k at 8, 32 at 2, 64 and up at 1; docs/perf.md)."""
    want = max(1, (4 * num_sms) // max(1, batch * num_kv_heads))
    cap = max(1, triton.cdiv(max_model_len, 64))  # no partition shorter than one 64-key tile at full length
    return min(triton.next_power_of_2(want), triton.next_power_of_2(cap), MAX_PARTITIONS)


def _v_strides(v_cache: torch.Tensor) -> tuple[int, int, int]:
    """(block, KV head, dim) strides of an int8 pool's page-transposed V [num_blocks, Hkv, D, page]; the
    kernels read other pools' V with K's strides."""
    return v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, sm_scale: float, num_parts: int = 1,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, window: int | None = None,
                 config: dict | None = None, cascade: CascadeBuffers | None = None) -> torch.Tensor:
    """q [B, Hq, D]; k_cache [num_blocks, page, Hkv, D], v_cache the same or, int8, [num_blocks, Hkv, D, page];
    block_tables [B, max_blocks] int32;
    seq_lens [B] int32 (context length incl. the new token, already written). Returns [B, Hq, D].
    config: BLOCK_N / num_warps / num_stages overrides (the kernel bench sweeps them). cascade: shared prefixes
    computed once per group (CascadeBuffers, filled by fill(); not with a window)."""
    batch, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    quant = k_cache.dtype == torch.int8
    if cascade is not None and (window or batch > cascade.max_batch):
        raise ValueError(f"cascade decode attention takes no sliding window and at most {cascade.max_batch} decodes, "
                         f"got {batch}")
    slots = num_parts + (CASCADE_CHUNKS if cascade is not None else 0)
    if out is None:
        out = torch.empty_like(q)
    if slots > 1:
        po = torch.empty(batch, num_heads, slots, head_dim, dtype=torch.float32, device=q.device)
        pm = torch.empty(batch, num_heads, slots, dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
    else:
        po = pm = pl = out
    cfg = _decode_config(quant, config)
    int8_qk = cfg.pop("INT8_QK") and quant
    int8_pv = cfg.pop("INT8_PV") and quant
    dummy = seq_lens
    if cascade is not None:  # (first: with one part the decode kernel merges its results into the output)
        c = CASCADE_CONFIG_CPU if INTERPRETED else CASCADE_CONFIG
        _prefix_kernel[(cascade.items.shape[0], num_kv_heads, CASCADE_CHUNKS)](
            q, k_cache, v_cache, block_tables, k_scale if quant else dummy, v_scale if quant else dummy,
            cascade.items, cascade.members, po, pm, pl, sm_scale, q.stride(0), q.stride(1), k_cache.stride(0),
            k_cache.stride(1), k_cache.stride(2), *_v_strides(v_cache), block_tables.stride(0), num_heads, G=group,
            ROWS=cascade.rows, D=head_dim, PAGE=page, NUM_PARTS=num_parts, SLOTS=slots, QUANT=quant, INT8_QK=int8_qk,
            INT8_PV=int8_pv, **c)
    _decode_kernel[(batch, num_kv_heads, num_parts)](
        q, k_cache, v_cache, block_tables, seq_lens, k_scale if quant else dummy, v_scale if quant else dummy,
        cascade.prefix_lens if cascade is not None else dummy, out, po, pm, pl, sm_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *_v_strides(v_cache),
        block_tables.stride(0), out.stride(0), out.stride(1),
        G=group, G_PAD=max(16, triton.next_power_of_2(group)), D=head_dim, PAGE=page, NUM_PARTS=num_parts,
        QUANT=quant, WINDOW=window or 0, INT8_QK=int8_qk, INT8_PV=int8_pv, CASCADE=cascade is not None,
        SLOTS=slots, **cfg,
    )
    if num_parts > 1:
        _reduce_kernel[(batch, num_heads)](po, pm, pl, cascade.prefix_lens if cascade is not None else dummy, out,
                                           out.stride(0), out.stride(1), num_heads, D=head_dim, NUM_PARTS=num_parts,
                                           SLOTS=slots, SLOTS_P2=triton.next_power_of_2(slots),
                                           CASCADE=cascade is not None, num_warps=4)
    return out


# ---------------------------------------------------------------------------------------- cascade decode
# `paged_decode(..., cascade=buffers)` (`--cascade-attention`): decodes whose contexts start with the same K/V pages
# (the prefix cache's shared blocks: a RAG document or system prompt behind many requests) read those pages once
# per group instead of once per sequence. _prefix_kernel computes each group's shared prefix for all its members'
# query heads at once (CASCADE_CHUNKS programs per KV head split it), then _decode_kernel the rest of each context,
# merging the prefix's results into its own where it runs in one partition (else the reduce merges both, as it
# merges partitions). The groups are found on the host from the block tables
# (cascade_plan) and reach the device in fixed-size buffers, so a CUDA graph replays any grouping.
CASCADE_CHUNKS = 4  # programs per (group item, KV head) over the shared prefix
CASCADE_ROWS = 64  # query rows (members x heads per KV head) of one work item's tile
CASCADE_MIN_PREFIX = 256  # shorter shared prefixes are left to the per-sequence kernel
# where the cascade pays (kernel_bench --cascade, H100, Mistral-7B shape, 1,536 shared keys): one group of 192 / 96 /
# 64 / 32 decodes 1.70x / 1.91x / 1.47x / 1.10x, of 16 0.97x; 8 groups of 8 1.27x, 16 of 4 1.06x, 16 of 3 1.02x,
# 16 of 2 with 8 decodes alone 0.70x (the RAG shape's batch: the two kernels run one after the other, and the
# decode kernel's time is its longest context's either way).
CASCADE_MIN_MEMBERS = 8  # smaller groups are left to the per-sequence kernel ...
CASCADE_MIN_GROUPED = 32  # ... and so is a batch with fewer decodes in groups
CASCADE_CONFIG = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
CASCADE_CONFIG_CPU = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 1}
CASCADE_ALIGN = 64  # a shared prefix is a multiple of this many keys: the configs' BLOCK_N (the prefix kernel's
# tiles are whole, unmasked)
CASCADE_MAX_SPLITS = 64  # _shared_groups splits this deep at most (its recursion)


def _shared_groups(tables: np.ndarray, own: np.ndarray, m: np.ndarray, depth: int, block_size: int,
                   min_prefix: int, min_members: int, per_item: int,
                   splits: int = 0) -> tuple[list[tuple[np.ndarray, int]], int]:
    """Decodes m (sharing their first `depth` pages; own[i]: decode i's whole pages before its last one) -> the
    grouping of them that saves the most K/V reads, [(members, shared keys)], and those reads (a group's prefix is
    read once per work item of per_item members): either all of m over the pages they all share, or, split by the
    first page they do not all share, the best grouping of each part (a chat template shared by every request, then
    documents shared by some: the documents' groups); splits: how deep this call is."""
    full = int(own[m].min())
    same = (tables[m, depth:full] == tables[m[0], depth:full]).all(0)
    common = depth + (int(np.argmin(same)) if not same.all() else full - depth)
    keys = common * block_size // CASCADE_ALIGN * CASCADE_ALIGN
    reads = (len(m) - -(-len(m) // per_item)) * keys
    best = ([(m, keys)], reads) if reads > 0 and keys >= min_prefix and len(m) >= min_members else ([], 0)
    deeper = m[own[m] > common]  # (the others end at the common pages)
    if len(deeper) < max(2, min_members) or splits >= CASCADE_MAX_SPLITS:
        return best
    order = deeper[np.argsort(tables[deeper, common], kind="stable")]
    page = tables[order, common]
    starts = np.flatnonzero(np.r_[True, page[1:] != page[:-1]])
    split: list[tuple[np.ndarray, int]] = []
    saved = 0
    for s, e in zip(starts, np.r_[starts[1:], len(order)]):
        if e - s >= max(2, min_members):
            groups, reads = _shared_groups(tables, own, order[s:e], common + 1, block_size, min_prefix, min_members,
                                           per_item, splits + 1)
            split += groups
            saved += reads
    return (split, saved) if saved > best[1] else best


def cascade_plan(tables: np.ndarray, lens: np.ndarray, block_size: int, per_item: int, max_items: int,
                 min_prefix: int | None = None, min_members: int | None = None,
                 min_grouped: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Groups of decodes that share leading K/V pages, from their block tables [n, width] (int32) and context
    lengths [n]: (prefix [n]: the keys the group's prefix covers, a multiple of CASCADE_ALIGN, 0 outside a group;
    members [n]:
    sequence indices, each group's together; items [k, 3]: (first index into members, members <= per_item, prefix
    keys), at most max_items, the groups that save the most reads first). Only whole pages before each member's
    last one count (a shared page is a full page of the prefix cache; the page a decode writes is its own); a group
    shares at least min_prefix keys (CASCADE_MIN_PREFIX) among at least min_members decodes (CASCADE_MIN_MEMBERS),
    and a plan with fewer than min_grouped decodes in groups (CASCADE_MIN_GROUPED) is none; _shared_groups chooses
    them."""
    min_prefix = CASCADE_MIN_PREFIX if min_prefix is None else min_prefix
    min_members = CASCADE_MIN_MEMBERS if min_members is None else min_members
    min_grouped = CASCADE_MIN_GROUPED if min_grouped is None else min_grouped
    n = len(lens)
    prefix = np.zeros(n, dtype=np.int32)
    members: list[int] = []
    items: list[tuple[int, int, int]] = []
    if n >= max(2, min_grouped) and per_item > 1:  # (one member per work item reads the prefix once per member)
        own = (np.asarray(lens) - 1) // block_size
        groups, _ = _shared_groups(tables, own, np.arange(n), 0, block_size, min_prefix, min_members, per_item)
        for m, keys in sorted(groups, key=lambda g: -(len(g[0]) - -(-len(g[0]) // per_item)) * g[1]):
            if len(items) + -(-len(m) // per_item) > max_items:
                continue
            prefix[m] = keys
            items += [(len(members) + i, min(per_item, len(m) - i), keys) for i in range(0, len(m), per_item)]
            members += m.tolist()
        if len(members) < min_grouped:
            prefix[:], members, items = 0, [], []
    return prefix, np.array(members, dtype=np.int32), np.array(items, dtype=np.int32).reshape(-1, 3)


class CascadeBuffers:
    """cascade_plan's arrays on the device, allocated once for up to max_batch decodes (CUDA-graph safe: fill()
    copies into them on the current stream, behind the work that reads their previous contents)."""

    def __init__(self, max_batch: int, group_size: int, device):
        self.max_batch = max_batch
        self.rows = CASCADE_ROWS
        self.per_item = max(1, CASCADE_ROWS // group_size)  # members of one work item
        self.max_items = -(-max_batch // self.per_item) + 32  # (a group's last item may be part-full: 32 groups)
        # one device buffer (fill() copies into it at once): the prefix lengths, the members, the items
        self.flat = torch.zeros(2 * max_batch + 3 * self.max_items, dtype=torch.int32, device=device)
        self.prefix_lens = self.flat[:max_batch]
        self.members = self.flat[max_batch:2 * max_batch]
        self.items = self.flat[2 * max_batch:].view(self.max_items, 3)

    def fill(self, tables: np.ndarray, lens: np.ndarray, block_size: int, **limits) -> int:
        """Plans the decodes with these block tables and context lengths (at most max_batch; limits: cascade_plan's
        min_* overrides); returns how many are in a group (0: none, and the buffers still hold the last plan, so no
        kernel is to read them: the backend then runs the plain decode)."""
        from workers.sampling import to_device

        prefix, members, items = cascade_plan(tables, np.asarray(lens), block_size, self.per_item, self.max_items,
                                              **limits)
        if not len(members):
            return 0
        host = np.zeros(self.flat.shape[0], dtype=np.int32)
        host[:len(prefix)] = prefix
        host[self.max_batch:self.max_batch + len(members)] = members
        host[2 * self.max_batch:2 * self.max_batch + items.size] = items.ravel()
        self.flat.copy_(to_device(torch.from_numpy(host), torch.int32, self.flat.device))
        return len(members)


@triton.jit
def _prefill_tile(q, m_i, l_i, acc, n0, hi, q_pos, qk_scale, k_ptr, v_ptr, bt_row_ptr, kvh, s_kb, s_kt, s_kh,
                  s_vb, s_vh, s_vd, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
                  WINDOW: tl.constexpr, QUANT: tl.constexpr):
    """One BLOCK_N tile of keys [n0, n0 + BLOCK_N) into the online softmax; MASK: causal/window/end mask."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hi
    k, v = _load_kv(k_ptr, v_ptr, bt_row_ptr, n0, hi, kvh, s_kb, s_kt, s_kh, s_vb, s_vh, s_vd, D, PAGE, BLOCK_N, QUANT)
    k, v = k.to(q.dtype), v.to(q.dtype)
    qk = _dot(q, tl.trans(k)) * qk_scale
    if MASK:
        ok = (offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :]
        if WINDOW > 0:
            ok = ok & (offs_n[None, :] > q_pos[:, None] - WINDOW)
        qk = tl.where(ok, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if MASK:  # a row may have seen no key yet (window): keep exp2 away from -inf - -inf
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["first_seq", "s_btb"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, qsl_ptr, ks_ptr, vs_ptr, out_ptr,
    sm_scale, first_seq,
    s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vh, s_vd, s_btb, s_ot, s_oh,
    G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    QUANT: tl.constexpr, WINDOW: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    b = first_seq + tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    nq = tl.load(qsl_ptr + b + 1) - q_start
    if tile * BLOCK_M >= nq:
        return
    seq_len = tl.load(lens_ptr + b)
    kvh = h // G
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    mask_m = offs_m < nq
    q_pos = seq_len - nq + offs_m  # the chunk's queries sit at the end of the context
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * s_qt + h * s_qh + offs_d[None, :], mask=mask_m[:, None],
                other=0.0)
    qk_scale = sm_scale * 1.4426950408889634  # exp2 domain
    if QUANT:
        qk_scale = qk_scale * tl.load(ks_ptr + kvh)
    bt_row_ptr = bt_ptr + b * s_btb

    first_q = seq_len - nq + tile * BLOCK_M
    hi = tl.minimum(first_q + BLOCK_M, seq_len)  # causal: no key past the tile's last query
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if WINDOW > 0:  # every tile is masked by the window
        lo = tl.maximum(first_q - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
        full_end = lo
    else:  # keys before the tile's first query are seen by all its queries: no mask there
        full_end = first_q // BLOCK_N * BLOCK_N
        for n0 in range(0, full_end, BLOCK_N):
            m_i, l_i, acc = _prefill_tile(q, m_i, l_i, acc, n0, hi, q_pos, qk_scale, k_ptr, v_ptr, bt_row_ptr, kvh,
                                          s_kb, s_kt, s_kh, s_vb, s_vh, s_vd, D, PAGE, BLOCK_N, False, WINDOW, QUANT)
    for n0 in range(full_end, hi, BLOCK_N):
        m_i, l_i, acc = _prefill_tile(q, m_i, l_i, acc, n0, hi, q_pos, qk_scale, k_ptr, v_ptr, bt_row_ptr, kvh,
                                      s_kb, s_kt, s_kh, s_vb, s_vh, s_vd, D, PAGE, BLOCK_N, True, WINDOW, QUANT)
    out = acc / l_i[:, None]
    if QUANT:
        out = out * tl.load(vs_ptr + kvh)
    tl.store(out_ptr + (q_start + offs_m)[:, None] * s_ot + h * s_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None])


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, first_seq: int, num_seqs: int,
                  max_query_len: int, sm_scale: float, out: torch.Tensor,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                  window: int | None = None, config: dict | None = None) -> torch.Tensor:
    """Causal attention for sequences first_seq .. first_seq+num_seqs-1 of a packed step: sequence b's
    queries are rows query_start_loc[b]:query_start_loc[b+1] of q [T, Hq, D], at the last positions of its
    seq_lens[b]-token context, whose K/V (this chunk's included) are already in the pages. Writes those
    rows of out [T, Hq, D]. max_query_len (a host int) sizes the grid: no device sync.
    config: BLOCK_M / BLOCK_N / num_warps / num_stages overrides (the kernel bench sweeps them)."""
    _, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    quant = k_cache.dtype == torch.int8
    cfg = {**(PREFILL_CONFIG_CPU if INTERPRETED else PREFILL_CONFIG), **(config or {})}
    grid = (triton.cdiv(max_query_len, cfg["BLOCK_M"]), num_heads, num_seqs)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        k_scale if quant else seq_lens, v_scale if quant else seq_lens, out, sm_scale, first_seq,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *_v_strides(v_cache),
        block_tables.stride(0), out.stride(0), out.stride(1),
        G=num_heads // num_kv_heads, D=head_dim, PAGE=page, QUANT=quant, WINDOW=window or 0, **cfg,
    )
    return out


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr, s_kt, s_kh, s_vt, s_vh,
                     s_cb, s_ct, s_ch, s_db, s_dt, s_dh, s_dd, PAGE: tl.constexpr, D: tl.constexpr,
                     QUANT: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding row of a CUDA-graph batch
        return
    offs_d = tl.arange(0, D)
    k = tl.load(k_ptr + t * s_kt + h * s_kh + offs_d).to(tl.float32)
    v = tl.load(v_ptr + t * s_vt + h * s_vh + offs_d).to(tl.float32)
    dst = (slot // PAGE) * s_cb + (slot % PAGE) * s_ct + h * s_ch + offs_d
    v_dst = (slot // PAGE) * s_db + (slot % PAGE) * s_dt + h * s_dh + offs_d * s_dd  # int8: transposed pages
    if QUANT:
        k = tl.clamp(k / tl.load(ks_ptr + h), -127.0, 127.0)
        v = tl.clamp(v / tl.load(vs_ptr + h), -127.0, 127.0)
        k = tl.where(k >= 0, tl.floor(k + 0.5), -tl.floor(0.5 - k))  # round half away from zero
        v = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v))
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty))
    tl.store(vc_ptr + v_dst, v.to(vc_ptr.dtype.element_ty))


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """k/v [T, Hkv, D] into the pool at slots [T] (int64; -1 = skip); int8 pools' V pages are transposed."""
    tokens, num_kv_heads, head_dim = k.shape
    quant = k_cache.dtype == torch.int8
    vb, vh, vd = _v_strides(v_cache)
    v_dst = (vb, 1, vh, vd) if quant else (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), 1)
    _write_kv_kernel[(tokens, num_kv_heads)](
        k, v, k_cache, v_cache, slots, k_scale if quant else slots, v_scale if quant else slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *v_dst, PAGE=k_cache.shape[1], D=head_dim, QUANT=quant,
        num_warps=1,
    )
