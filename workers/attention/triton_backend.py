"""The GPU attention backend: Triton paged decode, Triton KV writes, SDPA for prefill chunks.

Owns per-step planning for the GPU path. Decodes read K/V straight from the pages
(workers/kernels/paged_attention.py), so the step needs no gather and the decode part is
CUDA-graph safe (everything it reads lives in the metadata tensors). Prefill chunks run
through SDPA (flash attention when the chunk starts at 0, the memory-efficient kernel
with an offset causal mask when it starts mid-prompt) over K/V gathered from the pages.
int8 pools: the write and decode kernels quantise / dequantise with the layer's per-KV-head
scales; a prefill chunk dequantises only the rows it gathered (its sequence's context).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.attention.base import AttentionBackend, AttentionMetadata, prefill_chunks
from workers.kernels.paged_attention import num_partitions, paged_decode, write_kv
from workers.kv_cache import LayerScales, dequantize


@dataclass
class _Plan:
    num_parts: int
    # per prefill sequence: (q_start, q_end, key slots [L], mask [1, nq, L] or None for plain causal)
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, num_kv_heads: int, num_sms: int):
        self.num_kv_heads = num_kv_heads
        self.num_sms = num_sms
        self.window: int | None = None

    def prepare(self, meta: AttentionMetadata, block_size: int, sliding_window: int | None) -> None:
        self.window = sliding_window
        nd = meta.num_decodes
        parts = 1
        if nd:
            parts = num_partitions(nd, self.num_kv_heads, max(meta.seq_lens_cpu[:nd]), self.num_sms)
        prefills = prefill_chunks(meta, block_size, sliding_window, plain_causal_mask=False)
        meta.plan = _Plan(parts, prefills)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                kv_scales: LayerScales | None = None) -> torch.Tensor:
        plan: _Plan = meta.plan
        ks = vs = None
        if kv_scales is not None:  # int8 pool: the kernels quantise / dequantise with these [Hkv] scales
            kv_scales.observe(k, v)
            ks, vs = kv_scales.k, kv_scales.v
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, ks, vs)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            paged_decode(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                         num_parts=plan.num_parts, k_scale=ks, v_scale=vs, out=out[:nd], window=self.window)
        if plan.prefills:
            flat_k = k_cache.view(-1, *k_cache.shape[2:])
            flat_v = v_cache.view(-1, *v_cache.shape[2:])
            for q_start, q_end, slots, mask in plan.prefills:
                if mask is None and ks is None:  # the chunk is the whole context: no gather needed
                    kp, vp = k[q_start:q_end], v[q_start:q_end]
                else:
                    kp, vp = flat_k[slots], flat_v[slots]  # [L, Hkv, D]: this sequence's context only
                if ks is not None:
                    kp, vp = dequantize(kp, ks, q.dtype), dequantize(vp, vs, q.dtype)
                qp = q[q_start:q_end].transpose(0, 1)  # [Hq, nq, D]
                o = F.scaled_dot_product_attention(qp, kp.transpose(0, 1), vp.transpose(0, 1), attn_mask=mask,
                                                   is_causal=mask is None, scale=scale, enable_gqa=True)
                out[q_start:q_end] = o.transpose(0, 1)
        return out
