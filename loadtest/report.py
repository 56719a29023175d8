"""Turning per-request records into the run's report: percentiles, throughput, goodput, errors.

Owns: SLO parsing, `summarize` (records -> plain dict, the `summary` of report.json), writing
report.json + records.jsonl, the rich tables (one run; two runs side by side with ratios).
Pure computation and file output; no HTTP, no plotting (plots.py).
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from loadtest.client import RequestRecord

PERCENTILES = (50, 90, 95, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2e")
_UNITS = {"ms": 1e-3, "s": 1.0, "us": 1e-6}


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft=120ms,tpot=30ms[,e2e=2s]' -> {'ttft': 0.12, 'tpot': 0.03, ...} in seconds; '' -> {} (no SLO).
    A ValueError naming --slo for a bad term, a term given twice, or a bound that is not a finite time > 0."""
    slo: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        m = re.fullmatch(r"(ttft|tpot|itl|e2e)\s*=\s*(\d+\.?\d*|\.\d+)\s*(ms|s|us)?", part)
        if not m:
            raise ValueError(f"--slo: bad term {part[:40]!r}; expected e.g. ttft=120ms,tpot=30ms")
        if m.group(1) in slo:
            raise ValueError(f"--slo: {m.group(1)} is given twice")
        value = float(m.group(2)) * _UNITS[m.group(3) or "ms"]
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"--slo: {part[:40]!r}: the bound must be a finite time > 0")
        slo[m.group(1)] = value
    return slo


def stats_ms(values) -> dict[str, float | None]:
    """mean / p50 / p90 / p95 / p99 / max in ms (numpy's linear percentiles, as vLLM's benchmark)."""
    a = np.asarray([v for v in values if v is not None], dtype=float) * 1e3
    if a.size == 0:
        return {"n": 0, "mean": None, **{f"p{p}": None for p in PERCENTILES}, "max": None}
    return {"n": int(a.size), "mean": float(a.mean()),
            **{f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}, "max": float(a.max())}


def meets_slo(r: RequestRecord, slo: dict[str, float]) -> bool:
    """Finished inside every term; a term with no value passes only where none can exist (TPOT and ITL of a
    one-token answer), not a TTFT or e2e the stream never gave."""
    if not r.ok:
        return False
    checks = {"ttft": r.ttft, "tpot": r.tpot, "e2e": r.e2e, "itl": max(r.itl) if r.itl else None}
    return all(checks[k] <= v if checks[k] is not None else k in ("tpot", "itl") for k, v in slo.items())


