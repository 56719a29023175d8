"""`--step-trace FILE`: a JSONL timeline of the batcher's steps and requests, to see where time to first token goes.

Owns the trace's rows and their report; the batcher (batcher/core.py) writes them. Each row has "ev" and "t" (ms
on the batcher's monotonic clock since the trace began):
- {"ev": "add", "req"}: a request was added to a worker's queue;
- {"ev": "step", "worker", "step", "lane", "predicted_ms", "features"}: a step was composed and sent to its
  worker (features: the cost model's terms, batcher/cost_model.py);
- {"ev": "out", "worker", "step", "execute_ms", "launch_ms", "idle_ms"}: its output came back (the worker's own
  figures: the step's device time, its host launch, how long the worker had waited for it);
- {"ev": "first", "worker", "step", "req"}: that step's output carried the request's first token;
- {"ev": "done", "req"}: the request finished (its last delta went to the gateway).
`python -m batcher.trace FILE` splits each request's time from "add" to "first" into: waiting for the step that
computes the end of its prompt to be composed; that step behind the steps before it on the worker (its output
came back minus its device time, from its composition); and the step's own device time. The load tester's TTFT
adds the gateway and HTTP on top. `--runs` also reports each replay of a sweep apart. Pure but for the file it writes (open, append, close).
"""

from __future__ import annotations

import json
import math
import sys
import time


class StepTrace:
    def __init__(self, path: str):
        self.file = open(path, "w", buffering=1)  # noqa: SIM115 (held open while serving; line-buffered: a run
        # that dies keeps its rows)
        self.t0 = time.monotonic()
        self.waiting_first: set[str] = set()  # requests added whose first token has not come back

    def write(self, ev: str, **fields) -> None:
        self.file.write(json.dumps({"ev": ev, "t": round((time.monotonic() - self.t0) * 1000.0, 3), **fields})
                        + "\n")

    def added(self, req: str) -> None:
        self.waiting_first.add(req)
        self.write("add", req=req)

    def first_tokens(self, worker: int, step: int, deltas) -> None:
        """After a step's output: a "first" row for each request whose first token it carried."""
        for d in deltas:
            if d.request_id in self.waiting_first and (d.new_token_ids or d.finish_reason is not None):
                self.waiting_first.discard(d.request_id)
                if d.new_token_ids:
                    self.write("first", worker=worker, step=step, req=d.request_id)

    def finished(self, req: str) -> None:
        self.waiting_first.discard(req)
        self.write("done", req=req)

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


def split_runs(rows: list[dict]) -> list[list[dict]]:
    """The rows of each run in a trace of several replays against one server (`laneserve loadtest sweep`, which
    drains each replay before the next): a new run begins at an "add" while no request is open (added, not "done").
    Each run keeps its requests' rows and every step's."""
    runs: list[set[str]] = []
    open_: set[str] = set()
    for r in rows:
        if r["ev"] == "add":
            if not open_:
                runs.append(set())
            runs[-1].add(r["req"])
            open_.add(r["req"])
        elif r["ev"] == "done":
            open_.discard(r["req"])
    steps = [r for r in rows if r["ev"] in ("step", "out")]
    return [steps + [r for r in rows if r.get("req") in ids] for ids in runs]


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile, interpolated between ranks as numpy's default (the simulator's summaries use it too)."""
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    runs = "--runs" in args
    args = [a for a in args if a != "--runs"]
    if len(args) != 1:
        print("usage: python -m batcher.trace FILE [--runs] (a --step-trace file; --runs: a line per replay too)",
              file=sys.stderr)
        return 2
    try:
        with open(args[0]) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as exc:
        print(f"batcher.trace: {args[0]}: {exc}", file=sys.stderr)
        return 2
    parts = ttft_breakdown(rows)
    n = len(parts["ttft"])
    print(f"{n} requests' time to first token at the batcher (ms), from {args[0]}:")
    for name, what in (("queued", "until the step that computes its prompt's end is composed"),
                       ("behind", "that step behind the steps before it (output back, less its device time)"),
                       ("step", "that step's device time"), ("ttft", "in all")):
        v = parts[name]
        print(f"  {name:7} p50 {percentile(v, 50):8.1f}  p95 {percentile(v, 95):8.1f}  mean "
              f"{sum(v) / n if n else float('nan'):8.1f}   {what}")
    if runs:  # each replay apart, to set beside the load tester's per-run TTFT p95
        print("per run (a run begins with a request added while none is open), p95 ms:")
        for i, run in enumerate(split_runs(rows)):
            p = ttft_breakdown(run)
            print(f"  run {i}: {len(p['ttft'])} requests  " + "  ".join(
                f"{k} {percentile(p[k], 95):.1f}" for k in ("queued", "behind", "step", "ttft")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
