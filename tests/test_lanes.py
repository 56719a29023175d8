"""Two lanes (issue 21, `--lanes streams`): decode-only and prefill-only steps in flight at once.

The scheduler's rules in simulated time against the contract-checking stand-in worker, which for two lanes also
checks that no step touches a block that another lane's step still in flight writes; the simulator's lane timing;
and greedy tokens identical to mixed mode and to transformers through the real model runner, for every model
family, and through the stack.
"""

from __future__ import annotations

import dataclasses
import random

import msgspec
import pytest

from batcher.block_manager import BlockManager
from batcher.config import BatcherConfig
from batcher.request import Request
from batcher.scheduler import Scheduler, StepOrderError
from batcher.sim.engine import CostModel, SimRequest, simulate
from laneserve.wire import protocol as P
from laneserve.wire.protocol import LANE_DECODE, LANE_MIXED, LANE_PREFILL, FinishReason
from tests.test_async_scheduling import _mix
from tests.test_scheduler import Driver, add

BS = 16


def cfg(**kw) -> BatcherConfig:
    return dataclasses.replace(BatcherConfig(), **kw)


class LaneDriver(Driver):
    """Keeps in flight whatever the scheduler gives (a prefill step and up to two decode steps), runs each on the
    stand-in worker as it is sent, and completes them in a random order that keeps each lane's own order."""

    def __init__(self, s: Scheduler, rng: random.Random, token_fn=None):
        super().__init__(s, token_fn)
        self.rng = rng
        self.flight: list[tuple[int, P.StepOutput]] = []  # (lane, output) in send order
        self.overlapped = 0  # completions made while both lanes had a step in flight

    def fill(self) -> None:
        while (st := self.s.schedule(self.now)) is not None:
            assert st.lane in (LANE_DECODE, LANE_PREFILL)
            assert st.lane == LANE_PREFILL or all(
                n == 1 + len(st.spec_token_ids.get(rid, ())) + (st.draft_jobs[rid].k if rid in st.draft_jobs else 0)
                for rid, n in st.num_scheduled_tokens.items())
            self.steps.append(st)
            self.flight.append((st.lane, self.w.execute(st)[0]))
            live = {}  # lane -> requests its steps in flight compute (not the void parts)
            for entry in self.s.in_flight:
                live.setdefault(entry.lane, set()).update(r.req.request_id for r in entry.records
                                                          if r.req.epoch == r.epoch)
            assert not (live.get(LANE_DECODE, set()) & live.get(LANE_PREFILL, set())), "a request in both lanes"
            for lane in live:  # a step with drafts is alone in flight in its lane (what it accepts places the next)
                entries = [entry for entry in self.s.in_flight if entry.lane == lane]
                assert len(entries) == 1 or not any(entry.drafts for entry in entries), "a step behind drafts"

    def step(self):
        self.fill()
        if not self.flight:
            return None
        heads = {}
        for i, (lane, _) in enumerate(self.flight):
            heads.setdefault(lane, i)
        self.overlapped += len(heads) == 2
        lane, out = self.flight.pop(self.rng.choice(sorted(heads.values())))
        self.now += 0.01
        self.w.done(out.step)
        self.take(self.s.update(out, self.now))
        self.s.bm.check()
        return True


def _mixed_tokens(setup, pool, **config) -> dict[str, list[int]]:
    d = Driver(Scheduler(cfg(async_scheduling=False, **config), *pool))
    setup(d.s)
    d.run()
    return d.tokens


def _setup(s: Scheduler) -> None:
    for i, (n, m) in enumerate([(5, 1), (15, 2), (16, 3), (17, 17), (40, 40), (100, 9), (31, 33), (300, 20),
                                (70, 60)]):
        add(s, f"r{i}", n, base=100 * i, max_tokens=m)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streams_give_the_same_tokens_as_mixed_and_keep_the_lanes_apart(seed):
    pool = (256, BS, 8192)
    ref = _mixed_tokens(_setup, pool, max_num_batched_tokens=64)
    d = LaneDriver(Scheduler(cfg(lanes="streams", max_num_batched_tokens=64), *pool), random.Random(seed))
    _setup(d.s)
    d.run()
    assert d.tokens == ref and all(f == FinishReason.LENGTH for f in d.finish.values())
    assert d.overlapped > 0  # the lanes really ran at once
    assert {st.lane for st in d.steps} == {LANE_DECODE, LANE_PREFILL}
    assert d.s.bm.num_free == 256 and not d.s.bm.held and not d.w.reqs


