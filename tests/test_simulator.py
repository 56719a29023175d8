"""Each policy doing its job, with numbers, on replayed traces in simulated time (the real Scheduler)."""

from __future__ import annotations

import dataclasses
import json
import os
import random
from pathlib import Path

import pytest

from batcher.config import BatcherConfig
from batcher.sim.cli import main
from batcher.sim.engine import CostModel, SimRequest, simulate, summarize

COST = CostModel(a=4.0, b=0.06, c=0.05, d=0.0001)
REPO = str(Path(__file__).resolve().parents[1])


def cfg(**kw) -> BatcherConfig:
    return dataclasses.replace(BatcherConfig(), **kw)


def tokens(k: int, n: int) -> list[int]:
    return [(k * 7919 + j) % 32000 for j in range(n)]


def bursty_trace(seed: int = 0, bursts: int = 6, per_burst: int = 40, long_frac: float = 0.25) -> list[SimRequest]:
    """Gamma-distributed bursts (shape 0.5) of short RAG prompts mixed with >2k-token ones, 3 s apart."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(bursts):
        for _ in range(per_burst):
            t += rng.gammavariate(0.5, 0.01)
            n = rng.randrange(2500, 4000) if rng.random() < long_frac else rng.randrange(50, 400)
            out.append(SimRequest(t, tokens(len(out), n), rng.randrange(30, 120)))
        t += 3.0
    return out


def assert_clean(res, reqs: list[SimRequest]) -> None:
    """Every request got all its tokens; every block is back in the pool (or pinned)."""
    assert res.finish.get("LENGTH", 0) == len(reqs)
    assert all(res.output_tokens[f"r{i}"] == r.output_tokens for i, r in enumerate(reqs))
    for s in res.schedulers:
        s.bm.check()
        assert s.bm.num_free + len(s.bm.pinned) == s.num_blocks and s.num_unfinished == 0


def test_gating_lowers_p95_tpot_of_running_decodes_in_bursts():
    reqs = bursty_trace()
    off = simulate(reqs, cfg(burst_gating=False), COST, num_blocks=4096)
    on = simulate(reqs, cfg(burst_gating=True), COST, num_blocks=4096)
    s_off, s_on = summarize(off), summarize(on)
    # Measured: p95 TPOT 68.6 ms -> 38.9 ms, p50 TTFT 1390 -> 562 ms; longs pay with a bounded wait.
    assert s_on["gated_prefills"] > 0 and s_off["gated_prefills"] == 0
    assert s_on["tpot_ms"]["p95"] < 0.7 * s_off["tpot_ms"]["p95"], (s_on["tpot_ms"], s_off["tpot_ms"])
    assert s_on["ttft_ms"]["p50"] < s_off["ttft_ms"]["p50"]
    assert_clean(on, reqs)
    assert_clean(off, reqs)


def test_gated_long_prompts_are_never_starved():
    # A sustained stream of short requests keeps >= 8 decodes active for 20 s; two long prompts arrive early.
    rng = random.Random(3)
    reqs = [SimRequest(0.05 * i, tokens(i, rng.randrange(50, 200)), 200) for i in range(400)]
    reqs += [SimRequest(0.5, tokens(10_000, 3000), 20), SimRequest(0.6, tokens(10_001, 3000), 20)]
    res = {}
    for wait in (1.0, 1000.0):
        res[wait] = simulate(reqs, cfg(max_gated_wait_s=wait, burst_queue_depth=0, burst_arrival_rate=5.0), COST,
                             num_blocks=8192)
        assert_clean(res[wait], reqs)
        assert res[wait].gated_prefills == 2
    # With the 1 s bound the long prompts start within ~1 s (+ their own prefill); unbounded they'd wait for the
    # end of the stream (~20 s): the bound is what prevents starvation.
    assert max(res[1.0].ttft) < 1.5
    assert max(res[1000.0].ttft) > 10.0


def test_bucketing_frees_nearly_done_sequences_blocks_sooner():
    # Seven long generations and, admitted last, one short answer; the pool runs out when the short one has
    # 8 tokens left. Newest-first alone preempts it; with buckets the newest long generation goes instead.
    reqs = [SimRequest(0.001 * k, tokens(k, 100), 300 if k < 7 else 20) for k in range(8)]
    flat = simulate(reqs, cfg(decode_buckets="", enable_prefix_caching=False), COST, num_blocks=60, check_kv=True)
    buck = simulate(reqs, cfg(decode_buckets="8,16,32", enable_prefix_caching=False), COST, num_blocks=60,
                    check_kv=True)
    # Metric: time from a request's first token with <= 8 outputs left to its final delta (= its blocks freed).
    # Measured: p95 1354 ms without buckets -> 56 ms with them.
    f, b = summarize(flat)["near_done_to_free_ms"], summarize(buck)["near_done_to_free_ms"]
    assert flat.preemptions > 0 and buck.preemptions > 0
    assert b["p95"] < 100 < 1000 < f["p95"], (b, f)
    assert b["mean"] < f["mean"] / 3
    assert_clean(flat, reqs)
    assert_clean(buck, reqs)


def test_prefix_caching_cuts_prefill_tokens_by_the_shared_fraction():
    shared, own, n = 1024, 256, 40
    prefix = tokens(99, shared)
    reqs = [SimRequest(0.2 * i, prefix + tokens(i, own), 8) for i in range(n)]
    on = simulate(reqs, cfg(), COST, num_blocks=2048, check_kv=True)
    off = simulate(reqs, cfg(enable_prefix_caching=False), COST, num_blocks=2048)
    expected_cut = (n - 1) * shared / (n * (shared + own))  # the first request computes the prefix once
    cut = 1 - on.prefill_tokens / off.prefill_tokens
    assert off.prefill_tokens == n * (shared + own)
    assert abs(cut - expected_cut) < 0.01, (cut, expected_cut)
    assert summarize(on)["prefix_hit_rate"] == pytest.approx((n - 1) * shared / (n * (shared + own)), abs=0.01)
    assert summarize(on)["ttft_ms"]["p50"] < summarize(off)["ttft_ms"]["p50"]
    assert_clean(on, reqs)


def test_tiny_pool_preempts_and_everyone_still_gets_the_right_token_count():
    rng = random.Random(5)
    reqs = [SimRequest(0.002 * i, tokens(i % 7, rng.randrange(20, 120)), rng.randrange(1, 80)) for i in range(150)]
    res = simulate(reqs, cfg(), COST, num_blocks=24, check_kv=True)  # 24 blocks of 16 tokens
    assert res.preemptions > 10
    assert_clean(res, reqs)


def test_aborts_mid_trace_free_everything():
    rng = random.Random(6)
    reqs = [SimRequest(0.01 * i, tokens(i, rng.randrange(20, 500)), 100) for i in range(60)]
    aborts = {f"r{i}": 0.01 * i + 0.05 for i in range(0, 60, 3)}
    res = simulate(reqs, cfg(), COST, num_blocks=512, check_kv=True, aborts=aborts)
    assert res.finish["ABORT"] == 20 and res.finish["LENGTH"] == 40
    for s in res.schedulers:
        s.bm.check()
        assert s.bm.num_free == s.num_blocks


def test_warm_prefix_pool_serves_hits_from_the_first_request():
    system = tokens(42, 512)
    reqs = [SimRequest(0.0 + 0.001 * i, system + tokens(i, 100), 4) for i in range(16)]
    res = simulate(reqs, cfg(), COST, num_blocks=512, check_kv=True, warm_prefixes=[system])
    # Every request, even those arriving together, gets the 512 pinned tokens (32 blocks) from the cache.
    assert all(res.first_chunk_cached[f"r{i}"] == 512 for i in range(16))
    for s in res.schedulers:
        assert len(s.bm.pinned) == 32 and s.bm.num_free == 512 - 32


def test_cli_writes_a_summary(tmp_path):
    traces = pytest.importorskip("loadtest.traces")
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 0.05 * i, "input_length": 100 + i, "output_length": 10})
                             + "\n" for i in range(50)))
    out = tmp_path / "out.json"
    assert main(["--trace", str(trace), "--time-unit", "s", "--json", str(out), "--limit", "40", "--speedup", "2",
                 "--config", '{"max_num_seqs": 8, "num_blocks": 256}']) == 0
    s = json.loads(out.read_text())
    assert s["requests"] == 40 and s["finish"] == {"LENGTH": 40} and s["output_tokens"] == 400
    assert {"p50", "p95", "p99"} <= set(s["ttft_ms"]) and s["throughput_tok_s"] > 0
    assert traces is not None


@pytest.mark.parametrize("pipelined,workers", [(False, 1), (True, 2)])
def test_in_process_path_equals_the_batcher_path(pipelined, workers):
    """simulate() runs steps in process by default; through SimWorker (StepInput/StepOutput, the worker
    checking every KV promise) it must give the same trace: tight pool (preemptions), shared prefixes,
    a warm prefix, aborts."""
    rng = random.Random(8)
    system = tokens(42, 64)
    reqs = [SimRequest(0.003 * i, (system if i % 2 else []) + tokens(i % 9, rng.randrange(20, 200)),
                       rng.randrange(1, 60)) for i in range(120)]
    aborts = {f"r{i}": 0.003 * i + 0.02 for i in range(0, 120, 10)}
    kw = dict(num_blocks=40, num_workers=workers, pipelined=pipelined, aborts=aborts, warm_prefixes=[system])
    fast = simulate(reqs, cfg(), COST, **kw)
    checked = simulate(reqs, cfg(), COST, check_kv=True, **kw)
    assert checked.preemptions > 0 and checked.prefix_hits > 0 and checked.finish.get("ABORT")
    skip = {"schedulers"}
    assert {k: v for k, v in vars(fast).items() if k not in skip} == \
        {k: v for k, v in vars(checked).items() if k not in skip}


RAG_FLAGS = ["--trace", "rag", "--rate", "1.5", "--burstiness", "1000", "--num-requests", "5", "--num-docs", "2",
             "--doc-tokens", "512", "--question-tokens", "8:16", "--output-tokens", "2", "--hit-rate", "0.6"]


def _rag_expected_hit_rate(flags: list[str]) -> float:
    """Spaced arrivals: every request on a document seen before finds all of it cached, nothing more."""
    from loadtest import cli as lt_cli

    trace = lt_cli.make_trace(lt_cli.build_parser().parse_args(["--url", "u", "--out", "x", *flags]))
    seen, hits = set(), 0
    for r in trace:
        hits += 512 * len(r.hash_ids) if r.hash_ids in seen else 0
        seen.add(r.hash_ids)
    return hits / sum(r.input_tokens for r in trace)


def test_simulate_takes_the_loadtest_generator_flags(tmp_path):
    """`laneserve simulate --trace rag` with loadtest's flags: the rag documents hit the prefix cache."""
    out = tmp_path / "rag.json"
    flags = [*RAG_FLAGS, "--num-requests", "40", "--seed", "3"]
    assert main([*flags, "--json", str(out)]) == 0
    s = json.loads(out.read_text())
    assert s["requests"] == 40 and s["output_tokens"] == 80
    expected = _rag_expected_hit_rate(flags)
    assert 0.2 < expected < 0.95 and s["prefix_hit_rate"] == pytest.approx(expected, abs=1e-4)
    assert main([*flags, "--json", str(out), "--limit", "10", "--speedup", "2"]) == 0
    assert json.loads(out.read_text())["requests"] == 10


