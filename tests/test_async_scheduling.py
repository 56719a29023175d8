"""Async scheduling (issue 7): two steps in flight per scheduler, against the contract-checking stand-in worker.

The driver keeps up to `max_inflight_steps` steps scheduled ahead, runs each one on the stand-in worker in order
(as the real worker would: it appends its own sampled token before the next step), and feeds the outputs back
oldest first. Tokens depend only on position, so async and strict alternation must give identical outputs.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque

import pytest

from batcher.config import BatcherConfig
from batcher.protocol import FinishReason, StepOutput
from batcher.scheduler import Scheduler
from batcher.simulator import CostModel, SimRequest, simulate
from tests.test_scheduler import Driver, add

BS = 16


def cfg(**kw) -> BatcherConfig:
    return dataclasses.replace(BatcherConfig(), **kw)


class AsyncDriver(Driver):
    """Keeps up to max_inflight_steps steps in flight: schedule, schedule, update, schedule, update, ..."""

    def __init__(self, s: Scheduler, token_fn=None, check_kv: bool = True):
        self.sampled: dict[str, int] = {}  # tokens the worker sampled per request (kept or discarded)

        def counting(rid, toks):
            self.sampled[rid] = self.sampled.get(rid, 0) + 1
            return token_fn(rid, toks) if token_fn else (len(toks) * 31 + len(rid)) % 32000

        super().__init__(s, counting, check_kv)
        self.flight: deque[StepOutput] = deque()
        self.max_depth = 0

    def fill(self) -> None:
        while len(self.flight) < self.s.max_inflight_steps:
            st = self.s.schedule(self.now)
            if st is None:
                break
            self.steps.append(st)
            self.flight.append(self.w.execute(st)[0])
            self.max_depth = max(self.max_depth, len(self.flight))

    def complete(self) -> None:
        self.now += 0.01
        self.take(self.s.update(self.flight.popleft(), self.now))
        self.s.bm.check()

    def step(self):
        self.fill()
        if not self.flight:
            return None
        self.complete()
        return True


def sync_tokens(setup, token_fn=None, **kw) -> Driver:
    s = Scheduler(cfg(async_scheduling=False, **kw.pop("config", {})), *kw.pop("pool"))
    d = Driver(s, token_fn=token_fn)
    setup(s)
    d.run()
    return d


def run_both(setup, pool, token_fn=None, config=None) -> tuple[Driver, AsyncDriver]:
    sync = sync_tokens(setup, token_fn, pool=pool, config=config or {})
    s = Scheduler(cfg(**(config or {})), *pool)
    d = AsyncDriver(s, token_fn=token_fn)
    setup(s)
    d.run()
    assert d.max_depth == 2  # the steps really overlapped
    return sync, d


def test_every_request_gets_exactly_max_tokens_and_the_same_tokens_as_strict_alternation():
    def setup(s):
        for i, (n, m) in enumerate([(5, 1), (15, 2), (16, 3), (17, 17), (40, 40), (100, 9), (31, 33)]):
            add(s, f"r{i}", n, base=100 * i, max_tokens=m)

    sync, d = run_both(setup, (256, BS, 8192))
    assert d.tokens == sync.tokens
    assert all(f == FinishReason.LENGTH for f in d.finish.values())
    assert {r: len(t) for r, t in d.tokens.items()} == {"r0": 1, "r1": 2, "r2": 3, "r3": 17, "r4": 40, "r5": 9,
                                                         "r6": 33}
    # Never scheduled past max_tokens: the worker sampled exactly what was delivered, nothing discarded.
    assert d.sampled == {r: len(t) for r, t in d.tokens.items()}
    assert d.s.bm.num_free == 256
    assert not d.w.reqs  # the worker dropped every request


def test_decode_is_scheduled_on_the_in_flight_token_with_its_new_block():
    s = Scheduler(cfg(), 64, BS, 8192)
    d = AsyncDriver(s)
    add(s, "a", 15, max_tokens=5)  # positions 0..14; the first decode (position 15) fills block 0, then block 1
    d.fill()
    first, second = d.steps
    assert first.num_scheduled_tokens == {"a": 15} and len(first.new_reqs[0].block_ids) == 1
    assert second.num_scheduled_tokens == {"a": 1} and not second.cached_reqs  # position 15: still block 0
    assert s.requests["a"].num_output_placeholders == 2
    d.complete()
    d.fill()
    third = d.steps[2]
    assert third.num_scheduled_tokens == {"a": 1} and third.cached_reqs[0].new_block_ids  # position 16: block 1
    d.run()
    assert len(d.tokens["a"]) == 5


def test_schedule_refuses_a_third_step_and_sync_mode_refuses_a_second():
    for on, depth in ((True, 2), (False, 1)):
        s = Scheduler(cfg(async_scheduling=on), 64, BS, 8192)
        add(s, "a", 10, max_tokens=50)
        steps = [s.schedule(0.0) for _ in range(3)]
        assert [st is not None for st in steps] == [True] * depth + [False] * (3 - depth)


def test_update_rejects_an_output_that_is_not_of_the_oldest_step():
    s = Scheduler(cfg(), 64, BS, 8192)
    add(s, "a", 10, max_tokens=50)
    s.schedule(0.0)
    second = s.schedule(0.0)
    with pytest.raises(ValueError):
        s.update(StepOutput(step=second.step, worker_id=0), 0.0)


def test_stop_tokens_end_requests_exactly_and_the_extra_in_flight_token_is_discarded():
    stop_at = {"s1": 1, "s3": 3, "s8": 8, "min": 2, "never": 10**9}

    def token_fn(rid, toks):  # the stop token 7 at output position stop_at[rid] (1-based), else non-stop tokens
        n_out = len(toks) - 20 + 1
        return 7 if n_out >= stop_at[rid] else 1000 + n_out

    def setup(s):
        for rid in stop_at:
            kw = {"min_tokens": 4} if rid == "min" else {}
            add(s, rid, 20, base=300 * len(rid), max_tokens=12, stop_token_ids=(7,), **kw)

    sync, d = run_both(setup, (128, BS, 8192), token_fn)
    assert d.tokens == sync.tokens
    assert d.tokens["s1"] == [7] and d.tokens["s3"] == [1001, 1002, 7] and d.tokens["s8"][-1] == 7
    assert len(d.tokens["s8"]) == 8 and d.tokens["min"] == [1001, 7, 7, 7] and len(d.tokens["never"]) == 12
    assert {r: f.name for r, f in d.finish.items()} == {"s1": "STOP", "s3": "STOP", "s8": "STOP", "min": "STOP",
                                                        "never": "LENGTH"}
    # The stopped ones were decoding in the next step already: the worker sampled one token more, never emitted.
    assert all(d.sampled[r] == len(d.tokens[r]) + 1 for r in ("s1", "s3", "s8", "min"))
    assert d.sampled["never"] == 12
    # ... and the worker was told to drop them after the fact.
    told = [rid for st in d.steps for rid in st.finished_req_ids]
    assert sorted(told) == sorted(stop_at) and not d.w.reqs
    assert d.s.bm.num_free == 128


def test_length_limits_count_tokens_in_flight():
    def setup(s):
        add(s, "ctx", 35, max_tokens=100)  # max_model_len 40: 5 tokens
        add(s, "one", 10, base=500, max_tokens=1)
        add(s, "two", 16, base=700, max_tokens=2)

    sync, d = run_both(setup, (64, BS, 40))
    assert d.tokens == sync.tokens and d.sampled == {"ctx": 5, "one": 1, "two": 2}
    s = Scheduler(cfg(max_active_blocks=2), 64, BS, 8192)
    d = AsyncDriver(s)
    add(s, "cap", 10, max_tokens=100)
    d.run()
    assert len(d.tokens["cap"]) == 22 and d.sampled["cap"] == 22 and d.finish["cap"] == FinishReason.LENGTH


def test_abort_with_two_steps_in_flight():
    s = Scheduler(cfg(), 64, BS, 8192)
    d = AsyncDriver(s)
    add(s, "a", 20, max_tokens=50)
    add(s, "b", 20, base=400, max_tokens=6)
    d.fill()
    d.complete()
    d.fill()  # two steps in flight, both decoding a
    assert len(d.flight) == 2 and all("a" in st.num_scheduled_tokens for st in d.steps[-2:])
    got = len(d.tokens["a"])
    d.take(s.abort_requests(["a"]))
    assert d.finish["a"] == FinishReason.ABORT
    assert s.bm.num_free == 64 - 2  # a's blocks are back at once; b holds 2
    d.run()  # the outputs of both steps in flight for a are dropped (Driver.take asserts no delta after finish)
    assert len(d.tokens["a"]) == got and d.sampled["a"] > got
    assert [st.finished_req_ids for st in d.steps[3:4]] == [["a"]] and "a" not in d.w.reqs
    assert len(d.tokens["b"]) == 6 and s.bm.num_free == 64


def test_preemption_of_in_flight_requests_under_a_tiny_pool():
    def setup(s):
        for i in range(4):
            add(s, f"r{i}", 30, base=100 * i, max_tokens=40)  # 70 tokens = 5 blocks each; 4 x 5 > 12

    sync, d = run_both(setup, (12, BS, 8192), config={"decode_buckets": ""})
    assert d.s.stats().preemptions > 0
    assert d.tokens == sync.tokens and all(len(t) == 40 for t in d.tokens.values())
    assert set(d.finish.values()) == {FinishReason.LENGTH}
    # Victims were in the step in flight: their token from it was sampled but dropped, then recomputed.
    assert sum(d.sampled.values()) > 4 * 40
    assert d.s.bm.num_free == 12 and not d.w.reqs


def test_a_request_short_of_blocks_waits_for_one_whose_last_token_is_in_flight():
    # 4 blocks: a and b hold 2 each. When b needs a third block, a is not schedulable (its last token is in
    # flight) and so not a victim; b, alone in the run order, must wait for a's blocks, not fail as "pool too small".
    def setup(s):
        add(s, "a", 31, max_tokens=2)
        add(s, "b", 31, base=500, max_tokens=10)

    sync, d = run_both(setup, (4, BS, 8192))
    assert d.tokens == sync.tokens and d.finish == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}
    assert len(d.tokens["b"]) == 10 and d.s.stats().preemptions == 0


def test_fail_all_with_steps_in_flight_resets_everything():
    s = Scheduler(cfg(), 64, BS, 8192)
    d = AsyncDriver(s)
    add(s, "a", 20, max_tokens=50)
    add(s, "b", 20, base=400, max_tokens=50)
    d.fill()
    assert len(d.flight) == 2
    deltas = s.fail_all("worker lost")
    assert sorted((x.request_id, x.finish_reason) for x in deltas) == [("a", FinishReason.ERROR),
                                                                       ("b", FinishReason.ERROR)]
    assert not s.in_flight and s.bm.num_free == 64 and s.num_unfinished == 0
    with pytest.raises(ValueError):  # the old steps' outputs are not the scheduler's any more (core drops them)
        s.update(d.flight[0], 1.0)
    add(s, "c", 20, base=800, max_tokens=3)
    st = s.schedule(1.0)
    assert sorted(st.finished_req_ids) == ["a", "b"] and list(st.num_scheduled_tokens) == ["c"]


def tokens(k: int, n: int) -> list[int]:
    return [(k * 7919 + j) % 32000 for j in range(n)]


@pytest.mark.parametrize("seed", [1, 2])
def test_pipelined_simulation_with_a_tiny_pool_aborts_and_a_warm_prefix(seed):
    rng = random.Random(seed)
    system = tokens(42, 64)
    reqs = [SimRequest(0.002 * i, (system if i % 3 == 0 else []) + tokens(i % 7, rng.randrange(5, 120)),
                       rng.randrange(1, 60)) for i in range(120)]
    aborts = {f"r{i}": 0.002 * i + rng.choice([0.0, 0.01, 0.03]) for i in range(0, 120, 7)}
    kw = dict(num_blocks=32, check_kv=True, aborts=aborts, warm_prefixes=[system])
    cost = CostModel(a=4.0, b=0.06, c=0.05, d=0.0001)
    res = simulate(reqs, cfg(), cost, pipelined=True, **kw)
    ref = simulate(reqs, cfg(async_scheduling=False), cost, **kw)
    assert res.preemptions > 0 and res.finish.get("ERROR", 0) == 0
    assert sum(res.finish.values()) == len(reqs)
    for i, r in enumerate(reqs):  # not aborted -> exactly its length (abort timing may differ between the runs)
        if f"r{i}" not in aborts:
            assert res.output_tokens[f"r{i}"] == r.output_tokens
    assert res.finish["LENGTH"] >= len(reqs) - len(aborts)
    assert sum(ref.finish.values()) == len(reqs)
    for s in res.schedulers:
        s.bm.check()
        assert s.bm.num_free + len(s.bm.pinned) == s.num_blocks and s.num_unfinished == 0 and not s.in_flight
        assert len(s.bm.pinned) == 4


def test_async_is_the_default_and_a_flag():
    import argparse

    from laneserve.config import add_arguments, from_args, to_argv

    ap = argparse.ArgumentParser()
    add_arguments(ap, BatcherConfig)
    assert from_args(BatcherConfig, ap.parse_args([]), env={}).async_scheduling is True
    off = from_args(BatcherConfig, ap.parse_args(["--no-async-scheduling"]), env={})
    assert off.async_scheduling is False and to_argv(off) == ["--no-async-scheduling"]
    assert Scheduler(off, 8, BS, 100).max_inflight_steps == 1
    assert Scheduler(cfg(), 8, BS, 100).max_inflight_steps == 2
