"""`laneserve simulate` (also `python -m batcher.sim`): replay a trace through the scheduler in simulated time.

Owns the command lines of `laneserve simulate` and `laneserve simulate sweep` (whose runs are batcher/sim/sweep.py's):
the trace (the flags and the trace of `laneserve loadtest`: loadtest.cli's
add_trace_args / trace_from_args; --limit, --speedup) and the config, running
engine.simulate(), printing / writing the summary, and --bench-step (the CPU cost of
one schedule() + update() with 256 running decodes). Must not simulate anything itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from batcher.config import BatcherConfig
from batcher.cost_model import CostModel, default_cost_model
from batcher.scheduler import Scheduler
from batcher.sim.engine import SimWorker, TraceSimRequest, simulate, summarize
from laneserve.wire.protocol import AddRequest, SamplingParams


def trace_requests(args: argparse.Namespace) -> list[TraceSimRequest]:
    """The trace of `laneserve loadtest` for the same trace flags (loadtest.cli.trace_from_args), first
    --limit rows, arrivals divided by --speedup. Each request's prompt is built when it arrives, by
    traces.compact_token_ids: the prefix sharing of the prompts the load client sends (hash_ids blocks:
    Mooncake's, rag's documents), so prefixes hit the simulated prefix cache as they hit the server's."""
    from loadtest.cli import GENERATED, trace_from_args

    trace = trace_from_args(args)
    if args.limit is not None:
        if args.trace in GENERATED and args.limit > len(trace):
            raise SystemExit(f"error: --limit {args.limit} is more than the {len(trace)} requests of the generated "
                             f"{args.trace!r} trace; set its length with --num-requests")
        trace = trace[:args.limit]
    return [TraceSimRequest(t.arrival / args.speedup, t, i) for i, t in enumerate(trace)]


SIM_FIELDS = {"num_blocks": 8192, "block_size": 16, "max_model_len": 32768, "num_workers": 1}  # --config's own


def _config(text: str | None) -> tuple[BatcherConfig, dict]:
    """--config (a JSON object, inline or in a file): its BatcherConfig fields, and its simulate() settings
    (SIM_FIELDS, with their defaults)."""
    data = {}
    if text:
        data = json.loads(Path(text).read_text()) if not text.lstrip().startswith("{") else json.loads(text)
    known = {f.name for f in dataclasses.fields(BatcherConfig)}
    unknown = set(data) - known - set(SIM_FIELDS)
    if unknown:
        raise SystemExit(f"unknown config fields: {sorted(unknown)}")
    return (BatcherConfig(**{k: v for k, v in data.items() if k in known}),
            {k: int(data.get(k, v)) for k, v in SIM_FIELDS.items()})


def check_step_noise(sigma: float) -> None:
    if not 0.0 <= sigma <= 10.0:  # (NaN fails too)
        raise SystemExit(f"error: --step-noise must be from 0 to 10, got {sigma}")