def test_rag_prefix_hits_in_the_simulator_match_the_server(stack, tmp_path):
    """The same rag flags replayed against the real stack and simulated: the same share of prompt tokens
    comes from the prefix cache (the load client's prompts and the simulator's share the same blocks)."""
    import re
    import urllib.request

    from loadtest import cli as lt_cli

    def counters() -> tuple[float, float]:
        text = urllib.request.urlopen(stack.url("/metrics"), timeout=10).read().decode()
        return tuple(float(re.search(rf"^laneserve:prefix_cache_{k}_total{{model_name=\S+}} (\S+)$", text,
                                     re.M).group(1)) for k in ("hits", "queries"))

    flags = [*RAG_FLAGS, "--seed", "23"]  # a seed no other test's documents use on the shared stack
    hits0, queries0 = counters()
    assert lt_cli.main(["--url", stack.base_url, *flags, "--slo", "", "--no-progress", "--no-plots",
                        "--out", str(tmp_path / "run")]) == 0
    hits1, queries1 = counters()
    out = tmp_path / "sim.json"
    assert main([*flags, "--json", str(out)]) == 0
    sim = json.loads(out.read_text())["prefix_hit_rate"]
    assert hits1 > hits0
    assert (hits1 - hits0) / (queries1 - queries0) == pytest.approx(sim, abs=1e-4)
    assert sim == pytest.approx(_rag_expected_hit_rate(flags), abs=1e-4)


