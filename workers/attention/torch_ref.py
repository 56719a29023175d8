"""The torch reference attention backend: scatter new K/V into the pool, gather, SDPA.

Owns the exact (not fast) path that runs anywhere and that faster backends are checked
against. Must not keep state between steps other than what prepare() builds for one step.

Decodes (one query each) are batched into one padded SDPA call; prefill chunks run one
SDPA call per sequence with a causal mask offset by the chunk's start position, since
chunks may start mid-prompt. Gather indices and masks are built once per step in
prepare() and shared by all layers, as (block, offset) pairs: pages are indexed as
[num_blocks, page, Hkv, D] rows, which an int8 pool's transposed V pages are too, through a
strided view (workers.kv_cache.v_rows). An int8 pool is quantised on write and dequantised
row by row as it is gathered (the step's working set only, the same transient copy the
float path's gather makes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from workers.attention.base import AttentionBackend, AttentionMetadata, Rope, allowed, key_slots, prefill_chunks
from workers.kernels.fused import rope_
from workers.kv_cache import LayerScales, dequantize, quantize_int8, v_rows

# Most gathered key rows one padded decode call may hold: bounds the transient K/V copy
# (rows x Hkv x D each, for K and V) whatever the batch and context lengths.
MAX_DECODE_GATHER = 1 << 16
# Not cuDNN: it rebuilds its plan for every new mask shape (~2 ms of CPU per call on an H200).
# GQA is folded into the query length below, so every backend here can take the masks.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


Slots = tuple[torch.Tensor, torch.Tensor]  # (block, offset in the page) of pool slots, same shape


def _split(slots: torch.Tensor, block_size: int) -> Slots:
    return slots // block_size, slots % block_size


@dataclass
class _Plan:
    writes: Slots  # where this step's new K/V rows go
    # decode groups: (first row, end row, slots [rows, max_len] (0 where masked),
    # mask [rows, 1, 1, max_len] bool, True = attend)
    decodes: list[tuple[int, int, Slots, torch.Tensor]]
    prefills: list[tuple[int, int, Slots, torch.Tensor]]  # (q_start, q_end, slots [L], mask [1, nq, L])


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, max_decode_gather: int = MAX_DECODE_GATHER):
        self.max_decode_gather = max_decode_gather

    def prepare(self, meta: AttentionMetadata, block_size: int, sliding_window: int | None) -> None:
        device = meta.slot_mapping.device
        nd = meta.num_decodes
        decodes = []
        lo = 0
        while lo < nd:  # consecutive groups, each padded to its own longest context
            hi, longest = lo + 1, meta.seq_lens_cpu[lo]
            while hi < nd and max(longest, meta.seq_lens_cpu[hi]) * (hi + 1 - lo) <= self.max_decode_gather:
                longest = max(longest, meta.seq_lens_cpu[hi])
                hi += 1
            lens = meta.seq_lens[lo:hi].long()
            k_pos = torch.arange(longest, device=device)
            mask = allowed((lens - 1)[:, None], k_pos[None, :], sliding_window) & (k_pos[None, :] < lens[:, None])
            slots = torch.where(mask, key_slots(meta.block_tables[lo:hi], k_pos, block_size), 0)
            decodes.append((lo, hi, _split(slots, block_size), mask[:, None, None, :]))
            lo = hi
        prefills = [(q0, q1, _split(slots, block_size), mask)
                    for q0, q1, slots, mask in prefill_chunks(meta, block_size, sliding_window)]
        meta.plan = _Plan(_split(meta.slot_mapping, block_size), decodes, prefills)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                kv_scales: LayerScales | None = None, rope: Rope | None = None,
                out: torch.Tensor | None = None, kv_written: bool = False) -> torch.Tensor:
        if rope is not None:
            rope_(q, k, *rope)
        plan: _Plan = meta.plan
        rows_k, rows_v = k_cache, v_rows(v_cache)  # [num_blocks, page, Hkv, D]
        if kv_scales is not None:  # int8 pool: quantise on write, dequantise each gathered working set
            if not kv_written:
                kv_scales.observe(k, v)
                rows_k[plan.writes] = quantize_int8(k, kv_scales.k)
                rows_v[plan.writes] = quantize_int8(v, kv_scales.v)
            ks, vs = kv_scales.k, kv_scales.v

            def read(rows, slots, s):
                return dequantize(rows[slots], s, q.dtype)
        else:
            if not kv_written:
                rows_k[plan.writes] = k.to(rows_k.dtype)
                rows_v[plan.writes] = v.to(rows_v.dtype)
            ks = vs = None

            def read(rows, slots, s):
                return rows[slots].to(q.dtype)
        out = torch.empty_like(q) if out is None else out
        num_kv_heads = rows_k.shape[2]
        group = q.shape[1] // num_kv_heads
        with sdpa_kernel(_SDPA_BACKENDS):
            for lo, hi, slots, mask in plan.decodes:
                kd = read(rows_k, slots, ks).transpose(1, 2)  # [rows, Hkv, L, D]
                vd = read(rows_v, slots, vs).transpose(1, 2)
                qd = q[lo:hi].unflatten(1, (num_kv_heads, group))  # [rows, Hkv, G, D]: a KV head's G queries
                o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
                out[lo:hi] = o.flatten(1, 2)
            for q_start, q_end, slots, mask in plan.prefills:
                kp = read(rows_k, slots, ks).transpose(0, 1)  # [Hkv, L, D]
                vp = read(rows_v, slots, vs).transpose(0, 1)
                nq = q_end - q_start
                # [nq, Hq, D] -> [Hkv, G*nq, D]: each KV head attends for its G query heads at once
                qp = q[q_start:q_end].unflatten(1, (num_kv_heads, group)).permute(1, 2, 0, 3).flatten(1, 2)
                m = mask.expand(group, nq, -1).reshape(1, group * nq, -1)
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=m, scale=scale)
                out[q_start:q_end] = o.unflatten(1, (group, nq)).permute(2, 0, 1, 3).flatten(1, 2)
        return out
