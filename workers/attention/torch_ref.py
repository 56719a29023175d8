"""The torch reference attention backend: scatter new K/V into the pool, gather, SDPA.

Owns the exact (not fast) path that runs anywhere and that faster backends are checked
against. Must not keep state between steps other than what prepare() builds for one step.

Decodes (one query each) are batched into one padded SDPA call; prefill chunks run one
SDPA call per sequence with a causal mask offset by the chunk's start position, since
chunks may start mid-prompt. Gather indices and masks are built once per step in
prepare() and shared by all layers. An int8 pool is quantised on write and dequantised
row by row as it is gathered (the step's working set only, the same transient copy the
float path's gather makes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from workers.attention.base import AttentionBackend, AttentionMetadata, allowed, key_slots, prefill_chunks
from workers.kv_cache import LayerScales, dequantize, quantize_int8


# Most gathered key rows one padded decode call may hold: bounds the transient K/V copy
# (rows x Hkv x D each, for K and V) whatever the batch and context lengths.
MAX_DECODE_GATHER = 1 << 16
# Not cuDNN: it rebuilds its plan for every new mask shape (~2 ms of CPU per call on an H200).
# GQA is folded into the query length below, so every backend here can take the masks.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class _Plan:
    # decode groups: (first row, end row, slots [rows, max_len] int64 (0 where masked),
    # mask [rows, 1, 1, max_len] bool, True = attend)
    decodes: list[tuple[int, int, torch.Tensor, torch.Tensor]]
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor]]  # (q_start, q_end, slots [L], mask [1, nq, L])


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
            decodes.append((lo, hi, slots, mask[:, None, None, :]))
            lo = hi
        prefills = prefill_chunks(meta, block_size, sliding_window)
        meta.plan = _Plan(decodes, prefills)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                kv_scales: LayerScales | None = None) -> torch.Tensor:
        plan: _Plan = meta.plan
        flat_k = k_cache.view(-1, *k_cache.shape[2:])
        flat_v = v_cache.view(-1, *v_cache.shape[2:])
        if kv_scales is not None:  # int8 pool: quantise on write, dequantise each gathered working set
            kv_scales.observe(k, v)
            ks, vs = kv_scales.k, kv_scales.v
            flat_k.index_copy_(0, meta.slot_mapping, quantize_int8(k, ks))
            flat_v.index_copy_(0, meta.slot_mapping, quantize_int8(v, vs))

            def read(flat, slots, s):
                return dequantize(flat[slots], s, q.dtype)
        else:
            flat_k.index_copy_(0, meta.slot_mapping, k.to(flat_k.dtype))
            flat_v.index_copy_(0, meta.slot_mapping, v.to(flat_v.dtype))
            ks = vs = None

            def read(flat, slots, s):
                return flat[slots].to(q.dtype)
        out = torch.empty_like(q)
        num_kv_heads = flat_k.shape[1]
        group = q.shape[1] // num_kv_heads
        with sdpa_kernel(_SDPA_BACKENDS):
            for lo, hi, slots, mask in plan.decodes:
                kd = read(flat_k, slots, ks).transpose(1, 2)  # [rows, Hkv, L, D]
                vd = read(flat_v, slots, vs).transpose(1, 2)
                qd = q[lo:hi].unflatten(1, (num_kv_heads, group))  # [rows, Hkv, G, D]: a KV head's G queries
                o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
                out[lo:hi] = o.flatten(1, 2)
            for q_start, q_end, slots, mask in plan.prefills:
                kp = read(flat_k, slots, ks).transpose(0, 1)  # [Hkv, L, D]
                vp = read(flat_v, slots, vs).transpose(0, 1)
                nq = q_end - q_start
                # [nq, Hq, D] -> [Hkv, G*nq, D]: each KV head attends for its G query heads at once
                qp = q[q_start:q_end].unflatten(1, (num_kv_heads, group)).permute(1, 2, 0, 3).flatten(1, 2)
                m = mask.expand(group, nq, -1).reshape(1, group * nq, -1)
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=m, scale=scale)
                out[q_start:q_end] = o.unflatten(1, (group, nq)).permute(2, 0, 1, 3).flatten(1, 2)
        return out
