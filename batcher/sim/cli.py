"""`laneserve simulate` (also `python -m batcher.sim`): replay a trace through the scheduler in simulated time.

Owns the command lines of `laneserve simulate` and `laneserve simulate sweep` (whose runs are batcher/sim/sweep.py's):
the trace (the flags and the trace of `laneserve loadtest`: loadtest.cli's
add_trace_args / trace_from_args; --limit, --speedup) and the config, running
engine.simulate(), printing / writing the summary, and --bench-step (the CPU cost of
one schedule() + update() with 256 running decodes). Must not simulate anything itself.
Every value is checked before the simulation starts: a bad one is a one-line error naming its flag (or file and
line) and exit status 2 (`main`), for `python -m batcher.sim` as for `laneserve simulate`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import typing
from pathlib import Path

from batcher.config import BatcherConfig
from batcher.cost_model import CostModel, default_cost_model
from batcher.scheduler import Scheduler
from batcher.sim.engine import SimWorker, TraceSimRequest, simulate, summarize
from batcher.spec import INDEX_BUDGET
from laneserve.config import check_numbers
from laneserve.wire.protocol import AddRequest, SamplingParams


def trace_requests(args: argparse.Namespace, max_model_len: int | None = None) -> list[TraceSimRequest]:
    """The trace of `laneserve loadtest` for the same trace flags (loadtest.cli.trace_from_args), first
    --limit rows, arrivals divided by --speedup, rows longer than max_model_len (if given) shortened as the load
    client shortens them (sweep.fit_rows; a note says how many). Each request's prompt is built when it arrives, by
    traces.compact_token_ids: the prefix sharing of the prompts the load client sends (hash_ids blocks:
    Mooncake's, rag's documents), so prefixes hit the simulated prefix cache as they hit the server's."""
    from batcher.sim.sweep import fit_rows
    from loadtest.cli import GENERATED, trace_from_args
    from loadtest.traces import MAX_SECONDS

    trace = trace_from_args(args)
    if args.limit is not None:
        if args.trace in GENERATED and args.limit > len(trace):
            raise SystemExit(f"error: --limit {args.limit} is more than the {len(trace)} requests of the generated "
                             f"{args.trace!r} trace; set its length with --num-requests")
        trace = trace[:args.limit]
    span = max(t.arrival for t in trace) / args.speedup if trace else 0.0
    if not span <= MAX_SECONDS:
        raise ValueError(f"--speedup {args.speedup}: the trace would span {span:.3g} s, more than {MAX_SECONDS:g}")
    trace, clamped = fit_rows(trace, max_model_len) if max_model_len else (trace, 0)
    if clamped:
        print(f"note: {clamped} of {len(trace)} requests shortened to fit max_model_len {max_model_len} (as laneserve "
              "loadtest shortens them to the server's; set max_model_len in --config)", file=sys.stderr)
    return [TraceSimRequest(t.arrival / args.speedup, t, i) for i, t in enumerate(trace)]


# --config's own settings (simulate()'s): name -> (default, lowest, highest); the highest keep a typo from
# allocating without bound
SIM_FIELDS = {"num_blocks": (8192, 1, 10_000_000), "block_size": (16, 1, 4096),
              "max_model_len": (32768, 1, 10_000_000), "num_workers": (1, 1, 256)}
TYPE_NAMES = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}


def _config(text: str | None) -> tuple[BatcherConfig, dict]:
    """--config (a JSON object, inline or in a file): its BatcherConfig fields, and its simulate() settings
    (SIM_FIELDS, with their defaults). Each checked as the server checks the same setting (type, then
    laneserve.config.check_numbers' ranges and BatcherConfig.validate); ValueError naming --config and the field."""
    data = {}
    if text:
        is_file = os.path.isfile(text)
        try:
            data = json.loads(Path(text).read_text() if is_file else text)
        except OSError as exc:
            raise ValueError(f"--config {text}: cannot read it ({exc.strerror})") from None
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are
            what = "not a JSON object" if is_file else "neither a file nor a JSON object"
            raise ValueError(f"--config {text[:60]!r}: {what} ({exc})") from None
        if not isinstance(data, dict):
            raise ValueError(f"--config {text[:60]!r}: must be a JSON object of settings, e.g. "
                             '\'{"num_blocks": 4096, "max_num_seqs": 64}\'')
    types = typing.get_type_hints(BatcherConfig) | dict.fromkeys(SIM_FIELDS, int)
    unknown = set(data) - set(types)
    if unknown:
        raise ValueError(f"--config: unknown fields {sorted(unknown)}")
    for name, value in data.items():
        if not _has_type(value, types[name]):
            raise ValueError(f"--config {name} {json.dumps(value)}: must be {TYPE_NAMES[types[name]]}")
        if name in SIM_FIELDS:
            _, lo, hi = SIM_FIELDS[name]
            if not lo <= value <= hi:
                raise ValueError(f"--config {name} {value}: must be from {lo} to {hi:,}")
    fields = {k: v for k, v in data.items() if k not in SIM_FIELDS}
    kw = {k: data.get(k, default) for k, (default, _, _) in SIM_FIELDS.items()}
    try:
        check_numbers(BatcherConfig, fields)  # a SystemExit naming the server's flag
        cfg = BatcherConfig(**fields)
        cfg.validate()
        Scheduler(cfg, 1, kw["block_size"], kw["max_model_len"])  # its own checks (lanes, slo_admission, ...)
    except (SystemExit, ValueError, OSError) as exc:
        raise ValueError(_as_field(str(exc.code if isinstance(exc, SystemExit) else exc), fields)) from None
    return cfg, kw


