"""Scheduler contract (docs/architecture.md), step by step, against the simulator's contract-checking worker."""

from __future__ import annotations

import dataclasses

import pytest

from batcher.config import BatcherConfig
from laneserve.wire.protocol import AddRequest, FinishReason, SamplingParams, StepOutput, TokenLogprobs
from batcher.scheduler import Scheduler, StepFailed
from batcher.sim.engine import SimWorker

BS = 16


def cfg(**kw) -> BatcherConfig:
    return dataclasses.replace(BatcherConfig(), **kw)


def add(s: Scheduler, rid: str, n_prompt: int, base: int = 0, **params) -> None:
    params.setdefault("max_tokens", 4)
    s.add_request(AddRequest(request_id=rid, prompt_token_ids=[base + i % 1000 for i in range(n_prompt)],
                             params=SamplingParams(**params), arrival_time=0.0))


class Driver:
    """Alternates schedule()/execute/update() in simulated time, collecting deltas per request."""

    def __init__(self, s: Scheduler, token_fn=None, check_kv: bool = True):
        self.s = s
        self.w = SimWorker(s.num_blocks, s.block_size, check_kv=check_kv, token_fn=token_fn)
        self.now = 0.0
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, FinishReason] = {}
        self.deltas = []
        self.steps = []

    def take(self, deltas) -> None:
        for d in deltas:
            assert d.request_id not in self.finish, f"delta after finish for {d.request_id}"
            self.deltas.append(d)
            self.tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
            if d.finish_reason is not None:
                self.finish[d.request_id] = d.finish_reason

    def step(self):
        st = self.s.schedule(self.now)
        if st is None:
            return None
        self.steps.append(st)
        out, _ = self.w.execute(st)
        self.now += 0.01
        self.take(self.s.update(out, self.now))
        return st

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if self.step() is None:
                break
        assert self.s.num_unfinished == 0
        self.s.bm.check()
        assert self.s.bm.num_free + len(self.s.bm.pinned) == self.s.num_blocks


def test_decodes_first_then_chunked_prefill_within_the_budget():
    s = Scheduler(cfg(max_num_batched_tokens=512), 1024, BS, 8192)
    d = Driver(s)
    add(s, "short", 10, max_tokens=20)
    d.step()  # prefill of short, samples its first token
    add(s, "long", 1200, base=5000)
    st = d.step()
    assert list(st.num_scheduled_tokens) == ["short", "long"]
    assert st.num_scheduled_tokens == {"short": 1, "long": 511}
    st = d.step()
    assert st.num_scheduled_tokens == {"short": 1, "long": 511}
    assert st.cached_reqs and st.cached_reqs[0].request_id == "long" and not st.new_reqs
    st = d.step()
    assert st.num_scheduled_tokens == {"short": 1, "long": 178}  # the rest of the prompt
    d.run()
    assert len(d.tokens["long"]) == 4 and len(d.tokens["short"]) == 20
    assert d.finish == {"short": FinishReason.LENGTH, "long": FinishReason.LENGTH}


def test_seq_cap_and_token_budget_bind():
    s = Scheduler(cfg(max_num_seqs=3, max_num_batched_tokens=64), 1024, BS, 8192)
    d = Driver(s)
    for i in range(5):
        add(s, f"r{i}", 40, base=100 * i, max_tokens=3)
    st = d.step()
    assert st.num_scheduled_tokens == {"r0": 40, "r1": 24}
    st = d.step()
    assert st.num_scheduled_tokens == {"r0": 1, "r1": 16, "r2": 40}  # decode first, then the chunk, cap 3
    assert all(len(x.num_scheduled_tokens) <= 3 and sum(x.num_scheduled_tokens.values()) <= 64 for x in d.steps)
    d.run()
    assert all(len(d.tokens[f"r{i}"]) == 3 for i in range(5))
    assert all(len(x.num_scheduled_tokens) <= 3 and sum(x.num_scheduled_tokens.values()) <= 64 for x in d.steps)


def test_stop_token_included_min_tokens_respected_and_length_limits():
    s = Scheduler(cfg(), 256, BS, 40)
    d = Driver(s, token_fn=lambda rid, toks: 7)  # the "model" always says 7
    add(s, "stop", 10, max_tokens=10, stop_token_ids=(7,))
    add(s, "min", 10, base=50, max_tokens=10, stop_token_ids=(7,), min_tokens=3)
    add(s, "len", 10, base=90, max_tokens=5)
    add(s, "ctx", 35, base=200, max_tokens=100)  # max_model_len 40: 5 tokens, then LENGTH
    d.run()
    assert d.tokens["stop"] == [7] and d.finish["stop"] == FinishReason.STOP
    assert d.tokens["min"] == [7, 7, 7] and d.finish["min"] == FinishReason.STOP
    assert len(d.tokens["len"]) == 5 and d.finish["len"] == FinishReason.LENGTH
    assert len(d.tokens["ctx"]) == 5 and d.finish["ctx"] == FinishReason.LENGTH


