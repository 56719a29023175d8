"""The Scheduler and the ModelRunner together under random load, against a plain run of the same requests.

Random requests (prompts of 1-120 tokens, some sharing prefixes; 0-40 tokens; greedy or seeded sampling; logprobs,
prompt logprobs, min_tokens, stop tokens, a repetition penalty) through the real scheduler and the real runner on
the tiny model (tests/test_lanes.py engine) in a random configuration: steps launched behind the one in flight
(--overlap-steps on / decode / off), both lanes layouts, async scheduling, small prefill chunks, a tight pool
(preemptions), prefix-cache hits, speculative decoding (ngram, the model as its own draft), piecewise graphs (even
seeds) and aborts of other requests. Every request's tokens, logprobs and prompt logprobs must be those of the
reference run: no overlap, mixed lanes, one step at a time, no speculation, a large pool.
"""

from __future__ import annotations

import random

import pytest

from laneserve.modelspec import TINY_EOS_IDS
from laneserve.wire.protocol import FinishReason
from tests.helpers_models import DEVICE, random_prompt
from tests.test_lanes import engine
from tests.test_speculative import CHEAP_VERIFY
from workers.config import WorkerConfig
from workers.cuda_graphs import PiecewiseGraphs
from workers.runner import ModelRunner

_RUNNERS: dict[tuple[str, bool, bool], ModelRunner] = {}


def runner(overlap: str, draft: bool = False, pieces: bool = False) -> ModelRunner:
    """The tiny model with --overlap-steps `overlap` (and itself as its draft model), built once. pieces: steps with
    a prompt chunk of up to 48 tokens through PiecewiseGraphs (captured on a GPU; on a CPU the same pieces, eager)."""
    if (overlap, draft, pieces) not in _RUNNERS:
        cfg = WorkerConfig(device=DEVICE, dtype="float32", kv_cache_memory="8MiB", max_model_len=512,
                           overlap_steps=overlap, draft_model="tiny" if draft else "",
                           piecewise_graph_tokens=48 if pieces else 0)
        r = _RUNNERS[overlap, draft, pieces] = ModelRunner(cfg)
        if pieces and r.pieces is None:
            r.pieces = PiecewiseGraphs(r.model, 48, r.device)
    return _RUNNERS[overlap, draft, pieces]


def random_jobs(rng: random.Random) -> dict[str, tuple[list[int], int, dict]]:
    """6-13 requests: prompts of 1-120 tokens, some starting alike (prefix-cache hits), some repeating a pattern
    (ngram drafts)."""
    prefixes = [random_prompt(rng.randrange(10, 70), seed=rng.randrange(10**6), vocab=256) for _ in range(2)]
    prefixes.append(random_prompt(rng.randrange(2, 8), seed=rng.randrange(10**6), vocab=256) * 40)
    jobs = {}
    for i in range(rng.randrange(6, 14)):
        n = rng.choice([rng.randrange(1, 8), rng.randrange(1, 121)])
        prompt = (rng.choice(prefixes + [[]]) + random_prompt(n, seed=rng.randrange(10**6), vocab=256))[:n]
        params = {}
        if rng.random() < 0.4:
            params |= {"temperature": rng.choice([0.6, 1.0]), "seed": rng.randrange(1000),
                       "top_k": rng.choice([0, 20]), "top_p": rng.choice([1.0, 0.9])}
        if rng.random() < 0.3:
            params["logprobs"] = rng.choice([0, 3])
        if rng.random() < 0.2:
            params["prompt_logprobs"] = rng.choice([0, 2])
        if rng.random() < 0.35:  # the tiny model's outputs are spread over ~256 ids: stop on some of them
            params["stop_token_ids"] = (*TINY_EOS_IDS, *rng.sample(range(256), 12))
            params["min_tokens"] = rng.choice([0, 0, 3])
        if rng.random() < 0.1:
            params["repetition_penalty"] = 1.3
        jobs[f"r{i}"] = (prompt, rng.choice([0, rng.randrange(1, 41), rng.randrange(1, 41)]), params)
    return jobs


def results(deltas) -> dict[str, tuple]:
    """Per request: its tokens, finish reason, logprobs and prompt logprobs (the latest per position)."""
    out = {}
    for d in deltas:
        toks, finish, lps, plps = out.setdefault(d.request_id, ([], [None], [], {}))
        toks += d.new_token_ids
        lps += d.logprobs or []
        finish[0] = d.finish_reason if d.finish_reason is not None else finish[0]
        for chunk in [d.prompt_logprobs] if d.prompt_logprobs else []:
            for j, lp in enumerate(chunk.token_logprobs):
                plps[chunk.start + j] = (lp, chunk.ranks[j], chunk.top_ids[j], chunk.top_logprobs[j])
    return out