def _has_type(value, tp: type) -> bool:
    """A JSON value of the field type tp (a bool is no number; an int is a float)."""
    if tp is bool or isinstance(value, bool):
        return tp is bool and isinstance(value, bool)
    return isinstance(value, (int, float) if tp is float else tp)


def _as_field(msg: str, fields: dict) -> str:
    """A server check's message naming a flag ('--max-num-seqs 0: ...') as one naming --config's field."""
    flag, _, rest = msg.partition(" ")
    name = flag.removeprefix("--").replace("-", "_")
    return f"--config {name} {rest}" if flag.startswith("--") and name in fields else f"--config: {msg}"


def check_range(flag: str, value: float, hi: float) -> None:
    if not 0.0 <= value <= hi:  # (NaN fails too)
        raise ValueError(f"{flag} {value}: must be from 0 to {hi:g}")


FRONTEND_HELP = ("ms each request spends outside the batcher before its first token (the HTTP path, the gateway, the "
                 "client), which the simulator does not model: added to every TTFT and end-to-end latency. "
                 "`python -m batcher.trace TRACE --client RECORDS...` measures it on a live run (its 'outside' "
                 "p50); default 0")


def check_out_file(flag: str, path: str | None) -> None:
    """A file the run writes at its end: its directory must exist, and it must not be a directory, before the run."""
    if path is None:
        return
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path}: is a directory")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK) or os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {path}: not writable")


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
    ap.add_argument("--frontend-ms", type=float, default=0.0, metavar="MS", help=FRONTEND_HELP)
    ap.add_argument("--bench-step", action="store_true",
                    help="time one schedule()+update() with 256 running (with --config's settings, e.g. SLO targets)")
    return ap


def main(argv: list[str] | None = None) -> int:
    """`laneserve simulate` / `python -m batcher.sim`: a bad value or file is one line on stderr and exit status 2."""
    from loadtest.cli import one_line_errors

    return one_line_errors("laneserve simulate", _main, sys.argv[1:] if argv is None else argv)


