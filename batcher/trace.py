"""`--step-trace FILE`: a JSONL timeline of the batcher's steps and requests, to see where time to first token goes.

Owns the trace's rows and their report; the batcher (batcher/core.py) writes them. Each row has "ev" and "t" (ms
on the batcher's monotonic clock since the trace began):
- {"ev": "clock", "wall"}: the first row: the batcher's wall clock (time.time()) at t = 0, to place the rows on
  the host's wall clock beside the load tester's send times;
- {"ev": "add", "req", "gw"}: a request was added to a worker's queue, "gw" ms after the gateway built it (the
  gateway's wall clock, in its AddRequest, against the batcher's: both on one host; absent for requests that carry
  no time);
- {"ev": "step", "worker", "step", "lane", "predicted_ms", "features"}: a step was composed and sent to its
  worker (features: the cost model's terms, batcher/cost_model.py);
- {"ev": "out", "worker", "step", "execute_ms", "launch_ms", "idle_ms", "draft_ms" (a draft model's steps)}: its
  output came back (the worker's own figures: the step's device time, its host launch, how long the worker had
  waited for it, the draft model's part of the device time);
- {"ev": "first", "worker", "step", "req"}: that step's output carried the request's first token.
`python -m batcher.trace FILE` splits each request's time from "add" to "first" into: waiting for the step that
computes the end of its prompt to be composed; that step behind the steps before it on the worker (its output
came back minus its device time, from its composition); and the step's own device time. The load tester's TTFT
adds the gateway and HTTP on top: `--client RECORDS...` (its records.jsonl files) splits that off request by
request, and "gw" splits it again: the gateway to the batcher, and the rest, which the clock row and the
client's wall-clock send time split once more: the way in (the client to the gateway's AddRequest: HTTP and the
gateway's parsing and tokenizing) and the way out (the batcher's first token to the client's first chunk).
`--fit-cost-model OUT` fits worker 0's step-cost model over every timed step of the trace and writes it for
`laneserve simulate --cost-model` (a server's `--cost-model-out` holds the fit over its last 512 steps: after a
run's drain those are decode steps, and a term they never vary keeps the prior's value). Pure but for the files
it writes (open, append, close).
"""

from __future__ import annotations

import json
import math
import sys
import time

from batcher.cost_model import CostModel, OnlineCostFit, learned_ms


class StepTrace:
    def __init__(self, path: str):
        self.file = open(path, "w", buffering=1)  # noqa: SIM115 (held open while serving; line-buffered: a run
        # that dies keeps its rows)
        self.t0 = time.monotonic()
        self.waiting_first: set[str] = set()  # requests added whose first token has not come back
        self.write("clock", wall=time.time())

    def write(self, ev: str, **fields) -> None:
        self.file.write(json.dumps({"ev": ev, "t": round((time.monotonic() - self.t0) * 1000.0, 3), **fields})
                        + "\n")

    def added(self, req: str, gateway_time: float = 0.0) -> None:
        """`gateway_time`: the AddRequest's arrival_time (the gateway's time.time() when it built the request)."""
        self.waiting_first.add(req)
        if gateway_time > 0.0:
            self.write("add", req=req, gw=round((time.time() - gateway_time) * 1000.0, 3))
        else:
            self.write("add", req=req)

    def first_tokens(self, worker: int, step: int, deltas) -> None:
        """After a step's output: a "first" row for each request whose first token it carried."""
        for d in deltas:
            if d.request_id in self.waiting_first and (d.new_token_ids or d.finish_reason is not None):
                self.waiting_first.discard(d.request_id)
                if d.new_token_ids:
                    self.write("first", worker=worker, step=step, req=d.request_id)

    def close(self) -> None:
        self.file.close()


