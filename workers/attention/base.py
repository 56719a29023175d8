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
from itertools import chain

import numpy as np
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
    block_tables_cpu: np.ndarray | None = None  # the block tables on the host (None in a decode graph's capture)
    # filled by AttentionBackend.prepare(); backend-private, computed once per step for all layers
    plan: object = None

    @classmethod
    def from_rows(cls, rows: list[tuple[list[int], int, int, list[int]]], block_size: int,
                  device: torch.device) -> tuple[AttentionMetadata, np.ndarray, np.ndarray]:
        """A step's metadata, input ids and positions (host arrays) from its sequences in row order, one-token ones
        first: each (block ids, first position, tokens computed, the known ones of those tokens: any missing at
        the end are input 0, for the caller to fill). Host values reach the device without a sync."""
        from workers.sampling import to_device

        # whole-step numpy, no per-row numpy calls (a step of 160 decodes took 1.2 ms row by row, on a CI-class CPU)
        query_lens = [n for _, _, n, _ in rows]
        seq_lens = [start + n for _, start, n, _ in rows]
        used = [-(-s // block_size) for s in seq_lens]  # blocks each row's context spans
        known_lens = [len(k) for *_, k in rows]
        qsl = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=qsl[1:])
        block_tables = np.zeros((len(rows), max(used)), dtype=np.int32)  # row-major fill of each row's first `used`
        block_tables[np.arange(block_tables.shape[1]) < np.array(used)[:, None]] = np.fromiter(
            chain.from_iterable(b[:u] for (b, *_), u in zip(rows, used)), dtype=np.int32, count=sum(used))
        row_of = np.repeat(np.arange(len(rows)), query_lens)
        offset = np.arange(qsl[-1]) - qsl[:-1][row_of]  # each token's place in its row
        positions = np.array([start for _, start, _, _ in rows], dtype=np.int64)[row_of] + offset
        slots = block_tables[row_of, positions // block_size].astype(np.int64) * block_size + positions % block_size
        ids = np.zeros(qsl[-1], dtype=np.int64)
        ids[offset < np.array(known_lens)[row_of]] = np.fromiter(chain.from_iterable(k for *_, k in rows),
                                                                 dtype=np.int64, count=sum(known_lens))
        decodes = 0
        while decodes < len(query_lens) and query_lens[decodes] == 1:
            decodes += 1
        meta = cls(query_start_loc=to_device(torch.from_numpy(qsl), torch.int32, device),
                   seq_lens=to_device(seq_lens, torch.int32, device),
                   block_tables=to_device(torch.from_numpy(block_tables), torch.int32, device),
                   slot_mapping=to_device(torch.from_numpy(slots), torch.int64, device),
                   num_decodes=decodes, query_lens_cpu=query_lens, seq_lens_cpu=seq_lens,
                   block_tables_cpu=block_tables)
        return meta, ids, positions

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


Rope = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (positions, cos, sin): AttentionBackend.forward's rope


class AttentionBackend:
    """prepare() once per step, then forward() once per layer."""

    name = "base"

    def prepare(self, meta: AttentionMetadata, block_size: int, sliding_window: int | None) -> None:
        raise NotImplementedError

    def begin(self, meta: AttentionMetadata) -> None:
        """Called by the model at the start of each forward, before any layer's forward(): device-side work the
        layers share (inside a CUDA graph's capture, so replays redo it)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                kv_scales: LayerScales | None = None, rope: Rope | None = None,
                out: torch.Tensor | None = None, kv_written: bool = False) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] of this step's tokens; k/v_cache [num_blocks, block_size, Hkv, D] of
        this layer. With rope (positions [T], fp32 cos and sin tables) q and k come before RoPE and the backend
        rotates them in place first (fused.rope_; the Triton backend in the launch that writes K/V, for pools that
        are not int8); without it they come rotated. Writes k/v into the cache at meta.slot_mapping, then returns
        attention output [T, Hq, D] (in out, contiguous [T, Hq, D], when given: a CUDA graph's static buffer).
        int8 caches come with kv_scales (this layer's per-KV-head scales, workers/kv_cache.py):
        the backend calls kv_scales.observe(k, v) before writing (the dynamic fallback sets the
        scales there once), quantises what it writes and dequantises what it reads, inside
        attention: never a full-precision copy of the pool. kv_written: q comes rotated and k / v are in the cache
        already (the model did both ahead of attention: the qkv GEMV, workers/kernels/gemv.py's qkv_rope_gemv, or
        the piecewise CUDA graph before it, through rope_write; rope is None then)."""
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
