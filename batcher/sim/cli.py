"""`laneserve simulate` (also `python -m batcher.sim`): replay a trace through the scheduler in simulated time.

Owns the command line: reading the trace (loadtest.traces) and the config, running
engine.simulate(), printing / writing the summary, and --bench-step (the CPU cost of
one schedule() + update() with 256 running decodes). Must not simulate anything itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from batcher.config import BatcherConfig
from batcher.scheduler import Scheduler
from batcher.sim.engine import DEFAULT_COST_MODEL, CostModel, SimWorker, TraceSimRequest, simulate, summarize
from laneserve.wire.protocol import AddRequest, SamplingParams


def _requests_from_trace(path: str, limit: int | None, speedup: float, block_size: int) -> list[TraceSimRequest]:
    from loadtest import traces  # the shared trace readers (format by file name/contents); numpy: loaded lazily

    if path == "synthetic":  # gamma bursts (shape 0.3) of short and >2k prompts, 5 req/s on average
        trace = traces.gamma_bursts(rate=5.0, n=limit or 5000, burstiness=0.3, input_tokens=(64, 4096),
                                    output_tokens=(16, 256))
    else:
        trace = traces.load_trace(path, limit=limit)
    if limit is not None:
        trace = trace[:limit]
    return [TraceSimRequest(t.arrival / speedup, t, i) for i, t in enumerate(trace)]


def _config(text: str | None) -> BatcherConfig:
    """--config: a JSON object of BatcherConfig fields, or a path to one."""
    if not text:
        return BatcherConfig()
    data = json.loads(Path(text).read_text()) if not text.lstrip().startswith("{") else json.loads(text)
    known = {f.name for f in dataclasses.fields(BatcherConfig)}
    unknown = set(data) - known - {"num_blocks", "block_size", "max_model_len", "num_workers"}
    if unknown:
        raise SystemExit(f"unknown config fields: {sorted(unknown)}")
    return BatcherConfig(**{k: v for k, v in data.items() if k in known})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="laneserve simulate", description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="synthetic", help="a shipped trace's short name (azure-conv, azure-code, burstgpt-1, ...; "
                                          "loadtest/data/README.md), a CSV/JSONL file, or 'synthetic'")
    ap.add_argument("--config", help="BatcherConfig fields as JSON (inline or a file); may also set num_blocks, "
                                     "block_size, max_model_len, num_workers")
    ap.add_argument("--cost-model", default=str(DEFAULT_COST_MODEL), help="JSON with a, b, c, d (ms)")
    ap.add_argument("--json", help="write the summary here")
    ap.add_argument("--limit", type=int, help="first N requests of the trace")
    ap.add_argument("--speedup", type=float, default=1.0, help="divide arrival times by X")
    ap.add_argument("--pipelined", action="store_true", help="keep 2 steps in flight per worker (async scheduling)")
    ap.add_argument("--bench-step", action="store_true", help="time one schedule()+update() with 256 running")
    args = ap.parse_args(argv)
    if args.bench_step:
        print(json.dumps(bench_step(), indent=1))
        return 0
    cfg = _config(args.config)
    extra = json.loads(Path(args.config).read_text() if args.config and not args.config.lstrip().startswith("{")
                       else (args.config or "{}"))
    block_size = int(extra.get("block_size", 16))
    try:
        reqs = _requests_from_trace(args.trace, args.limit, args.speedup, block_size)
    except FileNotFoundError as e:
        ap.error(str(e))
    t0 = time.perf_counter()
    res = simulate(reqs, cfg, CostModel.load(args.cost_model), num_blocks=int(extra.get("num_blocks", 8192)),
                   block_size=block_size, max_model_len=int(extra.get("max_model_len", 32768)),
                   num_workers=int(extra.get("num_workers", 1)), pipelined=args.pipelined)
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
          f"{s['preemptions']}; gated {s['gated_prefills']}; prefix hit rate {s['prefix_hit_rate']:.1%}")


def bench_step(num_running: int = 256, repeats: int = 200) -> dict:
    """CPU cost of one schedule() + update() with num_running decoding sequences (no prefill)."""
    cfg = BatcherConfig()
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
