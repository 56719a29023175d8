"""Test helpers for the worker: tiny HF checkpoints and a minimal batcher that drives ModelRunner.

`Sim` plays the batcher's part as docs/architecture.md defines it (block allocation, chunked
prefill within a token budget, NewReq/CachedReq diffs, finished ids) without importing the
real scheduler, so the runner is tested against the contract alone.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from laneserve.wire import protocol as P

ARCHS = ("llama", "mistral", "qwen2")
BLOCK = 16
# CI runs on CPU; WORKER_TEST_DEVICE=cuda reruns the same exactness checks on a GPU (fp32).
DEVICE = os.environ.get("WORKER_TEST_DEVICE", "cpu")


def make_checkpoint(path: str, arch: str, *, seed: int = 0, max_shard_size: str | None = None, **overrides):
    """A small random HF checkpoint saved as safetensors; returns the HF model (fp32, eval)."""
    import transformers

    common = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=512, rms_norm_eps=1e-5,
                  initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if arch == "llama":  # Llama-3 RoPE scaling, untied
        cfg = transformers.LlamaConfig(**common, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    elif arch == "mistral":  # sliding window shorter than prompt + output
        cfg = transformers.MistralConfig(**common, sliding_window=48)
    elif arch == "qwen2":  # qkv bias, tied embeddings
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
    else:
        raise ValueError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kw)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def edit_config(path: str, **changes) -> None:
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(file, "w") as f:
        json.dump(cfg, f)


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    # explicit mask: otherwise generate() treats prompt tokens equal to pad_token_id as padding
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def random_prompt(n: int, seed: int, vocab: int = 128) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@dataclass
class _Req:
    rid: str
    params: P.SamplingParams
    tokens: list[int]
    blocks: list[int]
    computed: int
    keep_blocks: bool
    chunk: int | None
    out: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    sent: bool = False
    scored: list = field(default_factory=list)  # the StepOutput.prompt_logprobs chunks it got, in order


class Sim:
    """Minimal batcher: FIFO, per-step token budget, optional per-request chunk size."""

    def __init__(self, runner, budget: int = 1 << 30):
        self.runner = runner
        self.budget = budget
        self.free = list(range(runner.num_blocks))
        self.running: dict[str, _Req] = {}
        self.done: dict[str, _Req] = {}
        self.finished_ids: list[str] = []
        self.step_no = 0

    def add(self, rid: str, prompt: list[int], params: P.SamplingParams, *, chunk: int | None = None,
            cached_blocks: list[int] = (), num_cached_tokens: int = 0, keep_blocks: bool = False,
            output_token_ids: list[int] = ()) -> None:
        """output_token_ids: a preempted request coming back with what it generated so far."""
        for b in cached_blocks:
            self.free.remove(b) if b in self.free else None
        self.running[rid] = _Req(rid, params, list(prompt) + list(output_token_ids), list(cached_blocks),
                                 num_cached_tokens, keep_blocks, chunk, out=list(output_token_ids))

    def step(self) -> P.StepOutput:
        new_reqs, cached, sched = [], [], {}
        budget = self.budget
        for r in self.running.values():
            n = min(len(r.tokens) - r.computed, r.chunk or budget, budget)
            if n <= 0:
                continue
            new_blocks = [self.free.pop(0) for _ in range(-(-(r.computed + n) // BLOCK) - len(r.blocks))]
            r.blocks += new_blocks
            if not r.sent:
                new_reqs.append(P.NewReq(request_id=r.rid, prompt_token_ids=r.tokens[:len(r.tokens) - len(r.out)],
                                         params=r.params, block_ids=list(r.blocks), num_computed_tokens=r.computed,
                                         output_token_ids=list(r.out)))
                r.sent = True
            elif new_blocks:
                cached.append(P.CachedReq(r.rid, new_blocks))
            sched[r.rid] = n
            budget -= n
        step = P.StepInput(step=self.step_no, new_reqs=new_reqs, cached_reqs=cached, num_scheduled_tokens=sched,
                           finished_req_ids=self.finished_ids)
        # round-trip through the wire format, as the real batcher's frames do
        step = P.decoder(P.BatcherToWorker).decode(P.encode(step))
        out = self.runner.execute(step)
        assert out.error is None and out.step == self.step_no
        self.step_no += 1
        self.finished_ids = []
        for rid, n in sched.items():
            self.running[rid].computed += n
        for rid, chunk in out.prompt_logprobs.items():
            self.running[rid].scored.append(chunk)
        for rid in [rid for rid, r in self.running.items() if not r.params.max_tokens and r.computed == len(r.tokens)]:
            self._finish(rid)  # max_tokens 0: its prompt is computed (scored), nothing is sampled
        for i, (rid, toks) in enumerate(zip(out.request_ids, out.sampled_token_ids)):
            r = self.running[rid]
            r.tokens += toks
            r.out += toks
            if out.logprobs is not None:
                r.logprobs += out.logprobs[i]
            if len(r.out) >= r.params.max_tokens:
                self._finish(rid)
        return out

    def _finish(self, rid: str) -> None:
        r = self.done[rid] = self.running.pop(rid)
        self.finished_ids.append(rid)
        if not r.keep_blocks:
            self.free += r.blocks

    def run(self, max_steps: int = 10_000) -> dict[str, list[int]]:
        for _ in range(max_steps):
            if not self.running:
                break
            self.step()
        assert not self.running, "requests still running"
        return {rid: r.out for rid, r in self.done.items()}


def greedy(n: int, **kw) -> P.SamplingParams:
    return P.SamplingParams(max_tokens=n, temperature=0.0, **kw)
