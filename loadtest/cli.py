"""`laneserve loadtest` (also `python -m loadtest`): build a trace, replay it, report.

  laneserve loadtest --url http://127.0.0.1:8000 --trace burstgpt-1 \
      --speedup 60 --max-requests 100 --slo ttft=120ms,tpot=30ms --out runs/burst
  laneserve loadtest --url URL --trace synthetic --rate 8 --burstiness 0.5 --num-requests 200 --out DIR
  laneserve loadtest --url URL --trace rag --num-docs 16 --doc-tokens 1024 --hit-rate 0.8 --out DIR
  laneserve loadtest --url URL --trace my_trace.jsonl --time-unit ms --out DIR
  laneserve loadtest sweep --url URL --trace rag --rates 24,30,36 --seeds 3 --slo ttft=120ms,tpot=30ms --out DIR
  laneserve loadtest compare runs/a/report.json runs/b/report.json
  laneserve loadtest compare runs/a/sweep.json runs/b/sweep.json --plot ab.png

Owns argument parsing and wiring only: traces.py makes the trace, client.py runs it,
report.py and plots.py write the results, sweep.py runs and summarises a sweep. The trace flags
(`add_trace_args`, `trace_from_args`) are shared with `laneserve simulate` (batcher/sim/cli.py):
the same flags build the same trace in both.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import urllib.parse
from pathlib import Path

from loadtest import traces

GENERATED = ("synthetic", "rag")  # --trace values made by a generator (the generator flags apply)
# The generator flags' defaults, and the flags that shape each generated trace (--seed is not among them: it also
# seeds the prompts of a trace file's replay). A flag left unset is None until trace_from_args fills it in.
GENERATOR_DEFAULTS = {"rate": 4.0, "burstiness": 1.0, "num_requests": 100, "input_tokens": 256, "output_tokens": 64,
                      "num_docs": 16, "doc_tokens": 1024, "question_tokens": (32, 96), "hit_rate": 0.8}
SHAPES = {"synthetic": ("rate", "burstiness", "num_requests", "input_tokens", "output_tokens"),
          "rag": ("rate", "burstiness", "num_requests", "num_docs", "doc_tokens", "question_tokens", "output_tokens",
                  "hit_rate")}
MAX_SPAN_S = 7 * 24 * 3600.0  # a replay planned to last longer is a mistake (a tiny --rate or --speedup)
MAX_SEEDS = 100  # per rate, in a sweep (every run's trace is built up front)
WINDOW_REQUESTS = 600  # a sweep over a trace file: requests per run (--window-requests)
WARMUP_REQUESTS = 32  # a sweep's warm-up replay (--warmup-requests; rag: at least --num-docs)


def positive(text: str) -> float:
    """argparse type: a finite number > 0 (a rate, a gamma shape, a speed-up)."""
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number > 0")
    return value


def non_negative(text: str) -> float:
    """argparse type: a finite number >= 0 (a window start)."""
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number >= 0")
    return value


def share(text: str) -> float:
    """argparse type: a number from 0 to 1."""
    value = float(text)
    if not 0.0 <= value <= 1.0:  # (NaN fails too)
        raise argparse.ArgumentTypeError(f"{text!r}: must be from 0 to 1")
    return value


def count(text: str) -> int:
    """argparse type: a whole number >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return value