def ttft_breakdown(rows: list[dict]) -> dict[str, list[float]]:
    """Per request that got a first token: ms from "add" to the composition of the step that carried it
    ("queued"), from then to its output less its device time ("behind"), its device time ("step"), and the sum
    ("ttft", the batcher's view)."""
    added, composed, outs = {}, {}, {}
    out: dict[str, list[float]] = {"queued": [], "behind": [], "step": [], "ttft": []}
    for r in rows:
        ev = r["ev"]
        if ev == "add":
            added[r["req"]] = r["t"]
        elif ev == "step":
            composed[r["worker"], r["step"]] = r["t"]
        elif ev == "out":
            outs[r["worker"], r["step"]] = r
        elif ev == "first" and r["req"] in added and (r["worker"], r["step"]) in composed:
            key = (r["worker"], r["step"])
            start, done = composed[key], outs[key]
            out["queued"].append(start - added[r["req"]])
            out["step"].append(done["execute_ms"])
            out["behind"].append(done["t"] - start - done["execute_ms"])
            out["ttft"].append(r["t"] - added[r["req"]])
    return out


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile, interpolated between ranks as numpy's default (the simulator's summaries use it too)."""
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def client_gap(rows: list[dict], records: list[dict]) -> dict[str, list[float]]:
    """The load tester's records (its records.jsonl rows) joined to the trace on the stream's id (the batcher's request
    id is "<id>-0" for the first choice): for each match, in ms, the client's TTFT ("client"), the batcher's ("add"
    to "first", "batcher") and the difference, the time outside the batcher ("outside": the HTTP path, the gateway,
    the client); where the trace has the gateway's time, that split into the gateway's AddRequest to the batcher
    ("gateway") and the rest ("rest"); where it also has its clock row and the record its wall-clock send time, the
    rest split into the client to the gateway's AddRequest ("in") and the batcher's first token to the client's
    first chunk ("out")."""
    added = {r["req"]: r for r in rows if r["ev"] == "add"}
    first = {r["req"]: r["t"] for r in rows if r["ev"] == "first"}
    wall0 = next((r["wall"] * 1000.0 - r["t"] for r in rows if r["ev"] == "clock"), None)  # ms at t = 0
    out: dict[str, list[float]] = {k: [] for k in ("client", "batcher", "outside", "gateway", "rest", "in", "out")}
    for rec in records:
        req = f"{rec.get('response_id')}-0"
        if rec.get("ttft") is not None and req in added and req in first:
            add = added[req]
            out["client"].append(rec["ttft"] * 1000.0)
            out["batcher"].append(first[req] - add["t"])
            out["outside"].append(out["client"][-1] - out["batcher"][-1])
            if "gw" in add:
                out["gateway"].append(add["gw"])
                out["rest"].append(out["outside"][-1] - add["gw"])
                if wall0 is not None and rec.get("sent_wall") is not None:
                    sent = rec["sent_wall"] * 1000.0
                    out["in"].append(wall0 + add["t"] - add["gw"] - sent)
                    out["out"].append(out["rest"][-1] - out["in"][-1])
    return out


def fit_cost_model(rows: list[dict], prior: CostModel, worker: int = 0) -> tuple[CostModel, int]:
    """A worker's step-cost model (batcher/cost_model.py) fitted as the server fits it (the same times kept, the
    draft model's part taken out), over every timed step of the trace at once instead of a sliding window:
    (model, steps it saw)."""
    features = {r["step"]: r["features"] for r in rows if r["ev"] == "step" and r["worker"] == worker}
    timed = []
    for r in rows:
        if r["ev"] == "out" and r["worker"] == worker and r["step"] in features:
            ms = learned_ms(r["execute_ms"], r.get("draft_ms", 0.0))
            if ms is not None:
                timed.append((tuple(features[r["step"]]), ms))
    fit = OnlineCostFit(prior, window=max(len(timed), 1), every=len(timed) + 1)
    for f, ms in timed:
        fit.observe(f, ms)
    return fit.fit(), len(timed)


def _line(name: str, v: list[float], what: str = "") -> str:
    n = len(v)
    return (f"  {name:7} p50 {percentile(v, 50):8.1f}  p95 {percentile(v, 95):8.1f}  mean "
            f"{sum(v) / n if n else float('nan'):8.1f}   {what}").rstrip()


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m batcher.trace",
                                 description="where a --step-trace file's time to first token went")
    ap.add_argument("file", help="a --step-trace file")
    ap.add_argument("--client", nargs="+", default=[], metavar="RECORDS",
                    help="the load tester's records.jsonl of runs against the traced server (a sweep's runs/*/): "
                         "for each, the TTFT p95 at the client and at the batcher, and the time outside the batcher")
    ap.add_argument("--fit-cost-model", metavar="OUT",
                    help="fit worker 0's step-cost model over every timed step of the trace and write it here, for "
                         "laneserve simulate --cost-model")
    ap.add_argument("--prior", metavar="FILE",
                    help="the fit's prior: the server's --cost-model (default: the shipped batcher/cost_model.json; "
                         "batcher/cost_model_streams.json for a --lanes streams server)")
    try:
        args = ap.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        rows = _read(args.file)
        runs = [(path, _read(path)) for path in args.client]
    except (OSError, ValueError) as exc:
        print(f"batcher.trace: {exc}", file=sys.stderr)
        return 2
    if args.fit_cost_model:
        try:
            prior = CostModel.load(args.prior) if args.prior else CostModel.load()
        except (OSError, ValueError) as exc:  # (naming the file)
            print(f"batcher.trace: --prior: {exc}", file=sys.stderr)
            return 2
        model, steps = fit_cost_model(rows, prior)
        try:
            model.save(args.fit_cost_model, source=f"{args.file}: worker 0's {steps} timed steps")
        except OSError as exc:
            print(f"batcher.trace: {args.fit_cost_model}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        print(f"cost model over {steps} timed steps, written to {args.fit_cost_model}: "
              + ", ".join(f"{k} {getattr(model, k):.4g}" for k in "abcdegm"))
    parts = ttft_breakdown(rows)
    print(f"{len(parts['ttft'])} requests' time to first token at the batcher (ms), from {args.file}:")
    for name, what in (("queued", "until the step that computes its prompt's end is composed"),
                       ("behind", "that step behind the steps before it (output back, less its device time)"),
                       ("step", "that step's device time"), ("ttft", "in all")):
        print(_line(name, parts[name], what))
    if runs:
        print("per load-tester run, ms (outside: its TTFT less the batcher's, request by request):")
        every: dict[str, list[float]] = {}
        for path, records in runs:
            gap = client_gap(rows, records)
            for k, v in gap.items():
                every.setdefault(k, []).extend(v)
            print(f"  {path}: {len(gap['outside'])} of {len(records)} matched; TTFT p95 "
                  f"{percentile(gap['client'], 95):.1f} at the client, {percentile(gap['batcher'], 95):.1f} at the "
                  f"batcher; outside p50 {percentile(gap['outside'], 50):.1f} p95 {percentile(gap['outside'], 95):.1f}")
        print(_line("outside", every["outside"], "every run: the HTTP path, the gateway, the client"))
        if every["gateway"]:
            print(_line("gateway", every["gateway"], "of which from the gateway's AddRequest to the batcher"))
            print(_line("rest", every["rest"], "and the rest: the client to the gateway, the first token back"))
        if every["in"]:
            print(_line("in", every["in"], "of the rest: the client's send to the gateway's AddRequest"))
            print(_line("out", every["out"], "and the batcher's first token to the client's first chunk"))
    return 0


def _read(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    except OSError as exc:
        raise OSError(f"{path}: {exc.strerror or exc}") from None


if __name__ == "__main__":
    sys.exit(main())