def test_step_noise_is_seeded_and_changes_timing_only():
    """--step-noise: steps take the cost model's time x (1 + N(0, sigma)) while the scheduler predicts with the model;
    the same seed gives the same run, another seed another, and every request still gets its tokens."""
    rng = random.Random(5)
    reqs = [SimRequest(0.004 * i, tokens(i, rng.randrange(20, 300)), rng.randrange(1, 40)) for i in range(80)]
    kw = dict(num_blocks=512, pipelined=True)
    base = simulate(reqs, cfg(schedule_lead_ms=1.0), COST, **kw)
    a = simulate(reqs, cfg(schedule_lead_ms=1.0), COST, step_noise=0.2, noise_seed=1, **kw)
    b = simulate(reqs, cfg(schedule_lead_ms=1.0), COST, step_noise=0.2, noise_seed=1, **kw)
    c = simulate(reqs, cfg(schedule_lead_ms=1.0), COST, step_noise=0.2, noise_seed=2, **kw)
    assert a.ttft == b.ttft and a.ttft != c.ttft and a.ttft != base.ttft
    assert a.output_tokens == base.output_tokens == {f"r{i}": r.output_tokens for i, r in enumerate(reqs)}
    assert simulate(reqs, cfg(schedule_lead_ms=1.0), COST, step_noise=0.0, noise_seed=9, **kw).ttft == base.ttft


