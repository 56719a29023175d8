"""`laneserve loadtest sweep`: one server's capacity over a range of request rates.

Owns: the plan of a sweep (one warm-up replay, then for each rate and each seed = base seed + i the
generated trace at that rate and seed, or a trace file's seed-th window at that rate: loadtest.cli), running it
with the one-run code (client.run_load, report.summarize), the per-rate aggregate (for each metric the worst and
the median seed), the two marks (`mark`), sweep.json / sweep.md, and the tables of one sweep or two side by side.
Plots: plots.plot_sweep / plot_sweeps.

Prompts. Every run synthesises its prompts with the base seed, so the rag trace's pooled documents
are the same token blocks in every run, and the warm-up (one request on each pooled document, then
round again) puts them in the server's prefix cache before the first measured run. The rag
generator numbers a fresh (miss) document by its request's index, the same in every run of the same
length: `traces.rag_fresh_docs_apart` gives each run its own, so that no run finds another's fresh
documents cached. The unique part of every prompt is salted with the run's index (LoadConfig.salt).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

from loadtest import traces

KIND = "laneserve-sweep"
# (key in a run's metrics, label, True when a higher value is worse)
METRICS = (
    ("ttft_p95_ms", "TTFT p95 ms", True),
    ("tpot_p95_ms", "TPOT p95 ms", True),
    ("itl_p95_ms", "ITL p95 ms", True),
    ("goodput_pct", "goodput %", False),
    ("output_tok_s", "output tok/s", False),
    ("rejected", "rejected", True),
)
SATURATION_WITHIN = 0.03  # saturation: median output tok/s within 3% of the best rate's
CAPACITY_GOODPUT_PCT = 95.0  # SLO capacity: the worst seed's goodput at least this
DEFINITIONS = {
    "worst": "per metric, the seed with the worst value (highest TTFT/TPOT p95 and rejections, lowest goodput "
             "and output tok/s; a p95 with no finished request counts as worst)",
    "median": "per metric, the median seed (of an even number, the better of the two middle ones)",
    "saturation_rate": f"the highest rate whose median-seed output tok/s is within {SATURATION_WITHIN:.0%} of "
                       "the maximum over rates",
    "knee_rate": f"the lowest rate whose median-seed output tok/s is within {SATURATION_WITHIN:.0%} of the maximum "
                 "over rates: where the curve flattens (the saturation rate, by issue 19's wording, is the highest "
                 "such rate, so it grows with the rates tried past the knee)",
    "saturation_reached": "whether the highest rate tried delivered less output tok/s than the rate before it "
                          f"scaled by the rates' ratio, less {SATURATION_WITHIN:.0%} (the curve bent); if not, "
                          "the server was not saturated at any rate tried and the saturation rate is only a bound",
    "slo_capacity_rate": "the highest rate at which, and at every lower rate, the worst seed's p95 TTFT and p95 "
                         "TPOT are inside the SLO (terms the SLO sets), its goodput is >= "
                         f"{CAPACITY_GOODPUT_PCT:g}% and every request of the trace was sent",
    "slo_holds_above_capacity": "rates above a failing one where the SLO held again (seed luck: not capacity)",
    "goodput": "requests that finished within every SLO term / requests sent; a request answered 429 (or any "
               "non-200), errored or cut by the time limit is a miss; 'rejected' counts the non-200 answers",
    "output_tok_s": "output tokens of the finished requests / (first send -> last finish), as vLLM's benchmark",
}


# ------------------------------------------------------------------------------------------- plan

def plan(make_trace: Callable[[float, int], list[traces.TraceRequest]], rates: list[float], seed: int, seeds: int,
         warmup_requests: int, rag_pool: tuple[int, int] | None = None):
    """(warm-up trace, [(rate, seed, trace)]) in run order: rates ascending, seeds within a rate.

    make_trace(rate, seed): the generated trace. rag_pool = (num_docs, doc_tokens) for the rag
    trace: the warm-up covers the pool, each measured run gets its own fresh documents (module doc).
    The warm-up is the first warmup_requests of the trace at the lowest rate with seed + seeds, a
    seed no measured run uses (so it replays none of their prompts)."""
    rates = sorted(rates)
    warmup = make_trace(rates[0], seed + seeds)[:warmup_requests] if warmup_requests > 0 else []
    if rag_pool is not None:
        warmup = traces.rag_cover_pool(warmup, *rag_pool)
    runs = []
    for rate in rates:
        for i in range(seeds):
            trace = make_trace(rate, seed + i)
            if rag_pool is not None:
                trace = traces.rag_fresh_docs_apart(trace, *rag_pool, run=len(runs) + 1)
            runs.append((rate, seed + i, trace))
    return warmup, runs


# ------------------------------------------------------------------------------------ aggregation

def run_metrics(summary: dict, planned: int | None = None) -> dict:
    """The sweep's metrics of one run, from report.summarize()'s summary (planned: the trace's requests)."""
    return {"unsent": max(0, (planned or 0) - summary["sent"]), "pool_waited": summary.get("pool_waited", 0),
            "ttft_p95_ms": summary["ttft_ms"]["p95"], "tpot_p95_ms": summary["tpot_ms"]["p95"],
            "itl_p95_ms": summary["itl_ms"]["p95"],
            "goodput_pct": 100.0 * summary["goodput"], "output_tok_s": summary["output_tok_s"],
            "rejected": summary["rejected"], "sent": summary["sent"], "finished": summary["finished"],
            "errored": summary["errored"]}


def _badness(value, higher_is_worse: bool) -> float:
    if value is None:
        return math.inf
    return value if higher_is_worse else -value


def aggregate(runs: list[dict]) -> list[dict]:
    """Runs [{"rate", "seed", "metrics"}] -> one row per rate (ascending): {"rate", "seeds", and for each
    metric {"worst", "worst_seed", "median", "median_seed"}} (see DEFINITIONS)."""
    by_rate: dict[float, list[dict]] = {}
    for r in runs:
        by_rate.setdefault(r["rate"], []).append(r)
    rows = []
    for rate in sorted(by_rate):
        group = sorted(by_rate[rate], key=lambda r: r["seed"])
        row: dict = {"rate": rate, "seeds": [r["seed"] for r in group]}
        for key, _, higher_is_worse in METRICS:
            def bad(r: dict) -> float:
                return _badness(r["metrics"].get(key), higher_is_worse)

            worst = max(group, key=bad)  # of equal ones, the lowest seed
            median = sorted(group, key=bad)[(len(group) - 1) // 2]  # (a sweep.json older than a metric: None)
            row[key] = {"worst": worst["metrics"].get(key), "worst_seed": worst["seed"],
                        "median": median["metrics"].get(key), "median_seed": median["seed"]}
        for key in ("unsent", "pool_waited"):  # the most of any seed
            row[key] = max(r["metrics"].get(key, 0) for r in group)
        rows.append(row)
    return rows


def holds_slo(row: dict, slo_ms: dict[str, float]) -> bool:
    """The worst seed of this rate is inside the SLO: p95 TTFT and p95 TPOT (the terms slo_ms sets, in ms)
    and goodput >= CAPACITY_GOODPUT_PCT, with the whole trace sent."""
    if row.get("unsent"):
        return False
    for key, term in (("ttft_p95_ms", "ttft"), ("tpot_p95_ms", "tpot")):
        if term in slo_ms and (row[key]["worst"] is None or row[key]["worst"] > slo_ms[term]):
            return False
    return row["goodput_pct"]["worst"] >= CAPACITY_GOODPUT_PCT


def mark(rows: list[dict], slo_ms: dict[str, float]) -> dict:
    """The saturation rate and the SLO capacity of aggregate()'s rows, ascending (None when no rate qualifies),
    and whether the curve bent (DEFINITIONS)."""
    tput = {row["rate"]: row["output_tok_s"]["median"] or 0.0 for row in rows}
    top = max(tput.values(), default=0.0)
    saturated = [rate for rate, v in tput.items() if top > 0 and v >= (1 - SATURATION_WITHIN) * top]
    rates = sorted(tput)
    reached = len(rates) >= 2 and tput[rates[-1]] < (1 - SATURATION_WITHIN) * tput[rates[-2]] * rates[-1] / rates[-2]
    capacity, above = None, []
    for row in rows:
        if not holds_slo(row, slo_ms):
            above = [r["rate"] for r in rows if r["rate"] > row["rate"] and holds_slo(r, slo_ms)]
            break
        capacity = row["rate"]
    return {"saturation_rate": max(saturated, default=None), "knee_rate": min(saturated, default=None),
            "saturation_reached": reached,
            "slo_capacity_rate": capacity, "slo_holds_above_capacity": above, "max_output_tok_s": top}


def build(meta: dict, runs: list[dict], slo_ms: dict[str, float]) -> dict:
    """The sweep.json object."""
    rows = aggregate(runs)
    for row in rows:
        row["holds_slo"] = holds_slo(row, slo_ms)
    return {"kind": KIND, "version": 1, "meta": meta, "slo_ms": slo_ms, **mark(rows, slo_ms), "rates": rows,
            "runs": runs, "definitions": DEFINITIONS}


def shape_problem(d) -> str | None:
    """Why d is not a sweep.json object, as far as compare and the plots read one; None when it is one."""
    def number(v, none_ok: bool = False) -> bool:
        return (v is None and none_ok) or (isinstance(v, (int, float)) and not isinstance(v, bool))

    if not isinstance(d, dict) or d.get("kind") != KIND:
        return f'no "kind": "{KIND}"'
    if not isinstance(d.get("meta", {}), dict):
        return '"meta" is not an object'
    if not isinstance(d.get("slo_ms"), dict) or not all(number(v) for v in d["slo_ms"].values()):
        return '"slo_ms" is not an object of numbers'
    if not all(number(d.get(k), none_ok=True) for k in ("saturation_rate", "slo_capacity_rate", "max_output_tok_s")):
        return "the saturation rate, SLO capacity or max output tok/s is not a number"
    if not isinstance(d.get("rates"), list):
        return '"rates" is not a list'
    for row in d["rates"]:
        if not isinstance(row, dict) or not number(row.get("rate")) or "holds_slo" not in row:
            return 'a row of "rates" has no rate or holds_slo'
        for key, _, _ in METRICS:  # a sweep.json older than a metric has none of it (plotted ones: always there)
            cell = row.get(key)
            if cell is None and key in ("itl_p95_ms", "rejected"):
                continue
            if not isinstance(cell, dict) or not all(number(cell.get(f), none_ok=True) for f in ("worst", "median")):
                return f"rate {row['rate']:g}: {key} is not a worst / median pair"
    return None


# ----------------------------------------------------------------------------------------- output

def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.1f}"
    return f"{v:,}"


def _rate(v) -> str:
    return "none" if v is None else f"{v:g} req/s"


def mark_lines(sweep: dict) -> list[str]:
    slo = ", ".join(f"p95 {k.upper()} <= {v:g} ms" for k, v in sweep["slo_ms"].items() if k in ("ttft", "tpot"))
    lines = [f"saturation rate: {_rate(sweep['saturation_rate'])} (the highest rate whose median-seed output tok/s "
             f"is within {SATURATION_WITHIN:.0%} of the maximum, {_fmt(sweep['max_output_tok_s'])}"
             + (f"; the lowest such rate, the knee: {_rate(sweep['knee_rate'])}" if sweep.get("knee_rate") is not None
                else "") + ")",
             f"SLO capacity: {_rate(sweep['slo_capacity_rate'])} (the highest rate at and below which the worst seed "
             f"has {slo + ' and ' if slo else ''}goodput >= {CAPACITY_GOODPUT_PCT:g}%)"]
    if sweep.get("saturation_reached") is False:  # (None: a sweep.json from before it was computed)
        lines[0] += ("; NOT reached: output tok/s still grew in proportion to the rate at the highest rate tried, "
                     "so saturation lies above it")
    if sweep.get("slo_holds_above_capacity"):
        lines[1] += (f"; the SLO held again at {', '.join(f'{r:g}' for r in sweep['slo_holds_above_capacity'])} "
                     "req/s, above a rate where it failed")
    return lines


def markdown(sweep: dict) -> str:
    m = sweep["meta"]
    out = ["# laneserve loadtest sweep", "",
           f"Model `{m.get('model')}` at {m.get('url')}; trace `{m.get('trace')}` "
           f"({', '.join(f'{k}={v}' for k, v in m.get('generator', {}).items())}); seeds "
           f"{', '.join(map(str, m.get('seeds', [])))}; warm-up {m.get('warmup_requests', 0)} requests; "
           f"SLO `{m.get('slo')}`.", ""]
    out += [f"- {line}" for line in mark_lines(sweep)] + [""]
    out += ["| rate | TTFT p95 ms (worst / median) | TPOT p95 ms | ITL p95 ms | goodput % | output tok/s | rejected "
            "| holds SLO |", "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in sweep["rates"]:
        cells = [f"{_fmt(row[k]['worst'])} / {_fmt(row[k]['median'])}" if k in row else "-" for k, _, _ in METRICS]
        out.append(f"| {row['rate']:g} | " + " | ".join(cells) + f" | {'yes' if row['holds_slo'] else 'no'} |")
    for row in sweep["rates"]:
        out += ["", f"## {row['rate']:g} req/s", "", "| metric | worst seed | median seed |", "|---|---:|---:|"]
        for key, label, _ in METRICS:
            c = row.get(key)
            if c is None:  # a sweep.json from before this metric
                continue
            out.append(f"| {label} | {_fmt(c['worst'])} (seed {c['worst_seed']}) | "
                       f"{_fmt(c['median'])} (seed {c['median_seed']}) |")
    return "\n".join(out) + "\n"


def write(out_dir: str | Path, sweep: dict) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(sweep, indent=2))
    (out / "sweep.md").write_text(markdown(sweep))
    return out / "sweep.json", out / "sweep.md"


def print_sweeps(sweeps: list[dict], names: list[str], console=None) -> None:
    """One table per rate, the sweeps' worst and median columns side by side (one sweep or two)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    rates = sorted({row["rate"] for s in sweeps for row in s["rates"]})
    for rate in rates:
        t = Table(title=f"{rate:g} req/s")
        t.add_column("metric")
        rows = [next((r for r in s["rates"] if r["rate"] == rate), None) for s in sweeps]
        for name in names:
            prefix = f"{name} " if len(sweeps) > 1 else ""
            t.add_column(f"{prefix}worst", justify="right")
            t.add_column(f"{prefix}median", justify="right")
        for key, label, _ in METRICS:
            cells = []
            for row in rows:
                cells += ["-", "-"] if row is None or key not in row else [
                    f"{_fmt(row[key]['worst'])} (s{row[key]['worst_seed']})",
                                                         f"{_fmt(row[key]['median'])} (s{row[key]['median_seed']})"]
            t.add_row(label, *cells)
        t.add_row("holds SLO", *[c for row in rows for c in (("-", "") if row is None else
                                                               ("yes" if row["holds_slo"] else "no", ""))])
        console.print(t)
    for s, name in zip(sweeps, names):
        for line in mark_lines(s):
            console.print(f"{name + ': ' if len(sweeps) > 1 else ''}{line}")


# --------------------------------------------------------------------------------------------- run

def run(warmup: list[traces.TraceRequest], runs: list[tuple[float, int, list[traces.TraceRequest]]], cfg,
        slo: dict[str, float], out_dir: str | Path, replay: Callable, console) -> tuple[list[dict], dict]:
    """Replay the warm-up, then every run, one after another, against cfg.url; each run's report.json and
    records.jsonl go to out_dir/runs/rate<R>_seed<S>/. replay(trace, cfg) -> (records, meta) is
    client.run_load (wrapped with a progress bar by the CLI). Returns the runs' rows and the first
    measured run's meta (the server's model, max_model_len...; "interrupted" when Ctrl-C stopped the sweep
    after the runs returned)."""
    from dataclasses import replace

    from loadtest import report

    if warmup:
        console.print(f"warm-up: {len(warmup)} requests")
        records, meta = replay(warmup, replace(cfg, salt=0))
        console.print(f"warm-up: {sum(r.ok for r in records)} of {len(records)} finished")
        if meta.get("interrupted"):
            return [], {**meta, "interrupted": True}
    rows, first_meta = [], None
    for k, (rate, seed, trace) in enumerate(runs, start=1):
        records, meta = replay(trace, replace(cfg, salt=k))
        first_meta = first_meta or meta
        summary = report.summarize(records, slo)
        name = f"rate{rate:g}_seed{seed}"
        report.write_report(Path(out_dir) / "runs" / name, {**meta, "rate": rate, "seed": seed}, summary, records)
        metrics = run_metrics(summary, meta.get("planned"))
        rows.append({"rate": rate, "seed": seed, "dir": f"runs/{name}", "wall_s": meta.get("wall_s"),
                     "metrics": metrics})
        console.print(f"rate {rate:g} seed {seed}: sent {metrics['sent']} finished {metrics['finished']} "
                      f"rejected {metrics['rejected']}  TTFT p95 {_fmt(metrics['ttft_p95_ms'])} ms  "
                      f"TPOT p95 {_fmt(metrics['tpot_p95_ms'])} ms  ITL p95 {_fmt(metrics['itl_p95_ms'])} ms  "
                      f"goodput {metrics['goodput_pct']:.1f}%  "
                      f"{_fmt(metrics['output_tok_s'])} output tok/s")
        if meta.get("interrupted"):  # Ctrl-C: keep what was measured, run no more
            console.print("[yellow]interrupted: the sweep stops here")
            return rows, {**first_meta, "interrupted": True}
    return rows, first_meta or {}
