"""The scheduling policy of one worker: what runs in the next step, and what a step's output means.

Owns the waiting queue and the running set of one worker, its KV block pool
(batcher/block_manager.py) and the policies: token budget and sequence cap,
decodes first then chunked prefill, decode buckets, burst gating
(batcher/burst.py), watermark admission, preemption by recompute, stop checks,
and the order of the steps in flight: async scheduling schedules up to
`max_inflight_steps` steps before their outputs come back; `update()` takes the
oldest one's (it raises StepOrderError on any other, and drops the outputs of
the steps that `fail_all()` made void). With `--lanes streams` (docs/lanes.md) steps come in two
lanes, decode-only and prefill-only, that the worker runs at once: up to max_inflight_steps decode
steps and one prefill step in flight, outputs in order within each lane; a request is never in
both lanes' steps in flight, and a freed block a step in flight may still write is held until
that step is done (batcher/block_manager.py). Pure: no I/O (except reading the
--warm-prefix file once at construction), no asyncio, time is passed in. Must
not know about sockets or the simulator. Policy choices: docs/scheduling.md.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from typing import Callable, Iterable

import msgspec

from batcher.block_manager import BlockManager
from batcher.burst import LongPromptGate
from batcher.config import BatcherConfig, load_warm_prefixes, parse_buckets
from batcher.cost_model import (MAX_STEP_MS, CostModel, Features, OnlineCostFit, attention_pairs, default_cost_model,
                                 learned_ms)
from batcher.grammar import GrammarError, Grammars, follow
from batcher.request import Request, Status, blocks_for
from batcher.slo import ADMISSION_MARGIN, MIN_PREFILL_TOKENS, PAUSE_STEPS, SloPolicy
from batcher.spec import DRAFT_CATCHUP, INDEX_BUDGET, SpecPolicy
from laneserve.wire.protocol import (ITERATION_TOKENS_BUCKETS, LANE_DECODE, LANE_MIXED, LANE_PREFILL, AddRequest,
                                     CachedReq, DraftJob, EngineStats, FinishReason, NewReq, SamplingParams, StepInput,
                                     StepOutput, TokenDelta)

WARM_PREFIX_ID = "__warm__/"  # internal requests that fill the warm prefix pool
MAX_STEP_S = MAX_STEP_MS / 1000.0  # a launch or idle time above this is not counted (a stall, or a bogus figure)
QUEUED, TURNAROUND = 1, 2  # how a step in flight was scheduled: behind another of its lane; on an output, alone
MAX_INFLIGHT_STEPS = 2  # with --async-scheduling: the worker runs one step while the next one waits in its socket
LANES = ("auto", "mixed", "streams")  # BatcherConfig.lanes
_WARM_PARAMS = SamplingParams(max_tokens=1)
_RUNNING = Status.RUNNING  # (read in the decode loop)


class Scheduled(msgspec.Struct, frozen=True, gc=False):
    """What one step in flight does to one request, checked against the request when the step's output comes back.

    Up to 256 per step, built and read in the hot paths: a msgspec Struct is built in C and its fields read like
    slots, a little dearer than a plain tuple, while a NamedTuple (a tuple subclass built by a Python __new__,
    unpacked through the iterator protocol) made schedule() + update() of 256 decodes ~11% slower. gc=False: it
    refers to a Request, which never refers back, so it is never part of a reference cycle."""

    req: Request
    num_tokens: int  # tokens computed in this step
    done: int  # its num_computed_tokens once this step is done
    samples: bool  # whether the worker samples a token for it in this step
    epoch: int  # its epoch when scheduled: the step is void for it once it is preempted or finished


def step_features(flight: list[Scheduled], drafts: dict[str, list[int]] | None = None) -> Features:
    """A step's cost-model terms (batcher/cost_model.py): prefill tokens, the token pairs their attention
    computes (each token over the context before its chunk and the chunk's tokens before it), decode rows (one
    token onto computed ones), K/V tokens read, whether it has any prefill. A request verifying drafts is decode
    rows, one per token (as the worker runs it: workers/runner.py)."""
    prefill = attention = decodes = kv = 0
    if drafts:
        spec = [rec for rec in flight if rec.req.request_id in drafts]
        flight = [rec for rec in flight if rec.req.request_id not in drafts]
        for rec in spec:
            decodes += rec.num_tokens
            kv += rec.num_tokens * rec.done
    for rec in flight:
        n, done = rec.num_tokens, rec.done
        kv += done
        if n == 1 and done != 1:  # done == 1: a one-token prompt
            decodes += 1
        else:
            prefill += n
            attention += attention_pairs(n, done - n)
    return prefill, attention, decodes, kv, 1 if prefill else 0


class InFlight(msgspec.Struct, gc=False):
    """A step sent to the worker whose output has not come back."""

    step: int
    records: list[Scheduled]
    features: Features  # its cost-model terms
    predicted: float  # its predicted time, ms
    lane: int
    drafts: dict | None  # request id -> its draft tokens, for the steps that verify drafts
    wait: int  # QUEUED, TURNAROUND or 0: how the worker was to wait for it
    draft_priced: float = 0.0  # its draft-model work priced with the model's cost model (draft_work_ms), ms


class StepOrderError(ValueError):
    """update() got the output of another step than the oldest in flight (nor a void one): the order is broken,
    the worker's K/V state unknown, so the caller fails all its requests (fail_all(str(exc)))."""


class StepFailed(Exception):
    """The worker failed the step (StepOutput.error): update() consumed it without applying it. The worker's K/V
    state is unknown, so the caller fails all its requests (fail_all(str(exc)))."""


