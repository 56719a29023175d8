"""KV-block accounting under random load: the real Scheduler against the contract-checking stand-in worker.

Random arrivals sharing prefixes (prefix-cache hits, a warm prefix), a tight pool (preemptions), prompts up to and
past the context limit, aborts at any time (in flight, waiting, preempted), stop tokens, async scheduling, both
lanes layouts, speculative decoding (ngram, a draft model) and fail_all. After every state change the block
table is recounted against the requests that hold blocks; at the end everything is back in the pool, every request
ended exactly once, and its tokens are the stand-in model's whatever was preempted, drafted or rolled back.
"""

from __future__ import annotations

import random
from collections import Counter

import msgspec
import pytest

from batcher.request import Status, blocks_for
from batcher.scheduler import Scheduler, StepFailed
from laneserve.wire.protocol import LANE_DECODE, LANE_PREFILL, AddRequest, FinishReason, SamplingParams
from tests.test_lanes import LaneDriver
from tests.test_speculative import BS, CHEAP_VERIFY, cfg

STOP = 7
WARM = [(5 * j + 3) % 997 + 1 for j in range(40)]  # 2 full blocks pinned, and a shared prefix
PREFIXES = [WARM, [2000 + j for j in range(32)], [3000 + j for j in range(50)], []]


def model(rid: str, toks: list[int]) -> int:
    """The stand-in model: a short cycle (drafts are found and accepted), a stray token now and then (rejected
    drafts), and the stop token at request-dependent places."""
    n, k = len(toks), int(rid[1:])
    if (n * 13 + k * 7) % 89 == 0:
        return STOP
    if (n + k) % 11 == 0:
        return 5000 + n % 97
    return 1000 + (n + k) % 5


def draft_model(rid: str, toks: list[int]) -> int:
    return model(rid, toks) if len(toks) % 3 else 4242


def reference(prompt: list[int], p: SamplingParams, rid: str, max_len: int) -> tuple[list[int], FinishReason]:
    """What the request must deliver: the model's tokens up to its stop or length limit (Scheduler._append_tokens)."""
    toks, limit = list(prompt), min(len(prompt) + p.max_tokens, max_len)
    while p.max_tokens:
        toks.append(model(rid, toks))
        if toks[-1] in p.stop_token_ids and len(toks) - len(prompt) >= p.min_tokens:
            return toks[len(prompt):], FinishReason.STOP
        if len(toks) >= limit:
            break
    return toks[len(prompt):], FinishReason.LENGTH


def check_blocks(s: Scheduler, slack: int) -> None:
    """Every block is free, held or referenced once per request holding it (plus its pin); only cached full blocks
    are shared, and they hold their holders' tokens; a request holds the blocks of its computed tokens (plus, while
    speculating, up to `slack` tokens' worth of rolled-back drafts)."""
    bm = s.bm
    bm.check()
    holders = Counter()
    for req in s.requests.values():
        if req.status == Status.WAITING:
            assert not req.block_ids and not req.num_computed_tokens and not req.num_output_placeholders, req
            continue
        assert req.status == Status.RUNNING and s.running.get(req.request_id) is req, req
        have, need = len(req.block_ids), blocks_for(req.num_computed_tokens, BS)
        assert need <= have <= blocks_for(req.num_computed_tokens + slack, BS), (req, slack)
        assert req.num_computed_tokens <= s.max_len and len(set(req.block_ids)) == have, req
        holders.update(req.block_ids)
        for i, b in enumerate(req.block_ids):
            if bm.hash[b] is not None:  # complete: its tokens are this request's at that place
                assert bm.tokens[b] == tuple(req.token_ids[i * BS:(i + 1) * BS]), (req, i, b)
    for b in range(bm.num_blocks):
        assert bm.ref[b] == holders[b] + (b in bm.pinned), (b, bm.ref[b], holders[b], b in bm.pinned)
        assert holders[b] <= 1 or bm.hash[b] is not None, f"uncached block {b} shared by {holders[b]} requests"
    assert bm.num_free + bm.num_held + sum(1 for r in bm.ref if r) == bm.num_blocks
    assert s.streams or not bm.held


