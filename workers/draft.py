"""The draft model of `--speculative draft` (docs/speculative.md): a smaller checkpoint that shares the model's
tokenizer, its paged KV pool, and the drafts it proposes for a step's DraftJobs.

Owns the draft's weights, its pool and its forwards. The pool has the model pool's blocks (the same ids, so the
batcher's one block table serves both: the draft K/V of a request's position p lives in the slot where the
model's K/V of p does), each block sized for the draft's layers and heads, in the model's dtype. Which positions
hold draft K/V is the batcher's to know (DraftJob.start): this keeps no per-request state. A draft is the draft
model's argmax, a function of the tokens before it only, so the runner's verification (workers/runner.py
_Verify) keeps greedy and seeded output unchanged and sampled output's distribution whatever the draft proposes;
a stale or missing draft K/V costs acceptance, never exactness. Must not do I/O beyond loading the weights.
"""

from __future__ import annotations

import hashlib
import os
import time

import numpy as np
import torch

from laneserve.modelspec import ModelConfig, load_model_config
from laneserve.wire.protocol import DraftJob
from workers.attention import AttentionMetadata, get_backend
from workers.config import WorkerConfig
from workers.kv_cache import BLOCK_SIZE, KVCache, bytes_per_block
from workers.loader import load_model
from workers.sampling import to_device


class Drafter:
    def __init__(self, cfg: WorkerConfig, target: ModelConfig, dtype: torch.dtype, device: torch.device,
                 max_model_len: int):
        mc = self.model_config = load_model_config(cfg.draft_model)
        if mc.vocab_size != target.vocab_size and not _same_tokenizer(cfg.draft_model, cfg.model):
            raise ValueError(f"--draft-model {cfg.draft_model}: its vocabulary has {mc.vocab_size} ids, the model's "
                             f"{target.vocab_size}; a draft model must share the model's tokenizer (different sizes "
                             "are accepted only with identical tokenizer.json files)")
        self.vocab = min(mc.vocab_size, target.vocab_size)  # drafts are ids both know
        self.device, self.dtype, self.max_model_len = device, dtype, max_model_len
        # random target weights (benchmarks) get a random draft; otherwise the draft's own file decides
        load_format = "dummy" if cfg.load_format == "dummy" else "auto"
        self.model = load_model(cfg.draft_model, mc, dtype, device, load_format, cfg.seed)
        self.backend = get_backend(cfg.attention_backend, device, mc.num_kv_heads)
        self.bytes_per_block = bytes_per_block(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype)
        self.kv_cache: KVCache | None = None

    def allocate(self, num_blocks: int) -> None:
        """The draft pool: as many blocks as the model's pool."""
        mc = self.model_config
        self.kv_cache = KVCache(mc.num_layers, num_blocks, mc.num_kv_heads, mc.head_dim, self.dtype, self.device)
        self.model.bind(self.kv_cache.layer_caches(), self.backend, self.max_model_len)
        if self.device.type == "cuda" and self.backend.name == "triton":
            attn = self.model.model.layers[0].self_attn
            k_cache, v_cache = self.kv_cache.layer_caches()[0]
            self.backend.compile_kernels(attn.num_heads, mc.head_dim, self.dtype, k_cache, v_cache, None,
                                         self.model.sliding_window)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def propose(self, jobs: list[tuple[list[int], list[int], DraftJob]]) -> tuple[list[list[int]], float]:
        """For each job (the request's tokens, its block ids, the job): its drafts ([] for k = 0), and the seconds
        it all took. One forward over every job's positions [start, stop), then one decode forward per further
        draft, each over the jobs that want that many; the drafts stay on the device until the end (one sync)."""
        t0 = time.perf_counter()
        bs, dev, window = BLOCK_SIZE, self.device, self.model_config.sliding_window
        order = sorted(range(len(jobs)), key=lambda i: jobs[i][2].stop - jobs[i][2].start != 1)  # decodes first
        rows = [(jobs[i][1], jobs[i][2].start, jobs[i][2].stop - jobs[i][2].start,
                 jobs[i][0][jobs[i][2].start:jobs[i][2].stop]) for i in order]
        meta, ids, positions = AttentionMetadata.from_rows(rows, bs, dev)
        self.backend.prepare(meta, bs, window)
        hidden = self.model(to_device(torch.from_numpy(ids), torch.int64, dev),
                            to_device(torch.from_numpy(positions), torch.int64, dev), meta)
        # the drafting jobs, most drafts first: the jobs that want a further draft are always a leading run
        ends = np.cumsum(meta.query_lens_cpu) - 1
        row_of = {i: int(ends[n]) for n, i in enumerate(order)}
        drafting = sorted((i for i in range(len(jobs)) if jobs[i][2].k > 0), key=lambda i: -jobs[i][2].k)
        out: list[list[int]] = [[] for _ in jobs]
        if not drafting:
            return out, time.perf_counter() - t0
        tokens = [self._argmax(hidden[to_device([row_of[i] for i in drafting], torch.int64, dev)])]
        for d in range(1, jobs[drafting[0]][2].k):
            live = [i for i in drafting if jobs[i][2].k > d]
            # draft d - 1 sits at position stop - 1 + d: its K/V is written, the next draft read off it
            rows = [(jobs[i][1], jobs[i][2].stop - 1 + d, 1, []) for i in live]
            meta, _, positions = AttentionMetadata.from_rows(rows, bs, dev)
            self.backend.prepare(meta, bs, window)
            hidden = self.model(tokens[-1][:len(live)], to_device(torch.from_numpy(positions), torch.int64, dev),
                                meta)
            tokens.append(self._argmax(hidden))
        host = torch.cat(tokens).tolist()  # the one sync
        at = 0
        for d, t in enumerate(tokens):
            for n, i in enumerate(drafting[:len(t)]):
                out[i].append(host[at + n])
            at += len(t)
        return out, time.perf_counter() - t0

    def _argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)[:, :self.vocab].argmax(dim=-1)


def _same_tokenizer(draft: str, model: str) -> bool:
    """Both are checkpoint directories with byte-identical tokenizer.json files."""
    files = [os.path.join(path, "tokenizer.json") for path in (draft, model)]
    if not all(os.path.isfile(f) for f in files):
        return False
    digests = set()
    for f in files:
        with open(f, "rb") as fh:
            digests.add(hashlib.sha256(fh.read()).hexdigest())
    return len(digests) == 1
