"""The GPU attention backend: Triton KV writes, Triton paged decode and paged prefill.

Owns per-step planning for the GPU path. Every kernel reads K/V straight from the pages
(workers/kernels/paged_attention.py): no gather, no mask tensors. Decodes are CUDA-graph safe
(everything they read lives in the metadata tensors); all prefill chunks of a step, wherever
each starts (chunked prefill, prefix-cache hits), go through one varlen launch.
int8 pools: the kernels quantise / dequantise with the layer's per-KV-head scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from workers.attention.base import AttentionBackend, AttentionMetadata, Rope
from workers.kernels.fused import rope_, rope_write_kv_, triton_kernels
from workers.kernels.paged_attention import (MAX_PARTITIONS, CascadeBuffers, PersistentDecodeBuffers, num_partitions,
                                             paged_decode, paged_decode_persistent, paged_prefill,
                                             plan_persistent_decode, target_chunks, write_kv)
from workers.kv_cache import LayerScales

# --decode-attention auto (the default): the persistent kernel for a decode batch whose longest context is at least
# SKEW_RATIO x its mean and SKEW_MIN_LEN long, the partitioned one otherwise. On the H200 (docs/perf.md) the
# persistent kernel was 1.7x faster on 1 x 8k + 7 x 128 (8k against a mean of 1.1k: 7x) and more on the skews
# beyond; on uniform batches it was 0.5-0.8x as fast. The boundary between those is not measured. Whole decode
# steps with auto on the H100: uniform 1.00x, 1 x 32k + 63 x 512 3.82x.
SKEW_RATIO = 4.0
SKEW_MIN_LEN = 4096


def skewed(lens) -> bool:
    """Whether a decode batch with these context lengths is skewed in --decode-attention auto's sense."""
    longest = max(lens)
    return longest >= SKEW_MIN_LEN and longest * len(lens) >= SKEW_RATIO * sum(lens)


def _stream_key(device: torch.device) -> int | None:
    """The current CUDA stream's handle (None off CUDA): the backend's per-stream buffers are keyed by it."""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None


@dataclass
class _Plan:
    num_parts: int  # decode partitions (flash-decoding)
    num_prefills: int  # sequences after the decodes
    max_prefill_len: int  # longest prefill chunk: sizes the prefill grid
    persistent: bool = False  # the decodes run the persistent kernel
    replan: bool = False  # persistent decode: the next layer builds the work plan (the first of each forward)
    # cascade decode: the decodes' host block tables and lengths to group (planned in the first layer's forward,
    # which knows the heads per KV head), or a decode graph's capture (it reads graph_cascade); then the buffers
    cascade_rows: tuple | None = None
    cascade_graph: bool = False
    cascade: CascadeBuffers | None = None


