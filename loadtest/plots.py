"""PNG plots of one run (matplotlib, Agg backend: no display needed).

timeline.png: requests sent per second and each request's TTFT against its send time.
cdf.png: empirical CDFs of TTFT, TPOT, ITL and E2E. Reads records only; writes files only.
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
