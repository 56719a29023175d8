"""The simulator's engine: a trace replayed through the real Scheduler in simulated time.

Owns the discrete-event loop (arrivals, aborts, one step in flight per worker, or with
`pipelined` up to the scheduler's max_inflight_steps run back to back, the next composed when the scheduler's
wake_at says (--schedule-lead-ms); with `--lanes streams`
the two lanes' steps run at once, each lane's in order, each step taking the cost model's time:
a model learned on a streams server has the lanes' sharing of the GPU in its step times), the stand-in
workers, the step times (batcher/cost_model.py's model, on the terms the scheduler
records for each step), the tally of the deltas and the latency summary. The stand-in workers execute
steps exactly as the ModelRunner contract says (per-request tokens / blocks /
num_computed_tokens, sample one token when a request's tokens are all computed) with a
deterministic "model": SimWorker from StepInputs, checking the scheduler's promises;
InProcessScheduler's worker, faster, from the scheduler's own record of each step. The
scheduler, block manager and router are the production code.
Must not use torch, sockets or the wall clock inside the simulation.

Outputs are forced to the trace's length: max_tokens = output tokens and no stop
tokens (ignore_eos), and the fake model never emits a stop token.
"""

from __future__ import annotations

import json
import math
import random
from collections import deque
from dataclasses import dataclass, field
from heapq import heapify, heappop, heappush
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from batcher.config import BatcherConfig
from batcher.cost_model import CostModel, attention_pairs
from batcher.router import pick_worker
from batcher.scheduler import Scheduled, Scheduler
from batcher.trace import percentile
from laneserve.wire.protocol import (LANE_DECODE, LANE_PREFILL, AddRequest, FinishReason, SamplingParams, StepInput,
                                     StepOutput, TokenDelta)

if TYPE_CHECKING:
    from loadtest.traces import TraceRequest

NEAR_DONE = 8  # outputs left: the smallest default decode bucket


@dataclass
class SimRequest:
    arrival: float
    prompt_token_ids: list[int]
    output_tokens: int
    params: SamplingParams | None = None  # default: max_tokens=output_tokens, no stop tokens

    def prompt(self) -> list[int]:
        return self.prompt_token_ids


@dataclass
class TraceSimRequest:
    """A trace row whose prompt is made when it arrives: 100k prompts never all exist at once."""

    arrival: float
    row: TraceRequest
    salt: int  # tells apart rows with equal fields: the row index
    params: SamplingParams | None = None

    @property
    def output_tokens(self) -> int:
        return max(self.row.output_tokens, 1)

    def prompt(self) -> list[int]:
        from loadtest.traces import compact_token_ids  # loaded already: the trace was read with it

        return compact_token_ids(self.row, salt=self.salt)


# ---------------------------------------------------------------------- the stand-in workers
def sim_token(num_tokens: int, request_id: str, vocab: int = 32000) -> int:
    """The token a simulated worker samples after num_tokens tokens: deterministic, never a stop token."""
    return (num_tokens * 31 + len(request_id)) % vocab


def allowed_token(mask: bytes, token: int) -> int:
    """`token` if the bitmask (P.StepInput.allowed_token_ids) allows it, else the allowed token at index token mod
    the number allowed: deterministic, like sim_token."""
    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")
    if token < len(bits) and bits[token]:
        return token
    allowed = np.flatnonzero(bits)
    if not len(allowed):
        raise AssertionError("a token mask that allows nothing")
    return int(allowed[token % len(allowed)])


