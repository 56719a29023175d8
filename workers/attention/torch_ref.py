"""The torch reference attention backend: scatter new K/V into the pool, gather, SDPA.

Owns the exact (not fast) path that runs anywhere and that faster backends are checked
against. Must not keep state between steps other than what prepare() builds for one step.

Decodes (one query each) are batched into one padded SDPA call; prefill chunks run one
SDPA call per sequence with a causal mask offset by the chunk's start position, since
chunks may start mid-prompt. Gather indices and masks are built once per step in
prepare() and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.attention.base import AttentionBackend, AttentionMetadata


@dataclass
class _Plan:
    decode_slots: torch.Tensor | None  # [num_decodes, max_len] int64 slots (0 where masked)
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_len] bool, True = attend
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor]]  # (q_start, q_end, slots [L], mask [1, nq, L])


def _key_slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return block_table[..., positions // block_size].long() * block_size + positions % block_size


def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) mask: q_pos [..., nq, 1] against k_pos [..., 1, L]."""
    ok = k_pos <= q_pos
    if window is not None:
        ok &= k_pos > q_pos - window  # HF/Mistral: a query sees the last `window` positions incl. itself
    return ok


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def prepare(self, meta: AttentionMetadata, block_size: int, sliding_window: int | None) -> None:
        device = meta.slot_mapping.device
        nd = meta.num_decodes
        decode_slots = decode_mask = None
        if nd:
            lens = meta.seq_lens[:nd].long()
            k_pos = torch.arange(max(meta.seq_lens_cpu[:nd]), device=device)
            mask = _allowed((lens - 1)[:, None], k_pos[None, :], sliding_window) & (k_pos[None, :] < lens[:, None])
            decode_slots = torch.where(mask, _key_slots(meta.block_tables[:nd], k_pos, block_size), 0)
            decode_mask = mask[:, None, None, :]
        prefills = []
        start = sum(meta.query_lens_cpu[:nd])
        for i in range(nd, meta.num_seqs):
            nq, seq_len = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
            q_start = start
            k_pos = torch.arange(seq_len, device=device)
            q_pos = k_pos[seq_len - nq:]
            slots = _key_slots(meta.block_tables[i], k_pos, block_size)
            mask = _allowed(q_pos[:, None], k_pos[None, :], sliding_window)[None]
            prefills.append((q_start, q_start + nq, slots, mask))
            start += nq
        meta.plan = _Plan(decode_slots, decode_mask, prefills)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        plan: _Plan = meta.plan
        flat_k = k_cache.view(-1, *k_cache.shape[2:])
        flat_v = v_cache.view(-1, *v_cache.shape[2:])
        flat_k.index_copy_(0, meta.slot_mapping, k.to(flat_k.dtype))
        flat_v.index_copy_(0, meta.slot_mapping, v.to(flat_v.dtype))
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            kd = flat_k[plan.decode_slots].transpose(1, 2).to(q.dtype)  # [nd, Hkv, L, D]
            vd = flat_v[plan.decode_slots].transpose(1, 2).to(q.dtype)
            qd = q[:nd].unsqueeze(2)  # [nd, Hq, 1, D]
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=plan.decode_mask, scale=scale, enable_gqa=True)
            out[:nd] = o.squeeze(2)
        for q_start, q_end, slots, mask in plan.prefills:
            kp = flat_k[slots].transpose(0, 1).to(q.dtype)  # [Hkv, L, D]
            vp = flat_v[slots].transpose(0, 1).to(q.dtype)
            qp = q[q_start:q_end].transpose(0, 1)  # [Hq, nq, D]
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=True)
            out[q_start:q_end] = o.transpose(0, 1)
        return out
