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
from workers.cuda_graphs import DecodeGraphs
from workers.kv_cache import BLOCK_SIZE, KVCache, bytes_per_block
from workers.loader import load_model
from workers.sampling import to_device

GRAPH_POSITIONS = 4  # a job's first pass replays a decode graph, a row per position, up to this many positions


class Drafter:
    def __init__(self, cfg: WorkerConfig, target: ModelConfig, dtype: torch.dtype, device: torch.device,
                 max_model_len: int):
        try:
            mc = self.model_config = load_model_config(cfg.draft_model)
        except ValueError as exc:  # (it names the file, and says --model)
            why = str(exc).replace("--model", "--draft-model")
            raise ValueError(f"--draft-model {cfg.draft_model}: {why}") from None
        if mc.vocab_size != target.vocab_size and not _same_tokenizer(cfg.draft_model, cfg.model):
            raise ValueError(f"--draft-model {cfg.draft_model}: its vocabulary has {mc.vocab_size} ids, the model's "
                             f"{target.vocab_size}; a draft model must share the model's tokenizer (different sizes "
                             "are accepted only with identical tokenizer.json files)")
        self.vocab = min(mc.vocab_size, target.vocab_size)  # drafts are ids both know
        self.device, self.dtype, self.max_model_len = device, dtype, max_model_len
        # random target weights (benchmarks) get a random draft; otherwise the draft's own file decides
        load_format = "dummy" if cfg.load_format == "dummy" else "auto"
        self.model = load_model(cfg.draft_model, mc, dtype, device, load_format, cfg.seed)
        self.backend = get_backend(cfg.attention_backend, device, mc.num_kv_heads, cfg.decode_attention,
                                   cfg.max_num_seqs)
        self.bytes_per_block = bytes_per_block(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype)
        self.kv_cache: KVCache | None = None
        self.graphs: DecodeGraphs | None = None  # capture_graphs(): CUDA, the Triton backend, not --enforce-eager

    def allocate(self, num_blocks: int) -> None:
        """The draft pool: as many blocks as the model's pool."""
        mc = self.model_config
        self.kv_cache = KVCache(mc.num_layers, num_blocks, mc.num_kv_heads, mc.head_dim, self.dtype, self.device)
        self.model.bind(self.kv_cache.layer_caches(), self.backend, self.max_model_len)
        self.model.compile_attention()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def capture_graphs(self, max_num_seqs: int) -> None:
        """CUDA graphs for the draft's passes (the decode graphs of workers/cuda_graphs.py, on the draft)."""
        self.graphs = DecodeGraphs(self.model, self.backend, max_num_seqs, self.max_model_len, BLOCK_SIZE,
                                   self.device)
        self.graphs.capture()

    def propose(self, jobs: list[tuple[list[int], list[int], DraftJob]]) -> tuple[list[list[int]], float]:
        """For each job (the request's tokens, its block ids, the job): its drafts ([] for k = 0), and the seconds
        it all took. One forward over every job's positions [start, stop), then one decode forward per further
        draft, each over the jobs that want that many; the drafts stay on the device until the end (one sync).
        With CUDA graphs each pass is a decode graph replay, a row per position (the first pass too while every job
        has at most GRAPH_POSITIONS positions and they fit the largest graph: every row's K/V is written before any
        row's attention reads it)."""
        t0 = time.perf_counter()
        graphs = self.graphs
        # the drafting jobs, most drafts first: the jobs that want a further draft are always a leading run
        drafting = sorted((i for i in range(len(jobs)) if jobs[i][2].k > 0), key=lambda i: -jobs[i][2].k)
        # (a catch-up of more positions runs eagerly: as graph rows, each would read its whole context)
        if graphs is not None and all(j.stop - j.start <= GRAPH_POSITIONS for _, _, j in jobs) and \
                sum(j.stop - j.start for _, _, j in jobs) <= graphs.sizes[-1]:
            rows, last = [], {}
            for i, (tokens, blocks, job) in enumerate(jobs):
                rows += [(tokens[q], q, blocks) for q in range(job.start, job.stop)]
                last[i] = len(rows) - 1
            logits = graphs.run_rows(rows)
        else:
            logits, last = self._eager(jobs)
        out: list[list[int]] = [[] for _ in jobs]
        if not drafting:  # (no copy to the host to wait for: wait for the device, or the time would be the launches')
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            return out, time.perf_counter() - t0
        drafts = [self._pick(logits[to_device([last[i] for i in drafting], torch.int64, self.device)])]
        for d in range(1, jobs[drafting[0]][2].k):
            live = [jobs[i] for i in drafting if jobs[i][2].k > d]
            # draft d - 1 sits at position stop - 1 + d: its K/V is written, the next draft read off it
            rows = [(0, job.stop - 1 + d, blocks) for _, blocks, job in live]
            drafts.append(self._pick(graphs.run_rows(rows, drafts[-1]) if graphs is not None else
                                     self._eager_decode(rows, drafts[-1][:len(live)])))
        host = torch.cat(drafts).tolist()  # the one sync
        at = 0
        for t in drafts:
            for n, i in enumerate(drafting[:len(t)]):
                out[i].append(host[at + n])
            at += len(t)
        return out, time.perf_counter() - t0

    def _eager(self, jobs: list[tuple[list[int], list[int], DraftJob]]) -> tuple[torch.Tensor, dict[int, int]]:
        """The first pass run eagerly: logits of every job's last position (row index by job)."""
        dev = self.device
        order = sorted(range(len(jobs)), key=lambda i: jobs[i][2].stop - jobs[i][2].start != 1)  # decodes first
        meta, ids, positions = AttentionMetadata.from_rows(
            [(jobs[i][1], jobs[i][2].start, jobs[i][2].stop - jobs[i][2].start,
              jobs[i][0][jobs[i][2].start:jobs[i][2].stop]) for i in order], BLOCK_SIZE, dev)
        self.backend.prepare(meta, BLOCK_SIZE, self.model_config.sliding_window)
        hidden = self.model(to_device(torch.from_numpy(ids), torch.int64, dev),
                            to_device(torch.from_numpy(positions), torch.int64, dev), meta)
        ends = np.cumsum(meta.query_lens_cpu) - 1
        end_of = {i: int(ends[n]) for n, i in enumerate(order)}
        rows = [i for i in range(len(jobs)) if jobs[i][2].k > 0]
        logits = self.model.compute_logits(hidden[to_device([end_of[i] for i in rows], torch.int64, dev)])
        return logits, {i: n for n, i in enumerate(rows)}

    def _eager_decode(self, rows: list[tuple[int, int, list[int]]], tokens: torch.Tensor) -> torch.Tensor:
        """One decode pass run eagerly: rows (unused, position, block ids), their input tokens on the device."""
        meta, _, positions = AttentionMetadata.from_rows([(blocks, q, 1, []) for _, q, blocks in rows], BLOCK_SIZE,
                                                         self.device)
        self.backend.prepare(meta, BLOCK_SIZE, self.model_config.sliding_window)
        hidden = self.model(tokens, to_device(torch.from_numpy(positions), torch.int64, self.device), meta)
        return self.model.compute_logits(hidden)

    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        return logits[:, :self.vocab].argmax(dim=-1)


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
