"""EngineDriver: drives a ModelRunner as the batcher and the worker loop would, for the tools that time it.

Owns the benchmark's requests (random prompts, block ids handed out in order), their chunked prefill
and the decode-only steady state; bench.py times its decode steps, breakdown.py profiles them. A tool
module: imports only the wire protocol and torch, and gets the runner from its caller.
"""

from __future__ import annotations

import time

import torch

from laneserve.wire import protocol as P


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class EngineDriver:
    """Drives ModelRunner.submit with StepInputs as the batcher and worker loop would (decode-only steady
    state)."""

    def __init__(self, runner, context: int, seed: int = 0, long_context: int = 0):
        """long_context: the first request's context instead of `context` (a skewed batch); 0: none."""
        self.runner = runner
        self.context = context
        self.long_context = long_context
        self.page = runner.block_size
        self.gen = torch.Generator().manual_seed(seed)
        self.step = 0
        self.next_block = 0
        self.reqs: dict[str, dict] = {}
        self.prefill_steps: list[tuple[int, float]] = []  # (tokens, seconds)

    def _blocks(self, n: int) -> list[int]:
        if self.next_block + n > self.runner.num_blocks:
            raise RuntimeError(f"KV pool too small: need {self.next_block + n} blocks, have {self.runner.num_blocks}")
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return ids

    def prefill(self, batch: int, vocab: int, chunk: int) -> None:
        params = P.SamplingParams(max_tokens=1 << 20, temperature=0.0)
        new = []
        for i in range(batch):
            rid = f"b{i}"
            context = self.long_context if i == 0 and self.long_context else self.context
            prompt = torch.randint(3, vocab, (context,), generator=self.gen).tolist()
            blocks = self._blocks((context + 1 + self.page) // self.page + 64)
            self.reqs[rid] = {"len": context}
            new.append(P.NewReq(request_id=rid, prompt_token_ids=prompt, params=params, block_ids=blocks))
        # prefill in token-budget chunks, several requests per step
        pending = {r.request_id: len(r.prompt_token_ids) for r in new}
        sent_new = False
        while pending:
            budget, sched = chunk, {}
            for rid, left in list(pending.items()):
                if budget <= 0:
                    break
                n = min(left, budget)
                sched[rid] = n
                budget -= n
                pending[rid] -= n
                if pending[rid] == 0:
                    del pending[rid]
            sync()
            t0 = time.perf_counter()
            self._run(P.StepInput(step=self.step, new_reqs=new if not sent_new else [], num_scheduled_tokens=sched))
            self.prefill_steps.append((sum(sched.values()), time.perf_counter() - t0))
            sent_new = True
        for r in self.reqs.values():
            r["len"] += 1  # the token sampled at the end of prefill

    def decode_step(self) -> float:
        """One decode step as the worker loop submits it: with overlapped steps the previous step is
        collected inside this submit and this one stays in flight, so in steady state the time of a
        submit is the time per step."""
        sched = {rid: 1 for rid in self.reqs}
        for r in self.reqs.values():
            r["len"] += 1
        t0 = time.perf_counter()
        self.runner.submit(P.StepInput(step=self.step, num_scheduled_tokens=sched))
        self.check(self.runner.take_outputs())
        self.step += 1
        return time.perf_counter() - t0

    def mixed_step(self, chunk: int, vocab: int) -> P.StepOutput:
        """Every request's decode beside a new prompt's first chunk of `chunk` tokens (its prompt is one longer:
        it samples nothing), with no step in flight before it, run to its end -> its output (launch_time: the
        host's time to build and launch it; execute_time: from the GPU's start on it to its end). The prompt is
        finished after."""
        rid = f"m{self.step}"
        prompt = torch.randint(3, vocab, (chunk + 1,), generator=self.gen).tolist()
        params = P.SamplingParams(max_tokens=1, temperature=0.0)
        new = P.NewReq(request_id=rid, prompt_token_ids=prompt, params=params,
                       block_ids=self._blocks(chunk // self.page + 2))
        for r in self.reqs.values():
            r["len"] += 1
        self.runner.submit(P.StepInput(step=self.step, new_reqs=[new],
                                       num_scheduled_tokens={**dict.fromkeys(self.reqs, 1), rid: chunk}))
        self.runner.flush()
        outs = self.runner.take_outputs()
        self.check(outs)
        self.step += 1
        self._run(P.StepInput(step=self.step, finished_req_ids=[rid]))
        return outs[-1]

    @staticmethod
    def check(outputs: list[P.StepOutput]) -> None:
        for out in outputs:
            if out.error:
                raise RuntimeError(out.error)

    def _run(self, step: P.StepInput) -> None:
        self.runner.submit(step)
        self.runner.flush()
        self.check(self.runner.take_outputs())
        self.step += 1

    def finish(self) -> None:
        self._run(P.StepInput(step=self.step, finished_req_ids=list(self.reqs)))
        self.reqs.clear()
        self.next_block = 0
