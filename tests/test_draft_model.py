"""Speculative decoding with a draft model (issue 22, `--speculative draft --draft-model ...`).

The pricing of a draft model's passes and the learning of its cost; the scheduler in simulated time against the
contract-checking stand-in worker, whose stand-in draft model checks that no draft reads draft K/V never computed
(catch-up, acceptance, preemption); the real model runner with a real draft model for every family, against
transformers; the stack over HTTP; and the clear errors.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest

from batcher.cost_model import CostModel
from batcher.scheduler import Scheduler
from batcher.spec import DRAFT_CATCHUP, MIN_DRAFTS, SpecPolicy
from laneserve.wire.protocol import DraftJob, FinishReason
from tests.test_async_scheduling import AsyncDriver
from tests.test_lanes import LaneDriver, engine, family  # noqa: F401  (family: the per-architecture fixture)
from tests.test_scheduler import Driver, add
from tests.test_speculative import BS, CHEAP_VERIFY, JOBS, EagerGraphs, cfg, completion, cycle


# ---------------------------------------------------------------------- pricing
def test_k_pays_for_the_draft_models_passes_and_learns_their_cost():
    cost = CostModel(a=4.8, b=0.02, c=0.011, d=2.7e-5)
    ngram, cheap, dear = (SpecPolicy(m, 8, 2, 4, draft_size=r) for m, r in
                          (("ngram", 0.0), ("draft", 0.02), ("draft", 0.6)))
    for spec in (ngram, cheap, dear):
        spec.drafted, spec.alpha = MIN_DRAFTS, 0.8
    ks = [[spec.choose_k(b, 1000 * b, cost, 256) for b in (1, 8)] for spec in (ngram, cheap, dear)]
    assert ks[0][0] >= ks[1][0] > ks[2][0] >= 1  # a draft pass as dear as 0.6 of a step buys fewer drafts
    assert ks[2][1] <= ks[1][1]
    dear.alpha = 0.3
    assert dear.choose_k(8, 8000, cost, 256) == 0  # a dear draft at low acceptance does not pay
    # the cost share is learned from the worker's draft time against the same work priced by the model's costs
    jobs = [DraftJob(0, 101, 3), DraftJob(40, 41, 1)]
    priced = SpecPolicy.draft_work_ms(jobs, cost)
    assert priced == pytest.approx(cost.step_ms(101, 0, 1, 142) + cost.step_ms(0, 0, 1, 102)
                                   + cost.step_ms(0, 0, 1, 103))
    with_pairs = CostModel(a=4.8, b=0.02, c=0.011, d=2.7e-5, e=1e-6)  # a prompt's attention: its token pairs
    assert SpecPolicy.draft_work_ms(jobs, with_pairs) == pytest.approx(
        with_pairs.step_ms(101, 101 * 101 // 2, 1, 142) + with_pairs.step_ms(0, 0, 1, 102)
        + with_pairs.step_ms(0, 0, 1, 103))
    dear.observe_draft(priced, 0.1 * priced)  # the first measurement replaces the parameter share
    assert dear.draft_ratio == pytest.approx(0.1)
    for _ in range(200):
        dear.observe_draft(priced, 0.05 * priced)
    assert dear.draft_ratio == pytest.approx(0.05, rel=0.01)


# ---------------------------------------------------------------------- the scheduler in simulated time
def noisy(rid: str, toks: list[int]) -> int:
    """A stand-in draft model that is right about two times in three."""
    return cycle(rid, toks) if len(toks) % 3 else 7


def _run(driver, config: dict, draft_fn=None, pool: int = 256, jobs=JOBS, max_len: int = 8192) -> Driver:
    s = Scheduler(cfg(**config), pool, BS, max_len, cost=CHEAP_VERIFY, draft_size=0.05)
    d = driver(s)
    d.w.draft_fn = draft_fn or cycle
    for i, (n, m) in enumerate(jobs):
        add(s, f"r{i}", n, base=100 * i, max_tokens=m, temperature=0.0)
    d.run()
    return d


DRIVERS = {"sync": lambda s: Driver(s, cycle), "pipelined": lambda s: AsyncDriver(s, cycle),
           "streams": lambda s: LaneDriver(s, random.Random(5), cycle)}


@pytest.mark.parametrize("mode", ["sync", "pipelined", "streams"])
def test_draft_model_drafts_give_the_same_tokens_in_fewer_steps(mode):
    config = {"async_scheduling": mode != "sync"} | ({"lanes": "streams"} if mode == "streams" else {})
    plain = _run(DRIVERS[mode], config)
    for draft_fn, rate in ((cycle, 0.9), (noisy, 0.3)):
        spec = _run(DRIVERS[mode], config | {"speculative": "draft"}, draft_fn)
        assert spec.tokens == plain.tokens and all(f == FinishReason.LENGTH for f in spec.finish.values())
        st = spec.s.stats()
        assert st.spec_steps > 0 and st.spec_accepted > rate * st.spec_drafted, (st.spec_accepted, st.spec_drafted)
        assert len(spec.steps) < 0.8 * len(plain.steps)
        assert spec.s.bm.num_free == 256 and not spec.w.reqs
        assert not any(st.spec_token_ids for st in spec.steps)  # the worker drafts, not the batcher
        first = {}
        for step in spec.steps:
            for rid, job in step.draft_jobs.items():
                first.setdefault(rid, job)
        assert all(job.start == 0 for job in first.values())  # a draft model starts from the prompt's first token


def test_a_long_prompt_catches_up_over_several_steps_then_drafts():
    """The draft K/V of a long prompt is computed over several steps, within the step's allowance, while a short
    request (least lag first) drafts from the first speculating step on."""
    prompt = 2 * DRAFT_CATCHUP + 700
    d = _run(DRIVERS["sync"], {"async_scheduling": False, "speculative": "draft"}, pool=512,
             jobs=[(prompt, 40), (20, 60)])
    steps = [step for step in d.steps if step.draft_jobs]
    assert steps[0].draft_jobs["r1"].k > 0
    long = [(step.draft_jobs["r0"], step.num_scheduled_tokens["r0"]) for step in steps if "r0" in step.draft_jobs]
    assert long[0][0].start == 0 and all(b.start == a.stop for (a, _), (b, _) in zip(long[:2], long[1:3]))
    assert [(j.k, n) for j, n in long[:2]] == [(0, 1), (0, 1)]  # catching up: one token decoded, no drafts
    j, n = long[2]  # the rest of the prompt, the tokens decoded meanwhile and its input: then its drafts
    assert j.stop == prompt + 3 and j.k > 0 and n == 1 + j.k
    for step in steps:  # the allowance: the positions before each job's input, all jobs together
        assert sum(j.stop - j.start for j in step.draft_jobs.values()) <= DRAFT_CATCHUP + len(step.draft_jobs)
    assert d.s.stats().spec_accepted > 0


@pytest.mark.parametrize("others", [[], [(2 * DRAFT_CATCHUP + 100, 40)] * 2])
def test_long_prompts_alone_catch_up_and_draft(others):
    """A review found a prompt lagging more than DRAFT_CATCHUP never drafting unless a short request did: catch-up
    runs in steps with K > 0 only, and K stayed 0 with no request caught up."""
    prompt = DRAFT_CATCHUP + 100
    d = _run(DRIVERS["sync"], {"async_scheduling": False, "speculative": "draft"}, pool=2048,
             jobs=[(prompt, 60), *others])
    drafted = {rid for step in d.steps for rid, job in step.draft_jobs.items() if job.k > 0}
    assert drafted == {f"r{i}" for i in range(1 + len(others))} and d.s.stats().spec_accepted > 0


@pytest.mark.parametrize("pool", [10, 14])
def test_a_tight_pool_preempts_requests_with_draft_jobs_and_loses_nothing(pool):
    plain = _run(DRIVERS["sync"], {"async_scheduling": False}, pool=pool)
    spec = _run(DRIVERS["sync"], {"async_scheduling": False, "speculative": "draft"}, noisy, pool=pool)
    assert spec.s.preemptions > 0 and spec.s.stats().spec_accepted > 0
    assert spec.tokens == plain.tokens and spec.s.bm.num_free == pool


def test_the_simulator_refuses_a_draft_model_it_does_not_have():
    from batcher.sim.engine import SimRequest, simulate
    from laneserve.wire.protocol import SamplingParams

    with pytest.raises(ValueError, match="no draft model"):
        simulate([SimRequest(0.0, [1, 2, 3], 4, SamplingParams(max_tokens=4))], cfg(speculative="draft"), CHEAP_VERIFY)


# ---------------------------------------------------------------------- the real model runner
@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    """Draft checkpoints: a random model of each family, with the model's vocabulary."""
    from tests.helpers_models import ARCHS, make_checkpoint

    out = {}
    for i, arch in enumerate(ARCHS):
        out[arch] = path = str(tmp_path_factory.mktemp(f"draft-{arch}"))
        make_checkpoint(path, arch, seed=10 + i)
    return out


