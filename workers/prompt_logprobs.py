"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's; OpenAI's echo scoring): one step's, from its prefill rows.

Prompt token j (j >= 1) is scored by the logits of position j - 1: its log_softmax there, its rank (how many tokens
are at least as likely: 1 for the argmax, vLLM's rule) and the top-k. A chunk computing positions [s, s + n) of a
prompt of P tokens scores tokens s + 1 .. min(s + n, P - 1) (the chunk's last row also scores the first token of the
next chunk; the prompt's last row predicts the first output, which is sampling's business). The full logits are
computed only for the rows of requests that ask, a slice of rows at a time, so a long chunk over a large vocabulary
never holds them all at once. Launched without waiting for the device; collect() waits for its own copies alone.
Must not know blocks or the scheduler.
"""

from __future__ import annotations

import torch

from laneserve.wire.protocol import PromptLogprobs
from workers.sampling import to_device, to_host

ROWS_PER_SLICE = 256  # rows of full logits alive at once (256 x a 128k vocabulary in fp32: 128 MiB)


def scored_span(start: int, num_tokens: int, num_prompt_tokens: int) -> int:
    """How many prompt tokens a chunk of num_tokens computed from position start scores (from token start + 1 on)."""
    return max(0, min(start + num_tokens, num_prompt_tokens - 1) - start)


class PromptScores:
    """The prompt logprobs of one step. rows: (request id, first hidden row of its chunk, its chunk's start, how many
    tokens it scores, the tokens it scores, its k)."""

    def __init__(self, rows: list[tuple[str, int, int, int, list[int], int]], hidden: torch.Tensor, compute_logits):
        self.rows = rows
        device = hidden.device
        index, targets = [], []
        for _, first, _, count, tokens, _ in rows:
            index += range(first, first + count)
            targets += tokens
        top_k = max(k for *_, k in rows)
        index_t = to_device(index, torch.int64, device)
        targets_t = to_device(targets, torch.int64, device)
        parts: list[list[torch.Tensor]] = [[], [], [], []]  # chosen logprob, rank, top values, top ids
        for lo in range(0, len(index), ROWS_PER_SLICE):
            logprobs = compute_logits(hidden[index_t[lo:lo + ROWS_PER_SLICE]]).float().log_softmax(dim=-1)
            chosen = logprobs.gather(1, targets_t[lo:lo + ROWS_PER_SLICE, None])
            parts[0].append(chosen.squeeze(1))
            parts[1].append((logprobs >= chosen).sum(dim=-1))
            if top_k:
                values, ids = logprobs.topk(min(top_k, logprobs.shape[1]), dim=-1)
                parts[2].append(values)
                parts[3].append(ids)
        self.host, self.event = to_host([torch.cat(p) for p in parts if p])

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def collect(self) -> dict[str, PromptLogprobs]:
        if self.event is not None:
            self.event.synchronize()
        chosen, ranks, *top = (p.tolist() for p in self.host)
        values, ids = top if top else ([], [])
        out = {}
        row = 0
        for rid, _, start, count, _, k in self.rows:
            end = row + count
            out[rid] = PromptLogprobs(start + 1, chosen[row:end], ranks[row:end],
                                      [r[:k] for r in ids[row:end]] if k else [[]] * count,
                                      [r[:k] for r in values[row:end]] if k else [[]] * count)
            row = end
        return out