def whole(text: str) -> int:
    """argparse type: a whole number >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be 0 or more")
    return value


def count_up_to(limit: int, unit: str = ""):
    """argparse type: a whole number from 1 to limit."""
    def bounded(text: str) -> int:
        value = count(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"{text!r}: at most {limit}{unit}")
        return value
    return bounded


def _length(text: str) -> int | tuple[int, int]:
    """'128' -> 128; '64:512' -> uniform on [64, 512]; lengths are >= 1."""
    try:
        parts = [count(x) for x in text.split(":", 1)]
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"{text!r}: expected N or LO:HI, whole numbers >= 1") from None
    if len(parts) == 2 and parts[0] > parts[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: LO:HI needs LO <= HI")
    return (parts[0], parts[1]) if len(parts) == 2 else parts[0]


def _rates(text: str) -> list[float]:
    """'24,30,36' -> [24.0, 30.0, 36.0]: distinct finite rates > 0."""
    try:
        rates = [positive(x) for x in text.split(",")]
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"{text!r}: give distinct finite rates > 0, e.g. 24,30,36") from None
    if len(set(rates)) != len(rates):
        raise argparse.ArgumentTypeError(f"{text!r}: a rate is given twice")
    return rates


def check_url(text: str, flag: str = "--url") -> str:
    """A server's base URL, http(s)://HOST[:PORT]; a ValueError naming the flag otherwise (checked after parsing:
    tests build traces with a placeholder URL)."""
    try:
        parts = urllib.parse.urlsplit(text)
        ok = parts.scheme in ("http", "https") and parts.hostname and parts.port != 0
    except ValueError:  # a port out of range, a bad IPv6 address
        ok = False
    if not ok or parts.query or parts.fragment:
        raise ValueError(f"{flag} {text!r}: must be http(s)://HOST[:PORT], a port from 1 to 65535")
    return text


def add_trace_args(p: argparse.ArgumentParser, rate: bool = True) -> argparse._ArgumentGroup:
    """--trace, --time-unit and the generator flags of the synthetic and rag traces: one definition for
    `laneserve loadtest`, `laneserve loadtest sweep` (rate=False: it has --rates) and `laneserve simulate`.
    Returns the generator group."""
    p.add_argument("--trace", default="synthetic",
                   help="a shipped trace's short name (" + ", ".join(traces.TRACE_NAMES)
                        + "; loadtest/data/README.md), a CSV/JSONL file, 'synthetic' (Gamma/Poisson) or 'rag' "
                          "(shared document prefixes)")
    p.add_argument("--time-unit", choices=tuple(traces.TIME_UNITS), default=None,
                   help="unit of a JSONL trace file's timestamps when the file does not say it (no header line; "
                        "shipped traces and files written by save_trace do)")
    g = p.add_argument_group("synthetic and rag traces (the same flags in laneserve loadtest and laneserve simulate; "
                             "an error with a trace they do not shape)")
    d = GENERATOR_DEFAULTS
    if rate:
        g.add_argument("--rate", type=positive, help=f"requests/s (default {d['rate']:g})")
    g.add_argument("--burstiness", type=positive,
                   help=f"gamma shape: 1 = Poisson, < 1 burstier (default {d['burstiness']:g})")
    g.add_argument("--num-requests", type=count, help=f"default {d['num_requests']}")
    g.add_argument("--input-tokens", type=_length, help=f"synthetic: N or LO:HI (default {d['input_tokens']})")
    g.add_argument("--output-tokens", type=_length, help=f"N or LO:HI (default {d['output_tokens']})")
    g.add_argument("--num-docs", type=count, help=f"rag: shared document pool size (default {d['num_docs']})")
    g.add_argument("--doc-tokens", type=count,
                   help=f"rag: document length (whole 512-token blocks; default {d['doc_tokens']})")
    g.add_argument("--question-tokens", type=_length, help="rag: N or LO:HI (default %d:%d)" % d["question_tokens"])
    g.add_argument("--hit-rate", type=share,
                   help=f"rag: share of prompts on a pooled document (default {d['hit_rate']:g})")
    g.add_argument("--seed", type=whole, default=0)
    return g


def generator_flags(args: argparse.Namespace) -> dict:
    """The generator flags that shape args.trace (for reports); a sweep over a trace file: its --window-requests."""
    if args.trace not in GENERATED:
        n = getattr(args, "window_requests", False)
        return {"seed": args.seed} if n is False else {"window_requests": n or WINDOW_REQUESTS, "seed": args.seed}
    return {k: getattr(args, k) for k in (*SHAPES[args.trace], "seed") if hasattr(args, k)}


def resolve_generator_flags(args: argparse.Namespace) -> None:
    """Set the unset generator flags that shape args.trace to their defaults (in args); one given for a trace it
    does not shape (a trace file, or the other generator's flag) is a ValueError, not ignored."""
    shaping = SHAPES.get(args.trace, ())
    stray = [k for k in GENERATOR_DEFAULTS if k not in shaping and getattr(args, k, None) is not None]
    if stray:
        flags = ", ".join("--" + k.replace("_", "-") for k in stray)
        what = (f"the {args.trace!r} trace takes --" + ", --".join(k.replace("_", "-") for k in shaping) if shaping
                else f"generator flags shape the generated traces ({', '.join(GENERATED)}), not a trace file")
        raise ValueError(f"{flags} {'does' if len(stray) == 1 else 'do'} not apply to --trace {args.trace}: {what}")
    for k in shaping:
        if hasattr(args, k) and getattr(args, k) is None:
            setattr(args, k, GENERATOR_DEFAULTS[k])


def trace_from_args(args: argparse.Namespace) -> list[traces.TraceRequest]:
    """The trace that --trace, --time-unit and the generator flags name (add_trace_args). A bad name,
    file, unit or generator value exits with the reason (SystemExit)."""
    try:
        resolve_generator_flags(args)
        if args.trace in GENERATED and args.time_unit is not None:
            raise ValueError(f"--time-unit is for trace files, not the generated {args.trace!r} trace")
        if args.trace == "synthetic":
            return traces.gamma_bursts(args.rate, args.num_requests, args.burstiness, args.input_tokens,
                                       args.output_tokens, seed=args.seed)
        if args.trace == "rag":
            return traces.rag(args.rate, args.num_requests, args.num_docs, args.doc_tokens, args.question_tokens,
                              args.output_tokens, args.hit_rate, args.burstiness, seed=args.seed)
        return traces.load_trace(args.trace, time_unit=args.time_unit)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from None


def check_span(trace: list[traces.TraceRequest], speedup: float, hint: str) -> float:
    """The replay's planned length in seconds; a ValueError when it is absurd (over MAX_SPAN_S), with the hint."""
    span = trace[-1].arrival / speedup if trace else 0.0
    if not span <= MAX_SPAN_S:
        raise ValueError(f"the replay would last {span:.3g} s, more than {MAX_SPAN_S / 86400:g} days: {hint}")
    return span


def writable_dir(path: str | Path, flag: str) -> None:
    """Create the directory now (parents too) and check a file can be written in it: a bad --out fails before the
    run, not after it. A ValueError naming the flag otherwise."""
    if not str(path):
        raise ValueError(f"{flag} is empty")
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot write files there ({exc.strerror or exc})") from None


def _add_request_args(p: argparse.ArgumentParser) -> None:
    r = p.add_argument_group("requests")
    r.add_argument("--model", default=None, help="default: the first model of GET /v1/models")
    r.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    r.add_argument("--prompt-mode", choices=("ids", "text"), default="ids",
                   help="token-id prompts, or text made with the server's /detokenize before the run's clock "
                   "starts (chat always sends text)")
    r.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="don't send ignore_eos (output lengths then follow the model)")
    r.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))


