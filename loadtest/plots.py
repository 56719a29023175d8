"""PNG plots of one run and of sweeps (matplotlib, Agg backend: no display needed).

timeline.png: requests sent per second and each request's TTFT against its send time.
cdf.png: empirical CDFs of TTFT, TPOT, ITL and E2E.
sweep.png (plot_sweep; plot_sweeps draws several sweeps on the same axes, for compare): against the
rate, output tok/s, goodput % and p95 TTFT / TPOT, median seed solid and worst seed dashed, the SLO
as horizontal lines, the saturation rate and the SLO capacity as vertical ones.
Reads records and sweep.json objects only; writes files only.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from loadtest.client import RequestRecord  # noqa: E402


def _cdf(ax, values, label: str) -> None:
    a = np.sort(np.asarray(values, dtype=float) * 1e3)
    ax.set_title(label)
    ax.set_xlabel("ms")
    ax.grid(alpha=0.3)
    if a.size:
        ax.plot(a, np.arange(1, a.size + 1) / a.size, drawstyle="steps-post")
        ax.set_ylim(0, 1.01)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", transform=ax.transAxes)


def plot_run(records: list[RequestRecord], out_dir: str | Path, title: str = "") -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sent = [r for r in records if r.sent is not None]
    ok = [r for r in sent if r.ok]
    bad = [r for r in sent if not r.ok]

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    times = np.asarray([r.sent for r in sent])
    if times.size:
        # ~60 bins over the run, whole seconds once the run is longer than a minute
        width = max(times.max() / 60, 0.05) if times.max() < 60 else float(np.ceil(times.max() / 60))
        counts, edges = np.histogram(times, bins=np.arange(0, times.max() + width, width))
        ax1.bar(edges[:-1], counts / width, width=width, align="edge", color="tab:blue")
    ax1.set_ylabel("requests sent / s")
    ax1.grid(alpha=0.3)
    ax1.set_title(title or "arrivals and TTFT over time")
    timed = [r for r in ok if r.ttft is not None]
    ax2.scatter([r.sent for r in timed], [r.ttft * 1e3 for r in timed], s=6, label="TTFT (ok)")
    if bad:
        ax2.scatter([r.sent for r in bad], [0] * len(bad), s=12, marker="x", color="tab:red", label="error")
    ax2.set_ylabel("TTFT ms")
    ax2.set_xlabel("s since start")
    ax2.legend(loc="best")
    ax2.grid(alpha=0.3)
    timeline = out / "timeline.png"
    fig.tight_layout()
    fig.savefig(timeline, dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    _cdf(axes[0][0], [r.ttft for r in ok if r.ttft is not None], "TTFT")
    _cdf(axes[0][1], [r.tpot for r in ok if r.tpot is not None], "TPOT")
    _cdf(axes[1][0], [g for r in ok for g in r.itl], "ITL")
    _cdf(axes[1][1], [r.e2e for r in ok], "E2E")
    fig.tight_layout()
    cdf = out / "cdf.png"
    fig.savefig(cdf, dpi=100)
    plt.close(fig)
    return [timeline, cdf]


def _sweep_lines(axes, sweep: dict, color: str, name: str) -> None:
    rates = [row["rate"] for row in sweep["rates"]]
    panels = ((axes[0], (("output_tok_s", "output tok/s"),)), (axes[1], (("goodput_pct", "goodput %"),)),
              (axes[2], (("ttft_p95_ms", "TTFT p95"), ("tpot_p95_ms", "TPOT p95"))))
    for ax, series in panels:
        for (key, label), marker in zip(series, ("o", "s")):
            for which, style in (("median", "-"), ("worst", "--")):
                ys = [np.nan if row[key][which] is None else row[key][which] for row in sweep["rates"]]
                ax.plot(rates, ys, style, marker=marker, color=color,
                        label=f"{name}{label}" if which == "median" else None)
        saturation = sweep.get("saturation_rate") if sweep.get("saturation_reached") is not False else None
        for rate, style in ((saturation, ":"), (sweep.get("slo_capacity_rate"), "-.")):
            if rate is not None:
                ax.axvline(rate, color=color, linestyle=style, alpha=0.6)


def plot_sweeps(sweeps: list[tuple[str, dict]], path: str | Path) -> Path:
    """(name, sweep.json object) pairs on one figure; one colour per sweep."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, (name, sweep) in enumerate(sweeps):
        _sweep_lines(axes, sweep, colors[k % len(colors)], f"{name}: " if len(sweeps) > 1 else "")
    slo = sweeps[0][1].get("slo_ms", {}) if sweeps else {}
    for term, style in (("ttft", "-"), ("tpot", "--")):
        if term in slo:
            axes[2].axhline(slo[term], color="tab:red", linestyle=style, alpha=0.5, label=f"SLO {term.upper()}")
    axes[1].axhline(95.0, color="tab:red", alpha=0.5, label="95% goodput")
    axes[0].set_ylabel("output tok/s")
    axes[1].set_ylabel("goodput %")
    axes[2].set_ylabel("ms")
    axes[2].set_xlabel("request rate (req/s)   solid: median seed, dashed: worst seed; "
                       "vertical dotted: saturation rate, dash-dot: SLO capacity")
    meta = sweeps[0][1].get("meta", {}) if sweeps else {}
    axes[0].set_title("sweep: " + " vs ".join(name for name, _ in sweeps) if len(sweeps) > 1 else
                      f"sweep: {meta.get('model')}, trace {meta.get('trace')}")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_sweep(sweep: dict, out_dir: str | Path) -> Path:
    return plot_sweeps([("", sweep)], Path(out_dir) / "sweep.png")
