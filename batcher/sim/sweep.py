"""`laneserve simulate sweep`: `laneserve loadtest sweep` in simulated time, for the simulator-against-GPU check.

Owns turning a simulated run into the load client's records and the sweep around it. The traces are the
ones `laneserve loadtest sweep` replays for the same flags (loadtest.sweep.plan: the warm-up, and per rate
and seed its trace, each rag run with documents of its own). Each run is one simulate() of the warm-up
followed, WARMUP_GAP_S after its last arrival, by the run's trace, on a fresh scheduler with async
scheduling (`--pipelined`); the run's requests become RequestRecords, so loadtest.report.summarize and
loadtest.sweep.build compute every figure as they do for a served sweep, and `laneserve loadtest compare`
sets a measured sweep.json beside a simulated one. Not simulated: ITL (no per-chunk times), the HTTP
path (the gateway's tokenizing and streaming time), and the load client's --no-ignore-eos, --endpoint chat and
context clamping (every request here gets exactly its trace's output tokens). Set `num_blocks` in --config to
the server's KV pool (its `cache_config_info` on /metrics): too small a pool makes requests wait for K/V space.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from batcher.cost_model import CostModel, default_cost_model
from batcher.sim.engine import SimResult, TraceSimRequest, simulate
from laneserve.wire.protocol import FinishReason

WARMUP_GAP_S = 60.0  # from the warm-up's last arrival to the run's first: its requests have finished by then


def records(res: SimResult, rows: list, first: int, shift: float) -> list:
    """The load client's RequestRecords of rows (the run's trace rows, simulated as requests r{first}, ...;
    their arrivals `shift` later than the trace says)."""
    from loadtest.client import RequestRecord

    out = []
    for i, row in enumerate(rows):
        rid = f"r{first + i}"
        rec = RequestRecord(index=i, scheduled=row.arrival, input_tokens=row.input_tokens,
                            max_tokens=max(row.output_tokens, 1), trace_input_tokens=row.input_tokens,
                            trace_output_tokens=row.output_tokens, sent=row.arrival, prompt_tokens=row.input_tokens)
        if rid in res.shed:
            rec.status, rec.error = 429, "shed by predictive SLO admission"
        else:
            arrival, first_at, end, n, reason = res.ends[rid]
            rec.status = 200
            rec.e2e, rec.output_tokens = end - arrival, n
            rec.ttft = None if first_at is None else first_at - arrival
            if reason not in (FinishReason.STOP, FinishReason.LENGTH):
                rec.error = FinishReason(reason).name
        out.append(rec)
    return out


def run_one(warmup: list, rows: list, cfg, cost: CostModel, step_noise: float, seed: int, **kw) -> list:
    """Simulate the warm-up, then rows WARMUP_GAP_S after it; the rows' RequestRecords."""
    shift = warmup[-1].arrival + WARMUP_GAP_S if warmup else 0.0
    reqs = [TraceSimRequest(r.arrival, r, i) for i, r in enumerate(warmup)]
    reqs += [TraceSimRequest(r.arrival + shift, r, len(warmup) + i) for i, r in enumerate(rows)]
    res = simulate(reqs, cfg, cost, pipelined=True, step_noise=step_noise, noise_seed=seed, **kw)
    late = [i for i in range(len(warmup)) if f"r{i}" in res.ends and res.ends[f"r{i}"][2] >= shift]
    if late:
        raise SystemExit(f"error: warm-up request {late[0]} was still running when the run began; the server is "
                         "overloaded at the warm-up's rate")
    return records(res, rows, len(warmup), shift)


def build_parser() -> argparse.ArgumentParser:
    from loadtest.cli import _rates, add_trace_args

    p = argparse.ArgumentParser(prog="laneserve simulate sweep", description=__doc__.splitlines()[0])
    p.add_argument("--rates", type=_rates, required=True, help="requests/s, comma-separated, e.g. 24,30,36")
    p.add_argument("--seeds", type=int, default=3, help="seeds per rate: --seed, --seed + 1, ...")
    p.add_argument("--warmup-requests", type=int, default=None,
                   help="as laneserve loadtest sweep's (default: 32, or --num-docs if more, for rag)")
    add_trace_args(p, rate=False)
    p.add_argument("--slo", default="ttft=120ms,tpot=30ms", help="SLO terms for goodput and the SLO capacity")
    p.add_argument("--config", help="BatcherConfig fields as JSON (inline or a file), as laneserve simulate's; "
                   "set num_blocks to the server's KV pool")
    p.add_argument("--cost-model", help="as laneserve simulate's (a server's --cost-model-out file, say)")
    p.add_argument("--step-noise", type=float, default=0.0, metavar="SIGMA", help="as laneserve simulate's")
    p.add_argument("--out", required=True, help="directory for sweep.json and sweep.md")
    return p


def main(argv: list[str]) -> int:
    from rich.console import Console

    from batcher.sim.cli import _config, check_step_noise, sim_kwargs
    from loadtest import report, sweep
    from loadtest.cli import GENERATED, generator_flags, trace_from_args

    p = build_parser()
    args = p.parse_args(argv)
    if args.trace not in GENERATED:
        p.error(f"--trace must be one of {', '.join(GENERATED)}: the sweep sets the rate of a generated trace")
    if args.seeds < 1:
        p.error("--seeds must be >= 1")
    check_step_noise(args.step_noise)
    slo = report.parse_slo(args.slo)
    cfg, kw = _config(args.config), sim_kwargs(args.config)
    cost_path = args.cost_model or str(default_cost_model(cfg.lanes))
    cost = CostModel.load(cost_path)
    warmup_n = args.warmup_requests
    if warmup_n is None:
        warmup_n = max(32, args.num_docs) if args.trace == "rag" else 32

    def make(rate: float, seed: int) -> list:
        return trace_from_args(argparse.Namespace(**{**vars(args), "rate": rate, "seed": seed}))

    rag_pool = (args.num_docs, args.doc_tokens) if args.trace == "rag" else None
    warmup, runs = sweep.plan(make, args.rates, args.seed, args.seeds, warmup_n, rag_pool)
    started = time.time()
    rows = []
    for rate, seed, trace in runs:
        summary = report.summarize(run_one(warmup, trace, cfg, cost, args.step_noise, seed, **kw), slo)
        rows.append({"rate": rate, "seed": seed, "metrics": sweep.run_metrics(summary)})
    gen = {k: v for k, v in generator_flags(args).items() if k not in ("rate", "seed")}
    meta = {"url": "simulated", "model": f"cost model {cost_path}", "trace": args.trace, "generator": gen,
            "rates": sorted(args.rates), "seeds": [args.seed + i for i in range(args.seeds)],
            "prompt_seed": args.seed, "warmup_requests": len(warmup), "slo": args.slo,
            "config": {**dataclasses.asdict(cfg), **kw}, "cost_model": dataclasses.asdict(cost),
            "step_noise": args.step_noise, "started_at": started, "wall_s": round(time.time() - started, 3),
            "interrupted": False}
    result = sweep.build(meta, rows, {k: v * 1e3 for k, v in slo.items()})
    json_path, md_path = sweep.write(args.out, result)
    sweep.print_sweeps([result], [""], Console())
    Console(stderr=True).print(f"wrote {json_path} and {md_path}")
    return 0