def _add_limits(w) -> None:
    w.add_argument("--time-limit", type=positive, default=None,
                   help="wall seconds for one replay (default: trace span + request timeout)")
    w.add_argument("--request-timeout", type=positive, default=600.0)
    w.add_argument("--max-connections", type=count, default=4096,
                   help="completions in flight at once (HTTP connections); one above it waits, and the wait counts "
                        "in its TTFT (reported: pool_wait_ms)")
    w.add_argument("--client-procs", type=count_up_to(64, " processes"), default=1,
                   help="processes that send and read the requests, each a round-robin share of the trace with its "
                        "own event loop (one loop reading hundreds of streams reads each chunk late: TTFT and ITL "
                        "measured high); the connections are split between them")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="laneserve loadtest", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--url", required=True, help="server base URL (OpenAI-compatible), e.g. http://127.0.0.1:8000")
    add_trace_args(p)
    w = p.add_argument_group("replay")
    w.add_argument("--speedup", type=positive, default=1.0, help="divide arrival times by this")
    w.add_argument("--start", type=non_negative, default=0.0, help="trace window start, trace seconds")
    w.add_argument("--duration", type=positive, default=None, help="trace window length, trace seconds")
    w.add_argument("--max-requests", type=count, default=None)
    w.add_argument("--max-input-tokens", type=count, default=None, help="cap each prompt (e.g. for a small model)")
    w.add_argument("--max-output-tokens", type=count, default=None, help="cap each output")
    w.add_argument("--salt", type=whole, default=0,
                   help="tell this run's prompts from other runs' with the same --seed on the same server (as a "
                        "sweep's runs are): their unique parts, and rag's fresh documents, differ by salt; 0: as "
                        "before")
    _add_limits(w)
    _add_request_args(p)
    _add_output_args(p, "directory for report.json, records.jsonl and plots")
    return p


