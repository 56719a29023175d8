"""ModelRunner on the embedded tiny model: determinism, seeds in batches, logprobs, state diffs."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest
import torch

from laneserve.modelspec import TINY_CONFIG
from laneserve.wire import protocol as P
from tests.helpers_models import DEVICE, Sim, greedy, random_prompt
from workers.config import WorkerConfig
from workers.cuda_graphs import PiecewiseGraphs
from workers.runner import ModelRunner


def tiny(seed: int = 0, **kw) -> ModelRunner:
    kw = {"dtype": "float32", **kw}
    return ModelRunner(WorkerConfig(seed=seed, device=DEVICE, kv_cache_memory="8MiB", max_model_len=1024, **kw))


@pytest.fixture(scope="module")
def runner():
    return tiny()


def test_tiny_runner_describes_itself(runner):
    assert (runner.block_size, runner.max_model_len, runner.model_name) == (16, 1024, "tiny")
    assert runner.num_blocks == (8 << 20) // (4 * 2 * 16 * 2 * 32 * 4)
    assert runner.model_config.vocab_size == 320 and runner.model_config.eos_token_ids == (257, 259)


def test_tiny_model_is_deterministic_in_its_seed(runner):
    again, other = tiny(seed=0), tiny(seed=1)
    mine, same, diff = (r.model.checkpoint_state_dict() for r in (runner, again, other))
    assert all(torch.equal(mine[k], same[k]) for k in mine)
    assert not torch.equal(mine["model.layers.0.mlp.up_proj.weight"], diff["model.layers.0.mlp.up_proj.weight"])
    prompt = random_prompt(20, seed=3, vocab=256)
    outs = []
    for r in (runner, again):
        sim = Sim(r)
        sim.add("a", prompt, greedy(24))
        outs.append(sim.run()["a"])
    assert outs[0] == outs[1]
    assert len(set(outs[0])) > 3  # not a degenerate repeat of one token


def seeded(n: int, seed: int) -> P.SamplingParams:
    return P.SamplingParams(max_tokens=n, temperature=0.9, top_p=0.95, top_k=50, seed=seed)


def test_seeded_sampling_same_alone_and_in_a_batch(runner):
    prompt = random_prompt(21, seed=5, vocab=256)
    sim = Sim(runner)
    sim.add("s", prompt, seeded(24, 1234))
    alone = sim.run()["s"]
    sim = Sim(runner, budget=40)
    sim.add("x", random_prompt(30, seed=6, vocab=256), P.SamplingParams(max_tokens=10, temperature=1.0))
    sim.add("y", random_prompt(7, seed=7, vocab=256), seeded(30, 99))
    sim.add("s", prompt, seeded(24, 1234), chunk=8)
    sim.add("z", random_prompt(50, seed=8, vocab=256), greedy(5, repetition_penalty=1.3))
    assert sim.run()["s"] == alone
    sim = Sim(runner)
    sim.add("s", prompt, seeded(24, 1235))
    assert sim.run()["s"] != alone


def test_preempted_request_resumes_identically(runner):
    prompt = random_prompt(25, seed=9, vocab=256)
    for params in (greedy(30), seeded(30, 7)):
        sim = Sim(runner)
        sim.add("a", prompt, params)
        full = sim.run()["a"]
        # recomputed from scratch after preemption: prompt + the 12 tokens it had, as a NewReq
        sim = Sim(runner)
        sim.add("a", prompt, params, output_token_ids=full[:12], chunk=16)
        assert sim.run()["a"] == full


def test_logprobs_only_for_requests_that_ask(runner):
    sim = Sim(runner)
    sim.add("lp", random_prompt(10, seed=11, vocab=256), greedy(6, logprobs=3))
    sim.add("no", random_prompt(12, seed=12, vocab=256), greedy(6))
    sim.run()
    lps = sim.done["lp"].logprobs
    assert len(lps) == 6 and sim.done["no"].logprobs == []  # "no" gets an empty list per step
    for tok, lp in zip(sim.done["lp"].out, lps):
        assert lp.top_ids[0] == tok and lp.logprob == pytest.approx(lp.top_logprobs[0])  # greedy = top-1
        assert len(lp.top_ids) == 3 and lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)


def test_runner_state_follows_the_diffs(runner):
    sp = greedy(100)
    out = runner.execute(P.StepInput(step=0, new_reqs=[
        P.NewReq(request_id="a", prompt_token_ids=list(range(20)), params=sp, block_ids=[3, 7]),
        P.NewReq(request_id="b", prompt_token_ids=list(range(5)), params=sp, block_ids=[9])],
        num_scheduled_tokens={"a": 16, "b": 5}))
    assert out.request_ids == ["b"] and len(out.sampled_token_ids[0]) == 1  # a's chunk did not reach its end
    assert runner.requests["a"].num_computed_tokens == 16
    out = runner.execute(P.StepInput(step=1, cached_reqs=[P.CachedReq("a", [11])],
                                     num_scheduled_tokens={"a": 4}, finished_req_ids=["b"]))
    assert out.request_ids == ["a"] and "b" not in runner.requests
    assert runner.requests["a"].block_ids == [3, 7, 11] and len(runner.requests["a"].token_ids) == 21
    assert runner.execute(P.StepInput(step=2)).request_ids == []
    runner.reset()
    assert runner.requests == {}


def test_bfloat16_on_cpu_runs():
    r = tiny(dtype="bfloat16")
    assert r.model.model.embed_tokens.weight.dtype == torch.bfloat16 and r.kv_cache.pool.dtype == torch.bfloat16
    sim = Sim(r)
    sim.add("a", random_prompt(20, seed=3, vocab=256), greedy(4))
    assert all(0 <= t < TINY_CONFIG.vocab_size for t in sim.run()["a"])


def _submit_all(runner: ModelRunner, steps) -> tuple[list[P.StepOutput], list[int], list[bool | None]]:
    """Submit each step before reading the outputs, as the async batcher sends them (steps may be a generator that
    reads the outputs so far). Returns the outputs and, after each submit, how many outputs were ready and whether
    the step launched behind the one in flight (None: none in flight, as with overlap off)."""
    outs, ready, behind = [], [], []
    for s in steps(outs) if callable(steps) else steps:
        runner.submit(s)
        f = runner._flights.get(s.lane)
        behind.append(None if f is None else f.behind)
        got = runner.take_outputs()
        ready.append(len(got))
        outs += got
    runner.flush()
    outs += runner.take_outputs()
    runner.reset()
    return outs, ready, behind


def _pipelined(runner: ModelRunner) -> tuple[list[P.StepOutput], list[int], list[bool | None]]:
    """Decode-only steps (some reading a token still in flight), a finish, a seeded + penalised request,
    logprobs, then two mixed steps (a new prompt's two chunks beside the decodes, which read their tokens in flight
    on the device), submitted as the async batcher sends them (_submit_all)."""
    new = [P.NewReq(request_id="a", prompt_token_ids=random_prompt(20, seed=1, vocab=256), params=greedy(50),
                    block_ids=[0, 1, 2]),
           P.NewReq(request_id="b", prompt_token_ids=random_prompt(9, seed=2, vocab=256),
                    params=P.SamplingParams(max_tokens=50, temperature=1.0, seed=5, repetition_penalty=1.3),
                    block_ids=[3, 4]),
           P.NewReq(request_id="c", prompt_token_ids=random_prompt(5, seed=3, vocab=256),
                    params=greedy(50, logprobs=2), block_ids=[5])]
    steps = [P.StepInput(step=0, new_reqs=new, num_scheduled_tokens={"a": 20, "b": 9, "c": 5})]
    steps += [P.StepInput(step=k, num_scheduled_tokens={"a": 1, "b": 1, "c": 1}) for k in (1, 2, 3)]
    steps += [P.StepInput(step=4, num_scheduled_tokens={"a": 1, "b": 1}, finished_req_ids=["c"])]
    steps += [P.StepInput(step=5, new_reqs=[P.NewReq(request_id="d", prompt_token_ids=random_prompt(30, 4, 256),
                                                     params=greedy(50), block_ids=[6, 7])],
                          num_scheduled_tokens={"a": 1, "b": 1, "d": 16})]
    steps += [P.StepInput(step=6, num_scheduled_tokens={"a": 1, "b": 1, "d": 14})]  # d's second chunk
    steps += [P.StepInput(step=k, num_scheduled_tokens={"a": 1, "b": 1, "d": 1}) for k in (7, 8)]
    return _submit_all(runner, steps)


KEY = lambda o: (o.step, o.request_ids, o.sampled_token_ids, o.logprobs, o.error, o.prompt_logprobs)  # noqa: E731


def test_overlapped_steps_give_the_serial_tokens():
    serial, ready_serial, behind_serial = _pipelined(tiny(overlap_steps="off"))
    overlapped, ready, behind = _pipelined(tiny(overlap_steps="on"))
    decode_only, _, behind_decode = _pipelined(tiny(overlap_steps="decode"))
    assert ready_serial == [1] * 9 and behind_serial == [None] * 9
    # one step stays in flight: each submit returns the previous step's output, collected after launching its
    # own forward, the mixed steps 5 and 6 too (their decodes read the tokens in flight on the device); with
    # --overlap-steps decode those two collect it first
    assert ready == [0] + [1] * 8
    assert behind == [False] + [True] * 8
    assert behind_decode == [False] + [True] * 4 + [False, False, True, True]
    assert [KEY(o) for o in overlapped] == [KEY(o) for o in serial] == [KEY(o) for o in decode_only]
    assert [o.step for o in overlapped] == list(range(9))


def _mixed_behind(outs: list[P.StepOutput]):
    """Mixed steps whose decodes' rows in the step in flight are not their own order, beside prompt logprobs over
    two chunks, a max_tokens 0 request, a one-token chunk in mid-prompt, and a request preempted while its token
    is in flight and resumed at once (same id, same block) from the tokens the batcher knows."""
    seeded = P.SamplingParams(max_tokens=50, temperature=1.0, seed=5, repetition_penalty=1.3)
    pa, pb, pc = random_prompt(20, 1, 256), random_prompt(9, 2, 256), random_prompt(5, 3, 256)
    yield P.StepInput(step=0, new_reqs=[
        P.NewReq(request_id="a", prompt_token_ids=pa, params=greedy(50), block_ids=[0, 1, 2]),
        P.NewReq(request_id="b", prompt_token_ids=pb, params=seeded, block_ids=[3, 4]),
        P.NewReq(request_id="c", prompt_token_ids=pc, params=greedy(50, logprobs=2), block_ids=[5])],
        num_scheduled_tokens={"a": 20, "b": 9, "c": 5})
    yield P.StepInput(step=1, num_scheduled_tokens={"a": 1, "b": 1, "c": 1})
    yield P.StepInput(step=2, new_reqs=[P.NewReq(request_id="d", prompt_token_ids=random_prompt(30, 4, 256),
                                                 params=greedy(50, prompt_logprobs=2), block_ids=[6, 7, 8])],
                      num_scheduled_tokens={"a": 1, "b": 1, "c": 1, "d": 16})
    yield P.StepInput(step=3, new_reqs=[P.NewReq(request_id="e", prompt_token_ids=random_prompt(12, 5, 256),
                                                 params=P.SamplingParams(max_tokens=0, prompt_logprobs=1),
                                                 block_ids=[9])],
                      num_scheduled_tokens={"a": 1, "b": 1, "c": 1, "d": 14, "e": 12})
    known = [t for o in outs if o.step < 3 for r, ts in zip(o.request_ids, o.sampled_token_ids) if r == "c"
             for t in ts]
    resumed = P.NewReq(request_id="c", prompt_token_ids=pc, params=greedy(50, logprobs=2), block_ids=[5],
                       output_token_ids=known)
    # d, whose token is row 3 of step 3's, comes first in this step's rows (the longest context)
    yield P.StepInput(step=4, new_reqs=[resumed, P.NewReq(request_id="g", prompt_token_ids=random_prompt(3, 6, 256),
                                                          params=greedy(50), block_ids=[10])],
                      finished_req_ids=["c", "e"],
                      num_scheduled_tokens={"a": 1, "b": 1, "d": 1, "c": 5 + len(known), "g": 1})
    yield P.StepInput(step=5, num_scheduled_tokens={"a": 1, "b": 1, "d": 1, "c": 1, "g": 2})
    yield from (P.StepInput(step=k, num_scheduled_tokens={"a": 1, "b": 1, "d": 1, "c": 1, "g": 1}) for k in (6, 7))


def test_mixed_steps_launched_behind_read_their_decodes_tokens_from_the_right_rows():
    serial, _, _ = _submit_all(tiny(overlap_steps="off"), _mixed_behind)
    on, _, behind = _submit_all(tiny(overlap_steps="on"), _mixed_behind)
    decode, _, behind_decode = _submit_all(tiny(overlap_steps="decode"), _mixed_behind)
    assert [KEY(o) for o in on] == [KEY(o) for o in serial] == [KEY(o) for o in decode]
    assert any(o.prompt_logprobs for o in on) and [o.step for o in on] == list(range(8))
    assert behind == [False] + [True] * 7
    assert behind_decode == [False, True, False, False, False, False, True, True]


@pytest.mark.parametrize("pieces", [0, 64])
def test_a_step_in_flight_is_published_from_between_the_next_steps_layers(pieces):
    """With a publisher set (the worker's socket), a step launched behind one in flight publishes that step's output
    from between its own layers' launches once it is done, not after its launch: on a CPU, where a step is done
    when its forward returns, from the next step's first layer. The outputs are the serial run's, each once, in
    order; eager and piecewise forwards alike."""
    serial, _, _ = _submit_all(tiny(overlap_steps="off"), _mixed_behind)
    r = tiny(overlap_steps="on", piecewise_graph_tokens=pieces)
    launching, published = [None, None], []

    def publish(outs):
        # from inside the forward: request a's computed tokens do not count the step being launched yet
        assert r.requests["a"].num_computed_tokens == launching[1]
        published.append((launching[0], [o.step for o in outs]))
        got.extend(outs)

    r.publish = publish
    got = []
    for s in _mixed_behind(got):
        launching[:] = s.step, r.requests["a"].num_computed_tokens if "a" in r.requests else None
        r.submit(s)
        assert r.take_outputs() == []  # published already
    r.flush()
    got += r.take_outputs()
    assert published == [(k + 1, [k]) for k in range(7)]
    assert [KEY(o) for o in got] == [KEY(o) for o in serial]


@pytest.mark.parametrize("backend,kv", [("auto", "auto"), ("triton", "auto"), ("triton", "int8")])
def test_piecewise_graphs_give_the_eager_tokens(backend, kv):
    """Steps with prompt chunks through the pieces between attentions (CUDA graphs on a GPU; on a CPU, where nothing
    is captured, the same pieces and static buffers run eagerly): the eager forward's tokens and logprobs, the
    steps' rows padded to the captured sizes, launched behind the step in flight. With the Triton backend each
    piece ends with the next layer's RoPE and K/V write (the padding rows write nothing), attention then without;
    on an int8 pool (its scales observed per step) the backend keeps both."""
    eager, _, _ = _submit_all(tiny(overlap_steps="on", piecewise_graph_tokens=0, attention_backend=backend,
                                   kv_cache_dtype=kv), _mixed_behind)
    r = tiny(overlap_steps="on", max_num_batched_tokens=64, attention_backend=backend, kv_cache_dtype=kv)
    assert r.model.rope_ahead is ((backend == "triton" or DEVICE == "cuda") and kv != "int8")
    if r.pieces is None:
        r.pieces = PiecewiseGraphs(r.model, 64, r.device)
    assert r.pieces.sizes == [16, 32, 48, 64]  # every 16 up to 256
    pieces, _, _ = _submit_all(r, _mixed_behind)
    # steps 0 and 2-5 (34, 19, 29, 6 + ..., 6 tokens); on a CPU the decode-only steps too (no decode graphs)
    assert r.pieces.steps == (5 if r.graphs is not None else 8)
    assert [KEY(o)[:3] for o in pieces] == [KEY(o)[:3] for o in eager]  # the tokens, exactly
    # the logprobs to within 1e-4: the padded GEMMs may sum in another order
    assert close(msgspec.to_builtins([KEY(o) for o in pieces]), msgspec.to_builtins([KEY(o) for o in eager]))


def close(a, b, tol: float = 1e-4) -> bool:
    """Nested lists / tuples / dicts equal, floats to within tol."""
    if isinstance(a, float) or isinstance(b, float):
        return abs(a - b) <= tol * max(1.0, abs(a), abs(b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(close(a[k], b[k], tol) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(close(x, y, tol) for x, y in zip(a, b))
    return a == b


def test_a_bad_piecewise_graph_size_is_a_clear_error():
    with pytest.raises(ValueError, match="--piecewise-graph-tokens -1: must be >= 0"):
        tiny(piecewise_graph_tokens=-1)


def test_a_bad_overlap_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="--overlap-steps 'yes': choose from auto, on, decode, off"):
        tiny(overlap_steps="yes")


def _metadata_row_by_row(rows, bs):
    """AttentionMetadata.from_rows's arrays as it once built them, one row at a time (the reference)."""
    tables = np.zeros((len(rows), max(-(-(start + n) // bs) for _, start, n, _ in rows)), dtype=np.int32)
    ids, positions, slots = [], [], []
    for i, (blocks, start, n, known) in enumerate(rows):
        pos = np.arange(start, start + n)
        used = np.asarray(blocks[:-(-(start + n) // bs)], dtype=np.int64)
        tables[i, :len(used)] = used
        ids.append(np.array(list(known) + [0] * (n - len(known)), dtype=np.int64))
        positions.append(pos)
        slots.append(used[pos // bs] * bs + pos % bs)
    return tables, np.concatenate(ids), np.concatenate(positions), np.concatenate(slots)


def test_step_metadata_matches_a_row_by_row_build():
    from workers.attention.base import AttentionMetadata

    rng = random.Random(0)
    for _ in range(200):
        rows = []
        for _ in range(rng.randrange(1, 12)):
            n = 1 if rng.random() < 0.5 else rng.randrange(1, 60)
            start = rng.randrange(0, 300)
            blocks = rng.sample(range(1000), -(-(start + n) // 16) + rng.randrange(0, 3))  # (spare blocks too)
            rows.append((blocks, start, n, [rng.randrange(32000) for _ in range(rng.choice([n, n - 1]))]))
        rows.sort(key=lambda r: r[2] != 1)  # decodes first
        meta, ids, positions = AttentionMetadata.from_rows(rows, 16, torch.device("cpu"))
        tables, ref_ids, ref_positions, ref_slots = _metadata_row_by_row(rows, 16)
        assert np.array_equal(meta.block_tables.numpy(), tables) and np.array_equal(ids, ref_ids)
        assert np.array_equal(positions, ref_positions) and np.array_equal(meta.slot_mapping.numpy(), ref_slots)
        assert meta.query_lens_cpu == [n for _, _, n, _ in rows] and meta.num_decodes == sum(r[2] == 1 for r in rows)