def test_first_delta_carries_num_cached_tokens():
    s = Scheduler(cfg(), 256, BS, 8192)
    d = Driver(s)
    add(s, "a", 100, max_tokens=2)
    d.run()
    add(s, "b", 100, max_tokens=2)  # same prompt: 6 full blocks cached (96 tokens)
    d.run()
    firsts = {}
    for x in d.deltas:
        firsts.setdefault(x.request_id, x)
    assert firsts["a"].num_cached_tokens == 0 and firsts["b"].num_cached_tokens == 96
    assert [x.num_cached_tokens for x in d.deltas if x.request_id == "b"][1:] == [0]
    st = s.stats()
    assert (st.prefix_queries, st.prefix_hits) == (200, 96)


def test_abort_frees_blocks_within_one_step_and_tells_the_worker():
    s = Scheduler(cfg(), 64, BS, 8192)
    d = Driver(s)
    add(s, "run", 100, max_tokens=50)
    add(s, "wait", 100, base=3000, max_tokens=50)
    s.cfg.max_num_seqs = 1
    d.step()
    free_before = s.bm.num_free
    deltas = s.abort_requests(["run", "wait", "unknown"])
    assert [(x.request_id, x.finish_reason) for x in deltas] == [("run", FinishReason.ABORT),
                                                                   ("wait", FinishReason.ABORT)]
    assert s.bm.num_free == free_before + 7 and s.num_unfinished == 0
    st = d.step()  # nothing to run, but the worker must drop "run"
    assert st is not None and st.finished_req_ids == ["run"] and not st.num_scheduled_tokens
    assert "run" not in d.w.reqs
    assert d.step() is None
    s.bm.check()


def test_abort_while_a_step_is_in_flight_drops_its_tokens():
    s = Scheduler(cfg(), 64, BS, 8192)
    w = SimWorker(64, BS)
    add(s, "a", 20, max_tokens=5)
    out, _ = w.execute(s.schedule(0.0))
    assert s.abort_requests(["a"])[0].finish_reason == FinishReason.ABORT
    assert s.update(out, 0.1) == []  # its sampled token is dropped: the abort was its final delta
    assert s.bm.num_free == 64


def test_output_rows_in_the_workers_order_and_a_missing_row_fails_only_its_request():
    s = Scheduler(cfg(), 64, BS, 8192)
    w = SimWorker(64, BS)
    for rid in ("a", "b", "c"):
        add(s, rid, 20, base=100 * len(rid) + ord(rid), max_tokens=5)
    out, _ = w.execute(s.schedule(0.0))
    assert out.request_ids == ["a", "b", "c"]
    tokens = dict(zip(out.request_ids, out.sampled_token_ids))
    lp = {rid: [TokenLogprobs(-float(i), [], [])] for i, rid in enumerate(out.request_ids)}
    # The worker lays rows out its own way (and here drops "b": a broken contract).
    rows = ["c", "a"]
    mine = StepOutput(step=out.step, worker_id=0, request_ids=rows, sampled_token_ids=[tokens[r] for r in rows],
                      logprobs=[lp[r] for r in rows])
    deltas = {d.request_id: d for d in s.update(mine, 0.1)}
    assert deltas["a"].new_token_ids == tokens["a"] and deltas["a"].logprobs == lp["a"]
    assert deltas["c"].new_token_ids == tokens["c"] and deltas["c"].logprobs == lp["c"]
    assert deltas["b"].finish_reason == FinishReason.ERROR and "sampled no token" in deltas["b"].error
    assert deltas["a"].finish_reason is None and s.num_unfinished == 2


def test_prompts_that_can_never_fit_get_error_deltas_not_a_hang():
    s = Scheduler(cfg(max_active_blocks=4), 8, BS, 100)
    d = Driver(s)
    add(s, "too-long", 101)  # > max_model_len
    add(s, "too-many-blocks", 70)  # 5 blocks > max_active_blocks=4
    add(s, "empty", 0)
    st = d.step()  # nothing to run: an empty step carries the errors back through update()
    assert st is not None and not st.num_scheduled_tokens
    assert d.finish == {"too-long": FinishReason.ERROR, "too-many-blocks": FinishReason.ERROR,
                        "empty": FinishReason.ERROR}
    assert all(x.error for x in d.deltas)
    s2 = Scheduler(cfg(), 4, BS, 1000)
    d2 = Driver(s2)
    add(s2, "pool", 65)  # 5 blocks, the pool has 4
    add(s2, "ok", 20, base=400, max_tokens=3)
    d2.run()
    assert d2.finish == {"pool": FinishReason.ERROR, "ok": FinishReason.LENGTH}