def _add_output_args(p: argparse.ArgumentParser, out_help: str) -> None:
    o = p.add_argument_group("output")
    o.add_argument("--slo", default="ttft=120ms,tpot=30ms",
                   help="goodput SLO, e.g. ttft=120ms,tpot=30ms,e2e=5s (terms ttft, tpot, itl, e2e; units us, ms "
                        "[the default], s); --slo= sets none: every finished request counts as good")
    o.add_argument("--out", required=True, help=out_help)
    o.add_argument("--no-plots", dest="plots", action="store_false")
    o.add_argument("--no-progress", dest="progress", action="store_false")


def make_trace(args: argparse.Namespace) -> list[traces.TraceRequest]:
    full = trace_from_args(args)  # (a generated trace spans at most traces.MAX_SECONDS)
    reqs = traces.window(full, args.start, args.duration, args.max_requests)
    if not reqs:
        span = f"0 to {full[-1].arrival:g} s" if full else "no request at all"
        raise ValueError(f"--start {args.start:g}" + (f" --duration {args.duration:g}" if args.duration else "")
                         + f" selects no request of the trace {args.trace!r} (its arrivals: {span})")
    return traces.cap(reqs, args.max_input_tokens, args.max_output_tokens)


def _load_config(args: argparse.Namespace, speedup: float = 1.0):
    from loadtest.client import LoadConfig

    return LoadConfig(url=args.url, model=args.model, endpoint=args.endpoint, speedup=speedup,
                      max_connections=args.max_connections, request_timeout=args.request_timeout,
                      time_limit=args.time_limit, ignore_eos=args.ignore_eos, prompt_mode=args.prompt_mode,
                      seed=args.seed, api_key=args.api_key, client_procs=args.client_procs)


def _run(trace, cfg, console, progress: bool):
    from loadtest.client import run_load

    if not progress:
        return run_load(trace, cfg)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("sent {task.fields[sent]} errors {task.fields[errors]}"), console=console) as bar:
        task = bar.add_task("requests", total=len(trace), sent=0, errors=0)

        def on_progress(sent: int, finished: int, errored: int) -> None:
            bar.update(task, completed=finished + errored, sent=sent, errors=errored)

        return run_load(trace, cfg, on_progress)


