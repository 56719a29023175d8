"""`laneserve loadtest` (also `python -m loadtest`): build a trace, replay it, report.

  laneserve loadtest --url http://127.0.0.1:8000 --trace burstgpt-1 \
      --speedup 60 --max-requests 100 --slo ttft=120ms,tpot=30ms --out runs/burst
  laneserve loadtest --url URL --trace synthetic --rate 8 --burstiness 0.5 --num-requests 200 --out DIR
  laneserve loadtest --url URL --trace rag --num-docs 16 --doc-tokens 1024 --hit-rate 0.8 --out DIR
  laneserve loadtest compare runs/a/report.json runs/b/report.json

Owns argument parsing and wiring only: traces.py makes the trace, client.py runs it,
report.py and plots.py write the results.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from loadtest import traces


def _length(text: str) -> int | tuple[int, int]:
    """'128' -> 128; '64:512' -> uniform on [64, 512]."""
    if ":" in text:
        lo, hi = text.split(":", 1)
        return int(lo), int(hi)
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="laneserve loadtest", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--url", required=True, help="server base URL (OpenAI-compatible), e.g. http://127.0.0.1:8000")
    p.add_argument("--trace", default="synthetic", help="a trace file, a shipped trace (" + ", ".join(traces.TRACE_NAMES) + "), 'synthetic' "
                                                        "(Gamma/Poisson) or 'rag'")
    g = p.add_argument_group("synthetic and rag traces")
    g.add_argument("--rate", type=float, default=4.0, help="requests/s")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson, < 1 burstier")
    g.add_argument("--num-requests", type=int, default=100)
    g.add_argument("--input-tokens", type=_length, default=256, help="N or LO:HI")
    g.add_argument("--output-tokens", type=_length, default=64, help="N or LO:HI")
    g.add_argument("--num-docs", type=int, default=16, help="rag: shared document pool size")
    g.add_argument("--doc-tokens", type=int, default=1024, help="rag: document length (whole 512-token blocks)")
    g.add_argument("--question-tokens", type=_length, default=(32, 96), help="rag: N or LO:HI")
    g.add_argument("--hit-rate", type=float, default=0.8, help="rag: share of prompts on a pooled document")
    g.add_argument("--seed", type=int, default=0)
    w = p.add_argument_group("replay")
    w.add_argument("--speedup", type=float, default=1.0, help="divide arrival times by this")
    w.add_argument("--start", type=float, default=0.0, help="trace window start, trace seconds")
    w.add_argument("--duration", type=float, default=None, help="trace window length, trace seconds")
    w.add_argument("--max-requests", type=int, default=None)
    w.add_argument("--max-input-tokens", type=int, default=None, help="cap each prompt (e.g. for a small model)")
    w.add_argument("--max-output-tokens", type=int, default=None, help="cap each output")
    w.add_argument("--time-limit", type=float, default=None,
                   help="wall seconds for the whole run (default: trace span + request timeout)")
    w.add_argument("--request-timeout", type=float, default=600.0)
    w.add_argument("--max-connections", type=int, default=256, help="HTTP connection pool size")
    r = p.add_argument_group("requests")
    r.add_argument("--model", default=None, help="default: the first model of GET /v1/models")
    r.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    r.add_argument("--prompt-mode", choices=("ids", "text"), default="ids",
                   help="token-id prompts, or text via /detokenize (chat always sends text)")
    r.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="don't send ignore_eos (output lengths then follow the model)")
    r.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    o = p.add_argument_group("output")
    o.add_argument("--slo", default="ttft=120ms,tpot=30ms", help="goodput SLO, e.g. ttft=120ms,tpot=30ms,e2e=5s")
    o.add_argument("--out", required=True, help="directory for report.json, records.jsonl and plots")
    o.add_argument("--no-plots", dest="plots", action="store_false")
    o.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def make_trace(args: argparse.Namespace) -> list[traces.TraceRequest]:
    if args.trace == "synthetic":
        reqs = traces.gamma_bursts(args.rate, args.num_requests, args.burstiness, args.input_tokens,
                                   args.output_tokens, seed=args.seed)
    elif args.trace == "rag":
        reqs = traces.rag(args.rate, args.num_requests, args.num_docs, args.doc_tokens, args.question_tokens,
                          args.output_tokens, args.hit_rate, args.burstiness, seed=args.seed)
    else:
        try:
            reqs = traces.load_trace(args.trace)
        except FileNotFoundError as exc:
            raise SystemExit(str(exc)) from None
    reqs = traces.window(reqs, args.start, args.duration, args.max_requests)
    return traces.cap(reqs, args.max_input_tokens, args.max_output_tokens)


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
    from loadtest.client import LoadConfig

    args = build_parser().parse_args(argv)
    slo = report.parse_slo(args.slo)
    trace = make_trace(args)
    console = Console(stderr=True)
    span = trace[-1].arrival / args.speedup if trace else 0.0
    console.print(f"replaying {len(trace)} requests over {span:.1f}s against {args.url}")
    cfg = LoadConfig(url=args.url, model=args.model, endpoint=args.endpoint, speedup=args.speedup,
                     max_connections=args.max_connections, request_timeout=args.request_timeout,
                     time_limit=args.time_limit, ignore_eos=args.ignore_eos, prompt_mode=args.prompt_mode,
                     seed=args.seed, api_key=args.api_key)
    try:
        records, meta = _run(trace, cfg, console, args.progress and console.is_terminal)
    except (aiohttp.ClientError, OSError, RuntimeError, ValueError) as exc:  # the probe failed
        console.print(f"[red]loadtest failed before the run: {exc}")
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


def _run_name(path: str) -> str:
    """runs/burst/report.json -> 'burst' (the --out directory names the run)."""
    from pathlib import Path

    p = Path(path)
    return p.parent.name if p.name == "report.json" and p.parent.name else p.stem


def compare_main(argv: list[str]) -> int:
    from loadtest import report

    p = argparse.ArgumentParser(prog="laneserve loadtest compare", description="two report.json side by side")
    p.add_argument("a")
    p.add_argument("b")
    args = p.parse_args(argv)
    with open(args.a) as fa, open(args.b) as fb:
        a, b = json.load(fa), json.load(fb)
    names = tuple(_run_name(x) for x in (args.a, args.b))
    report.print_compare(a, b, names if names[0] != names[1] else (args.a, args.b))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "compare":
        return compare_main(argv[1:])
    return run_main(argv)


if __name__ == "__main__":
    sys.exit(main())
