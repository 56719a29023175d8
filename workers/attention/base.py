"""The attention backend interface and the per-step metadata every backend reads.

Owns the shape of a step as attention sees it (vLLM vocabulary). Must not know requests,
sampling or the model: a backend gets q/k/v of one layer and that layer's slice of the pool.

A step packs the scheduled tokens of all sequences into one flat batch, decodes first:
sequences 0..num_decodes-1 have exactly one query token, the rest are prefill chunks that
may start anywhere (chunked prefill, prefix-cache hits). Sequence i's query tokens are
rows query_start_loc[i]:query_start_loc[i+1]; its context (cached + new) is seq_lens[i]
tokens, so its queries sit at positions seq_lens[i]-query_len .. seq_lens[i]-1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.kv_cache import LayerScales


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [B+1] int32, on device
    seq_lens: torch.Tensor  # [B] int32, context length incl. this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32 (padded with 0)
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V goes in the flattened pool
    num_decodes: int  # leading sequences with one query token each (= their token count)
    # host copies, so backends can plan without a device sync
    query_lens_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    # filled by AttentionBackend.prepare(); backend-private, computed once per step for all layers
    plan: object = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


class AttentionBackend:
    """prepare() once per step, then forward() once per layer."""

    name = "base"

    def prepare(self, meta: AttentionMetadata, block_size: int, sliding_window: int | None) -> None:
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                kv_scales: LayerScales | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] of this step's tokens (RoPE applied); k/v_cache
        [num_blocks, block_size, Hkv, D] of this layer. Writes k/v into the cache at
        meta.slot_mapping, then returns attention output [T, Hq, D].
        int8 caches come with kv_scales (this layer's per-KV-head scales, workers/kv_cache.py):
        the backend calls kv_scales.observe(k, v) before writing (the dynamic fallback sets the
        scales there once), quantises what it writes and dequantises what it reads, inside
        attention: never a full-precision copy of the pool."""
        raise NotImplementedError


def key_slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flattened pool slots of `positions` in a sequence with this block table."""
    return block_table[..., positions // block_size].long() * block_size + positions % block_size


def allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) mask: q_pos [..., nq, 1] against k_pos [..., 1, L]."""
    ok = k_pos <= q_pos
    if window is not None:
        ok &= k_pos > q_pos - window  # HF/Mistral: a query sees the last `window` positions incl. itself
    return ok


def prefill_chunks(meta: AttentionMetadata, block_size: int, window: int | None):
    """Per prefill sequence: (q_start, q_end, key slots [L], mask [1, nq, L])."""
    device = meta.slot_mapping.device
    chunks = []
    start = sum(meta.query_lens_cpu[:meta.num_decodes])
    for i in range(meta.num_decodes, meta.num_seqs):
        nq, seq_len = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
        k_pos = torch.arange(seq_len, device=device)
        slots = key_slots(meta.block_tables[i], k_pos, block_size)
        mask = allowed(k_pos[seq_len - nq:, None], k_pos[None, :], window)[None]
        chunks.append((start, start + nq, slots, mask))
        start += nq
    return chunks
