"""SLO-driven step composition: TTFT deadlines, TPOT budgets, and the time each step may take.

Owns the per-request targets (`assign`), the order of the waiting queue (`order_waiting`: least
deadline slack first, then the shortest), the step's time allowance (`latest_step_end`: the
latest end that keeps every running request's TPOT within budget) and predictive admission
(`predicted_ttft`). The scheduler turns the allowance into prefill tokens with the step-cost
model (batcher/cost_model.py). Pure: times are the scheduler's clock (seconds), passed in.

Rules (docs/scheduling.md, "SLO scheduling"):
- TPOT is an average over a request's outputs, so a step may run long when every request it
  delays is ahead of its budget: request r, with its first token at f, m outputs once this step
  is done and a TPOT budget tau, allows this step to end by f + tau*(m-1+h) - h*t_dec, where h =
  min(outputs left, TPOT_HORIZON) tokens still to come at the decode-only step time t_dec. The
  horizon bounds how much of a long request's future a burst may borrow against.
- Waiting requests are served by (priority, starved first, feasible first, slack, uncached
  tokens): slack = deadline - (start + own prefill time); one late by more than the admission
  margin allows goes behind those that can still make it (it is a miss either way) until it is a
  whole target past its deadline (then it goes first: no starvation). Requests without a TTFT
  target keep their queue order, after those with one.
- The long-prompt gate (batcher/burst.py) may hold a prompt with a TTFT target only while it
  would still make its deadline after one more step (`may_hold`).
- Coalescing (`due`): new prefills wait in a decode-only step for company while each would still
  start before COALESCE_FRACTION of its target is used.
- Decode pausing (`--slo-pause-decodes`, on): while a waiting prompt, served in order, would miss its TTFT
  deadline (late ones too: their TTFT still counts), a decoding request sits a step out, leaving it to the
  prompts, if at PAUSE_SHARE of its TPOT budget (latest_step_end's rule) its next token could still come
  PAUSE_STEPS full steps later; at least --min-active-decodes run, those with the least slack first (`pausable`).
  TGI's prefill-first batching pauses decodes the same way, on a waiting-token ratio rather than on budgets.
- Admission (`--slo-admission reject`): a request whose predicted TTFT, behind the running
  prefills and everything waiting of its priority or better, exceeds ADMISSION_MARGIN x its
  target is shed at once (retryable); one whose own prefill alone would exceed it is served.
"""

from __future__ import annotations

import math
from typing import Iterable

from batcher.config import BatcherConfig
from batcher.cost_model import CostModel
from batcher.request import Request
from laneserve.sampling import check_slo_target

TPOT_HORIZON = 64  # outputs ahead a step may borrow TPOT slack against
ADMISSION_MARGIN = 1.25  # shed when the predicted TTFT exceeds this x the target
MIN_PREFILL_TOKENS = 2048  # prefill tokens a step may take whatever the TPOT slack: the default budget (no worse)
MAX_LEAD_MS = 1000  # --schedule-lead-ms
COALESCE_FRACTION = 0.25  # new prefills may wait for company until this share of their TTFT target is used
PAUSE_STEPS = 3  # a decode sits a step out only if its next token may still come this many full steps later
PAUSE_SHARE = 0.9  # of its TPOT budget (the rest: a margin for the predictions)


def prefill_s(r: Request, uncached: int, cost: CostModel, overhead_per_token: float) -> float:
    """Predicted seconds of r's prefill of `uncached` tokens after its cached ones, with the decode work those
    tokens' steps carry (overhead_per_token ms each)."""
    return (cost.chunk_ms(uncached, r.compute_target - uncached) + uncached * overhead_per_token) / 1000.0


