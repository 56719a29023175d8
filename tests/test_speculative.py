"""Speculative decoding, first round (issue 22, `--speculative ngram`): prompt-lookup drafts, greedy verification.

The proposer and the choice of K on their own; the scheduler in simulated time against the contract-checking
stand-in worker (which verifies drafts with its own deterministic model and checks every prefix hit's K/V), in
strict alternation, pipelined and with two lanes, under a tight pool; greedy tokens identical to transformers and
to decoding without drafts through the real model runner for every model family; and the stack over HTTP.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from batcher.config import BatcherConfig
from batcher.cost_model import CostModel
from batcher.scheduler import Scheduler
from batcher.spec import MIN_DRAFTS, PROBE_EVERY, PROBE_MAX, NgramIndex, SpecPolicy, expected_tokens
from laneserve.wire.protocol import AddRequest, FinishReason, SamplingParams
from tests.test_async_scheduling import AsyncDriver
from tests.test_lanes import LaneDriver, engine, family  # noqa: F401  (family: the per-architecture fixture)
from tests.test_scheduler import Driver, add

BS = 16
STOP = 1006


def cfg(**kw) -> BatcherConfig:
    return dataclasses.replace(BatcherConfig(), **kw)


# ---------------------------------------------------------------------- the proposer and K
def test_ngram_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix():
    idx = NgramIndex(1, 3)
    toks = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 6, 7]
    # suffix (6, 7): last seen before at 5..6, followed by 1, 2, 6, 7 (the 3-gram (2, 6, 7) never occurred)
    assert idx.propose(toks, 3) == [1, 2, 6]
    assert idx.propose(toks, 0) == [] and NgramIndex(2, 3).propose([1, 2, 3], 4) == []
    toks += [1]  # (6, 7, 1) occurred: the longest match wins, and the index grew with the new token
    assert idx.propose(toks, 2) == [2, 6]
    fresh = NgramIndex(1, 3)
    assert fresh.propose(toks, 2) == idx.propose(toks, 2)
    assert NgramIndex(2, 2).propose([4, 4, 4, 4], 3) == [4]  # continuation known up to the end only


def test_the_ngram_index_grown_in_budgeted_steps_is_the_whole_index_of_its_window():
    """grow() in steps of any budget (a long prompt's index is built over several steps) gives the index of all the
    n-grams at once (the latest occurrence of each), of the latest INDEX_WINDOW tokens, then grows with new ones."""
    import random

    from batcher.spec import INDEX_WINDOW

    def reference(tokens: list[int], lo: int, hi: int, first_end: int) -> dict:
        last = {}
        for end in range(max(lo, first_end), len(tokens)):
            for n in range(lo, min(hi, end) + 1):
                last[tuple(tokens[end - n:end])] = end
        return last

    rng = random.Random(7)
    for lo, hi, length, vocab in [(1, 3, 200, 5), (2, 4, 600, 3), (2, 2, 50, 2), (3, 5, INDEX_WINDOW + 300, 4)]:
        tokens = [rng.randrange(vocab) for _ in range(length)]
        first_end = length - INDEX_WINDOW  # (a long context: only its latest INDEX_WINDOW tokens are indexed)
        idx = NgramIndex(lo, hi)
        while not idx.ready(tokens):
            idx.grow(tokens, rng.choice([1, 2, 7, 64, 1000]))
        assert idx.last == reference(tokens, lo, hi, first_end), (lo, hi, length)
        tokens += [rng.randrange(vocab) for _ in range(3)]  # a step's new tokens: indexed on top
        idx.grow(tokens)
        assert idx.last == reference(tokens, lo, hi, first_end), (lo, hi, length)


def test_k_follows_the_cost_model_and_the_measured_acceptance():
    assert expected_tokens(0, 0.7) == 1.0 and expected_tokens(3, 1.0) == 4.0
    assert expected_tokens(2, 0.5) == pytest.approx(1 + 0.5 + 0.25)
    cost = CostModel(a=4.8, b=0.02, c=0.011, d=2.7e-5)  # a decode row is cheap next to reading the weights
    spec = SpecPolicy("ngram", 8, 2, 4)
    spec.drafted = MIN_DRAFTS  # the measured rate decides
    spec.alpha = 0.9
    ks = [spec.choose_k(b, 2000 * b, cost, 256) for b in (1, 8, 32, 128)]
    assert ks[0] == 8 and ks == sorted(ks, reverse=True) and ks[-1] <= 1  # fewer drafts as the batch grows
    spec.alpha = 0.05
    assert spec.choose_k(32, 64000, cost, 256) == 0  # does not pay
    assert spec.choose_k(300, 600000, cost, 256) == 0  # no room in the largest graph


def test_a_rate_measured_low_is_probed_again_and_a_new_server_starts_optimistic():
    cost = CostModel(a=4.8, b=0.02, c=0.011, d=2.7e-5)
    spec = SpecPolicy("ngram", 4, 2, 4)
    assert spec.choose_k(16, 32000, cost, 256) > 0  # no drafts verified yet: assumed at least 0.8
    for _ in range(100):  # drafts never accepted
        spec.observe(8, MIN_DRAFTS, 0)
    assert spec.alpha < 0.01 and spec.steps == 100 and spec.sequences == 800
    picks = [spec.choose_k(32, 64000, cost, 256) for _ in range(PROBE_EVERY + 3)]
    # the probe comes at the PROBE_EVERY-th decision that came out 0 and holds (pipelined, the next calls may
    # compose no step)
    first = picks.index(4)
    assert first < PROBE_EVERY and set(picks[:first]) == {0} and set(picks[first:]) == {4}
    spec.observe(32, 128, 0)  # a step verified drafts: the probe is done
    # a probe that found nothing: the next one waits twice as long (the n-th decision after it), up to PROBE_MAX
    gaps = []
    for _ in range(6):
        n = 1
        while spec.choose_k(32, 64000, cost, 256) == 0:
            n += 1
        gaps.append(n)
        spec.observe(32, 128, 0)
    assert gaps == [min(PROBE_EVERY * 2 ** i, PROBE_MAX) for i in range(1, 7)]
    spec.alpha = 0.9  # drafts pay again: the first decision that speculates resets the interval
    assert spec.choose_k(32, 64000, cost, 256) > 0 and spec.until_probe == spec.probe_every == PROBE_EVERY


def test_a_batch_where_no_drafts_could_pay_is_decided_without_prompt_lookup():
    """SpecPolicy.hopeless bounds every subset of the requests that may draft (with the shortest context among them
    for all): when it says no K pays, choose_k() says 0 for each subset that could find drafts; and counting its
    answers as decisions keeps the probe at the PROBE_EVERY-th one."""
    rng = random.Random(3)
    bounded = 0
    for _ in range(300):
        cost = CostModel(a=rng.uniform(1, 8), b=0.02, c=rng.uniform(0.001, 0.1), d=rng.uniform(0, 2e-4),
                         h=rng.uniform(0, 2))
        contexts = [rng.randrange(16, 20000) for _ in range(rng.randrange(1, 96))]
        may = rng.sample(range(len(contexts)), rng.randrange(1, len(contexts) + 1))
        spec = SpecPolicy("ngram", rng.randrange(1, 9), 2, 4)
        spec.drafted, spec.alpha = MIN_DRAFTS, rng.uniform(0, 1)
        shortest = min(contexts[i] for i in may)
        total = sum(contexts)
        if not spec.hopeless(len(may), len(may) * shortest, cost, len(contexts) - len(may),
                             total - len(may) * shortest):
            continue
        bounded += 1
        for _ in range(5):
            drafting = rng.sample(may, rng.randrange(1, len(may) + 1))
            ctx = sum(contexts[i] for i in drafting)
            fresh = SpecPolicy("ngram", spec.max_k, 2, 4)
            fresh.drafted, fresh.alpha = spec.drafted, spec.alpha
            assert fresh.choose_k(len(drafting), ctx, cost, 256, len(contexts) - len(drafting), total - ctx) == 0
    assert 30 < bounded < 270  # (both answers came up)

    cost = CostModel(a=4.8, b=0.02, c=0.011, d=2.7e-5)
    with_bound, alone = (SpecPolicy("ngram", 4, 2, 4) for _ in range(2))
    for spec in (with_bound, alone):
        spec.drafted, spec.alpha = MIN_DRAFTS, 0.01
    picks = {"bound": [], "alone": []}
    for _ in range(2 * PROBE_EVERY):
        skipped = with_bound.hopeless(32, 64000, cost)
        picks["bound"].append(0 if skipped else with_bound.choose_k(32, 64000, cost, 256))
        picks["alone"].append(alone.choose_k(32, 64000, cost, 256))
    assert picks["bound"] == picks["alone"] and picks["alone"].index(4) == PROBE_EVERY - 1
    # a due probe that finds nobody with drafts waits another interval, so the bound keeps skipping lookups
    spec = SpecPolicy("ngram", 4, 2, 4)
    spec.drafted, spec.alpha = MIN_DRAFTS, 0.01
    skips = 0
    while spec.hopeless(32, 64000, cost):
        skips += 1
    assert skips == PROBE_EVERY - 1 and spec.until_probe == 1
    assert spec.choose_k(0, 0, cost, 256, 32, 64000) == 0 and spec.until_probe == PROBE_EVERY
    assert spec.hopeless(32, 64000, cost)


def test_prompt_lookup_waits_while_drafts_cannot_pay_and_resumes_when_they_can():
    """With a measured acceptance so low that no K pays, schedule() leaves the n-gram indexes alone (no lookup
    cost at all); when drafts pay again, the indexes catch up and the steps verify drafts."""
    s = Scheduler(cfg(speculative="ngram"), 256, BS, 8192, cost=CHEAP_VERIFY)
    d = Driver(s, cycle)
    for i in range(6):
        add(s, f"r{i}", 40, base=100 * i, max_tokens=400, temperature=0.0)
    while not all(r.is_decoding for r in s.running.values()) or len(s.running) < 6:
        d.step()
    s.spec.drafted, s.spec.alpha = 10 * MIN_DRAFTS, 0.0
    s.spec.until_probe = s.spec.probe_every = PROBE_MAX
    s.spec.observe(1, 1, 0)  # (a step that verified drafts: no probe pending)
    indexed = {rid: r.ngrams.done if r.ngrams else 0 for rid, r in s.running.items()}
    steps = [d.step() for _ in range(20)]
    assert not any(st.spec_token_ids for st in steps)
    assert {rid: r.ngrams.done if r.ngrams else 0 for rid, r in s.running.items()} == indexed
    s.spec.alpha = 0.9
    steps = [d.step() for _ in range(20)]
    assert any(st.spec_token_ids for st in steps)  # (drafts come from indexes that caught up)
    d.run()
    assert all(len(t) == 400 for t in d.tokens.values()) and s.bm.num_free == 256


@pytest.mark.parametrize("kw, error", [({"speculative": "eagle"}, "speculative must be"),
                                       ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                                       ({"prompt_lookup_min": 5}, "prompt_lookup_min")])
def test_bad_settings_are_clear_errors(kw, error):
    from batcher.core import Batcher

    c = cfg(**({"speculative": "ngram"} | kw))
    with pytest.raises(ValueError, match=error):
        Scheduler(c, 8, BS, 100)
    with pytest.raises(SystemExit, match=error):
        Batcher(c)


# ---------------------------------------------------------------------- the scheduler in simulated time
def cycle(rid: str, toks: list[int]) -> int:
    """The stand-in model: after the prompt it repeats a cycle of 7 tokens, so prompt lookup finds drafts."""
    return 1000 + (len(toks) + len(rid)) % 7


JOBS = [(5, 1), (15, 30), (16, 3), (17, 47), (40, 40), (100, 9), (31, 33), (64, 64)]
CHEAP_VERIFY = CostModel(a=5.0, b=0.02, c=0.01, d=0.0)


def _run(driver, config: dict, pool: int = 256, jobs=JOBS, **params) -> Driver:
    s = Scheduler(cfg(**config), pool, BS, 8192, cost=CHEAP_VERIFY)
    d = driver(s)
    for i, (n, m) in enumerate(jobs):
        add(s, f"r{i}", n, base=100 * i, max_tokens=m, **({"temperature": 0.0} | params))
    d.run()
    return d


def _drivers():
    return {"sync": lambda s: Driver(s, cycle), "pipelined": lambda s: AsyncDriver(s, cycle),
            "streams": lambda s: LaneDriver(s, random.Random(5), cycle)}


@pytest.mark.parametrize("mode", ["sync", "pipelined", "streams"])
def test_drafts_give_the_same_tokens_in_fewer_steps(mode):
    lanes = {"lanes": "streams"} if mode == "streams" else {}
    plain = _run(_drivers()[mode], {**lanes, "async_scheduling": mode != "sync"})
    spec = _run(_drivers()[mode], {**lanes, "async_scheduling": mode != "sync", "speculative": "ngram"})
    assert spec.tokens == plain.tokens and all(f == FinishReason.LENGTH for f in spec.finish.values())
    assert {r: len(t) for r, t in spec.tokens.items()} == {f"r{i}": m for i, (_, m) in enumerate(JOBS)}
    st = spec.s.stats()
    assert st.spec_steps > 0 and st.spec_accepted > 0.8 * st.spec_drafted  # the cycle is easy to guess
    assert len(spec.steps) < 0.6 * len(plain.steps)
    assert spec.s.bm.num_free == 256 and not spec.w.reqs
    assert all(len(st.spec_token_ids.get(r, ())) <= 4 for st in spec.steps for r in st.num_scheduled_tokens)


@pytest.mark.parametrize("seed", range(4))
def test_with_two_lanes_and_arrivals_mid_run_a_step_with_drafts_stays_alone_in_its_lane(seed):
    """Requests arriving while others speculate (K falls to 0 while a prompt waits or prefills): no decode step is
    composed behind one with drafts (LaneDriver checks it at every step), and the tokens are those without drafts."""
    runs = []
    for mode in ("off", "ngram"):
        s = Scheduler(cfg(lanes="streams", speculative=mode), 256, BS, 8192, cost=CHEAP_VERIFY)
        d = LaneDriver(s, random.Random(seed), cycle)
        arrivals, calls, compose = iter(range(40)), itertools.count(1), s.schedule

        def schedule(now, s=s, arrivals=arrivals, calls=calls, compose=compose):
            # a short request arrives before every 7th call, also between two steps sent at once
            if next(calls) % 7 == 0 and (i := next(arrivals, None)) is not None:
                add(s, f"x{i}", 20, base=5000 + 37 * i + seed, max_tokens=30, temperature=0.0)
            return compose(now)

        s.schedule = schedule
        for i, (n, m) in enumerate(JOBS):
            add(s, f"r{i}", n, base=100 * i, max_tokens=m, temperature=0.0)
        d.run()
        runs.append(d)
    assert runs[1].tokens == runs[0].tokens and runs[1].s.stats().spec_steps > 0


@pytest.mark.parametrize("pool", [10, 14])
def test_a_tight_pool_preempts_requests_with_drafts_and_loses_nothing(pool):
    plain = _run(_drivers()["sync"], {"async_scheduling": False}, pool=pool)
    spec = _run(_drivers()["sync"], {"async_scheduling": False, "speculative": "ngram"}, pool=pool)
    assert spec.s.preemptions > 0 and spec.s.stats().spec_accepted > 0
    assert spec.tokens == plain.tokens and spec.s.bm.num_free == pool
    for st in spec.steps:  # no drafts beside a prompt (re)computed, a preempted request's included
        if st.spec_token_ids:
            assert all(n == 1 + len(st.spec_token_ids.get(rid, ())) for rid, n in st.num_scheduled_tokens.items())


def test_a_stop_token_inside_the_accepted_drafts_ends_the_request_there():
    """STOP is one of the cycle's tokens: after min_tokens outputs the drafts hold it, and the request stops on it
    exactly as without drafts (the tokens drafted after it are dropped, max_tokens is never passed)."""
    jobs = [(12, 40), (20, 40), (9, 12)]
    runs = []
    for speculative in ("off", "ngram"):
        d = Driver(Scheduler(cfg(async_scheduling=False, speculative=speculative), 256, BS, 8192, cost=CHEAP_VERIFY),
                   cycle)
        for i, (n, m) in enumerate(jobs):
            add(d.s, f"r{i}", n, base=7 * i, max_tokens=m, temperature=0.0, stop_token_ids=[STOP], min_tokens=9)
        d.run()
        runs.append(d)
    ref, d = runs
    assert d.tokens == ref.tokens and d.finish == ref.finish
    assert all(t[-1] == STOP and f == FinishReason.STOP for t, f in zip(d.tokens.values(), d.finish.values()))
    assert any(STOP in drafts for st in d.steps for drafts in st.spec_token_ids.values())
    assert d.s.stats().spec_accepted > 0 and d.s.bm.num_free == 256


def test_penalised_and_logprob_requests_get_no_drafts_and_sampled_ones_do():
    for params in ({"repetition_penalty": 1.2}, {"logprobs": 2}):
        d = _run(_drivers()["sync"], {"async_scheduling": False, "speculative": "ngram"}, jobs=JOBS[:3], **params)
        assert not any(st.spec_token_ids for st in d.steps) and d.s.stats().spec_steps == 0
    d = _run(_drivers()["sync"], {"async_scheduling": False, "speculative": "ngram"}, jobs=JOBS[:3], temperature=0.8,
             seed=1)
    assert d.s.stats().spec_steps > 0


def test_a_request_that_opts_out_gets_no_drafts():
    s = Scheduler(cfg(async_scheduling=False, speculative="ngram"), 256, BS, 8192, cost=CHEAP_VERIFY)
    d = Driver(s, token_fn=lambda rid, toks: toks[-3])  # the model continues the pattern: prompt lookup matches
    for rid, speculative in (("in", True), ("out", False)):
        s.add_request(AddRequest(request_id=rid, prompt_token_ids=[5, 6, 7] * 20, arrival_time=0.0,
                                 params=SamplingParams(max_tokens=30), speculative=speculative))
    d.run()
    drafted = {rid for st in d.steps for rid in st.spec_token_ids}
    assert drafted == {"in"} and len(d.tokens["out"]) == 30


def test_verifying_drafts_of_a_sampled_request_keeps_the_models_distribution():
    """Chi-square on a 5-token vocabulary: a Markov chain p(b | a) = softmax(L[a] / T). The worker's verify
    (workers/runner.py _Verify) of one fixed draft, then plain sampling when it emitted one token: the first two
    output tokens must follow p(x0 | a0) p(x1 | x0) (a verify that kept drafts too often or too rarely would not)."""
    import torch

    from workers.runner import RequestState, _Verify

    torch.manual_seed(0)
    V, T, a0, draft, trials = 5, 0.8, 2, 3, 6000
    L = torch.randn(V, V) * 1.5
    p = torch.softmax(L / T, dim=-1)
    counts = torch.zeros(V, V)
    params = SamplingParams(max_tokens=8, temperature=T)
    for _ in range(trials):
        r = RequestState("r", params, [1, a0], 1, [0], 1)
        (_, tokens), = _Verify([(r, [draft], 0)], torch.stack([L[a0], L[draft]])).accept()
        if len(tokens) == 1:
            tokens.append(int(torch.multinomial(p[tokens[0]], 1)))
        counts[tokens[0], tokens[1]] += 1
    expected = trials * p[a0][:, None] * p
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 51.18, chi2  # 24 degrees of freedom, p = 0.001
    assert counts[draft].sum() > 0.5 * trials * p[a0, draft]  # the draft was taken (kept) at its own rate


def test_overlapped_steps_sample_seeded_and_penalised_requests_as_steps_one_at_a_time(family):  # noqa: F811
    """workers/runner.py overlap (a decode step launched before the last one's tokens reach the host, the GPU's
    default), forced on here: a seeded request draws the noise of its true output index, and a penalised one waits
    for its tokens (its penalties count them), so the tokens are those of steps run one at a time."""
    from tests.helpers_models import random_prompt

    hf, runner = family
    jobs = {"a": (random_prompt(37, seed=21), 30), "b": (random_prompt(9, seed=22), 25)}
    for params in ({"temperature": 0.7, "seed": 11}, {"temperature": 0.0, "repetition_penalty": 1.5}):
        alone, _ = engine(runner, "mixed", jobs, random.Random(0), params=params, async_scheduling=False)
        runner.overlap = True
        try:
            overlapped, s = engine(runner, "mixed", jobs, random.Random(0), params=params)
        finally:
            runner.overlap = runner.device.type == "cuda"
        assert overlapped == alone, params


def test_a_seeded_sampled_request_gets_the_same_tokens_with_drafts(family):  # noqa: F811
    """The verify samples each position with the request's generator for that output index: the tokens of a
    seeded request are those of decoding without drafts."""
    from tests.helpers_models import random_prompt

    hf, runner = family
    pattern = random_prompt(6, seed=5)
    jobs = {"loop": (pattern * 5, 40), "a": (random_prompt(37, seed=21), 30)}
    params = {"temperature": 0.1, "seed": 11}  # peaked: drafts of the repeating prompt are kept now and then
    plain, _ = engine(runner, "mixed", jobs, random.Random(0), params=params)
    out, s = engine(runner, "mixed", jobs, random.Random(1), cost=CHEAP_VERIFY, speculative="ngram", params=params)
    assert out == plain
    assert s.stats().spec_accepted > 0


def test_with_nothing_to_draft_speculation_changes_nothing():
    """The simulator's stand-in model never repeats itself, so prompt lookup finds no match past the first output:
    K stays 0 and async scheduling keeps two steps in flight, step for step as without --speculative."""
    from batcher.sim.engine import SimRequest, simulate
    from laneserve.wire.protocol import SamplingParams

    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    reqs = [SimRequest(0.001 * i, [(i * 13 + j) % 32000 for j in range(40)], 24, greedy) for i in range(20)]
    runs = [simulate(reqs, cfg(speculative=mode), CHEAP_VERIFY, num_blocks=64, pipelined=True, check_kv=True)
            for mode in ("off", "ngram")]
    assert runs[1].schedulers[0].stats().spec_steps == 0
    assert (runs[1].steps, runs[1].ttft, runs[1].e2e) == (runs[0].steps, runs[0].ttft, runs[0].e2e)


def test_drafts_never_preempt_or_fail_a_request_that_one_token_would_fit():
    """An 8-block pool (128 tokens) and a prompt of 100 that stops at 126 tokens: drafts must not ask for blocks
    that plain decoding would not need (it would preempt, or fail the request alone in the pool)."""
    stop = 2000  # not one of the cycle's tokens

    def stop_at_126(rid, toks):
        return stop if len(toks) == 125 else cycle(rid, toks)

    runs = []
    for speculative in ("off", "ngram"):
        d = Driver(Scheduler(cfg(async_scheduling=False, speculative=speculative), 8, BS, 128, cost=CHEAP_VERIFY),
                   stop_at_126)
        add(d.s, "a", 100, max_tokens=27, temperature=0.0, stop_token_ids=[stop])
        d.run()
        runs.append(d)
    assert runs[1].finish == runs[0].finish == {"a": FinishReason.STOP} and runs[1].tokens == runs[0].tokens
    assert runs[1].s.preemptions == 0 and runs[1].s.stats().spec_accepted > 0


class EagerGraphs:
    """A stand-in for workers/cuda_graphs.py DecodeGraphs on the CPU: runs the same rows eagerly as decode rows,
    which is what a captured graph computes (run_rows is DecodeGraphs' own)."""

    sizes = [1, 2, 4, 8, 64]
    block_size = BS

    from workers.cuda_graphs import DecodeGraphs
    run_rows = DecodeGraphs.run_rows
    del DecodeGraphs

    def __init__(self, model, backend, window):
        self.model, self.backend, self.window = model, backend, window
        self.rows: list[int] = []

    def run(self, ids, pos, slots, lens, tables, src=None, prev=None):
        import numpy as np
        import torch

        from workers.attention import AttentionMetadata

        n = len(ids)
        self.rows.append(n)
        table = np.zeros((n, max(len(t) for t in tables)), dtype=np.int32)
        for i, t in enumerate(tables):
            table[i, :len(t)] = t
        lens = [int(x) for x in lens]
        dev = next(self.model.parameters()).device  # (WORKER_TEST_DEVICE=cuda: the model's, like DecodeGraphs')
        i32, i64 = torch.int32, torch.int64
        meta = AttentionMetadata(query_start_loc=torch.arange(n + 1, dtype=i32, device=dev),
                                 seq_lens=torch.tensor(lens, dtype=i32, device=dev),
                                 block_tables=torch.from_numpy(table).to(dev),
                                 slot_mapping=torch.tensor(np.asarray(slots), dtype=i64, device=dev), num_decodes=n,
                                 query_lens_cpu=[1] * n, seq_lens_cpu=lens, block_tables_cpu=table)
        self.backend.prepare(meta, BS, self.window)  # (cascade: planned from the host tables, as for an eager step)
        tokens = torch.tensor(np.asarray(ids), dtype=i64, device=dev)
        if src is not None:
            rows = torch.tensor(src, device=dev)
            tokens = torch.where(rows >= 0, prev[rows.clamp(min=0)], tokens)
        hidden = self.model(tokens, torch.tensor(np.asarray(pos), dtype=i64, device=dev), meta)
        return self.model.compute_logits(hidden)


def test_the_verify_graph_path_gives_transformers_tokens(family):  # noqa: F811
    """workers/runner.py's CUDA-graph verify (a row per position) run on the CPU: a stand-in for DecodeGraphs runs
    the same rows eagerly as decode rows, which is what the captured graph computes."""
    from tests.helpers_models import hf_greedy, random_prompt

    hf, runner = family
    pattern = random_prompt(6, seed=5)
    jobs = {"loop": (pattern * 5, 40), "a": (random_prompt(37, seed=21), 30), "c": (random_prompt(5, seed=1) * 8, 60)}
    runner.graphs = graphs = EagerGraphs(runner.model, runner.backend, runner.model_config.sliding_window)
    try:
        out, s = engine(runner, "mixed", jobs, random.Random(1), cost=CHEAP_VERIFY, speculative="ngram")
    finally:
        runner.graphs = None
    assert out == {rid: hf_greedy(hf, prompt, n) for rid, (prompt, n) in jobs.items()}
    assert s.stats().spec_accepted > 0 and max(graphs.rows) > len(jobs)  # verify rows went through the graph path


# ---------------------------------------------------------------------- the real model runner
def test_every_family_gives_transformers_greedy_tokens_with_drafts(family):  # noqa: F811
    from tests.helpers_models import hf_greedy, random_prompt

    hf, runner = family
    pattern = random_prompt(6, seed=5)
    jobs = {"loop": (pattern * 5, 40), "a": (random_prompt(37, seed=21), 30), "b": (random_prompt(9, seed=22), 25)}
    plain, _ = engine(runner, "mixed", jobs, random.Random(0))
    assert all(plain[rid] == hf_greedy(hf, prompt, n) for rid, (prompt, n) in jobs.items())
    for lanes in ("mixed", "streams"):
        out, s = engine(runner, lanes, jobs, random.Random(1), cost=CHEAP_VERIFY, speculative="ngram")
        assert out == plain
        st = s.stats()
        assert st.spec_steps > 0 and st.spec_accepted > 0


# ---------------------------------------------------------------------- through the stack
async def completion(session, base: str, body: dict):
    """POST /v1/completions (a 200 asserted): (text, completion tokens), or with stream the streamed text."""
    import json

    async with session.post(f"{base}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        if not body.get("stream"):
            out = await r.json()
            return out["choices"][0]["text"], out["usage"]["completion_tokens"]
        text = ""
        async for line in r.content:
            line = line.decode().strip()
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
        return text


async def test_stack_gives_the_same_text_with_drafts_streamed_or_not(stack, make_stack):
    import aiohttp

    spec = make_stack("--speculative", "ngram")
    body = {"model": "tiny", "prompt": "abcabcabcabcabcabcabcabc", "max_tokens": 48, "temperature": 0,
            "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        async def complete(base: str, **extra):
            out = await completion(s, base, body | extra)
            assert extra.get("stream") or "stop" in extra or out[1] == 48
            return out

        ref, _ = await complete(stack.base_url)
        assert await complete(spec.base_url) == (ref, 48)
        assert await complete(spec.base_url, stream=True) == ref
        stop = [ref[20:23]]  # a stop string: text and usage end at it as without drafts
        assert await complete(spec.base_url, stop=stop) == await complete(stack.base_url, stop=stop)
        seeded = {"temperature": 0.4, "seed": 3}  # a seeded sampled request: its tokens too
        assert await complete(spec.base_url, **seeded) == await complete(stack.base_url, **seeded)
        assert await complete(spec.base_url, speculative=False) == (ref, 48)  # the opt-out
        async with s.get(f"{spec.base_url}/metrics") as r:
            metrics = await r.text()
    steps = next(float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith("laneserve:spec_decode_num_steps_total"))
    assert steps > 0


def test_drafts_never_take_the_block_a_later_decode_needs_for_its_one_token():
    """A review found A's drafts taking the pool's last free block, so B (later in the step) was preempted for its
    one token: drafts may take free blocks only, and not those the step's other decodes need."""
    stop = 999

    def model(rid: str, toks: list[int]) -> int:
        return (6 if len(toks) == 15 else stop) if rid == "A" else 7  # A: one more of its pattern, then its stop

    s = Scheduler(cfg(async_scheduling=False, speculative="ngram"), 3, BS, 8192, cost=CHEAP_VERIFY)
    d = Driver(s, model)
    s.add_request(AddRequest(request_id="A", prompt_token_ids=[5, 6] * 7 + [5], arrival_time=0.0,
                             params=SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=(stop,))))
    s.add_request(AddRequest(request_id="B", prompt_token_ids=list(range(100, 116)), arrival_time=0.0,
                             params=SamplingParams(max_tokens=30, temperature=0.0)))
    d.run()
    assert s.preemptions == 0 and [len(d.tokens[r]) for r in "AB"] == [2, 30]
    assert dict(d.steps[1].num_scheduled_tokens) == {"A": 1, "B": 1}  # A's drafts had no block to spare


def test_the_ngram_index_keeps_the_latest_window_only():
    """A review found it growing with the generation (60k entries after 20k tokens) and proposing from position 3 of
    a 6,000-token sequence, though it looks up the latest INDEX_WINDOW tokens only."""
    from batcher.spec import INDEX_WINDOW

    rng = random.Random(0)
    tokens = [1, 2, 3, 4] + [rng.randrange(100, 10_000) for _ in range(20_000)] + [1, 2, 3]
    index = NgramIndex(1, 3)
    for end in range(1, len(tokens) + 1, 500):
        index.grow(tokens[:end])
    assert index.propose(tokens, 4) == []  # (1, 2, 3) last occurred 20k tokens back
    assert len(index.last) <= 2 * INDEX_WINDOW * 3
    recent = tokens + [7, 8, 9, 1, 2, 3]
    assert index.propose(recent, 3) == [7, 8, 9]