class Scheduler:
    def __init__(self, cfg: BatcherConfig, num_blocks: int, block_size: int, max_model_len: int,
                 warm_prefixes: list[list[int]] | None = None, cost: CostModel | None = None,
                 grammars: Grammars | None = None, draft_size: float = 0.0):
        """draft_size: --speculative draft, the worker's draft model's parameters over its model's."""
        self.cfg = cfg
        self.grammars = grammars  # the token masks of constrained requests (structured output)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        self.buckets = parse_buckets(cfg.decode_buckets)
        self.lanes: list[list[Request]] = [[] for _ in range(len(self.buckets) + 1)]  # _run_order()'s, kept empty
        self.watermark_blocks = int(cfg.watermark * num_blocks)
        self.max_len = max_model_len
        if cfg.max_active_blocks > 0:
            self.max_len = min(max_model_len, cfg.max_active_blocks * block_size)
        if warm_prefixes is None:
            warm_prefixes = load_warm_prefixes(cfg.warm_prefix) if cfg.warm_prefix else []
        self.warm_prefixes = warm_prefixes
        self.max_inflight_steps = MAX_INFLIGHT_STEPS if cfg.async_scheduling else 1
        self.lead = cfg.schedule_lead_ms / 1000.0  # --schedule-lead-ms (s)
        # schedule() returned None to compose late (--schedule-lead-ms): call it again at this time (None: when a
        # step's output or a request comes)
        self.wake_at: float | None = None
        if cfg.lanes not in LANES:
            raise ValueError(f"lanes must be one of {', '.join(LANES)}, got {cfg.lanes!r}")
        self.streams = cfg.lanes == "streams"  # auto: the batcher asks the worker; without one (simulator) mixed
        self.prefill_lane = LANE_PREFILL if self.streams else LANE_MIXED  # the lane prompts are computed in
        self.step_no = 0  # these survive fail_all()
        self.void: set[int] = set()  # steps that were in flight at a fail_all(): update() drops their outputs
        # two lanes, after a fail_all the batcher itself decided (the worker did not fail): the void steps the worker
        # still runs on its other stream write blocks the fresh pool could hand out again; no step until they are back
        self.fence: set[int] = set()
        self.grown: list[Request] = []  # running requests given blocks in the step being composed (schedule() sends)
        self.slo = SloPolicy(cfg)
        self.spec = SpecPolicy(cfg.speculative, cfg.num_speculative_tokens, cfg.prompt_lookup_min,
                               cfg.prompt_lookup_max, draft_size)
        self.spec_k = 0  # draft tokens per request in the step being composed (0: no speculation)
        # its drafts, for its StepInput: request id -> the draft tokens (ngram) or its DraftJob (a draft model)
        self.drafts: dict[str, list[int] | DraftJob] = {}
        self.catchup: dict[str, int] = {}  # --speculative draft: _draft_catchup() for the step being composed
        self.proposals: dict[str, list[int]] = {}  # --speculative ngram: _choose_k()'s drafts, up to max K each
        # The step-cost model (cost, else --cost-model, else the shipped fit), learned online from the worker.
        self.fit = OnlineCostFit(cost or CostModel.load(cfg.cost_model or default_cost_model(cfg.lanes)))
        self.decode_part_ms = 0.0  # the last composed step's cost without its prefills
        self.step_decodes = 0  # and its decodes
        self.time_left: float | None = None  # ms of prefill the step being composed may still take (None: no cap)
        self.floor_left = 0  # prefill tokens it takes even past time_left
        self.mixed_paid = False  # it has a prefill already (so it runs eagerly: cost model's mixed_ms)
        self.admit_counter = 0
        self.preemptions = 0
        self.gated_prefills = 0
        self.paused_decodes = 0  # decode rows that sat a step out for waiting prompts (SLO decode pausing)
        self.paused: list[Request] = []  # those of the step being composed (_pause; _unpause)
        self.iteration_tokens = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)  # steps by tokens: EngineStats
        self.iteration_tokens_sum = 0
        self.bubble_ms = 0.0  # EngineStats.pipeline_bubble_ms
        self.eager_steps, self.eager_launch_ms, self.eager_step_ms = 0, 0.0, 0.0  # EngineStats' likewise
        self._reset()

    def _reset(self) -> None:
        self.bm = BlockManager(self.num_blocks, self.block_size, self.cfg.enable_prefix_caching)
        self.gate = LongPromptGate(self.cfg)
        self.requests: dict[str, Request] = {}  # everything held: waiting or running
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}  # insertion order = admission order
        self.finished_ids: list[str] = []  # for the next StepInput: the worker drops their state
        self.pending: list[TokenDelta] = []  # deltas made outside update() (rejections), sent with the next
        self.in_flight: deque[InFlight] = deque()  # oldest first
        self.on_output = False  # a step's output was applied since the last schedule()
        self.late = False  # ... and it came while a late composition was due (wake_at): before its step was sent
        self.busy = [0.0, 0.0, 0.0]  # per lane: when the worker is predicted to be done with its steps in flight
        self.new_arrivals = 0
        self.num_internal = 0
        self.num_constrained = 0  # requests held that follow a grammar
        # lanes whose last step left a running request waiting for held blocks (_make_room): until it has them,
        # no admissions, which would take them first (two lanes: a prefill step is composed before a decode step)
        self.awaiting_held: set[int] = set()
        self.composing = LANE_MIXED  # the lane of the step being composed
        self._queue_warm_prefixes()

    @property
    def busy_until(self) -> float:
        """When the worker is predicted to be done with the steps in flight of the lane prompts are computed in."""
        return self.busy[self.prefill_lane]

    # ------------------------------------------------------------------ intake
    def reject_reason(self, msg: AddRequest) -> str | None:
        """Why this request can never run here (None: it can). The batcher answers such a request
        with Rejected before add_request; add_request still guards with an ERROR delta."""
        n = len(msg.prompt_token_ids)
        why = None
        if n == 0:
            why = "empty prompt"
        elif n > self.max_len:
            limit = "max_model_len" if self.max_len == self.max_model_len else "max_active_blocks"
            why = f"prompt of {n} tokens exceeds the context limit of {self.max_len} ({limit})"
        elif blocks_for(n, self.block_size) > self.bm.num_usable:
            why = f"prompt of {n} tokens needs more KV blocks than the pool has ({self.bm.num_usable})"
        elif msg.request_id in self.requests:
            why = "duplicate request id"
        return why

    def add_request(self, msg: AddRequest, now: float | None = None, grammar=None,
                    received: float | None = None) -> str | None:
        """Queue a request that arrived at `now` (this scheduler's clock; None: the next schedule()'s), following
        `grammar` (an llguidance matcher at its tokens so far: batcher/grammar.py) if given; `received`: when the
        batcher got it, if earlier (its grammar compiled meanwhile), where its queue time starts. Returns why it was
        shed instead (retryable: predictive SLO admission), else None."""
        why = self.reject_reason(msg)
        if why is not None:
            self.pending.append(TokenDelta(msg.request_id, [], FinishReason.ERROR, error=why))
            return None
        req = Request(msg.request_id, msg.prompt_token_ids, msg.params, msg.arrival_time, self.max_len)
        req.speculative = msg.speculative
        req.received_at = received
        self.slo.assign(req, msg.priority, msg.slo_ttft_ms, msg.slo_tpot_ms, now)
        if self.slo.reject and req.deadline is not None and now is not None:
            req.admission_uncached = req.compute_target - self._hit_blocks(req) * self.block_size
            ttft, alone = self.slo.predicted_ttft(req, self.waiting, self.running.values(),
                                                  max(now, self.busy_until), now, self.fit.model,
                                                  self._overhead_per_token())
            limit = (req.deadline - now) * ADMISSION_MARGIN
            if ttft > limit and alone <= limit:  # the queue makes it late (alone, a retry would not help)
                self.slo.shed += 1
                return (f"predicted time to first token {ttft * 1000:.0f} ms exceeds {ADMISSION_MARGIN}x the "
                        f"target of {(req.deadline - now) * 1000:.0f} ms: the server is at its SLO capacity")
        self.requests[req.request_id] = req
        if grammar is not None:
            req.grammar = grammar
            req.stop_check_from = 0  # every token it samples goes through _append_tokens (the grammar)
            self.num_constrained += 1
        waiting = self.waiting
        if waiting and req.priority < waiting[-1].priority:  # behind the last one of its priority or better
            i = len(waiting)
            while i and waiting[i - 1].priority > req.priority and not waiting[i - 1].internal:
                i -= 1
            waiting.insert(i, req)
        else:
            waiting.append(req)
        self.new_arrivals += 1
        return None

    def _hit_blocks(self, req: Request) -> int:
        """The leading blocks of req the prefix cache holds now."""
        # a request scoring its prompt computes all of it: a cached block's positions would go unscored
        return self.bm.lookup(req) if req.params.prompt_logprobs is None else 0

    def _queue_warm_prefixes(self) -> None:
        """Warm prefixes are normal prefills of internal requests, first in line; see _finish_warm. One longer than
        the context (with the sentinel token) is cut to the full blocks that fit. None without prefix caching (the
        batcher's config refuses that pair): nothing would find them. Together they pin at most half the pool (each
        checked alone, two of half the pool each once pinned all of it, and every user request was refused)."""
        pinned = 0
        for i, ids in enumerate(self.warm_prefixes if self.bm.enable_prefix_caching else ()):
            full = min(len(ids), self.max_len - 1) // self.block_size * self.block_size
            blocks = blocks_for(full, self.block_size)
            if full == 0 or pinned + blocks > self.bm.num_usable // 2:
                continue  # nothing cacheable, or it would crowd out the traffic it is meant to speed up
            pinned += blocks
            # The sentinel last token is never computed, so the worker never samples for it.
            req = Request(f"{WARM_PREFIX_ID}{i}", ids[:full] + [0], _WARM_PARAMS, internal=True)
            self.requests[req.request_id] = req
            self.waiting.append(req)
            self.num_internal += 1

    def abort_requests(self, ids: Iterable[str]) -> list[TokenDelta]:
        deltas = []
        for rid in ids:
            req = self.requests.get(rid)
            if req is None or req.internal:
                continue
            if req.status == Status.WAITING:
                self.waiting.remove(req)
                del self.requests[rid]
                req.status = Status.FINISHED
                self.num_constrained -= req.grammar is not None
            else:
                self._finish(req)
            deltas.append(TokenDelta(rid, [], FinishReason.ABORT))
        return deltas

    def fail_all(self, error: str, worker_failed: bool = True) -> list[TokenDelta]:
        """ERROR deltas for every request held, and a fresh state; the steps in flight become void. worker_failed
        False (the batcher found the output wrong, the worker carries on): with two lanes no new step is composed
        until the void ones are back (fence). When the worker failed a step it abandoned the others, its streams
        synchronised, and sends nothing more for them."""
        deltas = self.pending
        deltas += [TokenDelta(rid, [], FinishReason.ERROR, error=error)
                   for rid, r in self.requests.items() if not r.internal]
        on_worker = [rid for rid, r in self.requests.items() if r.on_worker] + self.finished_ids
        queries, hits = self.bm.queries, self.bm.hits
        self.void.update(entry.step for entry in self.in_flight)
        if self.streams and not worker_failed:
            self.fence = {entry.step for entry in self.in_flight}
        self._reset()
        # the worker's K/V can't be trusted any more: the prefix cache goes too (its counters stay)
        self.bm.queries, self.bm.hits = queries, hits
        self.finished_ids = on_worker
        return deltas

    # ------------------------------------------------------------------ one step
    def schedule(self, now: float) -> StepInput | None:
        """The next step, or None: nothing to run, or max_inflight_steps already in flight."""
        step = self._next_step(now)
        if step is None:
            return None
        flight, num_running = step
        num_scheduled = {rec.req.request_id: rec.num_tokens for rec in flight}
        n = sum(num_scheduled.values())
        if n:  # (a step of none only tells the worker which requests finished)
            self.iteration_tokens[bisect_left(ITERATION_TOKENS_BUCKETS, n)] += 1
            self.iteration_tokens_sum += n
        cached_reqs = []
        for req in self.grown:  # running ones that got blocks for this step: the worker gets those
            blocks = req.block_ids
            cached_reqs.append(CachedReq(req.request_id, blocks[req.num_sent_blocks:]))
            req.num_sent_blocks = len(blocks)
        new_reqs = []
        for rec in flight[num_running:]:  # admitted in this step: the worker gets their whole state
            req = rec.req
            new_reqs.append(NewReq(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                                   params=req.params, block_ids=list(req.block_ids),
                                   num_computed_tokens=rec.done - rec.num_tokens,
                                   output_token_ids=req.output_token_ids))
            req.num_sent_blocks = len(req.block_ids)
        finished, self.finished_ids = self.finished_ids, []
        allowed = {}
        if self.num_constrained:  # the tokens each constrained request that samples in this step may take
            constrained = [rec.req for rec in flight if rec.samples and rec.req.grammar is not None]
            if constrained:
                masks = self.grammars.masks([req.grammar for req in constrained])
                allowed = {req.request_id: mask for req, mask in zip(constrained, masks)}
        drafts = self.in_flight[-1].drafts or {}
        by_model = self.spec.draft_model
        return StepInput(step=self.step_no, new_reqs=new_reqs, cached_reqs=cached_reqs,
                         num_scheduled_tokens=num_scheduled, finished_req_ids=finished, lane=self.in_flight[-1].lane,
                         spec_token_ids={} if by_model else drafts, draft_jobs=drafts if by_model else {},
                         allowed_token_ids=allowed)

    def _next_step(self, now: float) -> tuple[list[Scheduled], int] | None:
        """Decide the next step and commit it (in_flight, and each request's state); returns its requests in run
        order, admissions last, and how many come before the admissions. None: no step. With two lanes: a
        prefill step when none is in flight and there is prefill work, else a decode step when fewer than
        max_inflight_steps are in flight. A step that speculates is the only one in flight of its lane: its
        drafts come from the tokens known, and what it accepts decides where the next one starts. With
        --schedule-lead-ms (mixed lane), a step that would queue behind one in flight is composed no earlier than
        `lead` before that one's predicted end: before then, None with wake_at set."""
        limit = self.max_inflight_steps
        self.wake_at = None
        # how the worker waits for a step composed now with none in flight (see _compose): for the host's turn-around
        # after the output just applied, or, if that output came before a late composition was due, for the lead
        after = (QUEUED if self.late else TURNAROUND) if self.on_output else 0
        self.on_output = self.late = False
        if self.spec.enabled:
            if not self.streams and (len(self.in_flight) >= limit or any(e.drafts for e in self.in_flight)):
                return None  # no step either way (a step with drafts is alone in flight): K need not be chosen
            self.spec_k = self._choose_k()
            if self.spec_k or any(e.drafts for e in self.in_flight):  # (two lanes: a step with drafts is alone)
                limit = 1
        if self.fence:
            self.fence &= self.void
            if self.fence:
                return None
        if not self.streams:
            if len(self.in_flight) >= limit:
                return None
            if self.in_flight and self.lead:  # late composition: arrivals until then join this step
                compose_at = self.busy[LANE_MIXED] - self.lead
                if now < compose_at:
                    self.wake_at = compose_at
                    return None
            return self._compose(now, LANE_MIXED, after)
        decoding = sum(1 for entry in self.in_flight if entry.lane == LANE_DECODE)
        if decoding == len(self.in_flight):  # no prefill step in flight
            step = self._compose(now, LANE_PREFILL, after)
            if step is not None:
                return step
        if decoding < limit:
            return self._compose(now, LANE_DECODE, after)
        return None

    def _choose_k(self) -> int:
        """Draft tokens per request for the next step (batcher/spec.py): from the decoding requests that may draft
        (prompt lookup finds a match in their tokens known now) and the others. 0 when none may draft: then async
        scheduling keeps its two steps in flight. 0 too while prompts wait or prefill: drafts spend compute that
        is spare only when the step is all decodes, and a step with drafts is alone in flight, which would also
        slow the prefills (measured on the H200: with drafts in such steps the bursty replay's TTFT p95 rose
        13-24% at 16-24 req/s)."""
        drafters = draft_context = 0
        proposals = self.proposals = {}
        if self.waiting or len(self.running) * 2 > self.cfg.max_num_seqs:  # (no K >= 1 fits the largest graph)
            return 0
        may_draft, shortest, total = [], 1 << 62, 0
        for r in self.running.values():
            if len(r.token_ids) + r.num_output_placeholders - r.num_computed_tokens > 1:  # (re)computing a prompt
                return 0
            total += r.num_computed_tokens
            if self._may_draft(r):
                may_draft.append(r)
                shortest = min(shortest, r.num_computed_tokens)
        by_model = self.spec.draft_model  # a draft model drafts for every request whose draft K/V catches up
        m = len(may_draft)
        # prompt lookup only where drafts could pay (SpecPolicy.hopeless: a bound over every subset of may_draft)
        if not by_model and self.spec.hopeless(m, m * shortest, self.fit.model, len(self.running) - m,
                                               total - m * shortest):
            return 0
        if by_model:
            self.catchup = self._draft_catchup()
        budget = INDEX_BUDGET  # (a long context's index is built over several steps)
        max_k = self.spec.max_k
        for r in may_draft:
            if by_model:
                drafts = self.catchup.get(r.request_id) == r.num_computed_tokens + 1
            else:
                if budget > 0:
                    budget -= r.ngrams.grow(r.token_ids, budget)
                drafts = r.ngrams.ready(r.token_ids) and r.ngrams.propose(r.token_ids, max_k)
                if drafts:
                    proposals[r.request_id] = drafts
            if drafts:
                drafters += 1
                draft_context += r.num_computed_tokens
        if by_model and not drafters and self.catchup:
            # none caught up: priced as if those catching up had (their catch-up runs in steps with K > 0 only, so a
            # prompt lagging more than DRAFT_CATCHUP behind never drafted unless another request did)
            caught = [r for r in may_draft if r.request_id in self.catchup]
            drafters, draft_context = len(caught), sum(r.num_computed_tokens for r in caught)
        others = len(self.running) - drafters
        other_context = total - draft_context
        return self.spec.choose_k(drafters, draft_context, self.fit.model, self.cfg.max_num_seqs, others,
                                  other_context)

    def _draft_catchup(self) -> dict[str, int]:
        """--speculative draft: request id -> where the draft model's K/V computation of it stops in the next step
        (batcher/spec.py), for the running requests that may draft: its input's position + 1 when its lag fits the
        step's allowance (DRAFT_CATCHUP positions for all; least lag first), so it drafts; else what is left of the
        allowance, for the first one that does not fit (it decodes one token and catches up by that much)."""
        plan, left = {}, DRAFT_CATCHUP
        for r in sorted((r for r in self.running.values() if self._may_draft(r)),
                        key=lambda r: r.num_computed_tokens - r.draft_done):
            behind = r.num_computed_tokens - r.draft_done
            if behind <= left:
                plan[r.request_id] = r.num_computed_tokens + 1
                left -= behind
            elif left:
                plan[r.request_id] = r.draft_done + left
                left = 0
        return plan

    def _may_draft(self, req: Request) -> bool:
        """Not opted out, no grammar, penalty or logprobs, min_tokens reached (a verify samples each position as
        decoding would, with nothing that depends on the tokens before it in the same step); ngram: makes its
        n-gram index the first time."""
        p = req.params
        if (req.internal or not req.speculative or req.grammar is not None or p.logprobs is not None
                or not p.max_tokens or p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
                or len(req.token_ids) - req.num_prompt_tokens < p.min_tokens):
            return False
        if req.ngrams is None and not self.spec.draft_model:
            req.ngrams = self.spec.index()
        return True

    def _compose(self, now: float, lane: int, after: int) -> tuple[list[Scheduled], int] | None:
        """_next_step() for one lane; after: how the worker waits for it if none is in flight (QUEUED, TURNAROUND
        or 0: _next_step)."""
        if self.new_arrivals:  # stamped with the clock of the first schedule() that sees them
            self.gate.detector.arrived(now, self.new_arrivals)
            self.new_arrivals = 0
        busy = self.busy[lane]
        if busy > now:  # when this step will start on the worker
            start = busy
        else:  # with none in flight, after the host's turn-around (two lanes: hidden by the other lane)
            start = now + (self.fit.model.h / 1000.0 if lane == LANE_MIXED else 0.0)
        budget = self.cfg.max_num_batched_tokens
        flight: list[Scheduled] = []
        self.grown.clear()
        self.awaiting_held.discard(lane)
        self.composing = lane
        ordered = self.slo.enabled and bool(self.waiting) and lane != LANE_DECODE
        if ordered:  # and the queue's pressure known before the decodes are in (decode pausing)
            self._order_waiting(now, start)
        pause = ordered and self.slo.behind and lane == LANE_MIXED and self.cfg.slo_pause_decodes
        budget, active, preempted = self._schedule_running(flight, budget, start, lane, pause)
        num_running = len(flight)
        # admitting while evicting, or while a running request waits for blocks, would just thrash
        if self.waiting and not preempted and not self.awaiting_held and lane != LANE_DECODE:
            # The gate's burst state, asked for only here (scheduling the running ones left the queue as it was).
            self.gate.detector.observe(now, len(self.waiting) - self.num_internal)
            if not self.slo.enabled:
                self._admit_waiting(now, start, flight, budget, active)
            else:
                # Coalescing: a step with no prefill replays a CUDA graph, one with any prefill runs eagerly
                # (cost model's mixed_ms), so new prefills wait for company while their deadlines allow.
                if self.mixed_paid or not num_running or self.slo.due(self.waiting, start, self.fit.model,
                                                                      self.decode_part_ms, self.step_decodes, budget):
                    self._admit_waiting(now, start, flight, budget, active)
        if self.paused:
            back = self._unpause(flight)
            flight[num_running:num_running] = back  # running requests' records before the admitted ones'
            num_running += len(back)
        # An empty step carries finished ids to the worker, or error deltas back through update() (a step
        # already in flight brings those back anyway); with two lanes a decode step does.
        if not flight and (lane == LANE_PREFILL or not self.finished_ids and (not self.pending or self.in_flight)):
            return None
        self.step_no += 1
        features = step_features(flight, self.drafts)
        predicted = self.fit.model.step_ms(*features)
        draft_priced = 0.0
        if self.drafts and self.spec.draft_model:  # and the draft model's passes
            draft_priced = self.spec.draft_work_ms(self.drafts.values(), self.fit.model)
            predicted += self.spec.draft_ratio * draft_priced
        self.busy[lane] = start + predicted / 1000.0
        drafts, self.drafts = self.drafts, {}
        # How the worker waits for it: behind a step of its lane (or, composed late, behind one that ended before
        # it was due: the worker's idle time is a bubble either way); or, composed on an output with none in flight,
        # for the host's turn-around (mixed lane: its idle time is the host gap h)
        if any(entry.lane == lane for entry in self.in_flight):
            wait = QUEUED
        else:
            wait = after if lane == LANE_MIXED else 0
        self.in_flight.append(InFlight(self.step_no, flight, features, predicted, lane, drafts or None, wait,
                                       draft_priced))
        if lane == LANE_PREFILL:  # no decode step takes them until this step's output is applied
            for rec in flight:
                rec.req.prefill_step = self.step_no
        return flight, num_running

    # ------------------------------------------------------------------ SLO (batcher/slo.py)
    def _prefill_time(self, flight: list[Scheduled], start: float) -> None:
        """The prefill time the step may take once its decodes (all of flight so far) are in: up to the
        latest end the decoding requests' TPOT budgets allow (time_left None: they set none)."""
        cost = self.fit.model
        self.step_decodes = len(flight)
        self.decode_part_ms = cost.step_ms(0, 0, len(flight), sum(rec.done for rec in flight))
        latest = self.slo.latest_step_end([rec.req for rec in flight], self.decode_part_ms / 1000.0)
        self.time_left = None if latest == math.inf else (latest - start) * 1000.0 - self.decode_part_ms
        self.floor_left = MIN_PREFILL_TOKENS
        self.mixed_paid = False

    def _chunk(self, left: int, budget: int, context: int) -> int:
        """How many of the `left` tokens a prefill after `context` computed ones gets in this step: the token
        budget, and with a TPOT cap the time left (at least the floor's tokens in all)."""
        n = left if left <= budget else budget
        t = self.time_left
        if t is None:
            self.mixed_paid = True
            return n
        cost = self.fit.model
        if not self.mixed_paid:  # the first prefill makes the step an eager (mixed) one
            t -= cost.mixed_ms(self.step_decodes)
            self.mixed_paid = True
        afford = cost.affordable(t, context)
        if afford < n:
            n = max(afford, min(n, self.floor_left))
        self.floor_left = max(0, self.floor_left - n)
        self.time_left = t - cost.chunk_ms(n, context)
        return n

    def _pause(self, decodes: list[Request], start: float, budget: int) -> list[Request]:
        """The decodes that run in a step whose waiting prompts would miss their deadlines (SloPolicy.pausable):
        one sits it out if its next token may come PAUSE_STEPS steps of a full token budget later."""
        cost = self.fit.model
        kv = sum(r.num_computed_tokens for r in decodes) + len(decodes)
        full_s = cost.step_ms(budget, 0, len(decodes), kv, 1) / 1000.0
        run, self.paused = self.slo.pausable(decodes, start + PAUSE_STEPS * full_s,
                                             cost.step_ms(0, 0, len(decodes), kv) / 1000.0, self.cfg.min_active_decodes)
        return run

    def _unpause(self, flight: list[Scheduled]) -> list[Scheduled]:
        """After admission: the decodes _pause set aside sit the step out only if a prompt got it; otherwise they
        run after all (a step of the floor's decodes alone would leave the GPU to nobody, e.g. while the seat cap or
        the K/V pool keeps the waiting prompts out): their records, for the step."""
        paused = [r for r in self.paused if r.status is _RUNNING]  # not preempted for the others' blocks
        self.paused = []
        back: list[Scheduled] = []
        if step_features(flight)[4]:
            self.paused_decodes += len(paused)
            return back
        budget = self.cfg.max_num_batched_tokens - sum(rec.num_tokens for rec in flight)
        self._schedule_decodes(back, budget, paused, [])
        return back

    def _overhead_per_token(self) -> float:
        """ms of decode work a prefill token brings along: a step's decode part over the step's token budget."""
        return self.decode_part_ms / self.cfg.max_num_batched_tokens

    def _order_waiting(self, now: float, start: float) -> None:
        waiting = list(self.waiting)
        for req in waiting:
            if req.arrived_at is None:  # added without a clock: it arrived now
                self.slo.stamp(req, now)
        self.gate.pressure = self.slo.order_waiting(waiting, start, self.fit.model, self._overhead_per_token())
        self.waiting = deque(waiting)

    def _run_order(self) -> tuple[list[Request], list[tuple[Request, int]]]:
        """The running requests in run order: decodes (one token left to compute) by bucket (lowest
        tokens-remaining first), then prefills as (request, tokens left to compute); oldest first within each.
        Left out (they wait for the steps in flight): requests whose in-flight samples already reach max_tokens
        or the context limit, constrained ones with a sample in flight (their next mask follows from that
        token), and warm prefixes whose last chunk is in flight.

        Hot path (every step, every running request): no sort, since `running` is in admission order, a stable
        split into one lane per bucket (plus prefills) is the (bucket, admit_seq) order; properties inlined
        (compute_target = len + placeholders - internal; tokens_remaining = max_num_tokens - len - placeholders),
        differences of the big numbers first: a small result is a cached int, a big one is allocated."""
        buckets, lanes = self.buckets, self.lanes
        rest = lanes[-1]
        prefills: list[tuple[Request, int]] = []
        top = buckets[-1] if buckets else -1  # above it: the rest lane, no search
        for r in self.running.values():
            ph = r.num_output_placeholders
            known = len(r.token_ids)
            if ph and (known + ph >= r.length_limit or r.grammar is not None):
                continue
            left = known - r.num_computed_tokens + ph - r.internal
            if left == 1:
                remaining = r.max_num_tokens - known - ph
                (rest if remaining > top else lanes[bisect_left(buckets, remaining)]).append(r)
            elif left > 0:
                prefills.append((r, left))
        decodes: list[Request] = []
        for lane in lanes:
            if lane:
                decodes += lane
                lane.clear()
        return decodes, prefills

    def _schedule_running(self, flight: list[Scheduled], budget: int, start: float,
                          lane: int = LANE_MIXED, pause: bool = False) -> tuple[int, int, bool]:
        """Schedule running requests in run order; preempt from the back of that order when blocks run out.

        The back is the newest request of the highest-remaining bucket: the one that would hold its blocks
        longest, while a nearly finished sequence is about to give its blocks back anyway. Each request is
        committed to the step as it gets its place (samples: its tokens are all computed then; warm prefixes
        never sample): _make_room only takes requests after it in the order. A decode step of two lanes takes
        the decodes only (not those whose last prefill chunk is in flight), a prefill step the prefills only;
        either may preempt any running request. pause: decodes with TPOT slack may sit the step out (_pause).
        """
        decodes, prefills = self._run_order()
        run_decodes, run_prefills = decodes, prefills
        if lane == LANE_DECODE:
            run_decodes = decodes = [r for r in decodes if not r.prefill_step]
            run_prefills = ()
        elif lane == LANE_PREFILL:
            run_decodes = ()
        bs = self.block_size
        threshold = self.cfg.long_prefill_threshold
        preemptions_before = self.preemptions
        grown = self.grown
        if self.spec_k and run_decodes:
            budget = self._schedule_drafts(flight, budget, run_decodes, decodes, prefills)
            run_decodes = ()
        victims = run_decodes
        if pause and run_decodes and (run_prefills or len(self.running) < self.cfg.max_num_seqs):
            run_decodes = self._pause(run_decodes, start, budget)  # (a full house admits no prompt to pause for)
            if self.paused:  # idle in this step: the first to give up their blocks (after the prefills)
                victims = run_decodes + self.paused
        budget = self._schedule_decodes(flight, budget, run_decodes, prefills, victims)
        # scheduled (or, two lanes, decoding) with at most threshold tokens left to compute
        active = (len(decodes) if lane == LANE_PREFILL else len(flight)) if threshold >= 1 else 0
        if self.slo.enabled:
            self._prefill_time(flight, start)
        # Then prefills. None if the loop above stopped: the budget is spent, or _make_room took them all.
        for req, left in run_prefills:
            if budget <= 0:
                break
            n = self._chunk(left, budget, req.num_computed_tokens)
            if n <= 0:
                break
            done = req.num_computed_tokens + n
            if done > len(req.block_ids) * bs:
                if not self._make_room(req, n, decodes, prefills):
                    break
                grown.append(req)
            self._commit_chunk(flight, req, n, left)
            budget -= n
            if left <= threshold:
                active += 1
        return budget, active, self.preemptions != preemptions_before

    def _schedule_decodes(self, flight: list[Scheduled], budget: int, decodes: list[Request],
                          prefills: list[tuple[Request, int]], victims: list[Request] | None = None) -> int:
        """One token each for `decodes`, in order, while the budget lasts and blocks can be found; the budget left.
        _make_room takes the running prompts (newest first), then from the back of `victims`: `decodes` itself by
        default, else `decodes` followed by decodes idle in this step (taken first). A decode taken before the loop
        reaches it is skipped; the one being scheduled is the last it can take."""
        bs = self.block_size
        if victims is None:
            victims = decodes
        for req in decodes:
            if budget <= 0:
                break
            if req.status is not _RUNNING:  # preempted for a decode before it
                continue
            done = req.num_computed_tokens + 1
            if done > len(req.block_ids) * bs:
                if not self._make_room(req, 1, victims, prefills):
                    break
                self.grown.append(req)
            req.num_computed_tokens = done
            samples = req.samples
            if samples:  # next step it decodes the token sampled now: the worker has it by then
                req.num_output_placeholders += 1
            flight.append(Scheduled(req, 1, done, samples, req.epoch))
            budget -= 1
        return budget

    def _schedule_drafts(self, flight: list[Scheduled], budget: int, run_decodes: list[Request],
                         decodes: list[Request], prefills: list[tuple[Request, int]]) -> int:
        """The decode loop of _schedule_running when the step speculates: a request that may draft and whose
        tokens are all known on the host gets its last token plus up to spec_k drafts (batcher/spec.py) to verify,
        any other one its one token. With a draft model, what _draft_catchup() planned: a request whose draft K/V
        does not catch up in this step decodes one token while it catches up by what the plan says. Returns the
        budget left."""
        bs = self.block_size
        bm = self.bm
        by_model = self.spec.draft_model
        # blocks the requests still to come need for their one token each: drafts may not take them (a request's
        # drafts taking the last free block had a later request preempted for its one token)
        reserve = sum(1 for req in run_decodes if req.num_computed_tokens >= len(req.block_ids) * bs)
        for req in run_decodes:
            if budget <= 0:
                break
            if req.num_computed_tokens >= len(req.block_ids) * bs:
                reserve -= 1  # (its own one token's block is its own to take)
            drafts, job = [], None
            if not req.num_output_placeholders and self._may_draft(req):
                room = min(self.spec_k, budget - 1, req.length_limit - len(req.token_ids) - 1)
                p = req.num_computed_tokens  # its input's position
                stop = self.catchup.get(req.request_id) if by_model else None
                if not by_model:
                    drafts = self.proposals.get(req.request_id, [])[:max(room, 0)]
                elif stop is not None:
                    job = DraftJob(req.draft_done, stop, max(room, 0) if stop == p + 1 else 0)
            k = job.k if job is not None else len(drafts)
            n = 1 + k
            done = req.num_computed_tokens + n
            if done > len(req.block_ids) * bs:
                before = len(req.block_ids)
                if not (k and bm.num_free - bm.blocks_needed(req, n) >= reserve and bm.allocate(req, n)):
                    # drafts take free blocks only, and none a later request's one token needs: they never preempt
                    if k:
                        drafts, n, done = [], 1, req.num_computed_tokens + 1
                        job = DraftJob(job.start, job.stop, 0) if job is not None else None
                    if done > len(req.block_ids) * bs and not self._make_room(req, n, decodes, prefills):
                        break
                if len(req.block_ids) > before:
                    self.grown.append(req)
            req.num_computed_tokens = done
            if req.samples:
                req.num_output_placeholders += 1
            flight.append(Scheduled(req, n, done, req.samples, req.epoch))
            if job is not None or drafts:
                self.drafts[req.request_id] = job if job is not None else drafts
            budget -= n
        return budget

    @staticmethod
    def _commit_chunk(flight: list[Scheduled], req: Request, n: int, left: int) -> None:
        """Put n of the `left` tokens req has to compute into the step (the decode loop above inlines the
        n == left == 1 case): it samples once they are all computed; warm prefixes never, nor a request with
        max_tokens 0 (it ends when its prompt is computed: _apply)."""
        req.num_computed_tokens = done = req.num_computed_tokens + n
        samples = n == left and req.samples
        if samples:  # next step it decodes the token sampled now: the worker has it by then
            req.num_output_placeholders += 1
        flight.append(Scheduled(req, n, done, samples, req.epoch))

    def _make_room(self, req: Request, n: int, decodes: list[Request], prefills: list[tuple[Request, int]]) -> bool:
        """Blocks for n more tokens of req, preempting from the back of the run order (decodes, then prefills);
        False if req lost its place. Blocks held for steps in flight (two lanes) come back when those are done:
        while they would cover the need, req waits for them instead of preempting or failing."""
        bm = self.bm
        while not bm.allocate(req, n):
            if bm.num_held and bm.blocks_needed(req, n) <= bm.num_free + bm.num_held:
                self.awaiting_held.add(self.composing)
                return False
            victim = prefills.pop()[0] if prefills else decodes.pop()
            if victim is req and not decodes and not prefills:
                if len(self.running) > 1:  # others hold blocks but wait on steps in flight: they end soon
                    return False
                self._finish(req)  # alone, and the whole pool still can't hold it
                self.pending.append(TokenDelta(req.request_id, [], FinishReason.ERROR, error=(
                    f"KV cache too small for {req.num_computed_tokens + n} tokens of context")))
                return False
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _admit_waiting(self, now: float, start: float, flight: list[Scheduled], budget: int, active: int) -> None:
        held: list[Request] = []
        waiting = self.waiting
        bm = self.bm
        while waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = waiting[0]
            if self.num_internal and not req.internal:
                break  # warm prefixes first (start-up only): users admitted with them would miss the cache
            if blocks_for(req.compute_target, self.block_size) > bm.num_usable:
                # It fitted when it came, before warm prefixes were pinned (at start-up, after a fail_all): it
                # never will now, and at the head of the line it would hold up every request behind it for good.
                self._finish(waiting.popleft())
                if req.internal:  # a warm prefix the others crowded out: dropped
                    self.num_internal -= 1
                else:
                    self.pending.append(TokenDelta(req.request_id, [], FinishReason.ERROR, error=(
                        f"KV cache too small for {req.compute_target} tokens of context")))
                continue
            if req.seen_at is None:
                req.seen_at = now
            if req.arrived_at is None:
                self.slo.stamp(req, now)
            hit_blocks = self._hit_blocks(req)
            uncached = req.compute_target - hit_blocks * self.block_size
            req.uncached_estimate = req.admission_uncached = uncached
            if not req.internal and self.gate.holds(now, uncached, req.seen_at, active) and (
                    not self.slo.enabled or self.slo.may_hold(req, start, self.fit.model, self._overhead_per_token(),
                                                              self.decode_part_ms / 1000.0)):
                if req.gated_since is None:
                    req.gated_since = now
                    self.gated_prefills += 1
                held.append(waiting.popleft())
                continue
            need = blocks_for(req.compute_target, self.block_size) - hit_blocks + bm.num_free_hits(req, hit_blocks)
            if self.running and bm.num_free - need < self.watermark_blocks:
                break  # first come, first served: later (smaller) prompts don't jump a big one for memory
            left = req.compute_target - hit_blocks * self.block_size
            n = self._chunk(left, budget, hit_blocks * self.block_size)
            if n <= 0:
                break
            hit_tokens = bm.acquire_prefix(req, hit_blocks)
            req.num_computed_tokens = hit_tokens
            req.draft_done = 0  # a draft model's K/V: never assumed in cached blocks (a stale one costs acceptance)
            if not bm.allocate(req, n):  # possible only when nothing runs and the pool is nearly all pinned
                bm.free_blocks(req)
                req.num_computed_tokens = 0
                break
            waiting.popleft()
            if req.num_preemptions == 0:
                req.num_cached_tokens = hit_tokens
            if req.scheduled_at is None:
                req.scheduled_at = now
            req.status = Status.RUNNING
            self.admit_counter += 1
            req.admit_seq = self.admit_counter
            self.running[req.request_id] = req
            req.on_worker = True  # once this step is sent (a NewReq: see schedule())
            self._commit_chunk(flight, req, n, left)
            budget -= n
            if left <= self.cfg.long_prefill_threshold:
                active += 1
        waiting.extendleft(reversed(held))

    # ------------------------------------------------------------------ step output
    def update(self, out: StepOutput, now: float) -> list[TokenDelta] | None:
        """Apply the output of the oldest step in flight: its deltas. None for the output of a void step (in
        flight at a fail_all()): dropped, nothing changes. Raises StepOrderError for any other step's output and
        StepFailed when the worker failed the step: either way the worker's K/V state is unknown, and the caller
        fails its requests (fail_all(str(exc)): the ERROR deltas' text)."""
        in_flight = self.in_flight
        i = self._oldest_of_lane(out.step)
        if i is None:
            if out.step in self.void:
                self.void.remove(out.step)
                return None
            oldest = {}
            for entry in in_flight:
                oldest.setdefault(entry.lane, entry.step)
            raise StepOrderError(f"worker {out.worker_id} returned step {out.step}, expected "
                                 f"{' or '.join(map(str, sorted(oldest.values()))) or None}")
        if out.error is not None:
            del in_flight[i]
            raise StepFailed(f"worker error: {out.error.splitlines()[-1]}")
        rows = len(out.request_ids)
        if len(out.sampled_token_ids) != rows or not all(out.sampled_token_ids) \
                or (out.logprobs is not None and len(out.logprobs) != rows):
            del in_flight[i]  # (checked before anything changes: a request left half-applied would hang)
            raise StepFailed(f"worker {out.worker_id} step {out.step}: {rows} request ids, "
                             f"{len(out.sampled_token_ids)} rows of sampled tokens (an empty one among them: "
                             f"{not all(out.sampled_token_ids)}), "
                             f"{'no' if out.logprobs is None else len(out.logprobs)} rows of logprobs")
        entry = in_flight[i]
        execute_ms = out.execute_time * 1000.0  # (a worker's figure: a NaN or a wild one must not wipe the fit)
        learned = learned_ms(execute_ms, out.draft_time * 1000.0 if entry.draft_priced else 0.0)
        if learned is not None:
            if learned < execute_ms:  # the draft model's part, priced apart
                self.spec.observe_draft(entry.draft_priced, execute_ms - learned)
            self.fit.observe(entry.features, learned)
            if entry.features[4] and 0.0 <= out.launch_time < MAX_STEP_S:  # a step with a prompt chunk: eager
                self.eager_steps += 1
                self.eager_launch_ms += out.launch_time * 1000.0
                self.eager_step_ms += out.execute_time * 1000.0
        if 0.0 < out.idle_time < MAX_STEP_S:
            if entry.wait == QUEUED:  # scheduled to queue, yet the worker waited for it
                self.bubble_ms += out.idle_time * 1000.0
            elif entry.wait == TURNAROUND:
                self.fit.observe_gap(out.idle_time * 1000.0)
        return self._apply(now, out, index=i)

    def _oldest_of_lane(self, step: int) -> int | None:
        """The place in in_flight of `step` if it is the oldest step in flight of its lane, else None."""
        in_flight = self.in_flight
        if in_flight and in_flight[0].step == step:
            return 0
        lanes_before = set()
        for i, entry in enumerate(in_flight):
            if entry.step == step:
                return None if entry.lane in lanes_before else i
            lanes_before.add(entry.lane)
        return None

    def _apply(self, now: float, out: StepOutput | None = None, *, sample: Callable[[int, str], int] | None = None,
               plain: list[str] | None = None, index: int = 0) -> list[TokenDelta]:
        """Apply the oldest step in flight: offer the K/V it computed to the prefix cache, append the tokens it
        sampled (stop checks), finish the warm prefixes it completed. Returns the deltas in schedule order.

        The tokens come from the worker's StepOutput `out` (rows in any order: the worker groups them for its
        kernels) or, for a worker in this process (the simulator's), from sample(the request's
        num_computed_tokens after the step, its id), called in schedule order; with `plain`, the deltas of one
        token that neither start nor end their request go there as request ids instead. index: the step's
        place in in_flight (two lanes: the oldest of its lane).
        """
        in_flight = self.in_flight
        if index:
            entry = in_flight[index]
            del in_flight[index]
        else:
            entry = in_flight.popleft()
        step_no, flight, lane, drafts = entry.step, entry.records, entry.lane, entry.drafts
        self.busy[lane] = now + sum(e.predicted for e in in_flight if e.lane == lane) / 1000.0
        self.on_output = True
        self.late = self.wake_at is not None
        if lane == LANE_PREFILL:
            for rec in flight:
                if rec.req.prefill_step == step_no:
                    rec.req.prefill_step = 0
        if self.bm.held:
            self.bm.release_held(in_flight[0].step if in_flight else math.inf)
        if drafts:  # the requests whose drafts this output verifies (not made void since)
            verified = [rec for rec in flight if rec.req.request_id in drafts and rec.req.epoch == rec.epoch]
        deltas, self.pending = self.pending, []
        bs = self.block_size
        bm = self.bm
        caching = bm.enable_prefix_caching
        logprobs = scored = None
        if out is not None:
            ids = out.request_ids  # -> their rows; a request listed twice gets its first row (walked backwards)
            rows = dict(zip(reversed(ids), range(len(ids) - 1, -1, -1)))
            sampled, logprobs, scored = out.sampled_token_ids, out.logprobs, out.prompt_logprobs
        for rec in flight:
            req = rec.req
            if req.epoch != rec.epoch:
                continue  # finished, aborted or preempted since it was scheduled: its share of the step is void
            done = rec.done
            if caching and done // bs > req.num_registered_blocks:  # this K/V is cached now: offer its full blocks
                bm.cache_full_blocks(req, done)
            # prompt logprobs go to the gateway as the chunks are scored (it keeps the latest per position)
            prompt_lps = scored.get(req.request_id) if scored else None
            if not rec.samples:
                if req.internal:
                    if done == req.compute_target:
                        self._finish_warm(req)
                    continue
                delta = None
                if not req.samples and done == req.compute_target:  # scored (max_tokens 0): it ends, nothing sampled
                    self._finish(req)
                    delta = TokenDelta(req.request_id, [], FinishReason.LENGTH, prompt_logprobs=prompt_lps)
                elif prompt_lps is not None:
                    delta = TokenDelta(req.request_id, [], prompt_logprobs=prompt_lps)
                if delta is not None:
                    if not req.samples and not req.first_delta_sent:  # what a first token's delta carries
                        delta.num_cached_tokens, delta.queued_ms = req.num_cached_tokens, req.queued_ms
                        req.first_delta_sent = True
                    deltas.append(delta)
                continue
            req.num_output_placeholders -= 1
            rid = req.request_id
            if sample is not None:
                token = sample(done, rid)
            else:
                i = rows.pop(rid, None)
                if i is None:  # the worker broke the contract; don't leave the request hanging
                    self._finish(req)
                    deltas.append(TokenDelta(rid, [], FinishReason.ERROR,
                                             error=f"worker sampled no token in step {out.step}"))
                    continue
                tokens = sampled[i]
                token = tokens[0] if len(tokens) == 1 else None  # the contract's one token
            toks = req.token_ids
            if token is None:  # a row of another length: its tokens appended as they are, each one checked
                delta = self._append_tokens(req, tokens)
            elif len(toks) >= req.stop_check_from:
                delta = self._append_tokens(req, [token])  # it may stop here
            else:  # hot path: no stop possible
                toks.append(token)
                if plain is not None and req.first_delta_sent:
                    plain.append(rid)
                    continue
                delta = TokenDelta(rid, [token])
            if not req.first_delta_sent:
                delta.num_cached_tokens = req.num_cached_tokens
                delta.queued_ms = req.queued_ms
                req.first_delta_sent = True
                req.first_token_at = now
            if logprobs is not None:
                delta.logprobs = logprobs[i]
            if prompt_lps is not None:
                delta.prompt_logprobs = prompt_lps
            deltas.append(delta)
        # Rows left in `rows` are tokens for requests that finished, were aborted or preempted meanwhile: dropped
        # (with steps in flight a request that stopped in step N has one more token coming from step N+1).
        if drafts:
            self._settle_drafts(verified, drafts, out)
        return deltas

    def _settle_drafts(self, verified: list[Scheduled], drafts: dict[str, list[int] | DraftJob],
                       out: StepOutput) -> None:
        """After a speculative step's tokens are appended: each request still running that verified drafts has
        K/V for its last token and the accepted drafts (the rejected ones' slots are written over later), so it
        computes from its last token on, as after any decode; the K/V now known is offered to the prefix cache.
        With a draft model, its draft K/V now runs to its input, then the drafts accepted before the last one it
        read (batcher/spec.py). The acceptance counts are the worker's rows (the tokens past a stop included)."""
        rows = {rid: len(t) for rid, t in zip(out.request_ids, out.sampled_token_ids) if rid in drafts}
        sequences = drafted = accepted = 0
        for rec in verified:
            req = rec.req
            d = drafts[req.request_id]
            k = d.k if isinstance(d, DraftJob) else len(d)
            accepted_here = max(rows.get(req.request_id, 1) - 1, 0)  # the row: accepted drafts, then one more
            if k:
                sequences += 1
                drafted += k
                accepted += accepted_here
            if req.epoch != rec.epoch:  # no longer running
                continue
            if isinstance(d, DraftJob):
                req.draft_done = d.stop + min(accepted_here, k - 1) if k else d.stop
            if k:
                req.num_computed_tokens = len(req.token_ids) - 1
                if self.bm.enable_prefix_caching:
                    self.bm.cache_full_blocks(req)
        self.spec.observe(sequences, drafted, accepted)

    def _append_tokens(self, req: Request, tokens: list[int]) -> TokenDelta:
        """Append sampled tokens up to the first stop (and finish there); STOP includes the stop token. A request
        with a grammar also stops when the grammar is complete (its last token then is no stop token)."""
        toks = req.token_ids
        stop_token_ids = req.params.stop_token_ids
        num_before = len(toks)
        reason = error = None
        for tok in tokens:
            toks.append(tok)
            if tok in stop_token_ids and len(toks) - req.num_prompt_tokens >= req.params.min_tokens:
                reason = FinishReason.STOP
                break
            if req.grammar is not None:  # (before the length check: a grammar completed by the last token is a stop)
                try:
                    if follow(req.grammar, tok):
                        reason = FinishReason.STOP
                        break
                except GrammarError as exc:  # its grammar failed (a parser limit): end it, without that token
                    toks.pop()
                    reason, error = FinishReason.INVALID, f"its grammar failed at token {tok}: {exc}"
                    break
            if len(toks) >= req.length_limit:  # max_tokens or the context limit
                reason = FinishReason.LENGTH
                break
        if reason is not None:
            self._finish(req)
        return TokenDelta(req.request_id, tokens[:len(toks) - num_before], reason, error=error)

    # ------------------------------------------------------------------ transitions
    def _finish(self, req: Request) -> None:
        """Running (or preempted-then-aborted) -> gone; its blocks go back to the pool."""
        self.running.pop(req.request_id, None)
        if self.requests.pop(req.request_id, None) is not None and req.grammar is not None:
            self.num_constrained -= 1
        self.bm.free_blocks(req, self._fence())
        req.status = Status.FINISHED
        req.epoch += 1
        if req.on_worker:
            self.finished_ids.append(req.request_id)
            req.on_worker = False

    def _fence(self) -> int | None:
        """Two lanes with steps in flight: the last step number sent (blocks freed now wait for it); else None."""
        return self.step_no if self.streams and self.in_flight else None

    def _finish_warm(self, req: Request) -> None:
        self.bm.cache_full_blocks(req)
        # the blocks the prefix cache maps: two warm prefixes sharing leading blocks, prefilled together, compute
        # those twice, and the copy the cache did not take goes back to the pool with the request
        cached = self.bm.cached
        self.bm.pin([cached[h] for h in req.block_hashes if h in cached])
        self._finish(req)
        self.num_internal -= 1

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: drop the K/V, requeue at the front; resumed later as a NewReq."""
        self.running.pop(req.request_id)
        self.bm.free_blocks(req, self._fence())
        req.status = Status.WAITING
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0  # tokens sampled for it by steps in flight are dropped (epoch changes)
        req.num_preemptions += 1
        req.epoch += 1
        if req.on_worker:
            self.finished_ids.append(req.request_id)
            req.on_worker = False
        self.waiting.appendleft(req)
        self.preemptions += 1

    # ------------------------------------------------------------------ introspection
    @property
    def num_unfinished(self) -> int:
        return len(self.requests) - self.num_internal

    def stats(self) -> EngineStats:
        n_running = sum(1 for r in self.running.values() if not r.internal)
        return EngineStats(num_running=n_running, num_waiting=self.num_unfinished - n_running,
                           kv_blocks_total=self.num_blocks, kv_blocks_free=self.bm.num_free,
                           prefix_queries=self.bm.queries, prefix_hits=self.bm.hits,
                           gated_prefills=self.gated_prefills, preemptions=self.preemptions, steps=self.step_no,
                           steps_timed=self.fit.steps, step_ms_predicted=self.fit.predicted_ms,
                           step_ms_measured=self.fit.measured_ms, slo_shed=self.slo.shed,
                           slo_paused_decodes=self.paused_decodes,
                           spec_steps=self.spec.steps, spec_sequences=self.spec.sequences,
                           spec_drafted=self.spec.drafted, spec_accepted=self.spec.accepted,
                           iteration_tokens=list(self.iteration_tokens), iteration_tokens_sum=self.iteration_tokens_sum,
                           pipeline_bubble_ms=self.bubble_ms, eager_steps=self.eager_steps,
                           eager_launch_ms=self.eager_launch_ms, eager_step_ms=self.eager_step_ms)