@pytest.mark.parametrize("seed", [3, 4])
def test_a_tiny_pool_preempts_across_lanes_and_loses_nothing(seed):
    rng = random.Random(seed)
    jobs = [(rng.randrange(5, 90), rng.randrange(1, 50)) for _ in range(14)]

    def setup(s):
        for i, (n, m) in enumerate(jobs):
            add(s, f"r{i}", n, base=50 * i, max_tokens=m)

    pool = (20, BS, 8192)
    ref = _mixed_tokens(setup, pool, max_num_batched_tokens=48)
    d = LaneDriver(Scheduler(cfg(lanes="streams", max_num_batched_tokens=48), *pool), rng)
    setup(d.s)
    d.run()
    assert d.s.preemptions > 0 and d.overlapped > 0
    assert d.tokens == ref and all(f == FinishReason.LENGTH for f in d.finish.values())


def test_a_decode_waiting_for_held_blocks_gets_them_before_a_readmission():
    """11 blocks: a decode needs one more while another prompt's first chunk is in flight and the pool is full. It
    preempts that prompt, whose blocks are held until its chunk is done; the next prefill step must not admit the
    prompt again onto them (it did, then the decode step preempted it again: for ever)."""
    s = Scheduler(cfg(lanes="streams", max_num_batched_tokens=40), 11, BS, 8192)
    d = LaneDriver(s, random.Random(0))
    for i, (n, m) in enumerate([(105, 9), (1, 9), (1, 0), (42, 1)]):
        add(s, f"r{i}", n, base=100 * i, max_tokens=m)
    d.run(max_steps=100)
    assert d.finish == dict.fromkeys(["r0", "r1", "r2", "r3"], FinishReason.LENGTH) and s.preemptions == 1


def test_update_takes_each_lanes_oldest_step_in_any_lane_order():
    s = Scheduler(cfg(lanes="streams"), 64, BS, 8192)
    d = LaneDriver(s, random.Random(0))
    add(s, "a", 20, max_tokens=30)
    d.fill()
    ((lane, first),) = d.flight  # a's prefill; nothing decodes until its output is applied
    assert lane == LANE_PREFILL
    d.flight.clear()
    d.w.done(first.step)
    d.take(s.update(first, 0.1))
    add(s, "b", 40, base=500, max_tokens=5)
    d.fill()
    assert [lane for lane, _ in d.flight] == [LANE_PREFILL, LANE_DECODE, LANE_DECODE]
    (_, pre), (_, dec1), (_, dec2) = d.flight
    with pytest.raises(StepOrderError, match=f"returned step {dec2.step}, expected {pre.step} or {dec1.step}"):
        s.update(dec2, 0.2)


def test_a_freed_block_a_step_may_still_write_is_held_until_that_step_is_done():
    bm = BlockManager(8, 4)
    req = Request("a", list(range(10)), P.SamplingParams(max_tokens=4))
    assert bm.allocate(req, 10)
    req.num_computed_tokens = 8
    bm.cache_full_blocks(req)  # blocks 0 and 1 are full and cached: complete, never written again
    tail = req.block_ids[2]
    bm.free_blocks(req, fence=5)
    assert bm.num_free == 7 and bm.num_held == 1 and list(bm.held) == [(5, [tail])]
    bm.check()
    bm.release_held(5)  # step 5 is still in flight
    assert bm.num_free == 7
    bm.release_held(6)
    assert bm.num_free == 8 and not bm.held
    bm.check()


def _pipelined_trace(seed: int) -> tuple[list[SimRequest], dict[str, float], list[int]]:
    rng = random.Random(seed)
    system = [(42 * 7919 + j) % 32000 for j in range(64)]
    reqs = [SimRequest(0.002 * i, (system if i % 3 == 0 else []) + [(i % 7 * 31 + j) % 32000
                                                                    for j in range(rng.randrange(5, 160))],
                       rng.randrange(1, 60)) for i in range(120)]
    aborts = {f"r{i}": 0.002 * i + rng.choice([0.0, 0.01, 0.03]) for i in range(0, 120, 7)}
    return reqs, aborts, system


@pytest.mark.parametrize("seed", [1, 2])
def test_simulated_streams_with_a_tiny_pool_aborts_and_a_warm_prefix(seed):
    reqs, aborts, system = _pipelined_trace(seed)
    cost = CostModel(a=4.0, b=0.06, c=0.05, d=0.0001)
    res = simulate(reqs, cfg(lanes="streams", max_num_batched_tokens=128), cost, num_blocks=32, check_kv=True,
                   aborts=aborts, warm_prefixes=[system], pipelined=True)
    assert res.preemptions > 0 and res.finish.get("ERROR", 0) == 0 and sum(res.finish.values()) == len(reqs)
    for i, r in enumerate(reqs):
        if f"r{i}" not in aborts:
            assert res.output_tokens[f"r{i}"] == r.output_tokens
    (s,) = res.schedulers
    s.bm.check()
    assert s.bm.num_free + len(s.bm.pinned) == s.num_blocks and not s.bm.held and not s.in_flight


