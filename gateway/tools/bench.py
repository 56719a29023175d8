"""Gateway benchmark: SSE tokens/s one gateway process streams, and the TTFT it adds.

Runs three processes: a real gateway (gateway.app.run), an instant batcher that speaks the real
protocol on a ROUTER socket and answers every step at once (one token per running request per
step, no model), and this process as the HTTP client. With a zero-cost engine, all the time seen by
the client is the gateway's (plus the client's own parsing): tokens/s measures the gateway's SSE
path; TTFT at concurrency 1 is the latency the gateway adds over the batcher.

    python -m gateway.tools.bench --streams 64 --tokens 256 --ttft-requests 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import tempfile
import time

import zmq

from laneserve.wire import protocol as P


def instant_batcher(address: str, ready, step_s: float = 0.0) -> None:
    """Every loop: one token for each running request, in one TokenBatch; Pong at once. step_s > 0: a step at
    most every step_s seconds (as a GPU's steps come), new requests' first tokens last in it (as a step's)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(address)
    dec = P.decoder(P.GatewayToBatcher)
    running: dict[str, list] = {}  # id -> [gateway identity, tokens left, token id]
    ready.set()
    step = 0
    next_step = time.monotonic()
    while True:
        timeout = (max(0, int((next_step - time.monotonic()) * 1000)) if step_s else 0) if running else 1000
        while sock.poll(timeout):
            ident, frame = sock.recv_multipart()
            msg = dec.decode(frame)
            if isinstance(msg, P.AddRequest):
                running[msg.request_id] = [ident, msg.params.max_tokens, 32 + len(running) % 90]
            elif isinstance(msg, P.AbortRequests):
                for rid in msg.request_ids:
                    if running.pop(rid, None) is not None:
                        sock.send_multipart([ident, P.encode(P.TokenBatch(step=step, timestamp=time.time(), deltas=[
                            P.TokenDelta(rid, [], P.FinishReason.ABORT)]))])
            elif isinstance(msg, P.Ping):
                sock.send_multipart([ident, P.encode(P.Pong(nonce=msg.nonce, workers_alive=1))])
            timeout = 0
        if not running or time.monotonic() < next_step:
            continue
        next_step = time.monotonic() + step_s
        step += 1
        by_gateway: dict[bytes, list] = {}
        for rid, st in list(running.items()):
            st[1] -= 1
            done = st[1] <= 0
            by_gateway.setdefault(st[0], []).append(
                P.TokenDelta(rid, [st[2]], P.FinishReason.LENGTH if done else None))
            if done:
                del running[rid]
        for ident, deltas in by_gateway.items():
            sock.send_multipart([ident, P.encode(P.TokenBatch(step=step, deltas=deltas, timestamp=time.time()))])


def direct_ttft(address: str, n: int, phase_s: float = 0.0) -> list[float]:
    """Baseline: AddRequest -> first delta straight over ZeroMQ, no gateway (its own socket: its delta comes
    apart from the gateway's batch); phase_s: each request after a random pause of up to this long."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    dec = P.decoder(P.BatcherToGateway)
    rng = random.Random(1)
    out = []
    for i in range(n):
        if phase_s:
            time.sleep(rng.random() * phase_s)
        t0 = time.perf_counter()
        sock.send(P.encode(P.AddRequest(request_id=f"direct-{i}", prompt_token_ids=list(b"bench"),
                                        params=P.SamplingParams(max_tokens=1), arrival_time=time.time())))
        while not isinstance(dec.decode(sock.recv()), P.TokenBatch):
            pass
        out.append(time.perf_counter() - t0)
    sock.close()
    ctx.term()
    return sorted(out)


def _background(base: str, streams: int) -> None:
    """A process holding `streams` endless SSE streams open and reading them (the load behind loaded TTFT)."""
    import aiohttp

    async def main() -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await asyncio.gather(*(_stream(session, base + "/v1/completions", 8000) for _ in range(streams)))

    asyncio.run(main())


def _pct(xs: list[float], q: float) -> float:
    return round(1e3 * xs[min(len(xs) - 1, int(q * len(xs)))], 3)


def gateway_process(address: str, port: int) -> None:
    from gateway.app import run
    from gateway.config import GatewayConfig

    run(GatewayConfig(port=port, batcher_address=address, max_queued_requests=0, request_timeout=0))


async def _stream(session, url: str, tokens: int, prompt: str | list[int] = "bench") -> tuple[float, int]:
    """-> (seconds to the first content chunk, content chunks received)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": tokens, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    ttft, chunks = 0.0, 0
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                if not chunks:
                    ttft = time.perf_counter() - t0
                chunks += 1
    return ttft, chunks


async def _wait_healthy(session, base: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            async with session.get(base + "/health") as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        await asyncio.sleep(0.1)
    raise SystemExit("gateway did not become healthy")


async def _loaded_ttft(base: str, address: str, n: int, load_streams: int, here: bool, step_s: float,
                       prompt_tokens: int = 0, burst: int = 1) -> dict:
    """TTFT of n 1-token requests, `burst` at a time, through the gateway and straight to the batcher, while
    load_streams streams run (read by another process, or with `here` by this one, as a load tester's loop does);
    prompt_tokens > 0: each request's prompt is that many token ids (else a short text)."""
    import aiohttp

    url = base + "/v1/completions"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await _wait_healthy(session, base)
        if here:
            load = [asyncio.create_task(_stream(session, url, 8000)) for _ in range(load_streams)]
        else:
            proc = mp.get_context("spawn").Process(target=_background, args=(base, load_streams), daemon=True)
            proc.start()
        deadline = time.monotonic() + 60
        while _in_flight(await (await session.get(base + "/metrics")).text()) < load_streams:
            if time.monotonic() > deadline:
                raise SystemExit("the background streams did not start")
            await asyncio.sleep(0.05)  # polling the gateway's gauge until the load runs
        rng = random.Random(0)
        ttfts = []
        for _ in range(-(-n // burst)):  # each burst at a random phase of the batcher's step (sent right after the
            # last one, every request would arrive just after a step and wait the same time for the next)
            await asyncio.sleep(rng.random() * step_s)
            prompts = [[rng.randrange(40, 90) for _ in range(prompt_tokens)] if prompt_tokens else "bench"
                       for _ in range(burst)]
            ttfts += [t for t, _ in await asyncio.gather(*(_stream(session, url, 1, p) for p in prompts))]
        ttfts.sort()
        direct = await asyncio.to_thread(direct_ttft, address, -(-n // burst), step_s)
        if here:
            for t in load:
                t.cancel()
            await asyncio.gather(*load, return_exceptions=True)
        else:
            proc.terminate()
            proc.join(10)
    out = {"load_streams": load_streams, "load_read_here": here, "prompt_tokens": prompt_tokens, "burst": burst,
           "loaded_added_ms_mean": round(1e3 * (sum(ttfts) / len(ttfts) - sum(direct) / len(direct)), 3)}
    for q, name in ((0.5, "p50"), (0.95, "p95"), (0.99, "p99")):
        out[f"loaded_ttft_ms_{name}"] = _pct(ttfts, q)
        out[f"loaded_direct_ms_{name}"] = _pct(direct, q)
        out[f"loaded_added_ms_{name}"] = round(_pct(ttfts, q) - _pct(direct, q), 3)
    return out


def _in_flight(metrics: str) -> float:
    for line in metrics.splitlines():
        if line.startswith("laneserve:gateway_requests_in_flight"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _drive(base: str, streams: int, tokens: int, ttft_requests: int) -> dict:
    import aiohttp

    url = base + "/v1/completions"
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        await _wait_healthy(session, base)
        await asyncio.gather(*(_stream(session, url, 8) for _ in range(8)))  # warm-up
        ttfts = sorted([(await _stream(session, url, 1))[0] for _ in range(ttft_requests)])
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_stream(session, url, tokens) for _ in range(streams)))
        elapsed = time.perf_counter() - t0
    total = sum(c for _, c in results)
    return {"streams": streams, "tokens_per_stream": tokens, "sse_tokens": total, "seconds": round(elapsed, 3),
            "sse_tokens_per_s": round(total / elapsed), "ttft_ms_p50": _pct(ttfts, 0.5),
            "ttft_ms_p99": _pct(ttfts, 0.99)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gateway.tools.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=64, help="concurrent SSE streams")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per stream")
    ap.add_argument("--ttft-requests", type=int, default=200, help="sequential 1-token requests for TTFT")
    ap.add_argument("--port", type=int, default=0, help="gateway port (0 = a free one)")
    ap.add_argument("--load-streams", type=int, default=0,
                    help="also TTFT under load: --ttft-requests sequential requests while this many streams run, "
                         "the batcher stepping every --step-ms, through the gateway and straight to the batcher")
    ap.add_argument("--step-ms", type=float, default=20.0, help="with --load-streams: ms between the batcher's steps")
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="with --load-streams: each measured request's prompt is this many token ids (0: a short text)")
    ap.add_argument("--burst", type=int, default=1,
                    help="with --load-streams: measured requests sent this many at a time")
    ap.add_argument("--load-here", action="store_true",
                    help="with --load-streams: read the load's streams in the measuring client's own event loop "
                         "(as a load tester does), not in another process")
    args = ap.parse_args(argv)
    port = args.port
    if not port:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    run_dir = tempfile.mkdtemp(prefix="laneserve-bench-")
    address = f"ipc://{run_dir}/batcher.sock"
    spawn = mp.get_context("spawn")
    ready = spawn.Event()
    step_s = args.step_ms / 1000.0 if args.load_streams else 0.0
    procs = [spawn.Process(target=instant_batcher, args=(address, ready, step_s), daemon=True)]
    procs[0].start()
    ready.wait(30)
    procs.append(spawn.Process(target=gateway_process, args=(address, port), daemon=True))
    procs[1].start()
    try:
        base = f"http://127.0.0.1:{port}"
        if args.load_streams:  # (a paced batcher: the unloaded figures below would measure its pace)
            print(json.dumps(asyncio.run(_loaded_ttft(base, address, args.ttft_requests, args.load_streams,
                                                      args.load_here, step_s, args.prompt_tokens, args.burst))))
            return 0
        direct = direct_ttft(address, args.ttft_requests)
        result = asyncio.run(_drive(base, args.streams, args.tokens, args.ttft_requests))
    finally:
        for p in procs:
            p.terminate()
            p.join(10)
        try:
            os.unlink(address[len("ipc://"):])
            os.rmdir(run_dir)
        except OSError:
            pass
    result.update(direct_ttft_ms_p50=_pct(direct, 0.5), direct_ttft_ms_p99=_pct(direct, 0.99))
    result.update(added_ttft_ms_p50=round(result["ttft_ms_p50"] - result["direct_ttft_ms_p50"], 3),
                  added_ttft_ms_p99=round(result["ttft_ms_p99"] - result["direct_ttft_ms_p99"], 3))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