def summarize(records: list[RequestRecord], slo: dict[str, float] | None = None) -> dict:
    slo = slo or {}
    sent = records  # a record exists once the dispatcher let its request go
    ok = [r for r in records if r.ok]
    starts = [r.sent for r in records if r.sent is not None]
    ends = [r.sent + r.e2e for r in ok]
    duration = (max(ends) - min(starts)) if ends and starts else 0.0
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum((r.prompt_tokens if r.prompt_tokens is not None else r.input_tokens) for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    good = [r for r in records if meets_slo(r, slo)]
    errors = Counter(str(r.status) for r in records if not r.ok)
    # answered with an HTTP error status (429 when the server sheds load, 503, 400...): a miss in goodput,
    # as is every other request that did not finish (no response, an error in the stream, the time limit)
    rejected = sum(1 for r in records if r.status not in (0, 200))
    kinds = Counter((r.error or "")[:80] for r in records if not r.ok)
    return {
        "sent": len(sent), "finished": len(ok), "errored": len(sent) - len(ok), "rejected": rejected,
        "duration_s": duration, "request_throughput": per_s(len(ok)),
        "input_tokens": in_tok, "output_tokens": out_tok,
        "output_tok_s": per_s(out_tok), "total_tok_s": per_s(in_tok + out_tok),
        "ttft_ms": stats_ms(r.ttft for r in ok), "tpot_ms": stats_ms(r.tpot for r in ok),
        "itl_ms": stats_ms(g for r in ok for g in r.itl), "e2e_ms": stats_ms(r.e2e for r in ok),
        "dispatch_lag_ms": stats_ms(r.sent - r.scheduled for r in records if r.sent is not None),
        "pool_waited": sum(1 for r in records if r.pool_wait > 0.0),
        "pool_wait_ms": stats_ms(r.pool_wait for r in records if r.sent is not None),
        "slo": {k: v * 1e3 for k, v in slo.items()},
        "goodput": (len(good) / len(sent)) if sent else 0.0, "goodput_req_s": per_s(len(good)),
        "errors_by_status": dict(sorted(errors.items())), "error_kinds": dict(kinds.most_common(5)),
        "clamped": sum(r.clamped for r in records),
        "output_tokens_short": sum(1 for r in ok if r.output_tokens != r.max_tokens),
    }


def write_report(out_dir: str | Path, meta: dict, summary: dict, records: list[RequestRecord]) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report.json"
    path.write_text(json.dumps({"meta": meta, "summary": summary}, indent=2))
    with open(out / "records.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(asdict(r)) + "\n")
    return path


def load_records(path: str | Path) -> list[RequestRecord]:
    with open(path) as f:
        return [RequestRecord(**json.loads(line)) for line in f if line.strip()]


def _fmt(v, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return f"{v:,}"


def _rows(s: dict) -> list[tuple[str, object]]:
    """(label, value) pairs shown for one summary; shared by the single and the compare tables."""
    rows: list[tuple[str, object]] = [
        ("sent", s["sent"]), ("finished", s["finished"]), ("errored", s["errored"]),
        ("rejected", s.get("rejected")),  # absent from report.json files written before it was counted
        ("duration s", s["duration_s"]), ("requests/s", s["request_throughput"]),
        ("output tok/s", s["output_tok_s"]), ("total tok/s", s["total_tok_s"]),
    ]
    for name in LATENCIES:
        st = s[f"{name}_ms"]
        rows += [(f"{name.upper()} {k} ms", st.get(k)) for k in ("mean", *(f"p{p}" for p in PERCENTILES))]
    rows.append(("goodput %", 100.0 * s["goodput"]))
    return rows


def print_report(meta: dict, s: dict, console: Console | None = None) -> None:
    console = console or Console()
    console.print(f"laneserve loadtest: model {meta.get('model')} at {meta.get('url')}")
    if meta.get("tokenizer_probe") is False:
        console.print("note: /tokenize gave no usable token alphabet; prompts use ids "
                      f"0..{meta.get('alphabet_size', 0) - 1}")
    t = Table(title="requests and throughput")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for label, v in _rows(s):
        if not label.split()[0].lower() in LATENCIES:
            t.add_row(label, _fmt(v))
    lat = Table(title="latency (ms)")
    cols = ("n", "mean", *(f"p{p}" for p in PERCENTILES), "max")
    for c in ("", *cols):
        lat.add_column(c, justify="right" if c else "left")
    for name in LATENCIES:
        st = s[f"{name}_ms"]
        lat.add_row(name.upper(), *(_fmt(st.get(c)) for c in cols))
    console.print(t)
    console.print(lat)
    planned = meta.get("planned")
    if planned is not None and planned > s["sent"]:
        console.print(f"[yellow]{planned - s['sent']} of {planned} trace requests were not sent (time limit)")
    if s["slo"]:
        terms = ", ".join(f"{k}<={v:g}ms" for k, v in s["slo"].items())
        console.print(f"goodput: {100 * s['goodput']:.1f}% of sent requests met {terms}")
    if s["errors_by_status"]:
        console.print(f"errors by HTTP status (0 = no response): {s['errors_by_status']}")
        for text, n in s["error_kinds"].items():
            console.print(f"  {n} x {text}")
    if s["clamped"]:
        console.print(f"{s['clamped']} requests were shortened to max_model_len={meta.get('max_model_len')}")
    lag = s["dispatch_lag_ms"]
    if lag["p99"] is not None and lag["p99"] > 50:
        console.print(f"[yellow]client lag p99 {lag['p99']:.0f} ms: the load generator fell behind the trace")
    if s.get("pool_waited"):
        console.print(f"[yellow]{s['pool_waited']} requests waited for a connection (up to "
                      f"{s['pool_wait_ms']['max']:.0f} ms, counted in their TTFT): --max-connections "
                      f"{meta.get('max_connections')} capped the requests in flight, not the server")
    if s.get("output_tokens_short") and meta.get("ignore_eos"):
        console.print(f"[yellow]{s['output_tokens_short']} finished requests gave other than max_tokens output "
                      "tokens with ignore_eos (no usage in the stream: counted by chunks?)")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def shape_problem(d) -> str | None:
    """Why d is not a report.json object, as far as compare reads one; None when it is one."""
    s = d.get("summary") if isinstance(d, dict) else None
    if not isinstance(s, dict):
        return 'no "summary" object'
    for key in ("sent", "finished", "errored", "duration_s", "request_throughput", "output_tok_s", "total_tok_s",
                "goodput"):
        if not _number(s.get(key)):
            return f"summary.{key} is not a number"
    if s.get("rejected") is not None and not _number(s["rejected"]):
        return "summary.rejected is not a number"
    for name in LATENCIES:
        st = s.get(f"{name}_ms")
        if not isinstance(st, dict) or not all(v is None or _number(v) for v in st.values()):
            return f"summary.{name}_ms is not a table of numbers"
    return None


def compare(a: dict, b: dict) -> list[tuple[str, object, object, float | None]]:
    """Rows (metric, A, B, B/A) of two report.json objects."""
    out = []
    for (label, va), (_, vb) in zip(_rows(a["summary"]), _rows(b["summary"])):
        ratio = (vb / va) if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va else None
        out.append((label, va, vb, ratio))
    return out


def print_compare(a: dict, b: dict, names: tuple[str, str], console: Console | None = None) -> None:
    console = console or Console()
    t = Table(title="laneserve loadtest compare")
    for col in ("metric", names[0], names[1], "B/A"):
        t.add_column(col, justify="left" if col == "metric" else "right")
    for label, va, vb, ratio in compare(a, b):
        t.add_row(label, _fmt(va), _fmt(vb), "-" if ratio is None else f"{ratio:.2f}x")
    console.print(t)