BAD_FLAGS = [  # flags -> the start of the one-line error
    (["--step-noise", "-0.1"], "--step-noise -0.1: must be from 0 to 10"),
    (["--step-noise", "nan"], "--step-noise nan: must be"),
    (["--frontend-ms", "-1"], "--frontend-ms -1.0: must be from 0 to 10000"),
    (["--input-tokens", "1000000000"], "--input-tokens 1000000000: must be N or LO:HI"),
    (["--trace", "rag", "--doc-tokens", "1000000000"], "--doc-tokens 1000000000: must be"),
    (["--limit", "6"], "--limit 6 is more than the 5 requests"),
    (["--config", '{"bogus": 1}'], "--config: unknown fields ['bogus']"),
    (["--config", "[1]"], "--config '[1]': must be a JSON object"),
    (["--config", "nofile.json"], "--config 'nofile.json': neither a file nor a JSON object"),
    (["--config", '{"num_workers": 0}'], "--config num_workers 0: must be from 1"),
    (["--config", '{"num_blocks": 1.7}'], "--config num_blocks 1.7: must be a whole number"),
    (["--config", '{"num_blocks": -5}'], "--config num_blocks -5: must be from 1"),
    (["--config", '{"block_size": 0}'], "--config block_size 0: must be from 1"),
    (["--config", '{"max_model_len": 0}'], "--config max_model_len 0: must be from 1"),
    (["--config", '{"max_num_seqs": 0}'], "--config max_num_seqs 0: must be >= 1"),
    (["--config", '{"max_num_batched_tokens": -1}'], "--config max_num_batched_tokens -1: must be >= 1"),
    (["--config", '{"watermark": 2}'], "--config watermark 2: must be >= 0 and <= 0.5"),
    (["--config", '{"watermark": NaN}'], "--config watermark nan: must be a finite number"),
    (["--config", '{"enable_prefix_caching": "no"}'], '--config enable_prefix_caching "no": must be true or false'),
    (["--config", '{"decode_buckets": "a"}'], "--config decode_buckets 'a': must be comma-separated"),
    (["--config", '{"lanes": "x"}'], "--config: lanes must be one of"),
    (["--config", '{"num_blocks": 100}', "--input-tokens", "3000"], "every request failed, e.g.: prompt of 3000"),
    (["--cost-model", "nofile.json"], "--cost-model nofile.json: cannot read it"),
    (["--json", "."], "--json .: is a directory"),
    (["--speedup", "1e-300"], "--speedup 1e-300: the trace would span"),
    (["--json", "nodir/x.json"], "--json nodir/x.json: "),
]