def run_main(argv: list[str]) -> int:
    import aiohttp
    from rich.console import Console

    from loadtest import report

    args = build_parser().parse_args(argv)
    slo = report.parse_slo(args.slo)
    trace = make_trace(args)
    if args.salt and args.trace == "rag":  # (a sweep's run k: its fresh documents, apart from other runs')
        trace = traces.rag_fresh_docs_apart(trace, args.num_docs, args.doc_tokens, run=args.salt)
    check_url(args.url)
    span = check_span(trace, args.speedup, "check --rate and --speedup, or cut the trace with --duration or "
                                           "--max-requests")
    writable_dir(args.out, "--out")
    console = Console(stderr=True)
    console.print(f"replaying {len(trace)} requests over {span:.1f}s against {args.url}")
    cfg = dataclasses.replace(_load_config(args, args.speedup), salt=args.salt)
    try:
        records, meta = _run(trace, cfg, console, args.progress and console.is_terminal)
    except (aiohttp.ClientError, OSError, RuntimeError, ValueError) as exc:  # the probe failed
        print(f"laneserve loadtest: failed before the run: {exc}", file=sys.stderr)  # one line: no rich wrapping
        return 2
    meta.update(trace=args.trace, start=args.start, duration=args.duration, max_requests=args.max_requests,
                max_input_tokens=args.max_input_tokens, max_output_tokens=args.max_output_tokens,
                seed=args.seed, slo=args.slo)
    summary = report.summarize(records, slo)
    path = report.write_report(args.out, meta, summary, records)
    report.print_report(meta, summary, Console())
    if args.plots:
        from loadtest.plots import plot_run

        plot_run(records, args.out, title=f"{meta['model']}: {args.trace}")
    console.print(f"wrote {path} and records.jsonl" + (", timeline.png, cdf.png" if args.plots else ""))
    return 0 if summary["finished"] or not summary["sent"] else 1


def build_sweep_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="laneserve loadtest sweep",
                                description="one warm-up replay, then an open-loop replay of the trace (generated, "
                                            "or a window of a trace file per seed) at each rate and seed against one "
                                            "server; sweep.json, sweep.md, "
                                            "sweep.png with the saturation rate and the SLO capacity")
    p.add_argument("--url", required=True, help="server base URL (OpenAI-compatible)")
    add_sweep_args(p)
    _add_limits(p.add_argument_group("replay"))
    _add_request_args(p)
    _add_output_args(p, "directory for sweep.json, sweep.md, sweep.png and runs/")
    return p


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    """A sweep's rates, seeds and warm-up, and the trace flags: `laneserve loadtest sweep` and `laneserve simulate
    sweep` (which replays the same traces: plan_sweep)."""
    p.add_argument("--rates", type=_rates, required=True, help="requests/s, comma-separated, e.g. 24,30,36")
    p.add_argument("--seeds", type=count_up_to(MAX_SEEDS), default=3,
                   help=f"seeds per rate: --seed, --seed + 1, ... (at most {MAX_SEEDS})")
    p.add_argument("--warmup-requests", type=whole, default=None,
                   help=f"requests of the warm-up replay, at most --num-requests (0: none; default: {WARMUP_REQUESTS},"
                        " or --num-docs if more, for rag)")
    p.add_argument("--window-requests", type=count, default=None,
                   help="a trace file or shipped trace: each run replays this many consecutive requests of it, seed s "
                        f"the s-th window (the warm-up the window after the last seed's), its gaps scaled alike so its "
                        f"mean rate is the run's rate: the trace's own bursts at each load (default {WINDOW_REQUESTS})")
    add_trace_args(p, rate=False)


def plan_sweep(p: argparse.ArgumentParser, args: argparse.Namespace):
    """The sweep's (warm-up trace, [(rate, seed, trace)]) for add_sweep_args' flags (loadtest.sweep.plan); a
    parser error for flags no sweep can take."""
    from loadtest import sweep

    try:
        resolve_generator_flags(args)
    except ValueError as exc:
        p.error(str(exc))
    if args.trace not in GENERATED:
        return _plan_file_sweep(p, args)
    if args.window_requests is not None:
        p.error(f"--window-requests is for a trace file; the generated {args.trace!r} trace takes --num-requests")
    warmup_n = args.warmup_requests
    if warmup_n is None:
        warmup_n = min(max(WARMUP_REQUESTS, args.num_docs) if args.trace == "rag" else WARMUP_REQUESTS,
                       args.num_requests)
    elif warmup_n > args.num_requests:
        p.error(f"--warmup-requests {warmup_n} is more than --num-requests {args.num_requests}")

    def make(rate: float, seed: int) -> list[traces.TraceRequest]:
        return trace_from_args(argparse.Namespace(**{**vars(args), "rate": rate, "seed": seed}))

    rag_pool = (args.num_docs, args.doc_tokens) if args.trace == "rag" else None
    return sweep.plan(make, args.rates, args.seed, args.seeds, warmup_n, rag_pool)