def _main(argv: list[str]) -> int:
    if argv and argv[0] == "sweep":
        return sweep_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.bench_step:
        print(json.dumps(bench_step(cfg=_config(args.config)[0]), indent=1))
        return 0
    check_range("--step-noise", args.step_noise, 10.0)
    check_range("--frontend-ms", args.frontend_ms, 10000.0)
    check_out_file("--json", args.json)
    cfg, kw = _config(args.config)
    cost = _cost_model(args.cost_model, cfg)
    reqs = trace_requests(args, kw["max_model_len"])
    t0 = time.perf_counter()
    res = simulate(reqs, cfg, cost, pipelined=args.pipelined, step_noise=args.step_noise, noise_seed=args.seed, **kw)
    if args.frontend_ms:
        res.ttft[:] = [t + args.frontend_ms / 1000.0 for t in res.ttft]
        res.e2e[:] = [t + args.frontend_ms / 1000.0 for t in res.e2e]
    summary = summarize(res) | {"wall_s": round(time.perf_counter() - t0, 2)}
    if res.errors:
        why = next(iter(res.errors.values()))
        if len(res.errors) == len(reqs):
            raise ValueError(f"every request failed, e.g.: {why} (see --config's num_blocks, block_size, "
                             "max_model_len)")
        print(f"note: {len(res.errors)} of {len(reqs)} requests failed (ERROR), e.g.: {why}", file=sys.stderr)
    _print(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


def _cost_model(path: str | None, cfg: BatcherConfig) -> CostModel:
    """--cost-model's model, else the shipped one for the config's lanes."""
    try:
        return CostModel.load(path or default_cost_model(cfg.lanes))
    except OSError as exc:
        raise ValueError(f"--cost-model {path}: cannot read it ({exc.strerror})") from None


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
    """CPU cost of one schedule() + update() with num_running decoding sequences (no prefill; with prompt lookup,
    after the steps that build their n-gram indexes, INDEX_BUDGET positions a step, if they are built)."""
    cfg = cfg or BatcherConfig()
    sched = Scheduler(cfg, 65536, 16, 32768)
    worker = SimWorker(65536, 16)
    prompt_tokens = 0
    for i in range(num_running):
        ids = [i % 300 + 1] * 7 + list(range(i, i + 500))
        prompt_tokens += len(ids)
        sched.add_request(AddRequest(request_id=f"b{i}", prompt_token_ids=ids,
                                     params=SamplingParams(max_tokens=100000), arrival_time=0.0))
    now = 0.0
    warm_up = -(-prompt_tokens // INDEX_BUDGET)
    while warm_up:
        out, _ = worker.execute(sched.schedule(now))
        sched.update(out, now)
        now += 0.01
        if len(sched.running) == num_running and all(r.is_decoding for r in sched.running.values()):
            warm_up -= 1
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
    p.add_argument("--frontend-ms", type=float, default=0.0, metavar="MS", help=FRONTEND_HELP)
    p.add_argument("--out", required=True, help="directory for sweep.json and sweep.md")
    return p


def sweep_main(argv: list[str]) -> int:
    from rich.console import Console

    from batcher.sim.sweep import run_one
    from loadtest import report, sweep
    from loadtest.cli import generator_flags, plan_sweep, writable_dir

    p = build_sweep_parser()
    args = p.parse_args(argv)
    check_range("--step-noise", args.step_noise, 10.0)
    check_range("--frontend-ms", args.frontend_ms, 10000.0)
    slo = report.parse_slo(args.slo)
    cfg, kw = _config(args.config)
    cost_path = args.cost_model or str(default_cost_model(cfg.lanes))
    cost = _cost_model(args.cost_model, cfg)
    writable_dir(args.out, "--out")  # now, not after the runs
    warmup, runs = plan_sweep(p, args)
    started = time.time()
    rows = []
    work = rows_done = served = 0.0  # over every run: the requests' own work (ms), decode rows, requests served
    for rate, seed, trace in runs:
        recs, res = run_one(warmup, trace, cfg, cost, args.step_noise, seed, frontend_s=args.frontend_ms / 1000.0,
                            **kw)
        rows.append({"rate": rate, "seed": seed, "metrics": sweep.run_metrics(report.summarize(recs, slo))})
        # the requests' own work: the steps' terms summed, priced as one step without its fixed a (nor g and m)
        own = cost.step_ms(res.prefill_tokens, res.attention_pairs, res.decode_tokens, res.kv_tokens_read) - cost.a
        work, rows_done, served = work + own, rows_done + res.decode_tokens, served + len(res.ends)
    gen = {k: v for k, v in generator_flags(args).items() if k not in ("rate", "seed")}
    meta = {"url": "simulated", "model": f"cost model {cost_path}", "trace": args.trace, "generator": gen,
            "rates": sorted(args.rates), "seeds": [args.seed + i for i in range(args.seeds)],
            "prompt_seed": args.seed, "warmup_requests": len(warmup), "slo": args.slo,
            "config": {**dataclasses.asdict(cfg), **kw}, "cost_model": dataclasses.asdict(cost),
            "step_noise": args.step_noise, "frontend_ms": args.frontend_ms, "started_at": started,
            "wall_s": round(time.time() - started, 3), "interrupted": False}
    ceiling = None
    if "tpot" in slo and served:
        w, o = work / served, rows_done / served
        ceiling = {"work_ms": round(w, 3), "decode_rows": round(o, 2), "every_step_mixed": round(
            cost.tpot_ceiling(slo["tpot"] * 1e3, w, o, 1.0), 1), "no_step_mixed": round(
            cost.tpot_ceiling(slo["tpot"] * 1e3, w, o, 0.0), 1)}
        meta["tpot_ceiling"] = ceiling
    result = sweep.build(meta, rows, {k: v * 1e3 for k, v in slo.items()})
    json_path, md_path = sweep.write(args.out, result)
    sweep.print_sweeps([result], [""], Console())
    if ceiling:
        print(f"TPOT ceiling: {ceiling['every_step_mixed']:g} req/s with a prompt chunk in every step, "
              f"{ceiling['no_step_mixed']:g} with none (any schedule: steps averaging the TPOT target, each request's "
              f"own work {ceiling['work_ms']:g} ms and {ceiling['decode_rows']:g} decode rows; docs/scheduling.md)")
    Console(stderr=True).print(f"wrote {json_path} and {md_path}")
    return 0