TIE = 1e-3  # logprobs this close may come out in either order: float sums differ with the batch and the chunks


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) < TIE for x, y in zip(a, b))


def same_top(ids: list[int], lps: list[float], ref_ids: list[int], ref_lps: list[float]) -> bool:
    """A top-k against the reference's top-(k + 1): the same values, and the same ids but where values tie."""
    return close(lps, ref_lps[:len(lps)]) and all(
        x == y or any(abs(ref_lps[j] - ref_lps[i]) < TIE for i in (j - 1, j + 1) if 0 <= i < len(ref_lps))
        for j, (x, y) in enumerate(zip(ids, ref_ids)))


def check(rid: str, got: tuple, want: tuple, params: dict) -> None:
    """got: a run's results (results()) for the request; want: the reference's, which asked for one more top logprob
    (at least 2) and prompt logprob. A greedy request's tokens are compared up to the first one that ties in the
    reference (then either may come first); an aborted request's, as far as they came."""
    toks, (finish,), lps, plps = got
    ref_toks, (ref_finish,), ref_lps, ref_plps = want
    n = len(ref_toks)
    if not params.get("temperature"):  # greedy
        n = next((i for i, (t, lp) in enumerate(zip(ref_toks, ref_lps)) if any(
            t != u and abs(lp.logprob - v) < TIE for u, v in zip(lp.top_ids, lp.top_logprobs))), n)
    if finish == FinishReason.ABORT:
        n = min(n, len(toks))
    assert toks[:n] == ref_toks[:n], rid
    if n == len(ref_toks) and finish != FinishReason.ABORT:
        assert (len(toks), finish) == (n, ref_finish), rid
    assert len(lps) == (len(toks) if "logprobs" in params else 0), rid
    for a, b in zip(lps[:n], ref_lps):
        assert close([a.logprob], [b.logprob]) and same_top(a.top_ids, a.top_logprobs, b.top_ids, b.top_logprobs), rid
    if finish != FinishReason.ABORT:
        assert plps.keys() == ref_plps.keys(), rid
    for pos, (lp, rank, ids, top) in plps.items():
        ref_lp, ref_rank, ref_ids, ref_top = ref_plps[pos]
        assert close([lp], [ref_lp]) and abs(rank - ref_rank) <= 1 and same_top(ids, top, ref_ids, ref_top), (rid, pos)


def random_config(rng: random.Random) -> tuple[str, bool, dict]:
    spec = rng.choice(["off", "off", "ngram", "draft"])
    config = dict(lanes=rng.choice(["mixed", "streams"]), async_scheduling=rng.random() < 0.75, speculative=spec,
                  num_speculative_tokens=rng.choice([2, 4]), max_num_batched_tokens=rng.choice([8, 16, 24, 40]),
                  enable_prefix_caching=rng.random() < 0.8, num_blocks=rng.choice([None, rng.randrange(11, 17)]))
    return rng.choice(["on", "on", "decode", "off"]), spec == "draft", config


def stress(seed: int) -> dict:
    rng = random.Random(seed)
    jobs = random_jobs(rng)
    ref: list = []
    asked = {rid: (prompt, n, params | {"logprobs": max(2, params.get("logprobs", 0) + 1)} | (
        {"prompt_logprobs": params["prompt_logprobs"] + 1} if "prompt_logprobs" in params else {}))
        for rid, (prompt, n, params) in jobs.items()}
    engine(runner("off"), "mixed", asked, random.Random(0), deltas=ref, async_scheduling=False)
    want = results(ref)
    overlap, draft, config = random_config(rng)
    aborts = {rid: rng.randrange(1, 30) for rid in rng.sample(sorted(jobs), rng.choice([0, 0, 1, 2]))}
    deltas: list = []
    pieces = seed % 2 == 0  # (not drawn from rng: the seeds keep the configurations they were chosen for)
    r = runner(overlap, draft, pieces)
    steps = r.pieces.steps if pieces else 0
    _, s = engine(r, jobs=jobs, rng=rng, cost=CHEAP_VERIFY, aborts=aborts, deltas=deltas, **config)
    assert not pieces or r.pieces.steps > steps
    got = results(deltas)
    assert got.keys() == want.keys() == jobs.keys()
    for rid in jobs:
        check(rid, got[rid], want[rid], jobs[rid][2])
    st = s.stats()
    return dict(overlap=overlap, draft=draft, pieces=pieces, **config, aborts=len(aborts), preemptions=s.preemptions,
                spec_accepted=st.spec_accepted, prefix_hits=st.prefix_hits,
                stops=sum(r[1][0] == FinishReason.STOP for r in want.values()))


@pytest.mark.parametrize("seed", [3, 14, 18, 27, 33, 44, 46, 53])
def test_random_load_gives_the_tokens_of_a_plain_run(seed):
    stress(seed)