class StressDriver(LaneDriver):
    """LaneDriver's random completion order (each lane's own kept) for either lanes layout, sending a random number
    of the steps the scheduler offers at a time, and void outputs (after fail_all) taken as they come."""

    def send(self) -> bool:
        st = self.s.schedule(self.now)
        if st is None:
            return False
        assert self.s.streams == (st.lane in (LANE_DECODE, LANE_PREFILL))
        self.steps.append(st)
        self.flight.append((st.lane, self.w.execute(st)[0]))
        live = {}  # lane -> requests its steps in flight compute (not the void parts)
        for entry in self.s.in_flight:
            live.setdefault(entry.lane, set()).update(r.req.request_id for r in entry.records if r.req.epoch == r.epoch)
        assert not (live.get(LANE_DECODE, set()) & live.get(LANE_PREFILL, set())), "a request in both lanes"
        for rid, req in self.s.running.items():  # the worker was told every block the scheduler gave
            assert req.num_sent_blocks == len(req.block_ids) and self.w.reqs[rid][1] == req.block_ids, req
        return True

    def abandon(self) -> None:
        """A step failed on the worker: it abandons every step in flight (workers/main.py _failed: their outputs
        are errors, and its lanes' streams are synchronized, so none writes K/V any more)."""
        for i, (lane, out) in enumerate(self.flight):
            self.w.done(out.step)
            self.flight[i] = (lane, msgspec.structs.replace(out, error="RuntimeError: boom"))

    def complete(self) -> None:
        heads = {}
        for i, (lane, _) in enumerate(self.flight):
            heads.setdefault(lane, i)
        _, out = self.flight.pop(self.rng.choice(sorted(heads.values())))
        self.now += 0.01
        self.w.done(out.step)
        if out.error is not None and out.step not in self.s.void:  # then all fail (batcher/core.py)
            with pytest.raises(StepFailed) as exc:
                self.s.update(out, self.now)
            self.take(self.s.fail_all(str(exc.value)))
        else:
            self.take(self.s.update(out, self.now) or [])  # None: a void step's


