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
from laneserve.wire.protocol import AddRequest, FinishReason, SamplingParams, StepOutput
from batcher.scheduler import Scheduler, StepFailed, StepOrderError
from batcher.sim.engine import CostModel, SimRequest, simulate
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
    with pytest.raises(StepOrderError, match="^worker 0 returned step 2, expected 1$"):
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


def test_generated_blocks_are_cached_once_their_tokens_are_known():
    # A follow-up turn (prompt = previous prompt + answer + more) hits every full block of the first turn, also
    # the ones completed by decodes: a block is offered to the prefix cache only when the step that finished
    # writing it is back (with a decode in flight, its last token is not known yet).
    for on in (False, True):
        s = Scheduler(cfg(async_scheduling=on), 64, BS, 8192)
        d = AsyncDriver(s)
        add(s, "turn1", 31, max_tokens=30)  # the prefill fills block 0 and all of block 1 but its last token
        d.run()
        history = [i % 1000 for i in range(31)] + d.tokens["turn1"]
        s.add_request(AddRequest(request_id="turn2", prompt_token_ids=history + [1, 2, 3, 4, 5], arrival_time=0.0,
                                 params=SamplingParams(max_tokens=3)))
        d.run()
        assert d.deltas[[x.request_id for x in d.deltas].index("turn2")].num_cached_tokens == 48, on


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


def test_random_mixes_give_the_same_outputs_as_strict_alternation():
    runs = [_random_mix(seed) for seed in range(8)]
    assert sum(p for p, _, _ in runs) > 5 and sum(st for _, st, _ in runs) > 20 and {d for _, _, d in runs} == {2}


def _random_mix(seed: int) -> tuple[int, int, int]:
    """Same tokens and finishes as strict alternation, limits honoured; -> (preemptions, stops, max depth)."""
    rng = random.Random(seed)
    pool = rng.choice([10, 16, 40, 200])
    config = {"decode_buckets": rng.choice(["", "8,16,32"]), "max_num_batched_tokens": rng.choice([32, 64, 2048]),
              "max_num_seqs": rng.choice([3, 256]), "enable_prefix_caching": rng.random() < 0.7}
    shared = [9000 + j for j in range(rng.choice([0, 16, 40]))]

    def token_fn(rid, toks):  # a stop token at a deterministic, request-dependent place, else position-based
        return 7 if (sum(map(ord, rid)) * 7 + len(toks) * 13) % 23 == 0 else 1000 + len(toks) % 500

    def setup(s):
        for i in range(rng.randrange(5, 25)):
            n = rng.randrange(1, 60)
            prompt = (shared + [100 * i + j for j in range(n)])[:8 * BS]
            s.add_request(AddRequest(request_id=f"q{i}", prompt_token_ids=prompt, arrival_time=0.0,
                                     params=SamplingParams(max_tokens=rng.randrange(1, 40), stop_token_ids=(7,),
                                                           min_tokens=rng.choice([0, 0, 3]))))

    state = rng.getstate()
    sync = sync_tokens(setup, token_fn, pool=(pool, BS, 8 * BS + 40), config=config)
    rng.setstate(state)
    s = Scheduler(cfg(**config), pool, BS, 8 * BS + 40)
    d = AsyncDriver(s, token_fn=token_fn)
    setup(s)
    d.run()
    assert d.tokens == sync.tokens and d.finish == sync.finish
    if s.stats().preemptions == 0:  # (a preempted request samples again what its in-flight step had)
        for rid, toks in d.tokens.items():  # never sampled past a length limit; at most one extra after a stop
            extra = {FinishReason.LENGTH: (0,), FinishReason.STOP: (0, 1)}[d.finish[rid]]
            assert d.sampled.get(rid, 0) - len(toks) in extra, rid
    assert not d.w.reqs and s.bm.num_free == pool
    return s.stats().preemptions, list(d.finish.values()).count(FinishReason.STOP), d.max_depth


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
    old = list(d.flight)
    assert s.update(old[0], 1.0) is None  # the old steps are void: their outputs are dropped as they come
    add(s, "c", 20, base=800, max_tokens=3)
    st = s.schedule(1.0)
    assert sorted(st.finished_req_ids) == ["a", "b"] and list(st.num_scheduled_tokens) == ["c"]
    assert s.update(old[1], 1.0) is None  # also behind a new step
    with pytest.raises(StepOrderError):  # once: a second copy is out of order
        s.update(old[1], 1.0)