def _with_draft(runner, draft: str):
    from workers.runner import ModelRunner

    return ModelRunner(dataclasses.replace(runner.cfg, draft_model=draft))


def test_every_family_gives_transformers_greedy_tokens_with_a_draft_model(family, drafts):  # noqa: F811
    from tests.helpers_models import ARCHS, hf_greedy, random_prompt

    hf, runner = family
    pattern = random_prompt(6, seed=5)
    jobs = {"loop": (pattern * 5, 40), "a": (random_prompt(37, seed=21), 30), "b": (random_prompt(9, seed=22), 25)}
    want = {rid: hf_greedy(hf, prompt, n) for rid, (prompt, n) in jobs.items()}
    arch = next(a for a in ARCHS if os.path.basename(runner.cfg.model).startswith(a))
    other = drafts[ARCHS[(ARCHS.index(arch) + 1) % len(ARCHS)]]  # another family: random drafts, few accepted
    for draft, lanes in ((runner.cfg.model, "mixed"), (other, "streams")):  # itself: nearly all accepted
        drafted = _with_draft(runner, draft)
        assert drafted.num_blocks < runner.num_blocks  # the same budget holds the draft's K/V too
        out, s = engine(drafted, lanes, jobs, random.Random(1), cost=CHEAP_VERIFY, speculative="draft")
        assert out == want, draft
        st = s.stats()
        assert st.spec_steps > 0
        if draft == runner.cfg.model:
            assert st.spec_accepted > 0.9 * st.spec_drafted