def build_parser() -> argparse.ArgumentParser:
    from loadtest.cli import add_trace_args, count, positive

    ap = argparse.ArgumentParser(prog="laneserve simulate", description=__doc__.splitlines()[0],
                                 epilog="laneserve simulate sweep ...: laneserve loadtest sweep in simulated time "
                                        "(--help there)")
    add_trace_args(ap)  # --trace, --time-unit and the generator flags: the same as laneserve loadtest's
    ap.add_argument("--config", help="BatcherConfig fields as JSON (inline or a file); may also set num_blocks, "
                                     "block_size, max_model_len, num_workers")
    ap.add_argument("--cost-model", help="JSON with a, b, c, d (ms); default: the shipped H200 fit for the "
                    "config's lanes (batcher/cost_model.json, or cost_model_streams.json with lanes streams)")
    ap.add_argument("--json", help="write the summary here")
    ap.add_argument("--limit", type=count,
                    help="first N requests of the trace (of a generated one: at most --num-requests)")
    ap.add_argument("--speedup", type=positive, default=1.0, help="divide arrival times by X")
    ap.add_argument("--pipelined", action="store_true", help="keep 2 steps in flight per worker (async scheduling)")
    ap.add_argument("--step-noise", type=float, default=0.0, metavar="SIGMA",
                    help="each step takes the cost model's time x (1 + N(0, SIGMA)), seeded by --seed, while the "
                         "scheduler predicts with the model (what its prediction errors cost); default 0")
    ap.add_argument("--bench-step", action="store_true",
                    help="time one schedule()+update() with 256 running (with --config's settings, e.g. SLO targets)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "sweep":
        return sweep_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.bench_step:
        print(json.dumps(bench_step(cfg=_config(args.config)[0]), indent=1))
        return 0
    check_step_noise(args.step_noise)
    cfg, kw = _config(args.config)
    reqs = trace_requests(args)
    t0 = time.perf_counter()
    cost = CostModel.load(args.cost_model or default_cost_model(cfg.lanes))
    res = simulate(reqs, cfg, cost, pipelined=args.pipelined, step_noise=args.step_noise, noise_seed=args.seed, **kw)
    summary = summarize(res) | {"wall_s": round(time.perf_counter() - t0, 2)}
    _print(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


def _print(s: dict) -> None:
    print(f"requests {s['requests']} {s['finish']}  simulated {s['duration_s']} s in {s['steps']} steps "
          f"(wall {s['wall_s']} s)")
    for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
        v = s[name]
        print(f"  {name:8s} p50 {v['p50']:10.2f}  p95 {v['p95']:10.2f}  p99 {v['p99']:10.2f}")
    print(f"  throughput {s['throughput_tok_s']} tok/s, {s['requests_per_s']} req/s; preemptions "
          f"{s['preemptions']}; gated {s['gated_prefills']}; prefix hit rate {s['prefix_hit_rate']:.1%}"
          + (f"; shed by SLO admission {s['rejected']}" if s.get("rejected") else ""))


def bench_step(num_running: int = 256, repeats: int = 200, cfg: BatcherConfig | None = None) -> dict:
    """CPU cost of one schedule() + update() with num_running decoding sequences (no prefill)."""
    cfg = cfg or BatcherConfig()
    sched = Scheduler(cfg, 65536, 16, 32768)
    worker = SimWorker(65536, 16)
    for i in range(num_running):
        sched.add_request(AddRequest(request_id=f"b{i}", prompt_token_ids=[i % 300 + 1] * 7 + list(range(i, i + 500)),
                                     params=SamplingParams(max_tokens=100000), arrival_time=0.0))
    now = 0.0
    while any(not r.is_decoding for r in sched.running.values()) or len(sched.running) < num_running:
        out, _ = worker.execute(sched.schedule(now))
        sched.update(out, now)
        now += 0.01
    sched_s = upd_s = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        step = sched.schedule(now)
        t1 = time.perf_counter()
        out, _ = worker.execute(step)
        t2 = time.perf_counter()
        sched.update(out, now)
        t3 = time.perf_counter()
        sched_s += t1 - t0
        upd_s += t3 - t2
        now += 0.01
    assert len(step.num_scheduled_tokens) == num_running
    return {"running": num_running, "schedule_us": round(sched_s / repeats * 1e6, 1),
            "update_us": round(upd_s / repeats * 1e6, 1),
            "total_us": round((sched_s + upd_s) / repeats * 1e6, 1)}


def build_sweep_parser() -> argparse.ArgumentParser:
    from loadtest.cli import add_sweep_args

    p = argparse.ArgumentParser(prog="laneserve simulate sweep", description="laneserve loadtest sweep in simulated "
                                "time (batcher/sim/sweep.py)")
    add_sweep_args(p)
    p.add_argument("--slo", default="ttft=120ms,tpot=30ms", help="SLO terms for goodput and the SLO capacity")
    p.add_argument("--config", help="BatcherConfig fields as JSON (inline or a file), as laneserve simulate's; "
                   "set num_blocks to the server's KV pool")
    p.add_argument("--cost-model", help="as laneserve simulate's (a server's --cost-model-out file, say)")
    p.add_argument("--step-noise", type=float, default=0.0, metavar="SIGMA", help="as laneserve simulate's")
    p.add_argument("--out", required=True, help="directory for sweep.json and sweep.md")
    return p


def sweep_main(argv: list[str]) -> int:
    from rich.console import Console

    from batcher.sim.sweep import run_one
    from loadtest import report, sweep
    from loadtest.cli import generator_flags, plan_sweep

    p = build_sweep_parser()
    args = p.parse_args(argv)
    warmup, runs = plan_sweep(p, args)
    check_step_noise(args.step_noise)
    slo = report.parse_slo(args.slo)
    cfg, kw = _config(args.config)
    cost_path = args.cost_model or str(default_cost_model(cfg.lanes))
    cost = CostModel.load(cost_path)
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
