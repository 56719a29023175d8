"""CUDA graphs: whole decode-only steps, and the pieces between attentions of the other steps (piecewise).

DecodeGraphs owns the static input buffers, the capture list of padded batch sizes and the replay
of decode-only steps. A decode step of n sequences replays the graph of the smallest captured size >= n, the
whole batch padded to that one size; the padding rows write no K/V (slot -1) and their
logits are dropped. The size list is fixed (1, 2, 4, 8, then every 8 to 64, every 16 to
128, every 32 after): every batch size up to max_num_seqs maps onto one of few graphs,
captured once at start. Only n matters: the rows' order and context lengths don't (the
kernel reads each row's length from the device buffers), except where each size is captured in more than one
variant of the decode-attention kernel: with --decode-attention auto the partitioned and the persistent one, and
with --cascade-attention also the cascade (for sizes of at least CASCADE_MIN_GROUPED: a smaller batch forms no
group), and a step replays the one its context lengths and shared prefixes call for (graph_variant).
Host inputs go through pinned buffers with non-blocking copies.

PiecewiseGraphs runs the other steps (prompt chunks, with or without decodes; drafts to verify) of up to
--piecewise-graph-tokens tokens: the forward's pieces between two attentions (the model's head() and tail(i): the
GEMMs, norms and activations, ~8 launches a layer; with the Triton backend on a pool that is not int8 also the
next layer's RoPE and K/V write, from static position and slot buffers) are replayed as CUDA graphs captured per
padded token count, and each layer's attention (the decode and prefill kernels, planned per step; RoPE and the K/V
write too on an int8 pool) runs eagerly between them on the step's real rows. What crosses an attention lives in
static buffers (the qkv projection, the attention output, the residual stream). A step of T tokens replays the
pieces of the smallest captured size >= T; the padding rows are computed by the pieces and seen by nothing else
(attention and the logits read rows < T only; their slots are -1). This takes the host's launch work of such a
step (~330 launches) down to one replay per piece and the attention's launches: 15-24 ms -> 6.5-9.3 ms on the H100,
and with RoPE and the K/V write in the pieces (32 launches fewer) 5.3-9.3 ms against 7.7-14.4 ms without them in the
same runs on another H100 (docs/perf.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from workers.attention.base import AttentionMetadata
from workers.kernels import paged_attention as pa

log = logging.getLogger("laneserve.worker")


def graph_variant(variants: tuple[str, ...], backend, lens, tables: np.ndarray, block_size: int) -> str:
    """Which of the captured variants (the decode-attention kernel: `partitioned`, `persistent`, or `cascade`, the
    partitioned one with shared prefixes once per group) a batch with these context lengths and host block tables
    replays: the only one, or the backend's choice (`--decode-attention auto`, `--cascade-attention`: the backend's
    decode_variant, which fills the cascade graphs' buffers when it picks them)."""
    return variants[0] if len(variants) == 1 else backend.decode_variant(lens, tables, block_size)


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4] + list(range(8, 64, 8)) + list(range(64, 128, 16)) + list(range(128, 1025, 32))
    out = [s for s in sizes if s < max_num_seqs]
    return out + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, model, backend, max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device):
        self.model, self.backend, self.block_size = model, backend, block_size
        self.sizes = capture_sizes(max_num_seqs)
        n = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        self.max_model_len = max_model_len
        i64, i32 = torch.int64, torch.int32
        self.input_ids = torch.zeros(n, dtype=i64, device=device)
        self.positions = torch.zeros(n, dtype=i64, device=device)
        self.slots = torch.full((n,), -1, dtype=i64, device=device)
        self.seq_lens = torch.ones(n, dtype=i32, device=device)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=i32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=i32, device=device)
        # pinned host staging: ids, positions, slots, seq_lens, pending-token rows in one int64 buffer;
        # tables apart. Two of each, used in turn: with overlapped steps the GPU may not yet have copied
        # the previous step's buffer when the next step is staged. A buffer is written again only once the
        # copies out of it are done (its event): replays with no host sync between them (a draft model's
        # passes) would otherwise overwrite a buffer the GPU has not read yet.
        self.host_vec = [torch.zeros(5, n, dtype=i64, pin_memory=True) for _ in range(2)]
        self.host_tables = [torch.zeros(n, self.max_blocks, dtype=i32, pin_memory=True) for _ in range(2)]
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0
        self.variants = getattr(backend, "graph_variants", ("partitioned",))  # decode-attention kernels
        self.graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}  # (batch size, variant) -> graph
        self.logits: dict[tuple[int, str], torch.Tensor] = {}
        self.last: tuple[int, str] | None = None  # the graph the last run() replayed
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    def meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(query_start_loc=self.query_start_loc[:bs + 1], seq_lens=self.seq_lens[:bs],
                                 block_tables=self.block_tables[:bs], slot_mapping=self.slots[:bs], num_decodes=bs,
                                 query_lens_cpu=[1] * bs, seq_lens_cpu=[self.max_model_len] * bs)

    def capture(self) -> None:
        t0 = time.perf_counter()
        before = torch.cuda.memory_allocated()
        pool = torch.cuda.graph_pool_handle()
        window = self.model.sliding_window
        with torch.inference_mode():
            for bs in reversed(self.sizes):  # largest first: later graphs reuse its memory pool
                for variant in self.variants:
                    if variant == "cascade" and bs < pa.CASCADE_MIN_GROUPED:  # (no group forms: never replayed)
                        continue
                    meta = self.meta(bs)
                    self.backend.prepare(meta, self.block_size, window, variant=variant)
                    for _ in range(2):  # warm-up: autotuning and lazy init stay out of the graph
                        self.model.compute_logits(self.model(self.input_ids[:bs], self.positions[:bs], meta))
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        hidden = self.model(self.input_ids[:bs], self.positions[:bs], meta)
                        self.logits[bs, variant] = self.model.compute_logits(hidden)
                    self.graphs[bs, variant] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        self.capture_bytes = torch.cuda.memory_allocated() - before
        log.info("captured %d decode graphs (batch 1..%d) in %.1fs, %.0f MiB", len(self.graphs), self.sizes[-1],
                 self.capture_seconds, self.capture_bytes / 2**20)

    def can_run(self, n: int) -> bool:
        return n <= self.sizes[-1]

    def run_rows(self, rows: list[tuple[int, int, list[int]]], prev_tokens: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """run() with a row per (input token, position, the sequence's block ids): each row a decode over the
        context up to its position (a step writes every row's K/V before any row's attention, so rows of one
        sequence see the ones before them). prev_tokens: row i's input token is prev_tokens[i] instead."""
        bs = self.block_size
        ids = np.array([t for t, _, _ in rows], dtype=np.int64)
        pos = np.array([q for _, q, _ in rows], dtype=np.int64)
        slots = np.array([blocks[q // bs] * bs + q % bs for _, q, blocks in rows], dtype=np.int64)
        src = np.arange(len(rows), dtype=np.int64) if prev_tokens is not None else None
        return self.run(ids, pos, slots, pos + 1, [blocks[:q // bs + 1] for _, q, blocks in rows], src, prev_tokens)

    def run(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray,
            tables: list[list[int]], src: np.ndarray | None = None,
            prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step of n = len(input_ids) sequences -> logits [n, vocab]. src[i] >= 0: sequence i's
        input token is prev_tokens[src[i]] (sampled by the step in flight, still on the device)."""
        n = len(input_ids)
        bs = next(s for s in self.sizes if s >= n)
        turn = self.turn
        host_vec, host_tables = self.host_vec[turn], self.host_tables[turn]
        self.turn ^= 1
        if self.copied[turn] is not None:
            self.copied[turn].synchronize()  # (at once, unless replays run ahead of the GPU)
        vec = host_vec.numpy()
        vec[0, :n], vec[1, :n], vec[2, :n], vec[3, :n] = input_ids, positions, slots, seq_lens
        vec[2, n:bs] = -1  # padding rows write no K/V
        vec[3, n:bs] = 1
        vec[4, :bs] = -1
        if src is not None:
            vec[4, :n] = src
        tables_np = host_tables.numpy()
        for i, t in enumerate(tables):
            tables_np[i, :len(t)] = t
        dev = self.input_ids.device
        staged = host_vec.to(dev, non_blocking=True)  # 10 KiB: whole buffer, contiguous
        self.input_ids[:bs].copy_(staged[0, :bs])
        if src is not None:
            rows = staged[4, :bs]
            self.input_ids[:bs] = torch.where(rows >= 0, prev_tokens[rows.clamp(min=0)], self.input_ids[:bs])
        self.positions[:bs].copy_(staged[1, :bs])
        self.slots[:bs].copy_(staged[2, :bs])
        self.seq_lens[:bs].copy_(staged[3, :bs])
        width = max(len(t) for t in tables)
        self.block_tables[:n, :width].copy_(host_tables[:n, :width], non_blocking=True)
        self.copied[turn] = event = self.copied[turn] or torch.cuda.Event()
        event.record()
        self.last = bs, graph_variant(self.variants, self.backend, seq_lens[:n], tables_np[:n], self.block_size)
        self.graphs[self.last].replay()
        return self.logits[self.last][:n]


def piece_sizes(max_tokens: int) -> list[int]:
    """Token counts the pieces are captured for: every 16 to 256, every 32 after, up to max_tokens. Padding costs GPU
    time (on the H100 a step of 1 decode + 1,024 tokens took 8% longer than eager replayed at 1,152 tokens, and
    still 6% at 1,056 with these sizes: more than its 3% of padding, the cause not known), so the steps are fine;
    a size's 33 graphs (7B) take ~50 ms to capture."""
    sizes = list(range(16, 256, 16)) + list(range(256, max_tokens + 1, 32))
    out = [s for s in sizes if s < max_tokens]
    return out + [max_tokens]


class PiecewiseGraphs:
    """The pieces between attentions of a step of up to max_tokens tokens as CUDA graphs (module docstring).
    Until capture() (and on a CPU, where nothing is captured) run() calls the pieces eagerly on the same static
    buffers: the same padding and data flow, for the CPU tests."""

    def __init__(self, model, max_tokens: int, device: torch.device):
        self.model = model
        self.sizes = piece_sizes(max_tokens)
        n = self.sizes[-1]
        first = model.model.layers[0].self_attn
        dtype = model.model.embed_tokens.weight.dtype
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.residual = torch.zeros(n, model.config.hidden_size, dtype=dtype, device=device)
        self.qkv = torch.zeros(n, sum(first.qkv_proj.sizes.values()), dtype=dtype, device=device)
        self.attn = torch.zeros(n, first.num_heads, first.head_dim, dtype=dtype, device=device)
        # the model's RoPE and K/V write may run ahead of attention (rope_ahead): then each piece ends with the next
        # layer's, reading the step's positions and slots from these (the padding rows' slots -1: no write)
        self.rope_ahead = model.rope_ahead  # (as captured: the pieces and attend must agree)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}  # padded size -> [head, tail 0, ..., tail L-1]
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        self.steps = 0  # steps run

    def can_run(self, tokens: int) -> bool:
        return tokens <= self.sizes[-1]

    def _pieces(self, size: int) -> list:
        model, o, qkv, layers = self.model, self.attn[:size].flatten(1), self.qkv[:size], len(self.model.model.layers)

        def head():
            model.head(self.input_ids[:size], self.residual[:size], qkv)
            if self.rope_ahead:
                model.rope_write(0, qkv, self.positions[:size], self.slots[:size])

        def tail(i: int):
            model.tail(i, o, self.residual[:size], qkv)
            if self.rope_ahead and i + 1 < layers:
                model.rope_write(i + 1, qkv, self.positions[:size], self.slots[:size])

        return [head] + [lambda i=i: tail(i) for i in range(layers)]

    def capture(self) -> None:
        t0 = time.perf_counter()
        before = torch.cuda.memory_allocated()
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in reversed(self.sizes):  # largest first: later graphs reuse its memory pool
                pieces = self._pieces(size)
                for piece in pieces:  # warm-up: lazy init stays out of the graphs
                    piece()
                torch.cuda.synchronize()
                self.graphs[size] = []
                for piece in pieces:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        piece()
                    self.graphs[size].append(graph)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        self.capture_bytes = torch.cuda.memory_allocated() - before
        log.info("captured %d piecewise graphs (%d token counts, up to %d) in %.1fs, %.0f MiB",
                 sum(map(len, self.graphs.values())), len(self.sizes), self.sizes[-1], self.capture_seconds,
                 self.capture_bytes / 2**20)

    def run(self, token_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            after_layer: Callable[[], None] | None = None) -> torch.Tensor:
        """The model's forward of one step (T = len(token_ids) <= the largest size) -> hidden states [T, hidden],
        a view of the residual buffer: valid until the next run(). after_layer: as the model's forward()."""
        model, tokens = self.model, token_ids.shape[0]
        size = next(s for s in self.sizes if s >= tokens)
        self.input_ids[:tokens].copy_(token_ids)
        if self.rope_ahead:
            self.positions[:tokens].copy_(positions)
            self.slots[:tokens].copy_(meta.slot_mapping)
            self.slots[tokens:size].fill_(-1)
        graphs = self.graphs.get(size)
        calls = [g.replay for g in graphs] if graphs else self._pieces(size)
        self.steps += 1
        model.backend.begin(meta)
        calls[0]()
        for i in range(len(model.model.layers)):
            model.attend(i, self.qkv[:tokens], positions, meta, out=self.attn[:tokens], kv_written=self.rope_ahead)
            calls[i + 1]()
            if after_layer is not None:
                after_layer()
        return self.residual[:tokens]