@pytest.mark.parametrize("flags, says", [  # the generator flags' types: argparse's error, status 2
    (["--input-tokens", "5:3"], "argument --input-tokens: '5:3': LO:HI needs LO <= HI"),
    (["--trace", "rag", "--question-tokens", "5:3"], "argument --question-tokens: '5:3'"),
    (["--seed", "-1"], "argument --seed: '-1': must be 0 or more"),
    (["--trace", "rag", "--hit-rate", "2"], "argument --hit-rate: '2': must be from 0 to 1"),
])
def test_cli_refuses_a_bad_generator_flag_before_the_run(flags, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(flags)
    assert e.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize("flags,error", BAD_FLAGS)
def test_cli_refuses_a_bad_value_in_one_line(flags, error, capsys, tmp_path, monkeypatch):
    """A bad flag, config field or value: one line naming it, exit status 2, before anything runs."""
    monkeypatch.chdir(tmp_path)
    assert main(["--num-requests", "5", "--output-tokens", "2", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"laneserve simulate: error: {error}") and err.count("\n") == 1, err


def test_python_m_batcher_sim_is_laneserve_simulate(tmp_path):
    """`python -m batcher.sim` exits as `laneserve simulate` does: one line, status 2, no traceback."""
    import subprocess
    import sys

    for cmd in (["-m", "batcher.sim"], ["-m", "laneserve.cli", "simulate"]):
        run = subprocess.run([sys.executable, *cmd, "--step-noise", "-0.1"], capture_output=True, text=True,
                             cwd=tmp_path, env={**os.environ, "PYTHONPATH": REPO})
        assert run.returncode == 2
        assert run.stderr == "laneserve simulate: error: --step-noise -0.1: must be from 0 to 10\n"


def test_cli_shortens_requests_to_max_model_len_as_loadtest_does(tmp_path, capsys):
    """A prompt over --config's max_model_len is shortened as the load client shortens it (with a note), not an
    ERROR finish; one the pool can never hold is, and a note says so."""
    out = tmp_path / "s.json"
    flags = ["--num-requests", "4", "--input-tokens", "300", "--output-tokens", "8", "--json", str(out)]
    assert main([*flags, "--config", '{"max_model_len": 200}']) == 0
    assert "note: 4 of 4 requests shortened to fit max_model_len 200" in capsys.readouterr().err
    s = json.loads(out.read_text())
    assert s["finish"] == {"LENGTH": 4} and s["output_tokens"] == 32
    assert main([*flags, "--input-tokens", "100:300", "--seed", "1", "--config", '{"num_blocks": 12}']) == 0
    err = capsys.readouterr().err
    s = json.loads(out.read_text())
    assert 0 < s["finish"]["ERROR"] < 4 and f"note: {s['finish']['ERROR']} of 4 requests failed (ERROR)" in err
    assert main(["sweep", "--trace", "synthetic", "--num-requests", "4", "--input-tokens", "300", "--output-tokens",
                 "4", "--rates", "5", "--seeds", "1", "--warmup-requests", "0", "--config", '{"max_model_len": 200}',
                 "--out", str(tmp_path / "sweep")]) == 0
    run = json.loads((tmp_path / "sweep" / "sweep.json").read_text())["runs"][0]["metrics"]
    assert run["finished"] == run["sent"] == 4 and run["errored"] == 0


SWEEP_FLAGS = ["sweep", "--trace", "rag", "--num-requests", "24", "--burstiness", "0.5", "--num-docs", "2",
               "--doc-tokens", "256", "--question-tokens", "16:64", "--output-tokens", "4:12", "--hit-rate", "0.7",
               "--rates", "20,60", "--seeds", "2", "--warmup-requests", "4"]


def test_simulated_sweep_is_a_loadtest_sweep(tmp_path):
    """`laneserve simulate sweep` writes loadtest sweep's sweep.json from the same traces (its figures computed by
    loadtest's own summary), so `laneserve loadtest compare` sets it beside a served one."""
    from loadtest import sweep
    from loadtest.cli import main as loadtest_main

    assert main([*SWEEP_FLAGS, "--slo", "ttft=10s,tpot=10s", "--out", str(tmp_path / "a")]) == 0
    a = json.loads((tmp_path / "a" / "sweep.json").read_text())
    assert a["kind"] == sweep.KIND and [r["rate"] for r in a["rates"]] == [20, 60]
    assert [(r["rate"], r["seed"]) for r in a["runs"]] == [(20, 0), (20, 1), (60, 0), (60, 1)]
    assert all(r["metrics"]["finished"] == r["metrics"]["sent"] == 24 for r in a["runs"])
    assert a["slo_capacity_rate"] == 60 and all(r["metrics"]["goodput_pct"] == 100.0 for r in a["runs"])
    # an SLO no request meets: no goodput, no capacity; the TTFTs are those of the same runs
    assert main([*SWEEP_FLAGS, "--slo", "ttft=0.001ms", "--out", str(tmp_path / "b")]) == 0
    b = json.loads((tmp_path / "b" / "sweep.json").read_text())
    assert b["slo_capacity_rate"] is None and all(r["metrics"]["goodput_pct"] == 0.0 for r in b["runs"])
    assert [r["metrics"]["ttft_p95_ms"] for r in b["runs"]] == [r["metrics"]["ttft_p95_ms"] for r in a["runs"]]
    assert loadtest_main(["compare", str(tmp_path / "a" / "sweep.json"), str(tmp_path / "b" / "sweep.json"),
                          "--plot", str(tmp_path / "ab.png")]) == 0
    # --frontend-ms: the time outside the batcher, on every TTFT of the same runs; TPOT unchanged
    assert main([*SWEEP_FLAGS, "--slo", "ttft=10s,tpot=10s", "--frontend-ms", "7", "--out", str(tmp_path / "c")]) == 0
    c = json.loads((tmp_path / "c" / "sweep.json").read_text())
    assert c["meta"]["frontend_ms"] == 7.0
    for ra, rc in zip(a["runs"], c["runs"]):
        assert rc["metrics"]["ttft_p95_ms"] == pytest.approx(ra["metrics"]["ttft_p95_ms"] + 7.0)
        assert rc["metrics"]["tpot_p95_ms"] == pytest.approx(ra["metrics"]["tpot_p95_ms"])


def test_simulated_records_carry_each_requests_token_gaps():
    """The simulated load client sees a request's tokens one step apart: its ITL is the gaps between its deltas
    (first token to last), each a step of the cost model or longer; alone, every gap is one decode step."""
    from batcher.sim.sweep import run_one
    from loadtest.traces import TraceRequest

    cost = CostModel(a=5.0, b=0.02, c=0.01, d=0.0, g=3.0)
    rows = [TraceRequest(0.0, 64, 6), TraceRequest(0.001, 300, 9), TraceRequest(5.0, 32, 5)]
    recs, _ = run_one([], rows, BatcherConfig(), cost, 0.0, 0, max_model_len=4096, num_blocks=256)
    for rec in recs:
        assert rec.ok and len(rec.itl) == rec.output_tokens - 1
        assert sum(rec.itl) == pytest.approx(rec.e2e - rec.ttft)
        assert min(rec.itl) >= cost.a / 1000.0 - 1e-9
    # the last request runs alone: each of its steps is one decode, a + c
    assert recs[2].itl == pytest.approx([(cost.a + cost.c) / 1000.0] * 4)


def test_tpot_ceiling_is_what_the_second_leaves_after_the_steps_a_tpot_target_needs():
    cost = CostModel(a=6.0, g=-2.0, m=0.01)
    # 40 steps a second at 25 ms: 240 ms of a (160 with every step mixed, g = -2), 10 ms a request (+ 1 ms of m
    # for its 100 rows beside prompt chunks)
    assert cost.tpot_ceiling(25.0, 10.0, 100, 0.0) == pytest.approx(76.0)
    assert cost.tpot_ceiling(25.0, 10.0, 100, 1.0) == pytest.approx(840 / 11)
    assert cost.tpot_ceiling(5.0, 10.0, 100, 0.0) == 0.0  # 200 steps of 6 ms do not fit in a second


def test_simulated_sweep_reports_the_tpot_ceiling(tmp_path, capsys):
    """Its requests' own work summed over every simulated step: with only c priced, 9 outputs are 8 decode rows
    of 1 ms, and 20 steps a second (a 50 ms TPOT target) of a = 10 ms leave 800 ms: 100 req/s."""
    model = tmp_path / "cost.json"
    model.write_text(json.dumps({"a": 10.0, "b": 0.0, "c": 1.0, "d": 0.0, "e": 0.0, "g": 0.0, "m": 0.0}))
    def meta(slo: str) -> dict:
        assert main(["sweep", "--trace", "synthetic", "--num-requests", "12", "--input-tokens", "32:32",
                     "--output-tokens", "9:9", "--rates", "5", "--seeds", "1", "--warmup-requests", "2", "--slo", slo,
                     "--cost-model", str(model), "--config", '{"num_blocks": 256}', "--out", str(tmp_path)]) == 0
        return json.loads((tmp_path / "sweep.json").read_text())["meta"]

    ceiling = meta("ttft=1s,tpot=50ms")["tpot_ceiling"]
    assert ceiling == {"work_ms": 8.0, "decode_rows": 8.0, "every_step_mixed": 100.0, "no_step_mixed": 100.0}
    assert "TPOT ceiling: 100 req/s with a prompt chunk in every step" in capsys.readouterr().out
    assert "tpot_ceiling" not in meta("ttft=1s")  # no TPOT term: no ceiling


def test_simulated_sweep_counts_shed_requests_as_misses(tmp_path):
    config = '{"slo_ttft_ms": 10, "slo_admission": "reject", "num_blocks": 512}'
    assert main([*SWEEP_FLAGS, "--config", config, "--out", str(tmp_path)]) == 0
    runs = json.loads((tmp_path / "sweep.json").read_text())["runs"]
    shed = [r["metrics"]["rejected"] for r in runs]
    assert max(shed) > 0
    assert all(r["metrics"]["finished"] == 24 - r["metrics"]["rejected"] for r in runs)
    assert all(r["metrics"]["goodput_pct"] <= 100.0 * (24 - r["metrics"]["rejected"]) / 24 for r in runs)


def test_a_gate_with_min_active_decodes_0_never_holds_prompts_on_an_idle_server():
    """--min-active-decodes 0 (docs/scheduling.md) held every long prompt of a burst while nothing ran: the batcher
    schedules on events, so they waited for a request that might never come."""
    reqs = [SimRequest(0.0, tokens(i, 3000), 20) for i in range(32)]
    res = simulate(reqs, cfg(min_active_decodes=0, burst_queue_depth=4), COST, num_blocks=8192)
    assert_clean(res, reqs)
