"""ModelRunner: per-request state from StepInput diffs, input preparation, one forward, sampling.

Owns the worker's view of its requests (token ids, block ids, num_computed_tokens) and the
step loop body of docs/architecture.md ("ModelRunner"). Trusts the batcher's StepInput (it
is validated at decode); errors propagate to the worker loop, which fails the step and
calls reset(). Must not do I/O or asyncio: workers/main.py owns the socket.

The row layout of a batch is the worker's, not the batcher's. The scheduler lists a step's
requests in its own order (decode buckets, for its priority and preemption rules); nothing here
relies on it, and outputs name their requests (StepOutput.request_ids), so the batcher does not
rely on the runner's order either. An eager step lays rows out for the attention backend:
decodes first (AttentionMetadata's num_decodes leading rows), longest context first, so that
a backend that pads groups of neighbouring decodes to their longest context (the torch one)
wastes little. A decode-only step replayed as a CUDA graph keeps the order it got: the graph
pads the whole batch to one captured size and the kernel reads each row's length on the
device, so an order would buy nothing there.

Lanes (StepInput.lane, docs/lanes.md): a LANE_MIXED step runs on the current stream, after the step
before it. With `--lanes streams` the batcher sends decode steps (LANE_DECODE) and prefill steps
(LANE_PREFILL); on CUDA each lane has its own stream, decode at high priority, and its own step in
flight, so a decode step launches (and its CUDA graph replays) while a long prefill chunk runs. The
batcher keeps the lanes apart: no request is in both lanes' steps in flight, and no block one lane's
step in flight writes is handed to the other lane; so nothing orders the two streams but the host
(each lane step's output waits for an event recorded after all of its work, and the host inputs go
through pinned non-blocking copies, so launching one lane's step never waits for the other's). The
decode graphs are the decode lane's alone. Elsewhere (CPU, tensor parallel) the lanes' steps run one
after the other, which is always correct.

Tensor parallel (cfg.tensor_parallel_size T > 1, docs/tensor_parallel.md): every rank runs a
ModelRunner on the same StepInputs; each holds its shard of the weights and a KV pool of its
num_kv_heads/T heads, sized to the smallest pool any rank can hold. Rank 0 alone computes logits
and samples, then broadcasts the token ids so every rank's request state stays identical.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from laneserve.modelspec import load_model_config, resolve_max_model_len
from laneserve.wire import protocol as P
from laneserve.wire.protocol import LANE_DECODE, LANE_MIXED, LANE_PREFILL
from workers.attention import AttentionMetadata, backend_name, get_backend
from workers.collectives import broadcast_tokens, min_across_ranks, rank_device
from workers.config import WorkerConfig
from workers.cuda_graphs import DecodeGraphs, PiecewiseGraphs
from workers.draft import Drafter
from workers.kernels.fused import triton_kernels
from workers.kernels.gemv import MAX_M as GEMV_MAX_M
from workers.kv_cache import (BLOCK_SIZE, DEFAULT_CPU_KV_BYTES, KVCache, bytes_per_block, gpu_kv_budget, load_kv_scales,
                              parse_bytes, resolve_kv_dtype)
from workers.loader import load_model, resolve_device, resolve_dtype
from workers.model.layers import check_shardable
from workers.prompt_logprobs import PromptScores, scored_span
from workers.sampling import Sampled, SampleRow, sample_on_device, to_device

log = logging.getLogger("laneserve.worker")
# --overlap-steps: decode = only decode-only steps launch behind the step in flight (as before 2026-12-05; kept
# to measure against), on = eager ones (a prefill chunk) too
OVERLAP_MODES = ("auto", "on", "decode", "off")
CASCADE_MODES = ("auto", "on", "off")


@dataclass
class RequestState:
    request_id: str
    params: P.SamplingParams
    token_ids: list[int]  # prompt + outputs
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sample_row: SampleRow = field(init=False)

    def __post_init__(self):
        self.sample_row = SampleRow(self.params, self.token_ids, self.num_prompt_tokens)  # shares token_ids



@dataclass
class _InFlight:
    """A launched step whose sampled tokens may still be on the device."""

    step: int
    lane: int
    reqs: list[RequestState]  # the requests that sample, in row order
    sampled: Sampled | None  # device tokens (None: nothing samples, or TP's already-collected tokens)
    t0: float
    collected: tuple | None = None  # TP: (tokens, logprobs), sampled and broadcast in step
    verify: _Verify | None = None  # speculative decoding: the drafts it verifies
    end: torch.cuda.Event | None = None  # CUDA: a timing event recorded after all of the step's work
    behind: bool = False  # launched while its lane's step before was in flight
    start: torch.cuda.Event | None = None  # CUDA: a timing event recorded before its work (drafts included)
    scores: PromptScores | None = None  # the prompt logprobs of its chunks, for the requests that ask
    draft_time: float = 0.0  # seconds its draft model took (StepInput.draft_jobs)
    launch_time: float = 0.0  # seconds the host took to build its forward's inputs and launch it

    def ready(self) -> bool:
        """Its tokens are on the host (collect() would not wait)."""
        return all(x is None or x.ready() for x in (self.sampled, self.verify, self.scores)) and (
            self.end is None or self.end.query())


class _Verify:
    """A step's draft verification (StepInput.spec_token_ids): at each of a request's 1 + K positions, the token the
    request's own sampler takes there (greedy: the argmax; sampled: its temperature, top-k/top-p/min-p and noise,
    seeded by output index), copied to the host without waiting. A request keeps the drafts that match those
    tokens, then the token after the last kept one: exactly what decoding without drafts samples. For a draft t
    that is acceptance with probability p(t) and, on rejection, a token from p without t: rejection sampling with a
    one-token proposal, so sampled output keeps the model's distribution, and a seeded request its tokens."""

    def __init__(self, reqs: list[tuple[RequestState, list[int], int]], logits: torch.Tensor):
        self.reqs = reqs  # (request, its drafts, its first row in logits)
        index, rows = [], []
        for r, drafts, first in reqs:
            for i in range(len(drafts) + 1):
                index.append(first + i)
                rows.append(dataclasses.replace(r.sample_row, ahead=i))
        self.sampled = sample_on_device(logits[to_device(index, torch.int64, logits.device)], rows) if rows else None

    def ready(self) -> bool:
        return self.sampled is None or self.sampled.ready()

    def accept(self) -> list[tuple[RequestState, list[int]]]:
        """Each request and its new tokens (appended to it; its last token is the next one to compute)."""
        targets = self.sampled.collect()[0] if self.sampled is not None else []
        out = []
        row = 0
        for r, drafts, _ in self.reqs:
            a = 0
            while a < len(drafts) and drafts[a] == targets[row + a]:
                a += 1
            tokens = drafts[:a] + [targets[row + a]]
            row += len(drafts) + 1
            r.token_ids += tokens
            r.num_computed_tokens = len(r.token_ids) - 1
            out.append((r, tokens))
        return out


