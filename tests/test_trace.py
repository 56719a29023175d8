"""--step-trace (batcher/trace.py): a served run's timeline and its time-to-first-token report."""

from __future__ import annotations

import json

import openai
import pytest

from batcher.trace import client_gap, main as report, ttft_breakdown


def test_a_served_run_traces_every_request_and_the_report_splits_its_ttft(make_stack, tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    stack = make_stack("--step-trace", str(path), "--max-num-batched-tokens", "64")
    client = openai.OpenAI(base_url=stack.api, api_key="none", max_retries=0, timeout=120)
    prompts = [[5 + i] * n for i, n in enumerate((3, 150, 40))]  # 150 tokens: chunked over three steps
    for p in prompts:
        assert client.completions.create(model="tiny", prompt=p, max_tokens=4,
                                         extra_body={"ignore_eos": True}).usage.completion_tokens == 4
    stack.stop()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    adds = [r["req"] for r in rows if r["ev"] == "add"]
    firsts = [r for r in rows if r["ev"] == "first"]
    assert len(adds) == 3 and sorted(r["req"] for r in firsts) == sorted(adds)
    steps = {(r["worker"], r["step"]): r for r in rows if r["ev"] == "step"}
    outs = {(r["worker"], r["step"]): r for r in rows if r["ev"] == "out"}
    assert set(outs) <= set(steps) and len(outs) >= 3 + 4  # each request's prefill steps and decodes
    for key, out in outs.items():
        assert out["t"] >= steps[key]["t"] and out["execute_ms"] >= 0, (key, out)  # (0: a step with no tokens)
    for r in firsts:  # a first token comes with its step's output
        assert (r["worker"], r["step"]) in outs
    parts = ttft_breakdown(rows)
    assert len(parts["ttft"]) == 3
    for q, b, s, t in zip(parts["queued"], parts["behind"], parts["step"], parts["ttft"]):
        assert q >= 0 and s > 0 and 0 <= t - (q + b + s) < 50  # (the rest: the batcher applying the output)
    assert report([str(path)]) == 0
    assert "3 requests' time to first token" in capsys.readouterr().out


def test_the_report_names_a_file_it_cannot_read(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert report([str(bad)]) == 2 and str(bad) in capsys.readouterr().err
    assert report([]) == 2


def test_the_report_joins_the_load_testers_records(make_stack, tmp_path, capsys):
    """--client: the load tester's records.jsonl joined to the trace on the stream's id: each request's TTFT outside
    the batcher (the HTTP path, the gateway, the client) is positive, since the client's TTFT spans the batcher's."""
    from loadtest import cli

    path, run = tmp_path / "trace.jsonl", tmp_path / "run"
    stack = make_stack("--step-trace", str(path))
    assert cli.main(["--url", stack.base_url, "--trace", "synthetic", "--num-requests", "6", "--rate", "20",
                     "--input-tokens", "8:16", "--output-tokens", "3:3", "--no-progress", "--no-plots",
                     "--out", str(run)]) == 0
    stack.stop()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    assert len(records) == 6 and all(r["response_id"].startswith("cmpl-") for r in records)
    gap = client_gap(rows, records)
    assert len(gap["outside"]) == 6 and min(gap["outside"]) > 0
    assert all(c > b > 0 for c, b in zip(gap["client"], gap["batcher"]))
    # the gateway's AddRequest time splits it: both parts positive (one host's wall clock; the client's TTFT spans
    # the gateway's work before the AddRequest and the first token's way back)
    assert len(gap["gateway"]) == 6 and min(gap["gateway"]) > 0 and min(gap["rest"]) > 0
    # and the trace's clock row with the records' wall-clock send times splits the rest: the way in (the client's
    # send to the gateway's AddRequest) and the way out (the batcher's first token to the client's first chunk)
    assert rows[0]["ev"] == "clock" and all(r["sent_wall"] > rows[0]["wall"] for r in records)
    assert len(gap["in"]) == len(gap["out"]) == 6 and min(gap["in"]) > 0 and min(gap["out"]) > 0
    assert all(i + o == pytest.approx(r) for i, o, r in zip(gap["in"], gap["out"], gap["rest"]))
    capsys.readouterr()
    assert report([str(path), "--client", str(run / "records.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "6 of 6 matched" in out and "of which from the gateway's AddRequest to the batcher" in out
    assert "the client's send to the gateway's AddRequest" in out


def test_the_cost_model_fitted_over_the_whole_trace_keeps_what_a_drain_forgets(tmp_path, capsys):
    """--fit-cost-model: a trace whose steps take a known model's time, with chunks over a cached prefix early and
    only decode steps at the end (a run's drain): the fit over every step recovers the model's terms, where the
    server's fit over its last 512 steps keeps the prior's attention term."""
    import random

    from batcher.cost_model import CostModel, OnlineCostFit

    true = CostModel(a=6.0, b=0.02, c=0.01, d=3e-5, e=3e-6, g=1.5)
    rng = random.Random(0)
    rows, step = [], 0
    for phase, n in (("mixed", 400), ("drain", 600)):
        for _ in range(n):
            step += 1
            decodes = rng.randint(1, 64)
            tokens = rng.choice((0, 0, rng.randint(16, 2048))) if phase == "mixed" else 0
            pairs = tokens * rng.choice((0, rng.randint(16, 4096))) + tokens * tokens // 2
            f = [tokens, pairs, decodes, decodes * rng.randint(100, 4000) + tokens, int(tokens > 0)]
            rows += [{"ev": "step", "t": step, "worker": 0, "step": step, "features": f},
                     {"ev": "out", "t": step + 0.5, "worker": 0, "step": step, "execute_ms": true.step_ms(*f)}]
    drain = [r for r in rows[-1200:] if r["ev"] == "step"][-512:]
    # what the server does not learn from either: another worker's steps, a wild time, a draft model's part
    f = [512, 512 * 512 // 2, 8, 9000, 1]
    rows += [{"ev": "step", "t": step + 1, "worker": 1, "step": step + 1, "features": f},
             {"ev": "out", "t": step + 2, "worker": 1, "step": step + 1, "execute_ms": 1.0},
             {"ev": "step", "t": step + 3, "worker": 0, "step": step + 1, "features": f},
             {"ev": "out", "t": step + 4, "worker": 0, "step": step + 1, "execute_ms": 1e9}]
    for i in range(2, 52):  # 50 steps with a draft model's passes in their device time
        f = [0, 0, i, 900 * i, 0]
        rows += [{"ev": "step", "t": step + i, "worker": 0, "step": step + i, "features": f},
                 {"ev": "out", "t": step + i, "worker": 0, "step": step + i, "execute_ms": true.step_ms(*f) + 30.0,
                  "draft_ms": 30.0}]
    path, out = tmp_path / "trace.jsonl", tmp_path / "cost.json"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert report([str(path), "--fit-cost-model", str(out), "--prior", str(tmp_path / "none.json")]) == 2
    assert "--prior" in capsys.readouterr().err
    assert report([str(path), "--fit-cost-model", str(out)]) == 0
    assert "cost model over 1050 timed steps" in capsys.readouterr().out
    fitted = CostModel.load(out)
    for k in "abcdeg":
        assert abs(getattr(fitted, k) - getattr(true, k)) <= 0.05 * getattr(true, k), (k, fitted)
    window = OnlineCostFit(CostModel.load())  # the server's: the last 512 steps, all decodes
    for r in drain:
        window.observe(tuple(r["features"]), true.step_ms(*r["features"]))
    assert window.fit().e == CostModel.load().e != fitted.e