def test_the_checking_worker_catches_a_block_handed_across_lanes_too_early(monkeypatch):
    """Without the held blocks, a block freed while a decode step still writes it goes to a prefill step."""
    reqs, aborts, system = _pipelined_trace(1)
    monkeypatch.setattr(Scheduler, "_fence", lambda self: None)
    with pytest.raises(AssertionError, match="still in flight writes"):
        simulate(reqs, cfg(lanes="streams", max_num_batched_tokens=128), CostModel(a=4.0, b=0.06, c=0.05, d=1e-4),
                 num_blocks=32, check_kv=True, aborts=aborts, pipelined=True)


def test_in_the_simulator_decodes_stop_waiting_for_a_long_prefill():
    """32 requests decoding, then a 4k-token prompt: mixed, its 2k-token chunks hold up two decode steps; streams,
    the decodes go on beside them (the simulator's lanes are independent queues: step times learned on a streams
    server hold the sharing), and the prompt's first token comes no later."""
    reqs = [SimRequest(0.0, [(i * 97 + j) % 32000 for j in range(64)], 40) for i in range(32)]
    reqs.append(SimRequest(0.05, [(7 + j) % 32000 for j in range(4096)], 8))
    cost = CostModel(a=5.0, b=0.02, c=0.01, d=2e-5)
    res = {lanes: simulate(reqs, cfg(lanes=lanes, burst_gating=False), cost, pipelined=True)
           for lanes in ("mixed", "streams")}
    tpot = {lanes: max(r.tpot) for lanes, r in res.items()}
    assert tpot["mixed"] > 0.008 and tpot["streams"] < 0.007
    assert res["streams"].ttft_of["r32"] <= res["mixed"].ttft_of["r32"]


def test_lanes_is_validated():
    from batcher.core import Batcher

    with pytest.raises(ValueError, match="lanes must be one of auto, mixed, streams, got 'both'"):
        Scheduler(cfg(lanes="both"), 8, BS, 100)
    with pytest.raises(SystemExit, match="--lanes must be one of auto, mixed, streams, got 'both'"):
        Batcher(cfg(lanes="both"))
    assert BatcherConfig().lanes == "mixed"
    s = Scheduler(cfg(), 64, BS, 100)  # auto without a worker to ask (tests, the simulator): mixed
    add(s, "a", 5)
    assert not s.streams and s.schedule(0.0).lane == LANE_MIXED


# ---------------------------------------------------------------------- the real model runner
@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def family(request, tmp_path_factory):
    from tests.helpers_models import ARCHS, DEVICE, make_checkpoint
    from workers.config import WorkerConfig
    from workers.runner import ModelRunner

    path = str(tmp_path_factory.mktemp(request.param))
    hf = make_checkpoint(path, request.param, seed=ARCHS.index(request.param))
    runner = ModelRunner(WorkerConfig(model=path, device=DEVICE, dtype="float32", kv_cache_memory="4MiB",
                                      max_model_len=512))
    return hf, runner


def engine(runner, lanes: str, jobs: dict[str, tuple], rng: random.Random, cost: CostModel | None = None,
           params: dict | None = None, num_blocks: int | None = None, aborts: dict[str, int] | None = None,
           deltas: list[P.TokenDelta] | None = None, **config) -> tuple[dict[str, list[int]], Scheduler]:
    """The real Scheduler driving the real ModelRunner in process, steps through the wire format; outputs applied
    in a random order that keeps each lane's. Returns each request's tokens (greedy unless `params` say otherwise;
    a job (prompt, n, its own params) adds to them), and the scheduler. The outputs reach the scheduler without
    their wall-clock times, so its cost model (hence its choices: K, chunking) is `cost`'s and the run is the same
    on a loaded machine. num_blocks: the scheduler's pool (default the runner's); aborts: request id -> the number
    of outputs applied before it is aborted; deltas: gets every delta."""
    s = Scheduler(cfg(**{"lanes": lanes, "max_num_batched_tokens": 40} | config), num_blocks or runner.num_blocks,
                  runner.block_size, runner.max_model_len, cost=cost)
    for rid, (prompt, n, *own) in jobs.items():
        sp = P.SamplingParams(**({"max_tokens": n, "temperature": 0.0} | (params or {}) | (own[0] if own else {})))
        s.add_request(P.AddRequest(request_id=rid, prompt_token_ids=prompt, params=sp, arrival_time=0.0), 0.0)
    wire = P.decoder(P.BatcherToWorker)
    outs: list[tuple[int, P.StepOutput]] = []
    tokens: dict[str, list[int]] = {}
    now = 0.0
    runner.reset()
    lane_of = {}
    aborts = dict(aborts or {})

    def take() -> list[tuple[int, P.StepOutput]]:
        return [(lane_of[o.step], msgspec.structs.replace(o, execute_time=0.0, draft_time=0.0, idle_time=0.0,
                                                           launch_time=0.0)) for o in runner.take_outputs()]

    applied = 0
    while s.num_unfinished or s.in_flight:  # (an aborted request's blocks may wait for the steps in flight)
        while (st := s.schedule(now)) is not None:
            lane_of[st.step] = st.lane
            runner.submit(wire.decode(P.encode(st)))
            outs += take()
        if not outs:  # on a GPU the steps may all be in flight still
            runner.flush()
            outs += take()
        heads = {}
        for i, (lane, _) in enumerate(outs):
            heads.setdefault(lane, i)
        now += 0.01
        new = s.update(outs.pop(rng.choice(sorted(heads.values())))[1], now)
        assert all(d.finish_reason in (None, FinishReason.LENGTH, FinishReason.STOP) for d in new), new
        applied += 1
        new += s.abort_requests([rid for rid, at in aborts.items() if at <= applied])
        aborts = {rid: at for rid, at in aborts.items() if at > applied}
        for d in new:
            tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
        if deltas is not None:
            deltas += new
    assert s.bm.num_free == s.num_blocks
    return tokens, s