def _plan_file_sweep(p: argparse.ArgumentParser, args: argparse.Namespace):
    """plan_sweep for a trace file: seed s replays the s-th window of --window-requests consecutive requests, at each
    rate (traces.at_rate); the warm-up is the start of the window after the last seed's."""
    from loadtest import sweep

    n = args.window_requests or WINDOW_REQUESTS
    warmup_n = WARMUP_REQUESTS if args.warmup_requests is None else args.warmup_requests
    if warmup_n > n:
        p.error(f"--warmup-requests {warmup_n} is more than --window-requests {n}")
    full = trace_from_args(args)
    need = (args.seed + args.seeds) * n + warmup_n
    if len(full) < need:
        p.error(f"--trace {args.trace}: {len(full)} requests, fewer than the {need} that --seed {args.seed}, --seeds "
                f"{args.seeds}, --window-requests {n} and a warm-up of {warmup_n} take; lower them")

    def make(rate: float, seed: int) -> list[traces.TraceRequest]:
        return traces.at_rate(full[seed * n:(seed + 1) * n], rate)

    return sweep.plan(make, args.rates, args.seed, args.seeds, warmup_n)


def sweep_main(argv: list[str]) -> int:
    import time

    import aiohttp
    from rich.console import Console

    from loadtest import report, sweep

    p = build_sweep_parser()
    args = p.parse_args(argv)
    slo = report.parse_slo(args.slo)
    warmup, runs = plan_sweep(p, args)
    check_url(args.url)
    for trace in (warmup, *(t for _, _, t in runs)):
        check_span(trace, 1.0, "raise the lowest of --rates, or lower --num-requests / --window-requests")
    writable_dir(args.out, "--out")
    console = Console(stderr=True)
    console.print(f"sweep: {len(runs)} replays ({len(args.rates)} rates x {args.seeds} seeds) of {len(runs[0][2])} "
                  f"requests against {args.url}, after a warm-up of {len(warmup)}")
    started = time.time()
    try:
        rows, meta = sweep.run(warmup, runs, _load_config(args), slo, args.out,
                               lambda trace, cfg: _run(trace, cfg, console, args.progress and console.is_terminal),
                               console)
    except (aiohttp.ClientError, OSError, RuntimeError, ValueError) as exc:  # a probe failed: the server is gone
        print(f"laneserve loadtest sweep: failed: {exc}", file=sys.stderr)
        return 2
    gen = generator_flags(args)
    gen.pop("rate", None)
    gen.pop("seed", None)
    sweep_meta = {"url": args.url, "model": meta.get("model"), "max_model_len": meta.get("max_model_len"),
                  "endpoint": args.endpoint, "trace": args.trace, "generator": gen, "rates": sorted(args.rates),
                  "seeds": [args.seed + i for i in range(args.seeds)], "prompt_seed": args.seed,
                  "warmup_requests": len(warmup), "slo": args.slo, "started_at": started,
                  "wall_s": round(time.time() - started, 3), "interrupted": bool(meta.get("interrupted")),
                  "request_timeout": args.request_timeout, "time_limit": args.time_limit}
    result = sweep.build(sweep_meta, rows, {k: v * 1e3 for k, v in slo.items()})
    json_path, md_path = sweep.write(args.out, result)
    sweep.print_sweeps([result], [""], Console())
    written = [json_path.name, md_path.name]
    if args.plots:
        from loadtest.plots import plot_sweep

        written.append(plot_sweep(result, args.out).name)
    console.print(f"wrote {', '.join(written)} and runs/ in {args.out}")
    return 0 if rows and not sweep_meta["interrupted"] and all(r["metrics"]["finished"] for r in rows) else 1


