"""The latency the gateway adds: `python -m gateway.tools.bench` (SSE throughput and TTFT, idle and under streaming
load: a real gateway and a protocol-speaking instant batcher), first tokens routed ahead of other deltas, and short
prompt work kept off the thread pool."""

from __future__ import annotations

import asyncio
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
    r = _bench("--load-streams", "4", "--step-ms", "5", "--ttft-requests", "6", "--prompt-tokens", "300",
               "--burst", "3")  # id prompts, three at a time
    assert (r["prompt_tokens"], r["burst"]) == (300, 3) and r["loaded_ttft_ms_p50"] > 0


async def test_a_first_token_is_routed_before_the_running_streams_deltas(tmp_path):
    """gateway/client.py: a step's output lists its decodes first and the prompts it completed last; the handlers
    of requests still waiting for their first token wake first, and each request's deltas keep their order."""
    from gateway.client import BatcherClient, DeltaQueue
    from gateway.config import GatewayConfig
    from laneserve.wire import protocol as P

    client = BatcherClient(GatewayConfig(batcher_address=f"ipc://{tmp_path}/none.sock"))  # not started: this loop
    try:
        queues = {rid: DeltaQueue() for rid in ("r0", "r1", "r2", "new")}
        for rid in ("r0", "r1", "r2"):
            queues[rid].waiting = False  # streaming already
        client.queues.update(queues)
        woke: list[tuple[str, list[int]]] = []

        async def handler(rid: str, n: int, ready: asyncio.Event) -> None:
            ready.set()
            for _ in range(n):
                woke.append((rid, (await queues[rid].get()).new_token_ids))

        readies = {rid: asyncio.Event() for rid in queues}
        tasks = [asyncio.create_task(handler(rid, 2 if rid == "new" else 1, readies[rid])) for rid in queues]
        await asyncio.gather(*(e.wait() for e in readies.values()))  # every handler waits on its queue
        client._on_batch(P.TokenBatch(step=1, timestamp=0.0, deltas=[
            P.TokenDelta("r0", [5]), P.TokenDelta("new", [], queued_ms=3.0), P.TokenDelta("r1", [6]),
            P.TokenDelta("new", [9]), P.TokenDelta("r2", [7])]))
        await asyncio.gather(*tasks)
        assert woke[:2] == [("new", []), ("new", [9])]  # both of its deltas, in order, ahead of the others
        assert [w[0] for w in woke[2:]] == ["r0", "r1", "r2"] and not queues["new"].waiting
    finally:
        await client.close()


async def test_short_prompt_work_runs_inline_and_long_work_in_a_thread():
    """gateway/routes.py off_loop: a thread's round trip under streaming load cost more than tokenizing or checking
    a short prompt, so only work on text over INLINE_CHARS leaves the event loop's thread."""
    import threading

    from gateway.routes import INLINE_CHARS, off_loop

    here = threading.get_ident()
    assert await off_loop(0, threading.get_ident) == here  # token ids: checked inline
    assert await off_loop(INLINE_CHARS, threading.get_ident) == here
    assert await off_loop(INLINE_CHARS + 1, threading.get_ident) != here
    assert await off_loop(10, divmod, 7, 2) == (3, 1)
    from gateway import schemas as S
    from gateway.routes import _prompt_size

    def size(**kw) -> int:
        return _prompt_size(S.CompletionRequest(model="m", **kw))
    assert size(prompt=[7] * 1900) == 1900 and size(prompt=["ab", [1, 2, 3]]) == 5 and size(prompt="x" * 99) == 99
    # a thread for echo (it decodes) and for more prompts than a request may have (refused after a scan)
    assert size(prompt=[7], echo=True) > INLINE_CHARS and size(prompt=[[1]] * 300) > INLINE_CHARS
