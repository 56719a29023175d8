"""Speculative decoding in the batcher (`--speculative ngram|draft`, docs/speculative.md): drafts and how many.

Owns the n-gram (prompt lookup) proposer, the rule that picks K, the number of draft tokens a step
verifies per request, and the acceptance bookkeeping behind it; with a draft model (the worker's, which proposes
the drafts), what its work costs. Pure: no I/O, no torch.

- Proposer: the longest suffix of the request's known tokens, of prompt_lookup_max down to
  prompt_lookup_min tokens, that occurred before (its latest earlier occurrence), proposes the K tokens
  that followed it. Each request keeps an index (n-gram -> the position after its latest occurrence),
  grown as tokens are appended, so a proposal costs O(max - min + K), not a scan of the context.
- K: the step verifies K drafts for each of the B requests it decodes; with acceptance rate a a
  request gains E(K) = (1 - a^(K+1)) / (1 - a) tokens from it (the accepted drafts and the token the
  verify samples after them). The cost model prices the step: a verify is a decode row per token (the
  worker replays the decode CUDA graph with B(K+1) rows; batcher/cost_model.py, workers/runner.py),
  each reading its context. K maximises B*E(K) / step time, 0 (no
  speculation) when a plain decode step gives more tokens per ms. a is the measured rate (drafted
  tokens accepted), smoothed over steps, starting from PRIOR_ACCEPTANCE; until MIN_DRAFTS draft tokens
  were verified it counts as at least OPTIMISTIC_ACCEPTANCE (else a server whose prior says "does not
  pay" would never measure it), and a decision that comes out 0 verifies max K anyway once PROBE_EVERY such
  decisions have passed (it holds until a step verifies drafts), so a rate measured low is measured again; each
  probe that changes nothing doubles that interval, up to PROBE_MAX, and a decision that speculates resets it
  (a model whose drafts never pay stops paying for probes: each runs a step alone in flight with max K). Only
  requests that may draft now count as drafting (no penalties, ..., and prompt lookup finds a match in their known
  tokens): with none, K is 0 and async scheduling keeps two steps in flight. Before looking up anything the
  scheduler asks `hopeless`: would no K pay even if all of them drafted at the shortest context among them (a
  bound for any subset: the cost model is linear)? Then K is 0 with no prompt lookup (~4 us a request a step),
  counted as a decision; a probe that falls due when nobody has drafts waits another interval.
- Draft model: the worker's draft model proposes the drafts (protocol DraftJob), for every request that may
  draft and whose draft K/V catches up in the step (below). Its K passes cost r * (a plain decode step of those
  requests) each, r the draft's cost over the model's: first its parameter share (WorkerReady.draft_size), then
  learned from the draft time the worker reports against the same work priced with the model's cost model
  (`draft_work_ms`). A request's draft K/V is computed
  lazily: a speculating step first computes the positions its draft has not seen (a prompt, a prefix-cache hit,
  tokens decoded without speculation), at most DRAFT_CATCHUP tokens per step for all requests together, least
  lag first (Scheduler._draft_catchup); the first that does not fit decodes plainly and catches up by what is
  left. Only requests that catch up count as drafting.
"""

from __future__ import annotations

from collections.abc import Iterable

from batcher.cost_model import CostModel, attention_pairs
from laneserve.wire.protocol import DraftJob

PRIOR_ACCEPTANCE = 0.5  # the acceptance rate assumed before any draft was verified
SMOOTHING = 0.05  # weight of one step's acceptance rate in the running estimate
MIN_DRAFTS = 256  # draft tokens verified before the measured rate alone decides
OPTIMISTIC_ACCEPTANCE = 0.8
PROBE_EVERY = 64  # decisions that come out 0 before one speculates anyway (doubling after each probe ...)
PROBE_MAX = 1024  # ... up to this many)
INDEX_WINDOW = 4096  # the proposer looks up the latest tokens only (building an index costs ~0.3 us per n-gram)
INDEX_BUDGET = 1024  # token positions indexed per step, all requests together (~5 ms at most); a request whose
# index is not complete yet does not draft
DRAFT_CATCHUP = 2048  # draft-model positions computed per step past each request's input, all requests together
MIN_DRAFT_RATIO = 0.01  # the draft's cost share assumed at least (a tiny draft is launch-bound, not free)
METHODS = ("off", "ngram", "draft")