def test_a_prompt_that_fitted_until_the_warm_prefix_was_pinned_errors_and_does_not_hold_up_the_line():
    """Found by tests/test_kv_stress.py: it was left at the head of the line, unadmittable, with everyone behind it."""
    s = Scheduler(cfg(), 10, BS, 8192, warm_prefixes=[list(range(1000, 1040))])  # 2 blocks pinned once prefilled
    d = Driver(s)
    add(s, "big", 160, max_tokens=2)  # the whole pool of 10 blocks when it came; then 8 are usable
    add(s, "small", 5, base=500, max_tokens=2)
    d.run()
    assert d.finish == {"big": FinishReason.ERROR, "small": FinishReason.LENGTH} and len(s.bm.pinned) == 2
    assert d.deltas[0].error == "KV cache too small for 160 tokens of context"


def test_warm_prefixes_pin_at_most_half_the_pool_together():
    """Each was checked alone against half the pool: two of half the pool each pinned all of it (a review), and
    every user request was refused."""
    s = Scheduler(cfg(), 10, BS, 8192, warm_prefixes=[list(range(k, k + 64)) for k in (1000, 2000, 3000)])
    d = Driver(s)  # each 4 blocks: the first fits in half the pool (5), the others would take it past
    add(s, "user", 5, base=500, max_tokens=2)
    d.run()
    assert d.finish == {"user": FinishReason.LENGTH} and len(s.bm.pinned) == 4 and s.num_unfinished == 0
    s = Scheduler(cfg(), 100, BS, 8192, warm_prefixes=[list(range(k, k + 800)) for k in (1000, 2000)])
    d = Driver(s)  # two of 50 blocks, each exactly half the pool
    add(s, "user", 3, base=500, max_tokens=2)
    d.run()
    assert d.finish == {"user": FinishReason.LENGTH} and len(s.bm.pinned) == 50


def test_warm_prefixes_sharing_blocks_pin_each_cached_block_once_and_a_long_one_is_cut_to_the_context():
    """A review found the copy of a shared block that the cache did not take pinned for good, and a prefix longer
    than the context sent to the worker whole (past its position table)."""
    head = list(range(1000, 1032))  # 2 blocks both prefixes start with; prefilled together, both compute them
    s = Scheduler(cfg(), 64, BS, 96, warm_prefixes=[head + list(range(2000, 2032)), head + list(range(3000, 3032)),
                                                    list(range(4000, 4200))])
    d = Driver(s)
    d.step()
    assert s.num_unfinished == 0 and s.bm.pinned == set(s.bm.cached.values())
    assert len(s.bm.pinned) == 2 + 2 + 2 + 5  # the shared head once; the third cut to 80 of 96 - 1 tokens
    assert max(len(ids) for ids in (nr.prompt_token_ids for nr in d.steps[0].new_reqs)) == 81  # (+ the sentinel)
    add(s, "user", 70, base=1000, max_tokens=2)
    d.run()
    assert d.finish == {"user": FinishReason.LENGTH}


@pytest.mark.parametrize("rows, logprobs", [([[7]], None), ([], None), ([[7], []], None), ([[7], [8]], [[]])])
def test_a_step_output_whose_rows_do_not_match_its_request_ids_fails_the_step_before_anything_changes(rows, logprobs):
    s = Scheduler(cfg(), 64, BS, 8192)
    d = Driver(s)
    add(s, "a", 20, max_tokens=5)
    add(s, "b", 20, base=500, max_tokens=5)
    st = s.schedule(0.0)
    with pytest.raises(StepFailed, match="2 request ids"):
        s.update(StepOutput(step=st.step, worker_id=0, request_ids=["a", "b"], sampled_token_ids=rows,
                            logprobs=logprobs), 0.01)
    d.take(s.fail_all("bad rows"))
    assert d.finish == {"a": FinishReason.ERROR, "b": FinishReason.ERROR} and not s.in_flight
    assert s.num_unfinished == 0 and s.bm.num_free == 64