def cascade_attention_on(mode: str, single_gpu: bool, backend: str, decode: str, window: bool) -> bool:
    """--cascade-attention (auto, on or off) for this worker: `auto` is on where it can run on one CUDA device
    (single_gpu: tensor-parallel size 1), whatever the pool's dtype (int8 included); `on` where it cannot run is a
    ValueError saying why. It runs with the Triton backend (backend: the resolved name, backend_name), its
    partitioned decode kernel (decode: --decode-attention auto or partitioned) and no sliding window (window)."""
    why = None
    if backend != "triton":
        why = "is a Triton kernel: it needs --attention-backend triton (the default on CUDA)"
    elif decode == "persistent":
        why = "runs with the partitioned decode kernel: it needs --decode-attention auto or partitioned"
    elif window:
        why = "needs a model without a sliding window"
    if mode == "on" and why:
        raise ValueError(f"--cascade-attention on {why}")
    return mode == "on" or (mode == "auto" and single_gpu and why is None)


class ModelRunner:
    def __init__(self, cfg: WorkerConfig, tp_rank: int = 0):
        """tp_rank: this process's rank when cfg.tensor_parallel_size > 1; the caller has joined
        the process group (workers.tp_group.TPGroup on rank 0, follower_main on the others)."""
        self.cfg = cfg
        if cfg.piecewise_graph_tokens < 0:
            raise ValueError(f"--piecewise-graph-tokens {cfg.piecewise_graph_tokens}: must be >= 0 (0: none)")
        if cfg.overlap_steps not in OVERLAP_MODES:
            raise ValueError(f"--overlap-steps {cfg.overlap_steps!r}: choose from {', '.join(OVERLAP_MODES)}")
        self.tp_rank, self.tp_size = tp_rank, cfg.tensor_parallel_size
        self.device = rank_device(resolve_device(cfg.device), tp_rank)
        if self.device.type == "cuda":  # streams, events and graphs made without a device name use this one
            torch.cuda.set_device(self.device)
        elif cfg.num_threads > 0:
            torch.set_num_threads(cfg.num_threads)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.kv_dtype = resolve_kv_dtype(cfg.kv_cache_dtype, self.dtype)
        self.model_config = load_model_config(cfg.model)
        gemv_rows = self._gemv_rows(cfg.decode_gemv_rows)  # (checked before the weights load)
        self.model_name = cfg.model
        cascade = self._cascade(cfg)
        if self.tp_size != 1:
            check_shardable(self.model_config, self.tp_size)
            if not dist.is_initialized() or dist.get_world_size() != self.tp_size:
                raise ValueError(f"--tensor-parallel-size {self.tp_size}: no process group of that size; start the "
                                 "worker through workers.main (it starts the other ranks)")
        self.num_kv_heads = self.model_config.num_kv_heads // self.tp_size  # this rank's share
        self.block_size = BLOCK_SIZE
        mc = self.model_config
        self.max_model_len = resolve_max_model_len(mc.max_position_embeddings, cfg.max_model_len)
        self.model = load_model(cfg.model, mc, self.dtype, self.device, cfg.load_format, cfg.seed,
                                tp_rank, self.tp_size)
        self.backend = get_backend(cfg.attention_backend, self.device, self.num_kv_heads, cfg.decode_attention,
                                   cfg.max_num_seqs, cascade)
        self.model.gemv_rows = gemv_rows
        self.drafter: Drafter | None = None  # --draft-model: loaded before the pool is sized, which holds its K/V too
        if cfg.draft_model:
            if self.tp_size != 1:
                raise ValueError("--draft-model needs --tensor-parallel-size 1")
            self.drafter = Drafter(cfg, mc, self.dtype, self.device, self.max_model_len)
        self.requests: dict[str, RequestState] = {}
        self.overlap = cfg.overlap_steps in ("on", "decode") or (
            cfg.overlap_steps == "auto" and self.device.type == "cuda" and self.tp_size == 1)
        if self.overlap and self.tp_size != 1:
            raise ValueError(f"--overlap-steps {cfg.overlap_steps} needs --tensor-parallel-size 1 (ranks broadcast "
                             "sampled tokens)")
        self._flights: dict[int, _InFlight] = {}  # lane -> its step in flight
        self._outbox: list[P.StepOutput] = []
        # Set by the worker's loop (workers/main.py): sends outputs to the batcher at once. An eager step's forward
        # calls it between its layers' launches for a step in flight that is done by then (_report_ready).
        self.publish: Callable[[list[P.StepOutput]], None] | None = None
        self._last_done = dict.fromkeys((LANE_MIXED, LANE_DECODE, LANE_PREFILL), 0.0)  # per lane: perf_counter
        # when its last step's tokens reached the host
        self.lane_streams: dict[int, torch.cuda.Stream] = {}
        if self.device.type == "cuda" and self.tp_size == 1:
            high = torch.cuda.Stream.priority_range()[1]  # the numerically lowest: the highest priority
            self.lane_streams = {LANE_DECODE: torch.cuda.Stream(self.device, priority=high),
                                 LANE_PREFILL: torch.cuda.Stream(self.device, priority=0)}
            for stream in self.lane_streams.values():  # first use of a stream stalls: not while serving
                with torch.cuda.stream(stream):
                    torch.zeros(1, device=self.device).add_(1)
                stream.synchronize()
        self.graphs: DecodeGraphs | None = None  # captured below, after the pool exists
        # steps with a prompt chunk: the pieces between attentions (any lane but the decode lane's: one static set)
        self.pieces: PiecewiseGraphs | None = None
        self.kv_cache = self._allocate_kv_cache()
        self.num_blocks = self.kv_cache.num_blocks
        if self.drafter is not None:
            self.drafter.allocate(self.num_blocks)
        self.model.bind(self.kv_cache.layer_caches(), self.backend, self.max_model_len, self.kv_cache.layer_scales())
        self.model.compile_attention()
        if self.device.type == "cuda" and self.backend.name == "triton" and not cfg.enforce_eager:
            self.graphs = DecodeGraphs(self.model, self.backend, cfg.max_num_seqs, self.max_model_len,
                                       BLOCK_SIZE, self.device)
            with self._hold_dynamic_scales():  # graphs read the scale tensors by pointer, set later in place
                self.graphs.capture()
            if self.drafter is not None:
                self.drafter.capture_graphs(cfg.max_num_seqs)
            tokens = min(cfg.piecewise_graph_tokens, cfg.max_num_batched_tokens)
            if tokens and self.tp_size == 1:  # (under tensor parallel the pieces would hold all-reduces)
                self.pieces = PiecewiseGraphs(self.model, tokens, self.device)
                self.pieces.capture()
        log.info("model %s on %s/%s: %d KV blocks (%.0f MiB, %s KV%s)", cfg.model, self.device,
                 str(self.dtype).split(".")[-1], self.num_blocks, self.kv_cache.nbytes / 2**20,
                 str(self.kv_dtype).split(".")[-1],
                 f", scales: {self.kv_cache.scales.source}" if self.kv_cache.scales is not None else "")

    def _gemv_rows(self, rows: int) -> int:
        """--decode-gemv-rows, checked (-1: GEMV_MAX_M where it measured faster and its kernels can run, else 0): the
        fused GEMV path runs Triton kernels on the model's own weights."""
        if not -1 <= rows <= GEMV_MAX_M:
            raise ValueError(f"--decode-gemv-rows {rows}: must be -1 (auto), 0 (off) or up to {GEMV_MAX_M}")
        head_dim, why = self.model_config.head_dim, None  # why: what keeps the path from running here
        if self.tp_size != 1:
            why = " needs --tensor-parallel-size 1 (its residual adds would come before the all-reduce)"
        elif head_dim % 16:
            why = (" needs a head_dim that is a multiple of 16 (its qkv GEMV does RoPE in blocks of heads); this "
                   f"model's is {head_dim}")
        elif not triton_kernels(torch.empty(0, device=self.device)):
            why = f": its kernels are Triton's and need a GPU; this worker runs on {self.device}"
        if rows == -1:
            measured = self.device.type == "cuda" and self.dtype in (torch.bfloat16, torch.float16)
            return GEMV_MAX_M if why is None and measured else 0
        if rows and why:
            raise ValueError(f"--decode-gemv-rows {rows}{why}")
        return rows

    def _cascade(self, cfg: WorkerConfig) -> bool:
        """--cascade-attention, checked (cascade_attention_on)."""
        if cfg.cascade_attention not in CASCADE_MODES:
            raise ValueError(f"--cascade-attention {cfg.cascade_attention!r}: choose from {', '.join(CASCADE_MODES)}")
        return cascade_attention_on(cfg.cascade_attention, self.device.type == "cuda" and self.tp_size == 1,
                                    backend_name(cfg.attention_backend, self.device), cfg.decode_attention,
                                    bool(self.model_config.sliding_window))

    def draft_size(self) -> float:
        """The draft model's parameters over the model's (0: none)."""
        if self.drafter is None:
            return 0.0
        return self.drafter.num_parameters() / sum(p.numel() for p in self.model.parameters())

    # ------------------------------------------------------------------ KV pool
    def _allocate_kv_cache(self) -> KVCache:
        mc = self.model_config
        per_block = bytes_per_block(mc.num_layers, self.num_kv_heads, mc.head_dim, self.kv_dtype)
        if self.drafter is not None:  # each block id holds the draft's K/V too
            per_block += self.drafter.bytes_per_block
        budget = parse_bytes(self.cfg.kv_cache_memory)  # per rank: each holds num_kv_heads/T heads
        need = -(-self.max_model_len // BLOCK_SIZE)
        if not budget:  # CPU: 256 MiB, or room for two full-length sequences if that is more
            budget = (self._measure_gpu_budget() if self.device.type == "cuda"
                      else max(DEFAULT_CPU_KV_BYTES, 2 * need * per_block))
        num_blocks = budget // per_block
        if self.tp_size > 1:  # block ids are the group's: every rank needs every block
            num_blocks = min_across_ranks(num_blocks, self.device)
        if num_blocks < need:
            raise ValueError(f"KV cache budget {budget / 2**20:.0f} MiB holds {num_blocks} blocks, fewer than the "
                             f"{need} one {self.max_model_len}-token sequence needs: raise --kv-cache-memory "
                             "(or --gpu-memory-utilization) or lower --max-model-len")
        cache = KVCache(mc.num_layers, num_blocks, self.num_kv_heads, mc.head_dim, self.kv_dtype, self.device)
        path = self._kv_scales_path()
        if cache.scales is not None and path:
            k, v = load_kv_scales(path, mc.num_layers, mc.num_kv_heads)  # the whole model's; keep this rank's heads
            lo, hi = self.tp_rank * self.num_kv_heads, (self.tp_rank + 1) * self.num_kv_heads
            cache.scales.load([row[lo:hi] for row in k], [row[lo:hi] for row in v], source=path)
        return cache

    def _kv_scales_path(self) -> str:
        """--kv-scales, else kv_scales.json beside the checkpoint, else '' (dynamic: first prefill chunk)."""
        if self.cfg.kv_scales:
            if self.kv_dtype != torch.int8:
                raise ValueError("--kv-scales is for an int8 KV cache: add --kv-cache-dtype int8")
            return self.cfg.kv_scales
        beside = os.path.join(self.cfg.model, "kv_scales.json")
        return beside if self.kv_dtype == torch.int8 and os.path.isfile(beside) else ""

    def _hold_dynamic_scales(self):
        """Warm-ups and graph capture must not set dynamic int8 scales from their placeholder tokens."""
        scales = self.kv_cache.scales
        return scales.hold() if scales is not None else contextlib.nullcontext()

    def _measure_gpu_budget(self) -> int:
        """Warm up with a max_num_batched_tokens prefill on a scratch pool, then size from what is left."""
        mc = self.model_config
        tokens = min(self.cfg.max_num_batched_tokens, self.max_model_len)
        # the scratch pool has its own scales (the warm-up's zeros set those, not the real pool's)
        scratch = KVCache(mc.num_layers, -(-tokens // BLOCK_SIZE), self.num_kv_heads, mc.head_dim, self.kv_dtype,
                          self.device)
        self.model.bind(scratch.layer_caches(), self.backend, self.max_model_len, scratch.layer_scales())
        torch.cuda.reset_peak_memory_stats(self.device)
        state = RequestState("warmup", P.SamplingParams(temperature=0.0), [0] * tokens, tokens,
                             list(range(scratch.num_blocks)), 0)
        self.requests["warmup"] = state
        self.execute(P.StepInput(step=-1, num_scheduled_tokens={"warmup": tokens}))
        self.requests.clear()
        del scratch
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return gpu_kv_budget(self.device, self.cfg.gpu_memory_utilization)

    # ------------------------------------------------------------------ step
    def reset(self) -> None:
        """Forget every request and any step in flight (after a failed step the batcher fails them all)."""
        self.requests.clear()
        self._flights.clear()
        self._outbox.clear()
        for stream in self.lane_streams.values():  # a step cut off in one lane must not write over the next ones
            stream.synchronize()

    def execute(self, step: P.StepInput) -> P.StepOutput:
        """Run one step to completion (no step in flight before or after)."""
        self.submit(step)
        self.flush()
        return self.take_outputs()[-1]

    # Pipelined use (workers/main.py): submit() starts a step; its output, and the one of the step that
    # was in flight before it, appear in take_outputs() once their tokens reach the host. With overlap
    # a step launches its forward first, with the tokens the step in flight sampled read on the device,
    # then collects that step's tokens (which waits only for its sampling kernels) while this forward runs:
    # the host's per-step work (output, socket, next input) hides behind the GPU, and so does an eager
    # step's own input preparation and launches (a step with a prefill chunk). Only a step whose drafts
    # continue the token in flight (speculation) collects it first. An eager step's launch can outlast the step
    # in flight (on an H100, 5-14 ms of host time for a 7B model's prompt step): between its layers' launches
    # the step in flight, once done, is collected and published at once (_report_ready), not after the launch.
    @property
    def in_flight(self) -> bool:
        return bool(self._flights)

    @property
    def overlap_eager(self) -> bool:
        """Steps with a prompt chunk (eager) launch behind the step in flight too (--overlap-steps but decode)."""
        return self.overlap and self.cfg.overlap_steps != "decode"

    @property
    def concurrent(self) -> bool:
        """Steps of the two lanes may be in flight on their own streams: wait for neither (flush_ready)."""
        return bool(self.lane_streams) and LANE_MIXED not in self._flights

    def submit(self, step: P.StepInput) -> None:
        t0 = time.perf_counter()
        lane = step.lane
        if lane not in self._last_done:
            raise ValueError(f"unknown lane {lane}")
        for rid in step.finished_req_ids:
            self.requests.pop(rid, None)
        for r in step.new_reqs:
            self.requests[r.request_id] = RequestState(
                r.request_id, r.params, list(r.prompt_token_ids) + list(r.output_token_ids),
                len(r.prompt_token_ids), list(r.block_ids), r.num_computed_tokens)
        for c in step.cached_reqs:
            self.requests[c.request_id].block_ids.extend(c.new_block_ids)
        for rid, mask in step.allowed_token_ids.items():  # structured output: read when this step samples
            self.requests[rid].sample_row.allowed = mask
        # A lane's steps run in order: a mixed step after everything, a decode or prefill step after its lane's.
        lanes = None if lane == LANE_MIXED or not self.lane_streams else (lane,)
        if not step.num_scheduled_tokens:
            self.flush(lanes)
            self._outbox.append(P.StepOutput(step=step.step, worker_id=self.cfg.worker_id))
            self._last_done[lane] = time.perf_counter()  # (the next step's idle time counts from here)
            return
        stream = self.lane_streams.get(lane)
        with torch.inference_mode(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if step.spec_token_ids and self.tp_size != 1:
                raise ValueError("speculative drafts need tensor parallel 1")
            pending = self._pending_rows(step.num_scheduled_tokens, lane, step.draft_jobs or step.spec_token_ids)
            if pending is None:
                self.flush(lanes)  # this step needs the tokens of the one in flight on the host
            start = None
            if self.device.type == "cuda":  # timed on the device, from when the GPU reaches it (launched behind the
                start = torch.cuda.Event(enable_timing=True)  # step in flight: that step's end, or later) to its end
                start.record()
            drafts, draft_time = self._propose(step.draft_jobs) if step.draft_jobs else (step.spec_token_ids, 0.0)
            t1 = time.perf_counter()
            sampled_reqs, logits_fn, verify, scores = self._run(step.num_scheduled_tokens, pending, lane, drafts)
            launch_time = time.perf_counter() - t1
            self.flush(lanes)
            f = self._flights[lane] = self._sample(step.step, lane, sampled_reqs, logits_fn, t0)
            f.verify, f.scores, f.draft_time, f.launch_time = verify, scores, draft_time, launch_time
            f.behind, f.start = pending is not None, start
            for rid in step.allowed_token_ids:
                self.requests[rid].sample_row.allowed = None
            if start is not None:  # after all of its work: the end of its device time; its output does not say
                f.end = torch.cuda.Event(enable_timing=True)  # "done" before the GPU is (two lanes: held blocks go
                f.end.record()  # free then; a step that samples nothing is not collected on its launch)
        if not self.overlap:
            self.flush(lanes)
        elif self.concurrent:
            self.flush_ready()  # the other lane's step may be done: report it now, not when the socket is idle

    def flush(self, lanes: tuple[int, ...] | None = None) -> None:
        """Collect the tokens of the steps in flight (of `lanes`, default all; waits for their sampling) and
        queue their outputs, oldest first."""
        for f in sorted((f for f in self._flights.values() if lanes is None or f.lane in lanes),
                        key=lambda f: f.step):
            self._collect(f)

    def flush_ready(self) -> None:
        """Collect the steps in flight whose tokens are on the host already (no wait)."""
        for f in sorted(self._flights.values(), key=lambda f: f.step):
            if f.ready():
                self._collect(f)

    def _report_ready(self) -> None:
        """Collect the steps in flight that are done and publish their outputs (with any queued before them): called
        between the layers of a forward being launched. Not a step that verifies drafts (it is always collected
        before the next step's launch), and nothing of the step being launched (it is not in flight yet)."""
        done = [f for f in sorted(self._flights.values(), key=lambda f: f.step) if f.verify is None and f.ready()]
        for f in done:
            self._collect(f)
        if done:
            self.publish(self.take_outputs())

    def _collect(self, f: _InFlight) -> None:
        del self._flights[f.lane]
        if f.end is not None:
            f.end.synchronize()
        out = P.StepOutput(step=f.step, worker_id=self.cfg.worker_id)
        if f.reqs:
            tokens, logprobs = f.collected or f.sampled.collect()
            for r, t in zip(f.reqs, tokens):
                r.token_ids.append(t)
            out.request_ids = [r.request_id for r in f.reqs]
            out.sampled_token_ids = [[t] for t in tokens]
            if logprobs is not None:
                out.logprobs = [[lp] if lp is not None else [] for lp in logprobs]
        if f.scores is not None:
            out.prompt_logprobs = f.scores.collect()
        if f.verify is not None:
            for r, tokens in f.verify.accept():
                out.request_ids.append(r.request_id)
                out.sampled_token_ids.append(tokens)
                if out.logprobs:
                    out.logprobs.append([])
        # This step's own time. On CUDA, on the device: launched behind its lane's step before, from that step's
        # end (a launch that outlasted that step counts here, not there). On the CPU, from its start or the end of
        # that step, when they overlapped.
        done = time.perf_counter()
        if f.start is not None:
            out.execute_time = f.start.elapsed_time(f.end) / 1000.0
        else:
            out.execute_time = done - max(f.t0, self._last_done[f.lane])
        out.idle_time = max(0.0, f.t0 - self._last_done[f.lane])
        out.draft_time = f.draft_time
        out.launch_time = f.launch_time
        self._last_done[f.lane] = done
        self._outbox.append(out)

    def take_outputs(self) -> list[P.StepOutput]:
        out, self._outbox = self._outbox, []
        return out

    def abandon(self) -> list[int]:
        """After submit() raised: the steps started whose outputs will not come; forgets everything."""
        lost = sorted(f.step for f in self._flights.values())
        self.reset()
        return lost

    def _propose(self, jobs: dict[str, P.DraftJob]) -> tuple[dict[str, list[int]], float]:
        """The draft model's work of a step (StepInput.draft_jobs) -> the drafts each request verifies, and the
        seconds it took."""
        if self.drafter is None:
            raise ValueError("draft jobs for a worker without --draft-model")
        work = []
        for rid, job in jobs.items():
            r = self.requests[rid]
            if not 0 <= job.start < job.stop <= len(r.token_ids) or job.k < 0 or (
                    job.k and job.stop != r.num_computed_tokens + 1):
                raise ValueError(f"{rid}: draft job {job} for {r.num_computed_tokens} computed of "
                                 f"{len(r.token_ids)} tokens")
            work.append((r.token_ids, r.block_ids, job))
        proposed, seconds = self.drafter.propose(work)
        return {rid: d for rid, d in zip(jobs, proposed) if d}, seconds

    def _pending_rows(self, scheduled: dict[str, int], lane: int, drafts) -> dict[str, int] | None:
        """With a step of this lane in flight: for a step that can run before its tokens reach the host (decodes
        and prompt chunks, no drafts), request id -> row of the in-flight step's tokens, for the requests whose
        input is that token. None when there is nothing in flight, or the step must wait for the host to have the
        tokens (drafts continue the token in flight on the host; --overlap-steps decode: any but a decode-only
        step, and any step after one that sampled nothing, as before eager steps launched behind)."""
        f = self._flights.get(lane)
        eager = self.overlap_eager
        if f is None or not self.overlap or drafts or f.sampled is None and not eager:
            return None
        rows = {id(r): i for i, r in enumerate(f.reqs)} if f.sampled is not None else {}
        pending = {}
        for rid, n in scheduled.items():
            r = self.requests[rid]
            if n == 1 and r.num_computed_tokens == len(r.token_ids) and id(r) in rows:
                pending[rid] = rows[id(r)]
            elif r.num_computed_tokens + n > len(r.token_ids) or not eager and (
                    n != 1 or r.num_computed_tokens + 1 != len(r.token_ids)):
                return None  # (a token it needs is not on the host; --overlap-steps decode: not a decode)
        return pending

    def _run_decode_graph(self, reqs: list[RequestState], src: np.ndarray | None, prev: torch.Tensor | None):
        """Decode-only step (one token each, every request samples): replay a CUDA graph. src[i] >= 0:
        request i's input token is prev[src[i]] (the in-flight step's tokens, on the device)."""
        bs = BLOCK_SIZE
        n = len(reqs)
        ids, pos, slots, lens = (np.empty(n, dtype=np.int64) for _ in range(4))
        for i, r in enumerate(reqs):
            p = r.num_computed_tokens
            ids[i], pos[i], lens[i] = (r.token_ids[p] if p < len(r.token_ids) else 0), p, p + 1
            slots[i] = r.block_ids[p // bs] * bs + p % bs
            r.num_computed_tokens = p + 1
        logits = self.graphs.run(ids, pos, slots, lens, [r.block_ids[:(r.num_computed_tokens - 1) // bs + 1]
                                                         for r in reqs], src, prev)
        return reqs, lambda: logits

    def _run_verify_graph(self, scheduled: dict[str, int], drafts: dict[str, list[int]]):
        """Decodes and draft verifications (every token on the host) as one decode graph replay, a row per
        position: a request's last token and each draft is a row of its own, over the context up to it (the
        step writes every row's K/V before any row's attention, so a draft sees the ones before it)."""
        rows, sampled_reqs, sample_rows, verify = [], [], [], []
        for rid, n in scheduled.items():
            r = self.requests[rid]
            p = r.num_computed_tokens
            first = len(rows)
            rows += [(token, p + i, r.block_ids) for i, token in enumerate([r.token_ids[p], *drafts.get(rid, ())])]
            r.num_computed_tokens = p + n
            if rid in drafts:
                verify.append((r, drafts[rid], first))
            else:
                sampled_reqs.append(r)
                sample_rows.append(first)
        logits = self.graphs.run_rows(rows)
        return (sampled_reqs, lambda: logits[to_device(sample_rows, torch.int64, logits.device)],
                _Verify(verify, logits))

    def _sample(self, step: int, lane: int, reqs: list[RequestState], logits_fn, t0: float) -> _InFlight:
        """Launch sampling of one token per request (appended when the step is flushed). Under TP only
        rank 0 computes logits and samples; the token ids are broadcast so every rank appends the same
        ones. A sampling error on rank 0 is broadcast too (as -1s), so the step fails on every rank alike.
        Called after the step in flight before it was collected: its tokens are in the requests' token_ids, so a
        seeded request's output index and a penalised one's counts are those of steps run one at a time."""
        if not reqs:
            return _InFlight(step, lane, [], None, t0)
        rows = [r.sample_row for r in reqs]
        if self.tp_size == 1:
            return _InFlight(step, lane, reqs, sample_on_device(logits_fn(), rows), t0)
        tokens = logprobs = None
        if self.tp_rank == 0:
            try:
                tokens, logprobs = sample_on_device(logits_fn(), rows).collect()
            except Exception:
                broadcast_tokens(None, len(reqs), 0, self.device)
                raise
        tokens = broadcast_tokens(tokens, len(reqs), self.tp_rank, self.device)
        return _InFlight(step, lane, reqs, None, t0, collected=(tokens, logprobs))

    def _decoding(self, rid: str) -> bool:
        """The request's input this step is its last token (not a prompt chunk)."""
        req = self.requests[rid]
        return req.num_computed_tokens + 1 == len(req.token_ids)

    def _scales_ready(self) -> bool:
        """Dynamic int8 scales are set by the first eager forward; a graph replay cannot set them."""
        return self.kv_cache.scales is None or self.kv_cache.scales.ready

    def _run(self, scheduled: dict[str, int], pending: dict[str, int] | None, lane: int = LANE_MIXED,
             drafts: dict[str, list[int]] | None = None):
        """The forward of one step -> (the requests that sample, a function returning their logits, the draft
        verification or None, the prompt logprobs or None). pending: request id -> row of the in-flight step's (of
        this lane) device tokens holding its input token; drafts: request id -> draft tokens its input continues
        with. The graph paths run decodes only (one token past the prompt, or the prompt's last token, which no
        prompt logprob needs), and none of a request that samples nothing (max_tokens 0)."""
        prev = self._flights[lane].sampled.tokens if pending else None
        # (the decode graphs' static buffers are the decode lane's: a prefill step never replays them)
        graphs = self.graphs if lane != LANE_PREFILL else None
        if graphs is not None and len(scheduled) <= self.graphs.sizes[-1] and self._scales_ready() and all(
                n == 1 and self.requests[rid].num_computed_tokens + 1 >= len(self.requests[rid].token_ids)
                and self.requests[rid].params.max_tokens for rid, n in scheduled.items()):
            src = np.array([pending.get(rid, -1) for rid in scheduled], dtype=np.int64) if pending else None
            return *self._run_decode_graph([self.requests[rid] for rid in scheduled], src, prev), None, None
        if drafts and graphs is not None and sum(scheduled.values()) <= graphs.sizes[-1] and \
                self._scales_ready() and all(n == 1 + len(drafts.get(rid, ())) and self._decoding(rid)
                                             for rid, n in scheduled.items()):
            return *self._run_verify_graph(scheduled, drafts), None
        # The row layout (module docstring): decodes (one token) first, longest context first.
        order = sorted(scheduled, key=lambda rid: (scheduled[rid] != 1,
                                                   -self.requests[rid].num_computed_tokens * (scheduled[rid] == 1)))
        reqs = [self.requests[rid] for rid in order]
        rows = []
        for r in reqs:
            n, start = scheduled[r.request_id], r.num_computed_tokens
            known = r.token_ids[start:start + n]  # a pending token (not yet on the host) stays 0 here
            if drafts and r.request_id in drafts:  # its last token, then the drafts to verify
                known = known + drafts[r.request_id]
                if len(known) != n:
                    raise ValueError(f"{r.request_id}: {n} tokens scheduled for 1 + {len(known) - 1} drafts")
            rows.append((r.block_ids, start, n, known))
        dev = self.device
        meta, ids, positions = AttentionMetadata.from_rows(rows, BLOCK_SIZE, dev)
        query_lens, qsl = meta.query_lens_cpu, np.cumsum([0, *meta.query_lens_cpu])
        self.backend.prepare(meta, BLOCK_SIZE, self.model_config.sliding_window)
        token_ids = to_device(torch.from_numpy(ids), torch.int64, dev)
        if pending:  # a decode's input row (its first) takes the in-flight step's token from the device
            src = np.full(len(ids), -1, dtype=np.int64)
            for i, rid in enumerate(order):
                src[qsl[i]] = pending.get(rid, -1)
            rows = to_device(torch.from_numpy(src), torch.int64, dev)
            token_ids = torch.where(rows >= 0, prev[rows.clamp(min=0)], token_ids)
        positions = to_device(torch.from_numpy(positions), torch.int64, dev)
        report = self._report_ready if self.publish is not None and self._flights else None
        if self.pieces is not None and lane != LANE_DECODE and self.pieces.can_run(len(ids)):
            hidden = self.pieces.run(token_ids, positions, meta, report)  # (valid until the next: used in this submit)
        else:
            hidden = self.model(token_ids, positions, meta, report)
        scores = self._score_prompts(reqs, query_lens, qsl, hidden)

        # A request samples when this step's chunk reaches the end of its tokens (+ a pending one), unless it asked
        # for none (max_tokens 0: its prompt is scored only); one that verifies drafts needs the logits of all its
        # rows (they follow the sampling rows').
        sample_idx, sampled_reqs, verify = [], [], []
        for i, r in enumerate(reqs):
            r.num_computed_tokens += query_lens[i]
            if drafts and r.request_id in drafts:
                verify.append((r, drafts[r.request_id], int(qsl[i])))
            elif r.num_computed_tokens >= len(r.token_ids) and r.params.max_tokens:
                sample_idx.append(int(qsl[i + 1]) - 1)
                sampled_reqs.append(r)
        if not verify:
            return (sampled_reqs, lambda: self.model.compute_logits(hidden[to_device(sample_idx, torch.int64, dev)]),
                    None, scores)
        rows, spec = [], []
        for r, d, first in verify:
            spec.append((r, d, len(sample_idx) + len(rows)))
            rows += range(first, first + 1 + len(d))
        logits = self.model.compute_logits(hidden[to_device(sample_idx + rows, torch.int64, dev)])
        return sampled_reqs, lambda: logits[:len(sample_idx)], _Verify(spec, logits), scores

    def _score_prompts(self, reqs: list[RequestState], query_lens: list[int], qsl: np.ndarray,
                       hidden: torch.Tensor) -> PromptScores | None:
        """The prompt logprobs of this step's chunks (workers/prompt_logprobs.py), for the requests that ask; reqs
        still at their chunks' starts. Under tensor parallel rank 0 alone (it alone answers the batcher)."""
        rows = []
        for i, r in enumerate(reqs):
            k = r.params.prompt_logprobs
            if k is None or self.tp_rank:
                continue
            start = r.num_computed_tokens
            count = scored_span(start, query_lens[i], r.num_prompt_tokens)
            if count:
                rows.append((r.request_id, int(qsl[i]), start, count, r.token_ids[start + 1:start + 1 + count], k))
        return PromptScores(rows, hidden, self.model.compute_logits) if rows else None