def stress(seed: int) -> tuple[StressDriver, Counter]:
    rng = random.Random(seed)
    spec = rng.choice(["off", "ngram", "draft"])
    config = dict(lanes=rng.choice(["mixed", "streams"]), async_scheduling=rng.random() < 0.8, speculative=spec,
                  num_speculative_tokens=rng.choice([2, 4, 6]), max_num_batched_tokens=rng.choice([16, 40, 64, 256]),
                  max_num_seqs=rng.choice([3, 8, 32]), decode_buckets=rng.choice(["", "8,16,32"]),
                  enable_prefix_caching=rng.random() < 0.85, max_active_blocks=rng.choice([0, 0, 6, 9]),
                  long_prefill_threshold=rng.choice([2048, 40]), burst_queue_depth=rng.choice([32, 3]),
                  schedule_lead_ms=rng.choice([0.0, 0.0, 5.0]), slo_tpot_ms=rng.choice([0.0, 0.0, 8.0]),
                  slo_ttft_ms=rng.choice([0.0, 0.0, 50.0]), slo_admission=rng.choice(["off", "reject"]))
    pool, max_model_len = rng.randrange(10, 30), rng.choice([100, 160, 260])
    s = Scheduler(cfg(**config), pool, BS, max_model_len, warm_prefixes=[WARM], cost=CHEAP_VERIFY,
                  draft_size=0.05 if spec == "draft" else 0.0)
    d = StressDriver(s, rng, model)
    d.w.draft_fn = draft_model
    slack = s.cfg.num_speculative_tokens if spec != "off" else 0
    expect, events = {}, Counter()
    n_requests, added = rng.randrange(20, 50), 0
    fail_at = rng.randrange(20, 300) if rng.random() < 0.3 else -1  # when the worker fails, if it does
    idle = last_arrival = 0
    for it in range(5000):
        for _ in range(min(rng.choice([0] * 6 + [1, 1, 2, 6]), n_requests - added)):  # in bursts
            rid, last_arrival = f"q{added}", it
            added += 1
            shape = rng.random()
            n = s.max_len + rng.choice([-2, -1, 0, 0, 1]) if shape < 0.15 else rng.randrange(1, 70)
            prompt = (rng.choice(PREFIXES) + [10_000 + 100 * added + j for j in range(n)])[:n]
            if shape > 0.85 and expect:  # an earlier request's prompt: a hit on all its full blocks but the last
                prompt = rng.choice(list(expect.values()))[0]
            p = SamplingParams(max_tokens=rng.choice([0, 1, 3, 12, 40, 100, 400]), temperature=0.0,
                               stop_token_ids=rng.choice([(), (STOP,)]), min_tokens=rng.choice([0, 0, 2]),
                               prompt_logprobs=rng.choice([None] * 9 + [0]))
            msg = AddRequest(request_id=rid, prompt_token_ids=prompt, params=p, arrival_time=d.now,
                             priority=rng.choice([0, 0, 1]), slo_ttft_ms=rng.choice([0.0, 0.0, 20.0]),
                             speculative=rng.random() < 0.9)
            if s.add_request(msg, d.now) is None:  # else shed (SLO admission): no delta
                expect[rid] = (prompt, p)
            else:
                events["shed"] += 1
        if rng.random() < 0.04 and added and it < last_arrival + 30:  # running, in flight, waiting, preempted, gone
            d.take(s.abort_requests([f"q{rng.randrange(added)}"]))
            events["aborts"] += 1
        if it == fail_at:  # every step in flight comes back failed; all fail at the first, or at once (lost)
            d.abandon()
            if not d.flight or rng.random() < 0.5:
                d.take(s.fail_all("worker lost"))
            events["fail_all"] += 1
        check_blocks(s, slack)
        while rng.random() < 0.7 and d.send():
            check_blocks(s, slack)
        if d.flight:
            d.complete()
            check_blocks(s, slack)
            idle = 0
        elif not d.send():  # idle: time passes (a gated prompt is let through), else it is stuck
            d.now += 0.5
            idle += 1
            if added == n_requests and (not s.num_unfinished or idle > 10):
                break
    assert not s.num_unfinished, f"stuck: {list(s.requests.values())}"
    assert not s.in_flight and not s.num_unfinished and not d.w.reqs and not s.bm.held
    s.bm.check()
    # the warm prefix's full blocks (none without prefix caching: nothing would find them)
    assert s.bm.num_free == pool - len(s.bm.pinned) and len(s.bm.pinned) == (2 if s.bm.enable_prefix_caching else 0)
    assert set(d.finish) == set(expect)  # each exactly once: Driver.take refuses a delta after the last
    for rid, (prompt, p) in expect.items():
        want, why = reference(prompt, p, rid, s.max_len)
        got, finish = d.tokens.get(rid, []), d.finish[rid]
        events[finish.name] += 1
        if finish in (FinishReason.ABORT, FinishReason.ERROR):
            assert got == want[:len(got)], rid
        else:
            assert (got, finish) == (want, why), rid
    events["preemptions"] += s.preemptions
    events["hits"] += s.bm.hits
    events["spec_accepted"] += s.stats().spec_accepted
    return d, events


SEEDS = [*range(14), 1071]  # 1071: a prompt that fitted until the warm prefix was pinned (it held up the line)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_load_keeps_the_block_table_consistent(seed):
    stress(seed)


def test_the_random_load_reaches_what_it_means_to():
    runs = [stress(seed) for seed in SEEDS]
    seen = sum((events for _, events in runs), Counter())
    assert all(seen[k] for k in ("preemptions", "hits", "spec_accepted", "aborts", "fail_all", "shed", "ABORT",
                                 "STOP", "ERROR", "LENGTH")), seen
    assert {(d.s.cfg.lanes, d.s.cfg.speculative) for d, _ in runs} >= {(lanes, spec) for lanes in ("mixed", "streams")
                                                                        for spec in ("off", "ngram")}
    assert {d.s.cfg.speculative for d, _ in runs} == {"off", "ngram", "draft"}