class SloPolicy:
    def __init__(self, cfg: BatcherConfig):
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            why = check_slo_target(name, getattr(cfg, name))
            if why:
                raise ValueError(why)
        lead = cfg.schedule_lead_ms
        if isinstance(lead, bool) or not isinstance(lead, (int, float)) or not 0 <= lead <= MAX_LEAD_MS:
            raise ValueError(f"schedule_lead_ms must be a number of milliseconds from 0 to {MAX_LEAD_MS}, got {lead!r}")
        if cfg.slo_admission not in ("off", "reject"):
            raise ValueError(f"slo_admission must be 'off' or 'reject', got {cfg.slo_admission!r}")
        self.ttft = cfg.slo_ttft_ms / 1000.0
        self.tpot = cfg.slo_tpot_ms / 1000.0
        self.reject = cfg.slo_admission == "reject"
        self.enabled = bool(self.ttft or self.tpot)  # some request may still bring its own targets
        self.shed = 0  # requests refused by predictive admission
        self.behind = False  # order_waiting's: a waiting request will miss its deadline

    def assign(self, req: Request, priority: int, ttft_ms: float, tpot_ms: float, now: float | None) -> None:
        """A request's targets: its own (ms, 0 = the server's) or the server's; its deadline once `now` is known."""
        req.priority = priority
        ttft = ttft_ms / 1000.0 if ttft_ms else self.ttft
        req.tpot = tpot_ms / 1000.0 if tpot_ms else self.tpot
        if ttft_ms or tpot_ms:
            self.enabled = True
        req.deadline = ttft if ttft else None  # relative until stamped
        if now is not None:
            self.stamp(req, now)

    @staticmethod
    def stamp(req: Request, now: float) -> None:
        """Make the deadline absolute: the request arrived at `now` (scheduler clock)."""
        req.arrived_at = now
        if req.deadline is not None:
            req.deadline += now

    @staticmethod
    def next_token_by(r: Request, decode_step_s: float, share: float = 1.0) -> float:
        """The latest time r's next token may come with its TPOT inside `share` of its budget, its later tokens
        at decode_step_s each (inf: it has no budget, or no first token yet)."""
        tpot, f = r.tpot, r.first_token_at
        if not tpot or f is None:
            return math.inf
        m = len(r.token_ids) - r.num_prompt_tokens + r.num_output_placeholders
        h = r.max_num_tokens - len(r.token_ids) - r.num_output_placeholders
        if h > TPOT_HORIZON:
            h = TPOT_HORIZON
        return f + share * tpot * (m - 1 + h) - h * decode_step_s

    @staticmethod
    def latest_step_end(decodes: Iterable[Request], decode_step_s: float) -> float:
        """The latest end of the step being composed that keeps every decoding request's TPOT within budget
        (inf: none has a budget, or none has its first token yet)."""
        by = SloPolicy.next_token_by
        return min((by(r, decode_step_s) for r in decodes), default=math.inf)

    @staticmethod
    def pausable(decodes: list[Request], until: float, decode_step_s: float, keep: int
                 ) -> tuple[list[Request], list[Request]]:
        """The decodes that run in a step composed while waiting prompts would miss their deadlines, and those
        that sit it out, each in their order. They run: those whose next token, at PAUSE_SHARE of their TPOT
        budget, is due before `until`, those with no budget to measure against (no TPOT target, or no first token
        yet: never paused), and at least `keep` (the least slack first). None sits out: (decodes, [])."""
        by = SloPolicy.next_token_by
        due = [by(r, decode_step_s, PAUSE_SHARE) for r in decodes]
        idle = [i for i, t in enumerate(due) if until < t < math.inf]
        short = keep - (len(decodes) - len(idle))
        if short > 0:  # the floor: the idle ones with the least slack run too
            idle.sort(key=due.__getitem__)
            idle = idle[short:]
        if not idle:
            return decodes, []
        skip = set(idle)
        return [r for i, r in enumerate(decodes) if i not in skip], [decodes[i] for i in sorted(idle)]

    def order_waiting(self, waiting: list[Request], start: float, cost: CostModel, overhead_per_token: float
                      ) -> bool:
        """Sort `waiting` (in place) for service; True if, served in that order from `start`, one of them that
        can still make its deadline misses it: the queue is under pressure (the long-prompt gate closes).
        Sets `behind`: one of them misses it, late ones included (decode pausing)."""
        def own_s(r: Request) -> float:
            return prefill_s(r, r.uncached_estimate, cost, overhead_per_token)

        keys = {}
        for r in waiting:
            d = r.deadline
            if r.internal:  # warm prefixes (start-up only) stay first
                keys[r.request_id] = (-math.inf,)
                continue
            if d is None:  # no TTFT target: after those with one that can still make it, in queue order
                keys[r.request_id] = (r.priority, 1, 0, math.inf, 0)
                continue
            target = d - r.arrived_at
            slack = d - start - own_s(r)
            # Late by more than admission tolerates: behind those that can still make it, until it is a whole
            # target past its deadline (then first: waiting twice its target is the longest anyone waits).
            late = slack < -(ADMISSION_MARGIN - 1.0) * target
            starved = r.num_preemptions > 0 or start - d > target
            keys[r.request_id] = (r.priority, not starved, late, slack if not starved else d, r.uncached_estimate)
        waiting.sort(key=lambda r: keys[r.request_id])
        t = start
        self.behind = False
        for r in waiting:
            t += own_s(r)
            if r.deadline is not None and t > r.deadline:
                self.behind = True
                if not keys[r.request_id][2]:
                    return True
        return False

    @staticmethod
    def may_hold(req: Request, start: float, cost: CostModel, overhead_per_token: float, step_s: float) -> bool:
        """May the long-prompt gate hold req for another step? Only while it would still make its deadline
        after one (always, for a request without a TTFT target: the gate's own time limit applies)."""
        d = req.deadline
        return d is None or start + step_s + prefill_s(req, req.uncached_estimate, cost, overhead_per_token) < d

    @staticmethod
    def due(waiting: Iterable[Request], start: float, cost: CostModel, decode_step_ms: float, decodes: int,
            budget: int) -> bool:
        """Must waiting prefills start in the step being composed (a decode-only one so far)? Yes when one has no
        TTFT target, when they fill the step's token budget, or when one of them, waiting through one more
        decode-only step, would start after COALESCE_FRACTION of its target: their first tokens then come
        back well inside the target while steps with a prefill, each paying the eager-step cost (mixed_ms of the
        step's decodes), stay few."""
        total = 0
        ms = cost.mixed_ms(decodes)
        earliest = math.inf
        for r in waiting:
            if r.internal or r.deadline is None or r.arrived_at is None:
                return True
            u = r.uncached_estimate
            total += u
            ms += 1000.0 * prefill_s(r, u, cost, 0.0)
            due = r.arrived_at + COALESCE_FRACTION * (r.deadline - r.arrived_at)
            if due < earliest:
                earliest = due
        if total >= budget:
            return True
        return start + (decode_step_ms + ms) / 1000.0 > earliest

    @staticmethod
    def predicted_ttft(req: Request, waiting: Iterable[Request], running: Iterable[Request], start: float,
                       now: float, cost: CostModel, overhead_per_token: float) -> tuple[float, float]:
        """When req's first token would come back (seconds from now): served after the prefills of the running
        requests and of every waiting request of its priority or better; and its own prefill alone."""
        t = start
        for r in running:
            left = r.compute_target - r.num_computed_tokens
            if left > 1:
                t += prefill_s(r, left, cost, overhead_per_token)
        for r in waiting:
            if r.priority <= req.priority:
                t += prefill_s(r, r.admission_uncached, cost, overhead_per_token)
        alone = (cost.a + cost.mixed_ms(0)) / 1000.0 + prefill_s(req, req.admission_uncached, cost, overhead_per_token)
        return t - now + alone, alone