def test_every_family_decodes_the_same_greedy_tokens_in_both_modes(family):
    from tests.helpers_models import hf_greedy, random_prompt

    hf, runner = family
    jobs = {f"r{i}": (random_prompt(n, seed=20 + i), m) for i, (n, m) in enumerate([(3, 9), (37, 24), (90, 12),
                                                                                      (17, 30), (60, 5)])}
    mixed, _ = engine(runner, "mixed", jobs, random.Random(0))
    streams, _ = engine(runner, "streams", jobs, random.Random(1))
    assert streams == mixed
    assert all(mixed[rid] == hf_greedy(hf, prompt, n) for rid, (prompt, n) in jobs.items())


async def test_stack_greedy_outputs_match_in_both_modes(stack, make_stack):
    """On CPU the worker runs the two lanes' steps one after the other (auto picks mixed there)."""
    streams = make_stack("--lanes", "streams", env={"LANESERVE_LOG_LEVEL": "INFO"})
    assert await _mix(streams.base_url) == await _mix(stack.base_url)
    assert any("streams lanes" in line for line in streams.lines)
    assert not any("failing its requests" in line for line in streams.lines)


def test_a_step_the_batcher_finds_wrong_fences_the_new_pool_until_the_other_lanes_void_steps_are_back():
    """A review: the batcher's own StepFailed (a row missing) reset the pool while the decode lane's steps, now void,
    still ran on the worker's other stream, and the next prefill was given blocks they still wrote. No step now
    until they are back; when the worker itself failed a step it dropped the others, so nothing waits."""
    from batcher.scheduler import StepFailed
    from batcher.sim.engine import SimWorker

    for worker_failed in (False, True):
        s = Scheduler(dataclasses.replace(BatcherConfig(), lanes="streams"), 8, 16, 4096)
        w = SimWorker(8, 16, check_kv=True)

        def add(rid: str, n: int, base: int) -> None:
            s.add_request(P.AddRequest(request_id=rid, prompt_token_ids=[base + i for i in range(n)],
                                       params=P.SamplingParams(max_tokens=50), arrival_time=0.0), now=0.0)

        add("a", 20, 100)
        first = s.schedule(0.0)
        out = w.execute(first)[0]
        w.done(first.step)
        s.update(out, 0.01)
        add("b", 20, 300)
        flight = []
        while (st := s.schedule(0.02)) is not None:
            flight.append((st, w.execute(st)[0]))
        pre = next(o for st, o in flight if st.lane == LANE_PREFILL)
        w.done(pre.step)
        with pytest.raises(StepFailed):
            s.update(P.StepOutput(step=pre.step, worker_id=0, request_ids=pre.request_ids, sampled_token_ids=[]),
                     0.03)
        s.fail_all("bad rows", worker_failed=worker_failed)
        add("c", 40, 500)
        decodes = [o for st, o in flight if st.lane == LANE_DECODE]
        assert decodes  # steps of the other lane in flight when it failed
        if worker_failed:
            assert s.schedule(0.04) is not None  # nothing to wait for
            continue
        assert s.schedule(0.04) is None  # fenced: void steps still run on the worker
        for o in decodes:
            w.done(o.step)
            assert s.update(o, 0.05) is None  # void: dropped
        st = s.schedule(0.06)
        assert st is not None and "c" in st.num_scheduled_tokens
        w.execute(st)  # the SimWorker checks no block is written by two steps in flight