def test_a_failed_step_raises_and_the_steps_behind_it_are_void():
    s = Scheduler(cfg(), 64, BS, 8192)
    d = AsyncDriver(s)
    add(s, "a", 20, max_tokens=50)
    d.fill()
    first, second = d.flight
    with pytest.raises(StepFailed, match="^worker error: RuntimeError: boom$"):
        s.update(StepOutput(step=first.step, worker_id=0, error="Traceback ...\nRuntimeError: boom"), 1.0)
    assert [(x.request_id, x.finish_reason, x.error) for x in s.fail_all("worker error: RuntimeError: boom")] == \
        [("a", FinishReason.ERROR, "worker error: RuntimeError: boom")]
    assert s.update(StepOutput(step=second.step, worker_id=0, error="lost too"), 1.0) is None  # void: no 2nd failure
    assert not s.void and s.bm.num_free == 64


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


def test_pipelining_hides_the_host_gap_in_the_simulator():
    # 64 steady decodes of 200 tokens; GPU step ~8 ms, 0.8 ms of batcher + transport between steps.
    reqs = [SimRequest(0.0, tokens(i, 100), 200) for i in range(64)]
    cost = CostModel(a=8.0, b=0.0, c=0.0, d=0.0, h=0.8)
    tpot = {}
    for pip in (False, True):
        res = simulate(reqs, cfg(), cost, num_blocks=2048, check_kv=True, pipelined=pip)
        assert all(n == 200 for n in res.output_tokens.values())
        tpot[pip] = sorted(res.tpot)[len(res.tpot) // 2]
    assert tpot[False] == pytest.approx(0.0088, rel=0.01) and tpot[True] == pytest.approx(0.008, rel=0.01)


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


# ---------------------------------------------------------------------- through the real stack
async def _greedy(session, base: str, prompt: str, max_tokens: int, **body) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **body}
    async with session.post(f"{base}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        out = await resp.json()
    ch = out["choices"][0]
    return {"text": ch["text"], "finish": ch["finish_reason"], "n": out["usage"]["completion_tokens"],
            "tokens": ch["logprobs"]["tokens"] if ch.get("logprobs") else None}


async def _mix(base: str, stop_id: int | None = None) -> list[dict]:
    import asyncio

    import aiohttp

    jobs = [("Hello, lanes", 1), ("Hello, lanes", 7), ("abc", 33), ("The quick brown fox", 17), ("x" * 40, 2)]
    extra = {"stop_token_ids": [stop_id]} if stop_id is not None else {}
    async with aiohttp.ClientSession() as s:
        return list(await asyncio.gather(*(_greedy(s, base, p, m, **extra) for p, m in jobs)))


async def test_stack_greedy_outputs_match_with_and_without_async_scheduling_and_overlap(stack, make_stack):
    import aiohttp

    on = await _mix(stack.base_url)  # the default stack schedules asynchronously
    assert [r["n"] for r in on] == [1, 7, 33, 17, 2] and all(r["finish"] == "length" for r in on)
    # A stop token: the first single-ASCII-character token of a greedy generation (byte-level tokenizer: id = byte).
    async with aiohttp.ClientSession() as s:
        probe = await _greedy(s, stack.base_url, "Hello, lanes", 24, logprobs=0)
    k, ch = next((i, t) for i, t in enumerate(probe["tokens"]) if len(t) == 1 and 32 <= ord(t) < 127)
    stopped = await _mix(stack.base_url, ord(ch))
    assert stopped[1]["n"] == min(k + 1, 7) and stopped[1]["finish"] == ("stop" if k < 7 else "length")
    assert stopped[0]["n"] == 1
    off = make_stack("--no-async-scheduling")
    assert await _mix(off.base_url) == on
    assert await _mix(off.base_url, ord(ch)) == stopped
    # the worker launching each step (with a prompt chunk too) before collecting the previous one (CUDA's default)
    overlapped = make_stack("--overlap-steps", "on")
    assert await _mix(overlapped.base_url) == on
    assert await _mix(overlapped.base_url, ord(ch)) == stopped
    assert not any("failing its requests" in line for line in stack.lines + off.lines + overlapped.lines)


async def test_batcher_keeps_two_steps_at_the_worker_and_checks_their_order(tmp_path):
    """The real Batcher on real sockets; the test plays the gateway and a worker (the stand-in SimWorker)."""
    import asyncio

    import zmq
    import zmq.asyncio

    from laneserve.wire import protocol as P
    from laneserve.wire import transport
    from batcher.core import Batcher
    from batcher.sim.engine import SimWorker

    c = cfg(batcher_address=f"ipc://{tmp_path}/b.sock", worker_address=f"ipc://{tmp_path}/w.sock")
    batcher = Batcher(c)
    serving = asyncio.create_task(batcher.run())
    ctx = zmq.asyncio.Context()
    gw = transport.connect(ctx, zmq.DEALER, c.batcher_address, identity=b"gw")
    wk = transport.connect(ctx, zmq.DEALER, c.worker_address, identity=b"worker-0")
    steps_in, to_gateway = P.decoder(P.BatcherToWorker), P.decoder(P.BatcherToGateway)

    async def recv(sock, dec):
        return dec.decode(await asyncio.wait_for(sock.recv(), 10))

    async def deltas(n: int) -> list:
        got = []
        while len(got) < n:
            got += (await recv(gw, to_gateway)).deltas
        return got

    try:
        await wk.send(P.encode(P.WorkerReady(worker_id=0, num_blocks=64, block_size=BS, max_model_len=1024,
                                             protocol_version=P.PROTOCOL_VERSION)))
        while not batcher.workers:  # the handshake is handled on the batcher's loop; ask until it is in
            await gw.send(P.encode(P.Ping(nonce=1)))
            await recv(gw, to_gateway)
        worker = SimWorker(64, BS)
        await gw.send(P.encode(P.AddRequest(request_id="a", prompt_token_ids=list(range(20)),
                                            params=P.SamplingParams(max_tokens=6), arrival_time=0.0)))
        first, second = await recv(wk, steps_in), await recv(wk, steps_in)  # both sent before any output
        assert (first.step, second.step) == (1, 2) and second.num_scheduled_tokens == {"a": 1}
        for st in (first, second):
            await wk.send(P.encode(worker.execute(st)[0]))
        got = 0
        while got < 2:  # one TokenBatch per update
            got += sum(len(d.new_token_ids) for d in await deltas(1))
        third, fourth = await recv(wk, steps_in), await recv(wk, steps_in)
        await wk.send(P.encode(worker.execute(fourth)[0]))  # out of order: the batcher fails the worker's requests
        (err,) = [d for d in await deltas(1) if d.finish_reason is not None]
        assert err.request_id == "a" and err.finish_reason == P.FinishReason.ERROR and "expected 3" in err.error
        await wk.send(P.encode(worker.execute(third)[0]))  # a step cut off by the failure: dropped quietly
        await gw.send(P.encode(P.AddRequest(request_id="b", prompt_token_ids=[5] * 20,
                                            params=P.SamplingParams(max_tokens=1), arrival_time=0.0)))
        nxt = await recv(wk, steps_in)
        assert nxt.finished_req_ids == ["a"] and list(nxt.num_scheduled_tokens) == ["b"]
        await wk.send(P.encode(worker.execute(nxt)[0]))
        (done,) = await deltas(1)
        assert done.request_id == "b" and done.finish_reason == P.FinishReason.LENGTH and len(done.new_token_ids) == 1
    finally:
        batcher._stop.set()
        await serving
        gw.close()
        wk.close()
        ctx.term()