def _run_name(path: str) -> str:
    """runs/burst/report.json -> 'burst', runs/h200/sweep.json -> 'h200' (the --out directory names the run)."""
    p = Path(path)
    return p.parent.name if p.name in ("report.json", "sweep.json") and p.parent.name else p.stem


def _load_result(path: str) -> tuple[dict, str]:
    """A report.json or sweep.json file's object and its kind, "report" or "sweep"; a ValueError naming the file."""
    from loadtest import report, sweep

    try:
        with open(path) as f:
            d = json.load(f)
    except ValueError as exc:  # not JSON, not UTF-8
        raise ValueError(f"{path}: not JSON ({exc})") from None
    kind = "sweep" if isinstance(d, dict) and d.get("kind") == sweep.KIND else "report"
    why = (sweep if kind == "sweep" else report).shape_problem(d)
    if why:
        raise ValueError(f"{path}: not a loadtest report or sweep ({why})")
    return d, kind


def _plot_path(text: str) -> Path:
    """--plot's file: NAME with no extension is NAME.png (as matplotlib writes it); a format matplotlib does not
    write, or a place no file can be written, is a ValueError before any table is printed."""
    from matplotlib.backend_bases import FigureCanvasBase

    path = Path(text)
    if not text or path.is_dir():
        raise ValueError(f"--plot {text!r}: give a file name, e.g. sweep-compare.png")
    if not path.suffix:
        path = path.with_name(path.name + ".png")
    formats = FigureCanvasBase.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:
        raise ValueError(f"--plot {text}: the extension must be one of {', '.join(sorted(formats))}")
    writable_dir(path.parent, "--plot")
    return path


def compare_main(argv: list[str]) -> int:
    from loadtest import report, sweep

    p = argparse.ArgumentParser(prog="laneserve loadtest compare",
                                description="two report.json side by side, or two sweep.json: tables side by side "
                                            "and both curves on one plot")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--plot", default="sweep-compare.png",
                   help="sweeps: where to write the plot (.png unless another extension is given)")
    p.add_argument("--no-plots", dest="plots", action="store_false")
    args = p.parse_args(argv)
    (a, kind_a), (b, kind_b) = _load_result(args.a), _load_result(args.b)
    if kind_a != kind_b:
        p.error(f"compare takes two report.json or two sweep.json files; got a {kind_a} and a {kind_b}")
    names = tuple(_run_name(x) for x in (args.a, args.b))
    names = names if names[0] != names[1] else (args.a, args.b)
    if kind_a == "report":
        report.print_compare(a, b, names)
        return 0
    plot = _plot_path(args.plot) if args.plots else None
    sweep.print_sweeps([a, b], list(names))
    if plot:
        from loadtest.plots import plot_sweeps

        print(f"wrote {plot_sweeps(list(zip(names, (a, b))), plot)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`laneserve loadtest` and `python -m loadtest`: a bad value or file is one line and exit status 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["compare"], ["sweep"]):
        return one_line_errors(f"laneserve loadtest {argv[0]}", compare_main if argv[0] == "compare" else sweep_main,
                               argv[1:])
    return one_line_errors("laneserve loadtest", run_main, argv)


def one_line_errors(tool: str, run, argv: list[str]) -> int:
    """run(argv), a bad value or file (a ValueError, OSError or ZeroDivisionError, or a SystemExit with a message
    such as trace_from_args' "error: ...") printed as one line, "TOOL: error: ...", and exit status 2; argparse's
    own exits pass. Every `laneserve` tool (laneserve/cli.py), and `python -m loadtest` / `python -m batcher.sim`."""
    try:
        return run(argv)
    except (ValueError, OSError, ZeroDivisionError) as exc:
        msg = str(exc)
    except SystemExit as exc:
        if not isinstance(exc.code, str):
            raise
        msg = exc.code
    print(f"{tool}: error: {msg.removeprefix('error: ')}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