class NgramIndex:
    """One request's n-grams of n in [min_n, max_n]: n-gram -> the position right after its latest occurrence
    whose continuation is known (so the suffix itself, which has none yet, is not its own match)."""

    __slots__ = ("min_n", "max_n", "last", "done")
    # (n-grams that end more than INDEX_WINDOW tokens back are never indexed: a long context's first proposal would
    # otherwise stall the batcher's step for ~0.25 s per 32k tokens; nor matched, and dropped from `last` once it
    # holds twice the window's worth: a long generation's index grew with it)

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.last: dict[tuple[int, ...], int] = {}
        self.done = 0  # tokens indexed: every n-gram ending before this position is in `last`

    def grow(self, tokens: list[int], budget: int = 1 << 62) -> int:
        """Index up to `budget` more of the n-grams that end before the last token (those have a known next token;
        of the latest INDEX_WINDOW tokens); returns how many positions it indexed."""
        last, lo, hi = self.last, self.min_n, self.max_n
        start = max(self.done, lo, len(tokens) - INDEX_WINDOW)
        stop = min(len(tokens), start + budget)
        for end in range(start, stop):  # tokens[end-n:end], followed by tokens[end]
            for n in range(lo, min(hi, end) + 1):
                last[tuple(tokens[end - n:end])] = end
        self.done = max(self.done, stop)
        if len(last) > 2 * INDEX_WINDOW * (hi - lo + 1):  # entries from before the window dropped, now and then
            self.last = {g: at for g, at in last.items() if at >= len(tokens) - INDEX_WINDOW}  # (amortised O(1))
        return max(stop - start, 0)

    def ready(self, tokens: list[int]) -> bool:
        return self.done >= len(tokens)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix n-gram (the
        index grown to the last token first, if it was not)."""
        if k <= 0 or len(tokens) < self.min_n + 1:
            return []
        if self.done < len(tokens):
            self.grow(tokens)
        last, oldest = self.last, len(tokens) - INDEX_WINDOW
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = last.get(tuple(tokens[-n:]))
            if start is not None and oldest <= start < len(tokens):
                return tokens[start:start + k]
        return []


def expected_tokens(k: int, alpha: float) -> float:
    """Tokens a request gains from a verify of k drafts accepted each with probability alpha (in sequence)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class SpecPolicy:
    """K per step and the acceptance statistics (EngineStats: spec_steps, spec_sequences, spec_drafted,
    spec_accepted)."""

    def __init__(self, method: str, max_k: int, min_n: int, max_n: int, draft_size: float = 0.0):
        if method not in ("", *METHODS):
            raise ValueError(f"speculative must be one of {', '.join(METHODS)}, got {method!r}")
        if method in ("ngram", "draft") and not (1 <= max_k <= 16):
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {max_k}")
        if method == "ngram" and not (1 <= min_n <= max_n <= 16):
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max <= 16, got {min_n}, {max_n}")
        self.enabled = method in ("ngram", "draft")
        self.draft_model = method == "draft"
        self.draft_ratio = max(draft_size, MIN_DRAFT_RATIO)  # the draft's step cost over the model's (learned)
        self.draft_steps = 0
        self.max_k, self.min_n, self.max_n = max_k, min_n, max_n
        self.alpha = PRIOR_ACCEPTANCE
        self.steps = self.sequences = self.drafted = self.accepted = 0
        self.probing = False  # a probe was decided: K stays up until a step verifies drafts
        self.probe_every = PROBE_EVERY  # 0-decisions between probes now
        self.until_probe = PROBE_EVERY

    def index(self) -> NgramIndex:
        return NgramIndex(self.min_n, self.max_n)

    def choose_k(self, batch: int, context: int, cost: CostModel, max_rows: int, others: int = 0,
                 other_context: int = 0) -> int:
        """The K that maximises tokens per ms of a step with `batch` requests that can draft (`context` K/V tokens
        in all) and `others` that decode one token each, with at most max_rows rows (the worker's largest decode
        graph: --max-num-seqs). A step with drafts is alone in flight: it also pays the host gap (cost h), and with
        a draft model its K passes over the drafting requests."""
        if not self.enabled:
            return 0
        if batch <= 0:  # nobody can draft: not a decision; a probe that hopeless() left due waits another interval
            if self.until_probe <= 1 and not self.probing:
                self.until_probe = self.probe_every
            return 0
        top = min(self.max_k, (max_rows - others) // batch - 1)
        if top < 1:
            return 0
        if self.probing:  # a probe waits for a step that drafts
            return top
        best_k = self._best_k(top, batch, context, cost, others, other_context)
        if best_k:
            self.probe_every = self.until_probe = PROBE_EVERY
            return best_k
        self.until_probe -= 1
        if self.until_probe <= 0:
            self.probing = True
            self.until_probe = self.probe_every = min(2 * self.probe_every, PROBE_MAX)
            return top
        return 0

    def _best_k(self, top: int, batch: int, context: int, cost: CostModel, others: int, other_context: int) -> int:
        """choose_k()'s K of at most top that maximises tokens per ms, 0 if none beats a plain step (no probing)."""
        alpha = self.alpha if self.drafted >= MIN_DRAFTS else max(self.alpha, OPTIMISTIC_ACCEPTANCE)
        best_k, best = 0, (batch + others) / cost.step_ms(0, 0, batch + others, context + other_context)
        draft_pass = self.draft_ratio * cost.step_ms(0, 0, batch, context) if self.draft_model else 0.0
        for k in range(1, top + 1):
            rows, kv = batch * (k + 1) + others, (k + 1) * context + other_context
            rate = (batch * expected_tokens(k, alpha) + others) / (cost.step_ms(0, 0, rows, kv) + cost.h
                                                                   + k * draft_pass)
            if rate > best:
                best_k, best = k, rate
        return best_k

    def hopeless(self, batch: int, context: int, cost: CostModel, others: int = 0, other_context: int = 0) -> bool:
        """Would choose_k() come out 0 whichever of the `batch` requests that may draft found drafts, with no probe
        due? Then that counts as a decision that came out 0 (the scheduler skips prompt lookup, ~4 us a request per
        step, where at a large batch nothing pays; when the probe is due it looks, and if nobody has drafts the probe
        waits another interval: choose_k). context: the shortest context among them times batch. For each K, a
        subset's rate is at most the larger of a step with drafts for nobody (a plain step that also pays the host
        gap h) and all of them drafting at that context (the cost model is linear in rows and K/V read, with terms
        >= 0), so if no K up to max_k beats a plain step for the latter, none does for any subset (whatever K the
        largest graph leaves it)."""
        if not self.enabled or batch <= 0 or self.probing or self.until_probe <= 1:
            return False
        if self._best_k(self.max_k, batch, context, cost, others, other_context):
            return False
        self.until_probe -= 1
        return True

    @staticmethod
    def draft_work_ms(jobs: Iterable[DraftJob], cost: CostModel) -> float:
        """A step's draft-model work priced with the model's cost model: one forward over every job's positions,
        then one decode forward per further draft over the jobs that want it."""
        jobs = list(jobs)
        prefill = attention = rows = kv = 0
        for j in jobs:
            n = j.stop - j.start
            kv += j.stop
            if n == 1:
                rows += 1
            else:
                prefill += n
                attention += attention_pairs(n, j.start)
        ms = cost.step_ms(prefill, attention, rows, kv)
        for d in range(1, max((j.k for j in jobs), default=0)):
            live = [j for j in jobs if j.k > d]
            ms += cost.step_ms(0, 0, len(live), sum(j.stop + d for j in live))
        return ms

    def observe_draft(self, priced_ms: float, measured_ms: float) -> None:
        """A step's draft-model time against its work priced with the model's cost model (draft_work_ms)."""
        if priced_ms > 0.0 and measured_ms > 0.0:
            self.draft_steps += 1
            weight = max(SMOOTHING, 1.0 / self.draft_steps)  # the first measurements replace the parameter share
            self.draft_ratio = max(self.draft_ratio + weight * (measured_ms / priced_ms - self.draft_ratio),
                                   MIN_DRAFT_RATIO)

    def observe(self, sequences: int, drafted: int, accepted: int) -> None:
        """One step's drafts: how many requests verified how many tokens, and how many of them were accepted."""
        if drafted <= 0:
            return
        self.probing = False
        self.steps += 1
        self.sequences += sequences
        self.drafted += drafted
        self.accepted += accepted
        self.alpha += SMOOTHING * (accepted / drafted - self.alpha)
