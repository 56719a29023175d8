"""Batched sampling: penalties, greedy, temperature, min-p, top-k, top-p, seeds, logprobs.

Owns turning one step's logits [B, V] into one token per row, vectorised over the batch
(per-row parameters are tensors, masks are built with one sort). Must not know blocks or
the model.

Semantics (vLLM's):
- penalties: repetition over prompt + output tokens (positive logits divided, negative
  multiplied), frequency (times count) and presence (once) over output tokens only;
  applied before greedy argmax too.
- logit_bias: each (token, bias) added to that token's logit first, before everything below.
- min_tokens: the request's stop_token_ids are masked until it has that many outputs.
- structured output: a row with an `allowed` bitmask (its grammar's, from the batcher) may only sample the
  tokens it allows; applied to the logits first, as vLLM's model runner applies it before its sampler: its
  logprobs are of the allowed tokens, and the filters below act on them alone.
- order: logit_bias -> penalties -> temperature -> min-p -> top-k -> top-p (top-p on the top-k
  renormalised distribution) -> sample as argmax(probs / Exp(1) noise).
- seed: a seeded request's noise comes from a generator seeded with (seed, output index),
  so its tokens depend on nothing but its own seed and history: not on batch mates, not
  on preemption and recompute.
- logprobs: of the model's raw distribution (log_softmax of the logits before penalties,
  temperature and filters; a grammar's mask applied), vLLM's default "raw_logprobs": the sampled token's plus
  top-N.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from laneserve.wire.protocol import SamplingParams, TokenLogprobs

GREEDY_EPS = 1e-5
_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio odd constant: spreads (seed, index) over the 63-bit space


@dataclass
class SampleRow:
    """What sampling needs of one request; token_ids is prompt + outputs so far."""

    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    allowed: bytes | None = None  # structured output: this step's token bitmask (P.StepInput.allowed_token_ids)
    ahead: int = 0  # a draft verification's row: it samples this many tokens past the request's known ones

    @property
    def num_output_tokens(self) -> int:
        """The output index of the token this row samples (its seeded noise is drawn for that index)."""
        return len(self.token_ids) - self.num_prompt_tokens + self.ahead


def seed_for(seed: int, output_index: int) -> int:
    return (seed * _SEED_MIX + output_index) & ((1 << 63) - 1)


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """Host values as a device tensor without a device sync (a pinned, non-blocking copy on CUDA)."""
    t = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """In place, vLLM's formulas; counts built from the token lists with one scatter_add each."""
    B, V = logits.shape
    device = logits.device
    rep = to_device([r.params.repetition_penalty for r in rows], torch.float32, device)
    freq = to_device([r.params.frequency_penalty for r in rows], torch.float32, device)
    pres = to_device([r.params.presence_penalty for r in rows], torch.float32, device)
    out_counts = _bin_counts([r.token_ids[r.num_prompt_tokens:] for r in rows], V, device)
    if any(r.params.repetition_penalty != 1.0 for r in rows):
        prompt_seen = _bin_counts([r.token_ids[:r.num_prompt_tokens] for r in rows], V, device) > 0
        factor = torch.where(prompt_seen | (out_counts > 0), rep[:, None], 1.0)
        logits.copy_(torch.where(logits > 0, logits / factor, logits * factor))
    logits -= freq[:, None] * out_counts
    logits -= pres[:, None] * (out_counts > 0)