def test_max_active_blocks_stops_generation_with_length():
    s = Scheduler(cfg(max_active_blocks=2), 64, BS, 8192)
    d = Driver(s)
    add(s, "a", 10, max_tokens=100)
    d.run()
    assert len(d.tokens["a"]) == 22 and d.finish["a"] == FinishReason.LENGTH  # 10 + 22 = 32 = 2 blocks
    assert [len(x.cached_reqs[0].new_block_ids) for x in d.steps if x.cached_reqs] == [1]
    assert sum(len(nr.block_ids) for x in d.steps for nr in x.new_reqs) + sum(
        len(c.new_block_ids) for x in d.steps for c in x.cached_reqs) == 2


def test_preemption_by_recompute_newest_first_and_everyone_finishes():
    s = Scheduler(cfg(decode_buckets=""), 12, BS, 8192)
    d = Driver(s)
    for i in range(4):
        add(s, f"r{i}", 30, base=100 * i, max_tokens=40)  # 70 tokens = 5 blocks each; 4 x 5 > 12
    d.run()
    assert s.stats().preemptions > 0
    assert all(len(d.tokens[f"r{i}"]) == 40 and d.finish[f"r{i}"] == FinishReason.LENGTH for i in range(4))
    # The first preempted request is the newest running one, and it comes back with its outputs.
    first = next(st for st in d.steps if st.finished_req_ids)
    victim = first.finished_req_ids[0]
    running_then = [r for r in first.num_scheduled_tokens]
    assert victim not in running_then
    resumed = next(nr for st in d.steps[d.steps.index(first):] for nr in st.new_reqs if nr.request_id == victim)
    assert resumed.output_token_ids and resumed.output_token_ids == d.tokens[victim][:len(resumed.output_token_ids)]
    order = [nr.request_id for st in d.steps for nr in st.new_reqs]
    admitted_before = order[:order.index(victim)]
    assert all(int(r[1:]) < int(victim[1:]) for r in admitted_before)


def test_bucketing_orders_decodes_and_protects_nearly_done_sequences():
    s = Scheduler(cfg(decode_buckets="8,16,32"), 1024, BS, 8192)
    d = Driver(s)
    add(s, "long-left", 10, max_tokens=100)
    add(s, "short-left", 10, base=200, max_tokens=6)
    add(s, "mid-left", 10, base=400, max_tokens=20)
    d.step()
    st = d.step()
    assert list(st.num_scheduled_tokens) == ["short-left", "mid-left", "long-left"]
    decodes, prefills = s._run_order()
    assert not prefills and decodes[-1].request_id == "long-left"  # the first preemption victim
    d.run()


def test_warm_prefix_is_prefilled_pinned_and_hit_without_deltas():
    warm = [list(range(1000, 1040))]  # 40 tokens: 2 full blocks are pinned, the tail is dropped
    s = Scheduler(cfg(), 32, BS, 8192, warm_prefixes=warm)
    d = Driver(s)
    st = d.step()
    assert st.new_reqs[0].request_id.startswith("__warm__") and st.num_scheduled_tokens == {"__warm__/0": 32}
    assert d.deltas == [] and s.num_unfinished == 0
    assert len(s.bm.pinned) == 2 and s.bm.num_free == 30
    s.add_request(AddRequest(request_id="u", prompt_token_ids=list(range(1000, 1040)) + [5, 6],
                             params=SamplingParams(max_tokens=2), arrival_time=0.0))
    d.run()
    assert d.deltas[0].num_cached_tokens == 32
    # Pinned blocks stay cached even when the rest of the pool is churned through.
    for i in range(6):
        add(s, f"churn{i}", 60, base=5000 + 100 * i, max_tokens=2)
    d.run()
    s.add_request(AddRequest(request_id="v", prompt_token_ids=list(range(1000, 1040)),
                             params=SamplingParams(max_tokens=1), arrival_time=0.0))
    d.run()
    assert [x for x in d.deltas if x.request_id == "v"][0].num_cached_tokens == 32


def test_watermark_holds_admission_but_never_deadlocks_an_idle_pool():
    s = Scheduler(cfg(watermark=0.6), 20, BS, 8192)
    d = Driver(s)
    add(s, "a", 80, max_tokens=30)  # 5 of 20 blocks
    add(s, "b", 80, base=500, max_tokens=3)  # would leave 20-5-5 = 10 < 12 free: waits
    st = d.step()
    assert list(st.num_scheduled_tokens) == ["a"]
    add(s, "big", 250, base=900, max_tokens=2)  # 16 blocks > 40% free, but admitted once the pool is idle
    d.run()
    assert set(d.finish) == {"a", "b", "big"} and all(f == FinishReason.LENGTH for f in d.finish.values())