class TritonAttentionBackend(AttentionBackend):
    """decode: `partitioned`, a grid of (sequence, KV head, partition), the partition count chosen per step from
    the batch size and longest context; or `persistent` (issue 25), a fixed grid over a work plan the device builds
    from the context lengths once per forward (begin()), for batches of at most max_batch decodes (larger eager
    ones fall back to partitioned); or `auto`: the persistent kernel for skewed batches (`skewed`), the
    partitioned one otherwise (the decode CUDA graphs are captured with each, workers/cuda_graphs.py).
    cascade (`--cascade-attention`): where the partitioned kernel runs, decodes whose contexts start with the same
    pages read them once per group (paged_attention's cascade decode); the decode CUDA graphs are also captured as
    `cascade`, which reads one set of buffers (graph_cascade) that decode_variant fills when it picks that graph
    before a replay; a batch with no group replays the plain graph."""

    name = "triton"

    def __init__(self, num_kv_heads: int, num_sms: int, decode: str = "partitioned", max_batch: int = 256,
                 cascade: bool = False):
        self.num_kv_heads = num_kv_heads
        self.cascade = cascade
        self.cascade_buffers: dict[int | None, CascadeBuffers] = {}  # eager steps', per CUDA stream
        self.graph_cascade: CascadeBuffers | None = None  # the decode graphs' (allocated at their capture)
        self.num_sms = num_sms
        self.window: int | None = None
        self.mode = decode
        self.persistent = decode != "partitioned"  # the persistent kernel may run
        self.graph_variants = {"partitioned": ("partitioned",), "persistent": ("persistent",),
                               "auto": ("partitioned", "persistent")}[decode] + (("cascade",) if cascade else ())
        self.max_batch = max_batch
        # per CUDA stream (two lanes' steps may both hold decode rows at once): allocated once, never replaced, as
        # CUDA graphs keep their addresses
        self.buffers: dict[int | None, PersistentDecodeBuffers] = {}

    def prepare(self, meta: AttentionMetadata, block_size: int, sliding_window: int | None,
                variant: str | None = None) -> None:
        """variant: the decode kernel to plan for (a CUDA graph's capture: graph_variants); None: the step's own
        (decode_persistent() decides, and an eager step's cascade groups are planned in its first layer)."""
        self.window = sliding_window
        nd = meta.num_decodes
        parts = 1
        use = False
        if nd:
            use = self.decode_persistent(meta.seq_lens_cpu[:nd]) if variant is None else variant == "persistent"
            if not use:
                parts = num_partitions(nd, self.num_kv_heads, max(meta.seq_lens_cpu[:nd]), self.num_sms)
        prefill_lens = meta.query_lens_cpu[nd:]
        meta.plan = _Plan(parts, len(prefill_lens), max(prefill_lens, default=0), use)
        if variant == "cascade":  # decode_variant fills its buffers before each replay
            meta.plan.cascade_graph = True
        elif variant is None and self.cascade and not use and 1 < nd <= self.max_batch:
            meta.plan.cascade_rows = (meta.block_tables_cpu[:nd], meta.seq_lens_cpu[:nd], block_size)

    def decode_variant(self, lens, tables: np.ndarray, block_size: int) -> str:
        """The captured decode graph for decodes of these context lengths and host block tables: `cascade` when a
        group forms among them (its buffers, graph_cascade, filled here)."""
        if self.decode_persistent(lens):
            return "persistent"
        if self.graph_cascade is not None and self.graph_cascade.fill(tables, np.asarray(lens), block_size):
            return "cascade"
        return "partitioned"

    def decode_persistent(self, lens) -> bool:
        """Whether decodes with these context lengths run the persistent kernel (else the partitioned one)."""
        if not self.persistent or len(lens) > self.max_batch:
            return False
        return self.mode == "persistent" or skewed(lens)

    def begin(self, meta: AttentionMetadata) -> None:
        meta.plan.replan = True

    def _plan_cascade(self, plan: _Plan, q: torch.Tensor) -> None:
        """The first layer's forward: the decodes' groups into their buffers (plan.cascade; None: no group)."""
        group = q.shape[1] // self.num_kv_heads
        if plan.cascade_graph:
            plan.cascade_graph = False
            if self.graph_cascade is None:
                self.graph_cascade = CascadeBuffers(self.max_batch, group, q.device)
            plan.cascade = self.graph_cascade
        elif plan.cascade_rows is not None:
            key = _stream_key(q.device)
            if key not in self.cascade_buffers:
                self.cascade_buffers[key] = CascadeBuffers(self.max_batch, group, q.device)
            buffers = self.cascade_buffers[key]
            plan.cascade = buffers if buffers.fill(*plan.cascade_rows) else None
            plan.cascade_rows = None

    def _persistent_buffers(self, q: torch.Tensor, k_cache: torch.Tensor) -> PersistentDecodeBuffers:
        key = _stream_key(q.device)
        if key not in self.buffers:
            self.buffers[key] = PersistentDecodeBuffers(self.max_batch, q.shape[1], q.shape[2], q.device,
                                                        target_chunks(self.num_sms, self.num_kv_heads),
                                                        quant=k_cache.dtype == torch.int8)
        return self.buffers[key]

    def compile_kernels(self, num_heads: int, head_dim: int, dtype: torch.dtype, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, kv_scales: LayerScales | None, window: int | None) -> None:
        """JIT-compile every kernel variant a step can pick before serving: each decode partition count
        (eager mixed steps choose it from their longest context) and the prefill. A compile mid-serving
        stalls that step ~1 s. The launches read block 0 and write only their scratch output."""
        dev = k_cache.device
        ks, vs = (kv_scales.k, kv_scales.v) if kv_scales is not None else (None, None)
        q = torch.zeros(1, num_heads, head_dim, dtype=dtype, device=dev)
        one = torch.ones(1, dtype=torch.int32, device=dev)
        table = torch.zeros(1, 1, dtype=torch.int32, device=dev)
        cascade = CascadeBuffers(1, num_heads // self.num_kv_heads, dev) if self.cascade else None  # (refused with
        # a window: the runner)
        parts = 1
        while parts <= MAX_PARTITIONS:
            paged_decode(q, k_cache, v_cache, table, one, 1.0, num_parts=parts, k_scale=ks, v_scale=vs, window=window)
            if cascade is not None:
                paged_decode(q, k_cache, v_cache, table, one, 1.0, num_parts=parts, k_scale=ks, v_scale=vs,
                             cascade=cascade)
            parts *= 2
        if self.persistent:  # the plan kernel is compiled per power-of-two batch padding
            pad = 16
            while True:
                batch = min(pad, self.max_batch)
                lens = torch.ones(batch, dtype=torch.int32, device=dev)
                buffers = self._persistent_buffers(q, k_cache)
                plan_persistent_decode(lens, buffers, window)
                paged_decode_persistent(q.expand(batch, -1, -1).contiguous(), k_cache, v_cache,
                                        table.expand(batch, -1).contiguous(), lens, 1.0, buffers, self.num_sms,
                                        k_scale=ks, v_scale=vs, window=window)
                if pad >= self.max_batch:
                    break
                pad *= 2
        qsl = torch.tensor([0, 1], dtype=torch.int32, device=dev)
        paged_prefill(q, k_cache, v_cache, table, one, qsl, 0, 1, 1, 1.0, torch.empty_like(q), ks, vs, window)

    @staticmethod
    def rope_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor, rope: Rope | None, kv_scales: LayerScales | None = None) -> None:
        """RoPE (if given) on q and k in place, then k / v into the pool at slots [T] (-1: none): one launch for a
        pool that is not int8 on a GPU (rope_write_kv_); an int8 pool's scales observe the rotated K first."""
        if rope is not None and kv_scales is None and triton_kernels(q):
            rope_write_kv_(q, k, v, *rope, k_cache, v_cache, slots)
            return
        if rope is not None:
            rope_(q, k, *rope)
        ks = vs = None
        if kv_scales is not None:
            kv_scales.observe(k, v)
            ks, vs = kv_scales.k, kv_scales.v
        write_kv(k, v, k_cache, v_cache, slots, ks, vs)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                kv_scales: LayerScales | None = None, rope: Rope | None = None,
                out: torch.Tensor | None = None, kv_written: bool = False) -> torch.Tensor:
        plan: _Plan = meta.plan
        ks = vs = None
        if kv_scales is not None:  # int8 pool: the kernels quantise / dequantise with these [Hkv] scales
            ks, vs = kv_scales.k, kv_scales.v
        if not kv_written:  # (else RoPE and the K/V write ran ahead: the qkv GEMV, or the piecewise graphs' pieces)
            self.rope_write(q, k, v, k_cache, v_cache, meta.slot_mapping, rope, kv_scales)
        out = torch.empty_like(q) if out is None else out
        nd = meta.num_decodes
        if nd and plan.persistent:
            buffers = self._persistent_buffers(q, k_cache)
            if plan.replan:  # once per forward, in the first layer: every layer reads the same plan
                plan_persistent_decode(meta.seq_lens[:nd], buffers, self.window)
                plan.replan = False
            paged_decode_persistent(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                                    buffers, self.num_sms, k_scale=ks, v_scale=vs, out=out[:nd], window=self.window)
        elif nd:
            if plan.cascade_graph or plan.cascade_rows is not None:
                self._plan_cascade(plan, q)
            paged_decode(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                         num_parts=plan.num_parts, k_scale=ks, v_scale=vs, out=out[:nd], window=self.window,
                         cascade=plan.cascade)
        if plan.num_prefills:
            paged_prefill(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, nd,
                          plan.num_prefills, plan.max_prefill_len, scale, out, ks, vs, self.window)
        return out