def _bin_counts(seqs: list[list[int]], vocab: int, device) -> torch.Tensor:
    width = max((len(s) for s in seqs), default=0)
    padded = torch.full((len(seqs), width + 1), vocab, dtype=torch.int64)  # vocab = padding bin, dropped
    for i, s in enumerate(seqs):
        padded[i, :len(s)] = torch.tensor(s, dtype=torch.int64)
    counts = torch.zeros(len(seqs), vocab + 1, device=device)
    counts.scatter_add_(1, to_device(padded, torch.int64, device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def apply_allowed(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """In place: -inf for every token a row's bitmask does not allow (rows without one untouched). Bit t of the
    mask's int32 word t // 32 allows token t; logits columns past the mask are not allowed."""
    B, V = logits.shape
    index = [i for i, r in enumerate(rows) if r.allowed is not None]
    words = np.frombuffer(b"".join(rows[i].allowed for i in index), dtype="<i4").reshape(len(index), -1)
    bits = to_device(torch.from_numpy(words.astype(np.int32)), torch.int32, logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bits[:, :, None] >> shifts) & 1).bool().reshape(len(index), -1)
    if allowed.shape[1] < V:
        allowed = torch.nn.functional.pad(allowed, (0, V - allowed.shape[1]))
    rows_t = to_device(index, torch.int64, logits.device)
    logits[rows_t] = logits[rows_t].masked_fill(~allowed[:, :V], float("-inf"))
    return logits


def min_p_mask(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """True where a token is dropped: prob < min_p * (the row's top prob)."""
    return probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values


def top_k_top_p_mask(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """True where a token is dropped. top_k <= 0 keeps all; top_p is applied to what top-k kept,
    keeping the smallest prefix (by prob, descending) whose mass reaches top_p. One sort."""
    B, V = logits.shape
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, V).clamp(max=V)
    # past the k-th, except tokens tied with it (vLLM keeps every logit >= the k-th's: bf16 logits tie often)
    drop_sorted = (rank >= k[:, None]) & (sorted_logits < sorted_logits.gather(1, (k - 1)[:, None]))
    probs = sorted_logits.masked_fill(drop_sorted, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    p = torch.where(top_p < 1.0, top_p, 2.0)  # top_p 1: never drop, whatever the rounding of cumsum
    drop_sorted |= mass_before >= p[:, None]
    return torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)


def exponential_noise(rows: list[SampleRow], shape: tuple[int, int], device) -> torch.Tensor:
    """Exp(1) noise per row; a seeded row draws from its own (seed, output index) generator."""
    q = torch.empty(shape, device=device).exponential_()
    for i, r in enumerate(rows):
        if r.params.seed is not None:
            g = torch.Generator(device=device).manual_seed(seed_for(r.params.seed, r.num_output_tokens))
            q[i].exponential_(generator=g)
    return q


def to_host(parts: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Device tensors copied to the host without waiting: on CUDA into pinned memory, queued right behind the
    kernels that made them, with an event that covers those copies alone (None: they are on the host already)."""
    if not parts[0].is_cuda:
        return parts, None
    host = [p.to("cpu", non_blocking=True) for p in parts]  # into pinned memory
    event = torch.cuda.Event()
    event.record()
    return host, event


class Sampled:
    """One step's sampled tokens (and logprobs), copied to the host without waiting: on CUDA the copies
    into pinned memory are queued right behind the sampling kernels, so collect() waits for those
    alone, not for work queued after them (the next step's forward)."""

    def __init__(self, tokens: torch.Tensor, raw_logprobs: torch.Tensor | None, rows: list[SampleRow]):
        self.tokens = tokens  # [B] int64, on the device: the next step may read it there
        self.rows = rows
        parts = [tokens]
        if raw_logprobs is not None:  # the sampled token's logprob and the top-N, computed now
            top_n = min(max(r.params.logprobs or 0 for r in rows), raw_logprobs.shape[1])
            top_vals, top_ids = raw_logprobs.topk(top_n, dim=-1)
            parts += [raw_logprobs.gather(1, tokens[:, None]).squeeze(1), top_vals, top_ids]
        self.host, self.event = to_host(parts)

    def ready(self) -> bool:
        """Whether collect() would return at once."""
        return self.event is None or self.event.query()

    def collect(self) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        if self.event is not None:
            self.event.synchronize()
        token_list = self.host[0].tolist()
        if len(self.host) == 1:
            return token_list, None
        chosen, top_vals, top_ids = (p.tolist() for p in self.host[1:])
        out: list[TokenLogprobs | None] = []
        for i, r in enumerate(self.rows):
            n = r.params.logprobs
            out.append(None if n is None else TokenLogprobs(chosen[i], top_ids[i][:n], top_vals[i][:n]))
        return token_list, out


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[TokenLogprobs | None] | None]:
    """logits [B, V] (any float dtype) -> (one token id per row, per-row logprobs or None when no row asked)."""
    return sample_on_device(logits, rows).collect()


def sample_on_device(logits: torch.Tensor, rows: list[SampleRow]) -> Sampled:
    """The sampling kernels for logits [B, V], launched without waiting for the device: every decision
    about which kernels to run is taken from the rows' (host) parameters."""
    logits = logits.float()
    B, V = logits.shape
    device = logits.device
    if any(r.allowed is not None for r in rows):  # (a copy: .float() of fp32 logits is the model's own tensor)
        logits = apply_allowed(logits.clone(), rows)
    raw_logprobs = logits.log_softmax(dim=-1) if any(r.params.logprobs is not None for r in rows) else None
    if any(r.params.logit_bias for r in rows):
        logits = logits.clone()
        at = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias if t < V]
        if at:
            i, t, b = zip(*at)
            logits.index_put_((to_device(i, torch.int64, device), to_device(t, torch.int64, device)),
                              to_device(b, torch.float32, device), accumulate=True)

    at = [(i, t) for i, r in enumerate(rows) if r.num_output_tokens < r.params.min_tokens
          for t in r.params.stop_token_ids if 0 <= t < V]  # min_tokens: no stop token yet
    if at:
        logits = logits.clone()
        i, t = zip(*at)
        logits.index_put_((to_device(i, torch.int64, device), to_device(t, torch.int64, device)),
                          logits.new_full((len(at),), float("-inf")))
    if any(r.params.repetition_penalty != 1.0 or r.params.frequency_penalty or r.params.presence_penalty
           for r in rows):
        logits = logits.clone()
        apply_penalties(logits, rows)

    tokens = logits.argmax(dim=-1)
    temps = [r.params.temperature for r in rows]
    if any(t >= GREEDY_EPS for t in temps):
        greedy = to_device([t < GREEDY_EPS for t in temps], torch.bool, device)
        temp = to_device([t if t >= GREEDY_EPS else 1.0 for t in temps], torch.float32, device)
        scaled = logits / temp[:, None]
        if any(r.params.min_p > 0 for r in rows):
            min_p = to_device([r.params.min_p for r in rows], torch.float32, device)
            scaled = scaled.masked_fill(min_p_mask(scaled.softmax(dim=-1), min_p), float("-inf"))
        if any(0 < r.params.top_k < V or r.params.top_p < 1.0 for r in rows):
            top_k = to_device([r.params.top_k for r in rows], torch.int64, device)
            top_p = to_device([r.params.top_p for r in rows], torch.float32, device)
            scaled = scaled.masked_fill(top_k_top_p_mask(scaled, top_k, top_p), float("-inf"))
        probs = scaled.softmax(dim=-1)
        sampled = (probs / exponential_noise(rows, (B, V), device)).argmax(dim=-1)
        tokens = torch.where(greedy, tokens, sampled)
    return Sampled(tokens, raw_logprobs, rows)