def test_the_draft_models_graph_passes_give_transformers_tokens(family, drafts):  # noqa: F811
    """workers/draft.py's CUDA-graph passes (a row per position, the first pass's catch-up included while it fits
    the largest graph) run on the CPU through the eager stand-in for DecodeGraphs."""
    from tests.helpers_models import hf_greedy, random_prompt

    hf, runner = family
    drafted = _with_draft(runner, runner.cfg.model)
    d = drafted.drafter
    d.graphs = graphs = EagerGraphs(d.model, d.backend, d.model_config.sliding_window)
    jobs = {"loop": (random_prompt(6, seed=5) * 5, 40), "a": (random_prompt(37, seed=21), 30)}
    out, s = engine(drafted, "mixed", jobs, random.Random(1), cost=CHEAP_VERIFY, speculative="draft")
    assert out == {rid: hf_greedy(hf, prompt, n) for rid, (prompt, n) in jobs.items()}
    assert s.stats().spec_accepted > 0.9 * s.stats().spec_drafted
    assert graphs.rows and max(graphs.rows) > len(jobs)  # a first pass of several positions went through a graph


def test_a_seeded_sampled_request_gets_the_same_tokens_with_a_draft_model(family, drafts):  # noqa: F811
    from tests.helpers_models import random_prompt

    hf, runner = family
    jobs = {"loop": (random_prompt(6, seed=5) * 5, 40), "a": (random_prompt(37, seed=21), 30)}
    params = {"temperature": 0.3, "seed": 11}
    plain, _ = engine(runner, "mixed", jobs, random.Random(0), params=params)
    out, s = engine(_with_draft(runner, runner.cfg.model), "mixed", jobs, random.Random(1), cost=CHEAP_VERIFY,
                    speculative="draft", params=params)
    assert out == plain and s.stats().spec_accepted > 0


def test_a_draft_model_with_another_vocabulary_is_a_clear_error(tmp_path):
    from tests.helpers_models import make_checkpoint
    from workers.config import WorkerConfig
    from workers.runner import ModelRunner

    make_checkpoint(str(tmp_path), "llama", vocab_size=200)
    with pytest.raises(ValueError, match="vocabulary has 200 ids, the model's 320"):
        ModelRunner(WorkerConfig(model="tiny", device="cpu", draft_model=str(tmp_path), kv_cache_memory="4MiB",
                                 max_model_len=512))
    with pytest.raises(ValueError, match="--draft-model /nonexistent: .*not found .*--draft-model must be 'tiny'"):
        ModelRunner(WorkerConfig(model="tiny", device="cpu", draft_model="/nonexistent", kv_cache_memory="4MiB",
                                 max_model_len=512))


def test_speculative_draft_and_draft_model_go_together():
    from laneserve.cli import main

    for argv in (["serve", "--speculative", "draft"], ["serve", "--draft-model", "tiny"]):
        with pytest.raises(SystemExit, match="go together"):
            main(argv)


# ---------------------------------------------------------------------- through the stack
async def test_stack_with_a_draft_model_gives_the_same_text(stack, make_stack):
    import aiohttp

    spec = make_stack("--speculative", "draft", "--draft-model", "tiny")  # the model itself: drafts mostly right
    body = {"model": "tiny", "prompt": "The draft proposes, the model disposes.", "max_tokens": 48,
            "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        async def complete(base: str, **extra):
            return await completion(s, base, body | extra)

        ref = await complete(stack.base_url)
        assert ref[1] == 48 and await complete(spec.base_url) == ref
        assert await complete(spec.base_url, stream=True) == ref[0]
        async with s.get(f"{spec.base_url}/metrics") as r:  # greedy, drafted by the model itself: mostly accepted
            metrics = await r.text()
        seeded = {"temperature": 0.5, "seed": 3}  # (a sampled request accepts fewer: how many depends on K)
        assert await complete(spec.base_url, **seeded) == await complete(stack.base_url, **seeded)
    value = {line.split()[0].split("{")[0]: float(line.split()[-1]) for line in metrics.splitlines()
             if line.startswith("laneserve:spec_decode_num_")}
    assert value["laneserve:spec_decode_num_accepted_tokens_total"] > 0.5 * value[
        "laneserve:spec_decode_num_draft_tokens_total"] > 0