class SimWorker:
    """Executes StepInputs like workers/runner.py would, minus the model; checks the scheduler's promises.

    With check_kv, it also keeps the token id written in every K/V slot and verifies, for every
    prefix-cache hit, that the slots the scheduler claims are computed hold exactly those tokens; and, for
    two lanes, that no step writes or reads a block another lane's step still in flight wrote (`done()`
    ends a step), the race the block manager's held blocks prevent.
    """

    def __init__(self, num_blocks: int, block_size: int, check_kv: bool = False, vocab: int = 32000,
                 token_fn=None, draft_fn=None):
        self.block_size = block_size
        self.vocab = vocab
        self.token_fn = token_fn  # (request_id, tokens so far) -> next token; default never a stop token
        # StepInput.draft_jobs: (request_id, tokens so far) -> the draft model's next token (default token_fn's).
        # With check_kv it also keeps the token whose draft-model K/V each slot holds, and checks that every job's
        # positions before its start hold its request's tokens (what the batcher's draft_done claims)
        self.draft_fn = draft_fn
        self.draft_kv = [-1] * (num_blocks * block_size) if check_kv else None
        self.reqs: dict[str, list] = {}  # id -> [token_ids, block_ids, num_computed]
        self.unsampled: set[str] = set()  # requests with max_tokens 0: their prompt is computed, nothing sampled
        self.kv = [-1] * (num_blocks * block_size) if check_kv else None
        self.writer: dict[int, tuple[int, int]] = {}  # check_kv: block -> (lane, step) of its last write
        self.open: set[int] = set()  # steps executed whose output is not applied yet

    def done(self, step: int) -> None:
        """The step's output was applied: the GPU is done with it."""
        self.open.discard(step)

    def _touch(self, block: int, step: StepInput, write: bool) -> None:
        lane, step_no = self.writer.get(block, (step.lane, 0))
        if lane != step.lane and step_no in self.open:
            raise AssertionError(f"step {step.step} (lane {step.lane}) {'writes' if write else 'reads'} block "
                                 f"{block} that step {step_no} (lane {lane}) still in flight writes")
        if write:
            self.writer[block] = (step.lane, step.step)

    def execute(self, step: StepInput) -> tuple[StepOutput, tuple[int, int, int, int, int]]:
        """Run the step; returns its output and its cost-model terms as this worker saw them."""
        bs = self.block_size
        for rid in step.finished_req_ids:
            self.reqs.pop(rid, None)
            self.unsampled.discard(rid)
        for nr in step.new_reqs:
            assert nr.request_id not in self.reqs, f"NewReq for a request the worker holds: {nr.request_id}"
            toks = nr.prompt_token_ids + nr.output_token_ids
            if self.kv is not None:
                for pos in range(nr.num_computed_tokens):
                    slot = nr.block_ids[pos // bs] * bs + pos % bs
                    assert self.kv[slot] == toks[pos], f"prefix hit of {nr.request_id} at {pos}: stale K/V"
                    self._touch(slot // bs, step, write=False)
            self.reqs[nr.request_id] = [toks, list(nr.block_ids), nr.num_computed_tokens]
            if not nr.params.max_tokens:
                self.unsampled.add(nr.request_id)
        for cr in step.cached_reqs:
            self.reqs[cr.request_id][1].extend(cr.new_block_ids)
        ids, sampled = [], []
        prefill_tokens = attention = decode_seqs = kv_read = 0
        reqs, kv, token_fn, vocab = self.reqs, self.kv, self.token_fn, self.vocab
        spec = self._draft(step) if step.draft_jobs else step.spec_token_ids
        for rid, n in step.num_scheduled_tokens.items():
            st = reqs[rid]
            toks, blocks, done = st
            drafts = spec.get(rid) if spec else None
            if drafts:  # its last token, then the drafts: verified below
                toks = toks + drafts
            end = done + n
            left = len(toks) - end  # tokens still to compute after this step
            if n <= 0 or left < 0 or end > len(blocks) * bs:
                raise AssertionError(f"bad schedule for {rid}: computed {done} + {n} of {len(toks)} tokens, "
                                     f"{len(blocks)} blocks")
            if kv is not None:
                for pos in range(done, end):
                    kv[blocks[pos // bs] * bs + pos % bs] = toks[pos]
                    self._touch(blocks[pos // bs], step, write=True)
            st[2] = end
            kv_read += end
            if drafts:  # a decode row per token (workers/runner.py)
                decode_seqs += n
                kv_read += (n - 1) * end
            elif n == 1 and done:
                decode_seqs += 1
            else:
                prefill_tokens += n
                attention += attention_pairs(n, done)
            if drafts:  # greedy verification: the drafts that match the model's next token, then its next token
                toks = st[0]
                new: list[int] = []
                while True:
                    tok = token_fn(rid, toks) if token_fn is not None else sim_token(len(toks), rid, vocab)
                    toks.append(tok)
                    new.append(tok)
                    if len(new) > len(drafts) or drafts[len(new) - 1] != tok:
                        break
                st[2] = len(toks) - 1
                ids.append(rid)
                sampled.append(new)
            elif not left and rid not in self.unsampled:
                # deterministic, never a stop token: outputs end by length
                tok = token_fn(rid, toks) if token_fn is not None else sim_token(end, rid, vocab)
                mask = step.allowed_token_ids.get(rid) if step.allowed_token_ids else None
                if mask is not None:  # structured output: a token the grammar allows
                    tok = allowed_token(mask, tok)
                toks.append(tok)
                ids.append(rid)
                sampled.append([tok])
        if step.allowed_token_ids and not set(step.allowed_token_ids) <= set(ids):
            raise AssertionError(f"step {step.step} has token masks for requests that do not sample in it")
        self.open.add(step.step)
        return (StepOutput(step=step.step, worker_id=0, request_ids=ids, sampled_token_ids=sampled),
                (prefill_tokens, attention, decode_seqs, kv_read, 1 if prefill_tokens else 0))

    def _draft(self, step: StepInput) -> dict[str, list[int]]:
        """The drafts of StepInput.draft_jobs (the draft model's work: workers/draft.py), checking the contract:
        positions [start, stop) known, a job that drafts ends at its request's input, and (check_kv) the draft
        K/V of every position before start is its request's token there."""
        drafts = {}
        fn = self.draft_fn or self.token_fn
        bs, kv = self.block_size, self.draft_kv
        for rid, job in step.draft_jobs.items():
            toks, blocks, done = self.reqs[rid]
            if not (0 <= job.start < job.stop <= len(toks) and job.k >= 0
                    and (not job.k or job.stop == done + 1 == len(toks))):
                raise AssertionError(f"bad draft job {job} for {rid}: {done} computed of {len(toks)}")
            proposed = list(toks)
            for _ in range(job.k):
                proposed.append(fn(rid, proposed) if fn is not None else sim_token(len(proposed), rid, self.vocab))
            if kv is not None:
                for pos in range(job.start):
                    if kv[blocks[pos // bs] * bs + pos % bs] != toks[pos]:
                        raise AssertionError(f"draft job {job} for {rid}: no draft K/V of its token at {pos}")
                # written: [start, stop), then each draft but the last (the pass that reads it proposes the next)
                for pos in range(job.start, job.stop + max(job.k - 1, 0)):
                    kv[blocks[pos // bs] * bs + pos % bs] = proposed[pos]
            if job.k:
                drafts[rid] = proposed[len(toks):]
        return drafts


class InProcessScheduler(Scheduler):
    """A Scheduler whose worker runs in this process (simulate()'s fast path): the worker reads each step off the
    scheduler's own record of it and samples sim_token()'s tokens, so no StepInput or StepOutput is built. The
    same decisions and state changes as schedule() / update() with a SimWorker (a test holds the two equal)."""

    def schedule_step(self, now: float) -> list[Scheduled] | None:
        """schedule() without the StepInput: the step's records in schedule order (see Scheduled)."""
        step = self._next_step(now)
        if step is None:
            return None
        self.finished_ids.clear()  # this worker keeps no per-request state to drop
        return step[0]

    def update_step(self, plain: list[str], now: float, step: int | None = None) -> list[TokenDelta]:
        """update() for the oldest step in flight (two lanes: `step`, the oldest of its lane), its tokens
        sim_token()'s. The deltas of one token that neither start nor end their request go in `plain` as request
        ids instead (cheaper to count)."""
        index = 0 if step is None else self._oldest_of_lane(step)
        assert index is not None, f"step {step} is not the oldest of its lane"
        return self._apply(now, sample=sim_token, plain=plain, index=index)


# ---------------------------------------------------------------------- results
@dataclass
class SimResult:
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    finish: dict[str, int] = field(default_factory=dict)  # finish reason name -> count
    output_tokens: dict[str, int] = field(default_factory=dict)  # request id -> tokens received
    # request id -> (arrival, first token or None, final delta, tokens received, finish reason), every finished one
    ends: dict[str, tuple[float, float | None, float, int, int]] = field(default_factory=dict)
    shed: dict[str, float] = field(default_factory=dict)  # request id -> arrival, of those predictive admission shed
    itl: dict[str, list[float]] = field(default_factory=dict)  # request id -> the gaps between its token deltas
    errors: dict[str, str] = field(default_factory=dict)  # request id -> why, of those that finished ERROR
    first_chunk_cached: dict[str, int] = field(default_factory=dict)
    duration: float = 0.0
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    attention_pairs: int = 0  # the steps' cost-model terms summed, as prefill_tokens and decode_tokens are
    kv_tokens_read: int = 0
    block_seconds: float = 0.0  # integral of KV blocks in use over time
    # "time to free": from a request's first token with <= NEAR_DONE outputs left to its final delta
    # (its blocks are freed in that same update); preempting nearly done sequences makes it long
    near_done_to_free: list[float] = field(default_factory=list)
    preemptions: int = 0
    gated_prefills: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    schedulers: list = field(default_factory=list)

    @property
    def rejected(self) -> int:
        """Requests shed by predictive SLO admission (never started)."""
        return len(self.shed)

    @property
    def ttft_of(self) -> dict[str, float]:
        """request id -> its TTFT, of those that finished by STOP or LENGTH."""
        return {rid: first - arrival for rid, (arrival, first, _, _, reason) in self.ends.items()
                if first is not None and reason in (FinishReason.STOP, FinishReason.LENGTH)}


@dataclass(slots=True)
class _Progress:
    """What the tally keeps of an unfinished request."""

    arrival: float
    near_done_from: float  # outputs that make it nearly done (inf once it is)
    outputs: int = 0
    first_at: float | None = None
    near_done_at: float | None = None
    last_at: float = 0.0  # its last delta with tokens
    gaps: list[float] = field(default_factory=list)  # between its deltas with tokens: the client's ITL


class _Tally:
    """The deltas as a client sees them: each unfinished request's progress, and the latencies of the finished
    ones into the SimResult. Every request must get exactly one finishing delta."""

    def __init__(self, res: SimResult):
        self.res = res
        self.live: dict[str, _Progress] = {}  # unfinished requests (a small dict: touched for every token)

    def arrived(self, rid: str, now: float, max_tokens: int) -> None:
        self.live[rid] = _Progress(now, max_tokens - NEAR_DONE)

    def deliver(self, deltas: list[TokenDelta], now: float) -> None:
        live, res = self.live, self.res
        first_chunk_cached = res.first_chunk_cached
        for d in deltas:
            rid = d.request_id
            new, reason = d.new_token_ids, d.finish_reason
            p = live.get(rid)
            assert p is not None, f"a delta for {rid} after its finish"
            n = p.outputs
            if (new or reason is not None) and rid not in first_chunk_cached:
                first_chunk_cached[rid] = d.num_cached_tokens
            if new:
                if not n:
                    p.first_at = now
                else:
                    p.gaps.append(now - p.last_at)
                p.last_at = now
                n += len(new)
                p.outputs = n
                if n >= p.near_done_from:
                    p.near_done_at = now
                    p.near_done_from = math.inf
            if reason is not None:
                name = FinishReason(reason).name
                res.finish[name] = res.finish.get(name, 0) + 1
                del live[rid]
                if n:
                    res.output_tokens[rid] = n
                res.ends[rid] = (p.arrival, p.first_at, now, n, reason)
                res.itl[rid] = p.gaps
                if reason == FinishReason.ERROR:
                    res.errors[rid] = d.error or "no reason given"
                if p.first_at is not None and reason in (FinishReason.STOP, FinishReason.LENGTH):
                    res.ttft.append(p.first_at - p.arrival)
                    res.e2e.append(now - p.arrival)
                    if n > 1:
                        res.tpot.append((now - p.first_at) / (n - 1))
                    if p.near_done_at is not None:
                        res.near_done_to_free.append(now - p.near_done_at)

    def deliver_plain(self, rids: list[str], now: float) -> None:
        """deliver() for deltas of one token that neither start nor end their request (given by request id)."""
        live = self.live
        for rid in rids:
            p = live[rid]
            n = p.outputs = p.outputs + 1
            p.gaps.append(now - p.last_at)
            p.last_at = now
            if n >= p.near_done_from:
                p.near_done_at = now
                p.near_done_from = math.inf


# ---------------------------------------------------------------------- the event loop
class _Fleet:
    """The simulated workers: each one's scheduler and stand-in worker, the steps it holds (oldest first) and when
    it is done with them. Starts steps (pushing their completion events) and applies the oldest one's output."""

    def __init__(self, scheds: dict[int, Scheduler], sim_workers: dict[int, SimWorker] | None, cost: CostModel,
                 pipelined: bool, res: SimResult, tally: _Tally, events: list, step_noise: float = 0.0,
                 noise_seed: int = 0):
        self.scheds, self.sim_workers, self.res, self.tally, self.events = scheds, sim_workers, res, tally, events
        self.busy: dict[int, deque] = {w: deque() for w in scheds}  # outputs of the steps held (None: in process)
        self.free_at = dict.fromkeys(scheds, 0.0)  # when the worker is done with the steps it holds
        self.pipelined = pipelined
        self.host_gap = cost.h / 1000.0  # paid by a step that starts with none in flight
        self.step_ms = cost.step_ms
        self.noise = step_noise  # a step takes the cost model's time x (1 + N(0, noise)): predictions that err
        self.rng = random.Random(noise_seed)
        # two lanes: when each lane of each worker is done with its steps (no host gap: the lanes hide it)
        self.lane_free = {w: {LANE_DECODE: 0.0, LANE_PREFILL: 0.0} for w, s in scheds.items() if s.streams}
        self.wake_at: dict[int, float] = {}  # per worker: the latest wake-up event pushed (see _wake)

    def start(self, w: int, now: float) -> None:
        """Schedule steps on worker w while it has room: one, or with `pipelined` up to max_inflight_steps (two
        lanes: as many as the scheduler gives)."""
        sched, outs, res = self.scheds[w], self.busy[w], self.res
        lanes = self.lane_free.get(w)
        depth = sched.max_inflight_steps if self.pipelined else 1
        while lanes is not None or len(outs) < depth:
            if self.sim_workers is None:
                scheduled = sched.schedule_step(now)
                if scheduled is None:
                    self._wake(w, sched.wake_at)
                    break
                out = None  # update_step() samples the tokens
            else:
                step = sched.schedule(now)
                if step is None:
                    self._wake(w, sched.wake_at)
                    break
                out, seen = self.sim_workers[w].execute(step)  # now: the state the worker would see
                assert seen == sched.in_flight[-1].features, f"step {step.step}: the worker ran {seen}"
            features = sched.in_flight[-1].features  # the scheduler's terms of the step
            dt = self.step_ms(*features) / 1000.0
            if self.noise:
                dt *= max(0.1, 1.0 + self.rng.gauss(0.0, self.noise))
            res.steps += 1
            res.prefill_tokens += features[0]
            res.decode_tokens += features[2]
            res.attention_pairs += features[1]
            res.kv_tokens_read += features[3]
            bm = sched.bm
            res.block_seconds += (bm.num_blocks - bm.num_free) * dt
            if lanes is not None:
                step_no, lane = sched.in_flight[-1].step, sched.in_flight[-1].lane
                lanes[lane] = done_at = max(now, lanes[lane]) + dt
                heappush(self.events, (done_at, 0, w, (step_no, out)))
                continue
            self.free_at[w] = done_at = max(now, self.free_at[w]) + (0.0 if outs else self.host_gap) + dt
            outs.append(out)
            heappush(self.events, (done_at, 0, w, None))

    def _wake(self, w: int, at: float | None) -> None:
        """The scheduler composes worker w's next step late (--schedule-lead-ms): an event to try again `at`."""
        if at is not None and self.wake_at.get(w) != at:
            self.wake_at[w] = at
            heappush(self.events, (at, 3, w, None))

    def step_done(self, w: int, now: float, step_out: tuple | None = None) -> None:
        """The oldest step of worker w (two lanes: step_out's (step number, output), the oldest of its lane) is
        done: apply its output, hand the deltas to the tally."""
        step = None
        if step_out is None:
            out = self.busy[w].popleft()
        else:
            step, out = step_out
            if self.sim_workers is not None:
                self.sim_workers[w].done(step)
        if out is None:
            plain: list[str] = []
            deltas = self.scheds[w].update_step(plain, now, step)
            if deltas:
                self.tally.deliver(deltas, now)
            self.tally.deliver_plain(plain, now)
        else:
            self.tally.deliver(self.scheds[w].update(out, now), now)


def simulate(requests: Sequence[SimRequest | TraceSimRequest], cfg: BatcherConfig, cost: CostModel = CostModel(),
             num_blocks: int = 8192, block_size: int = 16, max_model_len: int = 32768, num_workers: int = 1,
             check_kv: bool = False, aborts: dict[str, float] | None = None,
             warm_prefixes: list[list[int]] | None = None, pipelined: bool = False,
             sim_worker: bool = False, step_noise: float = 0.0, noise_seed: int = 0) -> SimResult:
    """Run the trace to completion; every request must get exactly one finishing delta (else RuntimeError).

    pipelined: keep up to max_inflight_steps (async scheduling) steps per worker, each starting when the previous
    one ends, so the cost model's host gap `h` is hidden (assumed shorter than a step); a step that starts with
    none in flight (strict alternation, the default, always; a step with drafts is alone in flight) pays it first
    (two lanes: never, the other lane hides it).
    Also shows the policy effect of scheduling one step ahead (admissions and stops seen a step later), and with
    --schedule-lead-ms of composing the queued step late.
    step_noise: each step takes the cost model's time x (1 + N(0, step_noise)) (at least 0.1 x), seeded by noise_seed,
    while the scheduler predicts with the model: what its prediction errors cost (late composition, SLO timing).
    sim_worker: run every step through a SimWorker (StepInput in, StepOutput out: the batcher's path, with the
    worker checking the scheduler's promises; check_kv implies it) rather than in process (InProcessScheduler),
    which is faster and gives the same results. `speculative: draft` is refused: the stand-in worker has no draft
    model (its drafts would be right and free).
    """
    if cfg.speculative == "draft":
        raise ValueError("the simulator has no draft model (its drafts would all be right and cost nothing): simulate "
                         "with speculative off or ngram")
    in_process = not (sim_worker or check_kv) and cfg.speculative in ("", "off")  # (drafts: a SimWorker verifies)
    sched_type = InProcessScheduler if in_process else Scheduler
    scheds = {w: sched_type(cfg, num_blocks, block_size, max_model_len, warm_prefixes, cost=cost)
              for w in range(num_workers)}
    sim_workers = None if in_process else {w: SimWorker(num_blocks, block_size, check_kv) for w in scheds}
    res = SimResult(schedulers=list(scheds.values()))
    tally = _Tally(res)
    # Events (time, kind, seq, payload), earliest first and steps first at equal times: kind 0 = step done (seq: the
    # worker), 1 = arrival (seq: its rank in arrival order, payload: the request's index), 2 = abort, 3 = a worker's
    # scheduler composes its next step (seq: the worker; --schedule-lead-ms). Arrivals are
    # read off `order` one at a time, so the heap only holds the steps in flight and the aborts.
    events: list = [(t, 2, seq, rid) for seq, (rid, t) in enumerate((aborts or {}).items())]
    heapify(events)
    fleet = _Fleet(scheds, sim_workers, cost, pipelined, res, tally, events, step_noise, noise_seed)
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)

    def arrival(seq: int) -> tuple | None:
        return (requests[order[seq]].arrival, 1, seq, order[seq]) if seq < len(order) else None

    owner: dict[str, int] = {}
    next_arrival = arrival(0)
    now = 0.0
    while next_arrival is not None or events:
        if next_arrival is not None and (not events or next_arrival < events[0]):
            now, kind, seq, payload = next_arrival
            next_arrival = arrival(seq + 1)
        else:
            now, kind, seq, payload = heappop(events)
        if kind == 1:
            r = requests[payload]
            rid = f"r{payload}"
            params = r.params or SamplingParams(max_tokens=max(r.output_tokens, 1))
            msg = AddRequest(request_id=rid, prompt_token_ids=r.prompt(), params=params, arrival_time=now)
            w = pick_worker(scheds, msg.prompt_token_ids) if num_workers > 1 else 0
            owner[rid] = w
            shed = scheds[w].add_request(msg, now)
            if shed is not None:  # predictive SLO admission: the client gets a 429
                res.shed[rid] = now
                continue
            tally.arrived(rid, now, params.max_tokens)
            fleet.start(w, now)
        elif kind == 2:
            w = owner.get(payload)
            if w is not None and payload in tally.live:
                tally.deliver(scheds[w].abort_requests([payload]), now)
                fleet.start(w, now)
        elif kind == 3:
            fleet.start(seq, now)
        else:
            fleet.step_done(seq, now, payload)
            fleet.start(seq, now)
        if not events and next_arrival is None:  # idle everywhere: anything still unfinished would hang
            for w in scheds:
                fleet.start(w, now)
    if tally.live:
        raise RuntimeError(f"{len(tally.live)} requests never finished, e.g. {next(iter(tally.live))}")
    res.duration = now - (requests[order[0]].arrival if requests else 0.0)
    for s in scheds.values():
        st = s.stats()
        res.preemptions += st.preemptions
        res.gated_prefills += st.gated_prefills
        res.prefix_queries += st.prefix_queries
        res.prefix_hits += st.prefix_hits
    return res


# ---------------------------------------------------------------------- summary
def summarize(res: SimResult) -> dict:
    def pcts(xs: list[float]) -> dict:
        return {f"p{p}": round(percentile(xs, p) * 1000, 3) for p in (50, 95, 99)} | {
            "mean": round(sum(xs) / len(xs) * 1000, 3) if xs else float("nan")}

    total_out = sum(res.output_tokens.values())
    return {
        "requests": sum(res.finish.values()), "finish": res.finish,
        "duration_s": round(res.duration, 3), "steps": res.steps,
        "ttft_ms": pcts(res.ttft), "tpot_ms": pcts(res.tpot), "e2e_ms": pcts(res.e2e),
        "output_tokens": total_out,
        "throughput_tok_s": round(total_out / res.duration, 1) if res.duration > 0 else 0.0,
        "requests_per_s": round(sum(res.finish.values()) / res.duration, 3) if res.duration > 0 else 0.0,
        "prefill_tokens": res.prefill_tokens, "preemptions": res.preemptions, "gated_prefills": res.gated_prefills,
        "rejected": res.rejected,
        "prefix_hit_rate": round(res.prefix_hits / res.prefix_queries, 4) if res.prefix_queries else 0.0,
        "block_seconds_per_request": round(res.block_seconds / max(1, sum(res.finish.values())), 4),
        "near_done_to_free_ms": pcts(res.near_done_to_free),
    }