def test_fail_all_errors_everyone_and_resets():
    s = Scheduler(cfg(), 64, BS, 8192)
    d = Driver(s)
    add(s, "a", 20, max_tokens=10)
    add(s, "b", 20, base=300, max_tokens=10)
    d.step()
    add(s, "c", 20, base=600, max_tokens=10)
    deltas = s.fail_all("worker lost")
    assert sorted(x.request_id for x in deltas) == ["a", "b", "c"]
    assert all(x.finish_reason == FinishReason.ERROR and x.error == "worker lost" for x in deltas)
    assert s.num_unfinished == 0 and s.bm.num_free == 64
    st = s.schedule(1.0)
    assert sorted(st.finished_req_ids) == ["a", "b"]


def test_stats():
    s = Scheduler(cfg(), 64, BS, 8192)
    d = Driver(s)
    add(s, "a", 20, max_tokens=10)
    add(s, "b", 20, base=300, max_tokens=10)
    s.cfg.max_num_seqs = 1
    d.step()
    st = s.stats()
    assert (st.num_running, st.num_waiting, st.kv_blocks_total, st.kv_blocks_free, st.steps) == (1, 1, 64, 62, 1)


def test_run_order_is_bucket_then_admission_order_under_churn():
    """_run_order() splits `running` (admission order) into lanes instead of sorting: check it against the
    sort it stands for, every step of a churning async workload (preemptions, stops, a warm prefix)."""
    import random
    from bisect import bisect_left

    def by_sorting(s: Scheduler) -> list:
        keyed = []
        for r in s.running.values():
            ph = r.num_output_placeholders
            if ph and (r.tokens_remaining <= 0 or r.num_tokens + ph >= r.max_len):
                continue
            left = r.num_uncomputed_tokens
            if left > 0:
                key = bisect_left(s.buckets, r.tokens_remaining) if left == 1 else len(s.buckets) + 1
                keyed.append((key, r.admit_seq, r, left))
        return [(r, left) for _, _, r, left in sorted(keyed, key=lambda k: k[:2])]

    rng = random.Random(3)
    s = Scheduler(cfg(max_num_batched_tokens=96, max_active_blocks=12), 40, BS, 8192,
                  warm_prefixes=[list(range(900, 932))])
    w = SimWorker(s.num_blocks, s.block_size, check_kv=True)
    flight, now, n_checked = [], 0.0, 0
    for i in range(600):
        if i < 300 and rng.random() < 0.3:
            add(s, f"r{i}", rng.randrange(1, 70), base=rng.choice([0, 900, rng.randrange(2000)]),
                max_tokens=rng.randrange(1, 60), stop_token_ids=(7,) if rng.random() < 0.3 else ())
        while len(flight) < s.max_inflight_steps:
            decodes, prefills = s._run_order()
            assert [(r, 1) for r in decodes] + prefills == by_sorting(s)
            n_checked += len(s.running)
            st = s.schedule(now)
            if st is None:
                break
            flight.append(w.execute(st)[0])
        if flight:
            now += 0.01
            s.update(flight.pop(0), now)
    assert n_checked > 1000 and s.preemptions > 0


def test_first_delta_carries_the_queue_time_and_steps_are_counted_by_tokens():
    """queued_ms: from the batcher's receipt (before the add when a grammar compiled first) to the first step that
    scheduled the request, a duration on the scheduler's clock; iteration_tokens counts each step by its tokens."""
    s = Scheduler(cfg(max_num_seqs=1), 64, BS, 256)
    d = Driver(s)
    for rid, received, base in (("a", None, 0), ("b", -0.5, 100)):  # (other prompts: no prefix-cache hit)
        s.add_request(AddRequest(request_id=rid, prompt_token_ids=list(range(base, base + 20)),
                                 params=SamplingParams(max_tokens=3), arrival_time=0.0), 0.0, received=received)
    d.run()
    queued = [(x.request_id, x.queued_ms) for x in d.deltas if x.queued_ms is not None]
    assert [rid for rid, _ in queued] == ["a", "b"]  # the first delta of each, only
    assert queued[0][1] == 0.0  # scheduled at once
    assert queued[1][1] == pytest.approx((0.5 + 0.03) * 1000)  # b waited for a's three steps (10 ms each)
    stats = s.stats()
    buckets = [0] * 13
    buckets[0], buckets[3] = 4, 2  # four 1-token decodes, two 20-token prefills (16 < 20 <= 32); not the empty step
    assert len(d.steps) == 7 and not d.steps[-1].num_scheduled_tokens
    assert stats.iteration_tokens == buckets and stats.iteration_tokens_sum == 44
