"""python -m gateway.tools.bench: the gateway's SSE throughput and the TTFT it adds, idle and under streaming load
(its own processes: a real gateway and a protocol-speaking instant batcher)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.stack import REPO


def _bench(*flags: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "gateway.tools.bench", *flags], cwd=REPO, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_gateway_bench_streams_and_times_ttft():
    r = _bench("--streams", "4", "--tokens", "16", "--ttft-requests", "10")
    assert r["sse_tokens"] == 4 * 16 and r["sse_tokens_per_s"] > 0
    assert 0 < r["direct_ttft_ms_p50"] <= r["direct_ttft_ms_p99"] and r["ttft_ms_p50"] > 0


def test_the_gateway_bench_times_ttft_under_streaming_load():
    for flags in ((), ("--load-here",)):
        r = _bench("--load-streams", "8", "--step-ms", "5", "--ttft-requests", "10", *flags)
        assert r["load_streams"] == 8 and r["load_read_here"] == bool(flags)
        # a paced batcher: each first token waits for a step, through the gateway and without it
        assert r["loaded_direct_ms_p50"] > 0 and r["loaded_ttft_ms_p50"] > 0
        assert r["loaded_added_ms_p95"] == round(r["loaded_ttft_ms_p95"] - r["loaded_direct_ms_p95"], 3)
