"""ModelRunner: per-request state from StepInput diffs, input preparation, one forward, sampling.

Owns the worker's view of its requests (token ids, block ids, num_computed_tokens) and the
step loop body of docs/architecture.md ("ModelRunner"). Trusts the sidecar's StepInput (it
is validated at decode); errors propagate to the worker loop, which fails the step and
calls reset(). Must not do I/O or asyncio: workers/main.py owns the socket.

Tensor parallel (cfg.tensor_parallel_size T > 1, docs/tensor_parallel.md): every rank runs a
ModelRunner on the same StepInputs; each holds its shard of the weights and a KV pool of its
num_kv_heads/T heads, sized to the smallest pool any rank can hold. Rank 0 alone computes logits
and samples, then broadcasts the token ids so every rank's request state stays identical.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from batcher import protocol as P
from workers.attention import AttentionMetadata, get_backend
from workers.config import WorkerConfig
from workers.cuda_graphs import DecodeGraphs
from workers.kv_cache import (BLOCK_SIZE, DEFAULT_CPU_KV_BYTES, KVCache, bytes_per_block, gpu_kv_budget,
                              load_kv_scales, parse_bytes, resolve_kv_dtype)
from workers.loader import load_model, load_model_config, resolve_device, resolve_dtype
from workers.parallel import broadcast_tokens, check_shardable, min_across_ranks, rank_device
from workers.sampling import SampleRow, sample

log = logging.getLogger("laneserve.worker")


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


class ModelRunner:
    def __init__(self, cfg: WorkerConfig, tp_rank: int = 0):
        """tp_rank: this process's rank when cfg.tensor_parallel_size > 1; the caller has joined
        the process group (workers.parallel.TPGroup on rank 0, follower_main on the others)."""
        self.cfg = cfg
        self.tp_rank, self.tp_size = tp_rank, cfg.tensor_parallel_size
        self.device = rank_device(resolve_device(cfg.device), tp_rank)
        if self.device.type == "cpu" and cfg.num_threads > 0:
            torch.set_num_threads(cfg.num_threads)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.kv_dtype = resolve_kv_dtype(cfg.kv_cache_dtype, self.dtype)
        self.model_config = load_model_config(cfg.model)
        self.model_name = cfg.model
        if self.tp_size != 1:
            check_shardable(self.model_config, self.tp_size)
            if not dist.is_initialized() or dist.get_world_size() != self.tp_size:
                raise ValueError(f"--tensor-parallel-size {self.tp_size}: no process group of that size; start the "
                                 "worker through workers.main (it starts the other ranks)")
        self.num_kv_heads = self.model_config.num_kv_heads // self.tp_size  # this rank's share
        self.block_size = BLOCK_SIZE
        mc = self.model_config
        limit = mc.max_position_embeddings
        if cfg.max_model_len > limit:
            raise ValueError(f"--max-model-len {cfg.max_model_len} exceeds the model's max_position_embeddings {limit}")
        self.max_model_len = cfg.max_model_len or limit
        self.model = load_model(cfg.model, mc, self.dtype, self.device, cfg.load_format, cfg.seed,
                                tp_rank, self.tp_size)
        self.backend = get_backend(cfg.attention_backend, self.device, self.num_kv_heads)
        self.requests: dict[str, RequestState] = {}
        self.graphs: DecodeGraphs | None = None  # captured below, after the pool exists
        self.kv_cache = self._allocate_kv_cache()
        self.num_blocks = self.kv_cache.num_blocks
        self.model.bind(self.kv_cache.layer_caches(), self.backend, self.max_model_len, self.kv_cache.layer_scales())
        if self.device.type == "cuda" and self.backend.name == "triton":
            attn = self.model.model.layers[0].self_attn
            k_cache, v_cache = self.kv_cache.layer_caches()[0]
            self.backend.compile_kernels(attn.num_heads, mc.head_dim, self.dtype, k_cache, v_cache, attn.kv_scales,
                                         self.model.sliding_window)
        if self.device.type == "cuda" and self.backend.name == "triton" and not cfg.enforce_eager:
            self.graphs = DecodeGraphs(self.model, self.backend, cfg.max_num_seqs, self.max_model_len,
                                       BLOCK_SIZE, self.device)
            with self._hold_dynamic_scales():  # graphs read the scale tensors by pointer, set later in place
                self.graphs.capture()
        log.info("model %s on %s/%s: %d KV blocks (%.0f MiB, %s KV%s)", cfg.model, self.device,
                 str(self.dtype).split(".")[-1], self.num_blocks, self.kv_cache.nbytes / 2**20,
                 str(self.kv_dtype).split(".")[-1],
                 f", scales: {self.kv_cache.scales.source}" if self.kv_cache.scales is not None else "")

    # ------------------------------------------------------------------ KV pool
    def _allocate_kv_cache(self) -> KVCache:
        mc = self.model_config
        per_block = bytes_per_block(mc.num_layers, self.num_kv_heads, mc.head_dim, self.kv_dtype)
        budget = parse_bytes(self.cfg.kv_cache_memory)  # per rank: each holds num_kv_heads/T heads
        if not budget:
            budget = self._measure_gpu_budget() if self.device.type == "cuda" else DEFAULT_CPU_KV_BYTES
        num_blocks = budget // per_block
        if self.tp_size > 1:  # block ids are the group's: every rank needs every block
            num_blocks = min_across_ranks(num_blocks, self.device)
        need = -(-self.max_model_len // BLOCK_SIZE)
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
        """Forget every request (after a failed step the sidecar fails them all)."""
        self.requests.clear()

    def execute(self, step: P.StepInput) -> P.StepOutput:
        t0 = time.perf_counter()
        for rid in step.finished_req_ids:
            self.requests.pop(rid, None)
        for r in step.new_reqs:
            self.requests[r.request_id] = RequestState(
                r.request_id, r.params, list(r.prompt_token_ids) + list(r.output_token_ids),
                len(r.prompt_token_ids), list(r.block_ids), r.num_computed_tokens)
        for c in step.cached_reqs:
            self.requests[c.request_id].block_ids.extend(c.new_block_ids)
        out = P.StepOutput(step=step.step, worker_id=self.cfg.worker_id)
        if not step.num_scheduled_tokens:
            return out
        with torch.inference_mode():
            sampled_reqs, tokens, logprobs = self._run(step.num_scheduled_tokens)
        out.request_ids = [r.request_id for r in sampled_reqs]
        out.sampled_token_ids = [[t] for t in tokens]
        if logprobs is not None:
            out.logprobs = [[lp] if lp is not None else [] for lp in logprobs]
        out.execute_time = time.perf_counter() - t0
        return out

    def _run_decode_graph(self, reqs: list[RequestState]):
        """Decode-only step (one token each, every request samples): replay a CUDA graph."""
        bs = BLOCK_SIZE
        n = len(reqs)
        ids, pos, slots, lens = (np.empty(n, dtype=np.int64) for _ in range(4))
        for i, r in enumerate(reqs):
            p = r.num_computed_tokens
            ids[i], pos[i], lens[i] = r.token_ids[p], p, p + 1
            slots[i] = r.block_ids[p // bs] * bs + p % bs
            r.num_computed_tokens = p + 1
        logits = self.graphs.run(ids, pos, slots, lens, [r.block_ids[:(r.num_computed_tokens - 1) // bs + 1]
                                                         for r in reqs])
        tokens, logprobs = self._sample(reqs, lambda: logits)
        return reqs, tokens, logprobs

    def _sample(self, reqs: list[RequestState], logits_fn):
        """Sample one token per request and append it. Under TP only rank 0 computes logits and
        samples; the token ids are broadcast so every rank appends the same ones. A sampling error on
        rank 0 is broadcast too (as -1s), so the step fails on every rank alike."""
        tokens = logprobs = None
        if self.tp_rank == 0:
            try:
                tokens, logprobs = sample(logits_fn(), [r.sample_row for r in reqs])
            except Exception:
                if self.tp_size > 1:
                    broadcast_tokens(None, len(reqs), 0, self.device)
                raise
        if self.tp_size > 1:
            tokens = broadcast_tokens(tokens, len(reqs), self.tp_rank, self.device)
        for r, t in zip(reqs, tokens):
            r.token_ids.append(t)
        return tokens, logprobs

    def _scales_ready(self) -> bool:
        """Dynamic int8 scales are set by the first eager forward; a graph replay cannot set them."""
        return self.kv_cache.scales is None or self.kv_cache.scales.ready

    def _run(self, scheduled: dict[str, int]):
        if self.graphs is not None and len(scheduled) <= self.graphs.sizes[-1] and self._scales_ready() and all(
                n == 1 and self.requests[rid].num_computed_tokens + 1 == len(self.requests[rid].token_ids)
                for rid, n in scheduled.items()):
            return self._run_decode_graph([self.requests[rid] for rid in scheduled])
        # Decodes (one token) first, longest context first: the attention backend batches them
        # into padded calls, and neighbours of similar length waste little padding.
        order = sorted(scheduled, key=lambda rid: (scheduled[rid] != 1,
                                                   -self.requests[rid].num_computed_tokens * (scheduled[rid] == 1)))
        reqs = [self.requests[rid] for rid in order]
        input_ids, positions, slots, query_lens, seq_lens, tables = [], [], [], [], [], []
        bs = BLOCK_SIZE
        for r in reqs:
            n, start = scheduled[r.request_id], r.num_computed_tokens
            pos = np.arange(start, start + n)
            num_blocks = -(-(start + n) // bs)
            blocks = np.asarray(r.block_ids[:num_blocks], dtype=np.int64)
            input_ids.append(np.asarray(r.token_ids[start:start + n], dtype=np.int64))
            positions.append(pos)
            slots.append(blocks[pos // bs] * bs + pos % bs)
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(blocks)
        width = max(len(t) for t in tables)
        block_tables = np.zeros((len(reqs), width), dtype=np.int32)
        for i, t in enumerate(tables):
            block_tables[i, :len(t)] = t
        qsl = np.zeros(len(reqs) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=qsl[1:])
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            num_decodes=_leading_ones(query_lens),
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)
        self.backend.prepare(meta, bs, self.model_config.sliding_window)
        hidden = self.model(torch.from_numpy(np.concatenate(input_ids)).to(dev),
                            torch.from_numpy(np.concatenate(positions)).to(dev), meta)

        # A request samples when this step's chunk reaches the end of its tokens.
        sample_idx, sampled_reqs = [], []
        for i, r in enumerate(reqs):
            r.num_computed_tokens += query_lens[i]
            if r.num_computed_tokens == len(r.token_ids):
                sample_idx.append(int(qsl[i + 1]) - 1)
                sampled_reqs.append(r)
        if not sampled_reqs:
            return [], [], None
        tokens, logprobs = self._sample(
            sampled_reqs, lambda: self.model.compute_logits(hidden[torch.tensor(sample_idx, device=dev)]))
        return sampled_reqs, tokens, logprobs


def _leading_ones(query_lens: list[int]) -> int:
    n = 0
    while n < len(query_lens) and query_lens[n] == 1:
        n += 1
    return n
