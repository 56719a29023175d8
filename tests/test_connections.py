"""Issue 26, items 3 and 6, on the real stack over raw sockets: slow and idle clients are closed within
--header-timeout / --body-timeout / --keepalive-timeout while normal clients are served; above --max-connections a new
connection gets a 503 JSON answer; malformed HTTP gets OpenAI's JSON error, not aiohttp's text/plain."""

from __future__ import annotations

import asyncio
import gzip
import json
import time

import aiohttp
import pytest

LIMIT_S = 2.0  # each of the three timeouts in the slow-client stack
SLACK_S = 1.5  # the guard's sweep tick (0.5 s) plus scheduling on a busy CI machine
CAP = 12


def _parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


async def _exchange(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send data, read until the server closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


async def _closed_after(reader: asyncio.StreamReader, trickle=None) -> tuple[float, bytes]:
    """Seconds until the server closes the connection (EOF or reset), and what it sent; `trickle` writes
    meanwhile, as a slow client does."""
    t0 = time.monotonic()
    task = asyncio.ensure_future(trickle()) if trickle else None
    try:
        data = await asyncio.wait_for(reader.read(), LIMIT_S * 4 + 10)
    except ConnectionResetError:
        data = b""
    finally:
        if task:
            task.cancel()
    return time.monotonic() - t0, data


async def _slow(port: int, kind: str) -> tuple[float, bytes, float]:
    """(seconds from the answer or the connection to the close, what was read, seconds from before the server's
    clock started: the connection, or for an idle keep-alive connection the request)."""
    start = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"

    async def drip(data: bytes):
        for i in range(len(data)):  # a client that sends a byte every 0.3 s (its pace, not a synchronisation)
            writer.write(data[i:i + 1])
            await writer.drain()
            await asyncio.sleep(0.3)

    try:
        if kind == "silent":  # connects and never sends
            return *await _closed_after(reader), time.monotonic() - start
        if kind == "slow headers":
            return *await _closed_after(reader, lambda: drip(head * 10)), time.monotonic() - start
        if kind == "slow body":
            writer.write(head + b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
            return *await _closed_after(reader, lambda: drip(b"x" * 990)), time.monotonic() - start
        assert kind == "idle keep-alive"
        body = b'{"prompt": "hi", "max_tokens": 1}'
        start = time.monotonic()  # (the keep-alive clock starts when the answer is done)
        writer.write(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        status = await reader.readline()
        assert b" 200 " in status, status
        t, _ = await _closed_after(reader)
        return t, status, time.monotonic() - start
    finally:
        writer.close()


async def _normal(url: str, n: int) -> list[int]:
    async with aiohttp.ClientSession() as s:
        statuses = []
        for i in range(n):
            async with s.post(url, json={"prompt": f"ok {i}", "max_tokens": 4, "ignore_eos": True}) as r:
                await r.read()
                statuses.append(r.status)
        return statuses


async def test_slow_and_idle_clients_are_closed_within_the_limits_and_normal_ones_are_served(make_stack):
    s = make_stack("--header-timeout", str(LIMIT_S), "--body-timeout", str(LIMIT_S),
                   "--keepalive-timeout", str(LIMIT_S), "--max-connections", str(CAP))
    kinds = ["silent", "slow headers", "slow body", "idle keep-alive"]
    slow = [asyncio.ensure_future(_slow(s.port, k)) for k in kinds * 2]
    normal = await _normal(s.url("/v1/completions"), 12)
    results = await asyncio.gather(*slow)
    assert normal == [200] * 12
    for kind, (after, data, since_start) in zip(kinds * 2, results):
        assert after < LIMIT_S + SLACK_S, (kind, after)
        if kind == "slow body":  # headers were in: an answer, then the close
            status, headers, body = _parse(data)
            assert status == 408 and headers["content-type"].startswith("application/json"), data
            assert json.loads(body)["error"]["code"] == "request_timeout"
        else:  # closed, no earlier than the limit (an idle keep-alive connection after its whole answer), timed
            # from before the server's clock started (the test's own clock starts later on a loaded machine)
            assert since_start >= LIMIT_S and (data == b"" or kind == "idle keep-alive"), (kind, since_start, data)

    # the cap: CAP connections open (silent, inside the header timeout), the next one is refused with a 503
    held = [await asyncio.open_connection("127.0.0.1", s.port) for _ in range(CAP)]
    try:
        status, headers, body = _parse(await _exchange(s.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"))
        assert status == 503 and headers["content-type"] == "application/json"
        assert int(headers["retry-after"]) == max(1, round(int(headers["retry-after-ms"]) / 1000))  # jittered too
        assert "--max-connections" in json.loads(body)["error"]["message"]
    finally:
        for _, w in held:
            w.close()
    # once they are gone the gateway serves again (the close reaches it asynchronously: retry on the 503)
    deadline = time.monotonic() + 10
    while (await _normal(s.url("/v1/completions"), 1)) != [200]:
        assert time.monotonic() < deadline, "the cap did not free up"
    metrics = await _get(s.url("/metrics"))
    assert 'request_errors_total{model_name="tiny",status="408"}' in metrics


async def _get(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return await r.text()


GZIP_BOMB = gzip.compress(b"a" * (64 << 20))
MALFORMED = {
    "bad request line": b"GARBAGE\r\n\r\n",
    "HTTP/2 preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    "request line too long": b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "header too long": b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 20000 + b"\r\n\r\n",
    "too many headers": b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(300)) + b"\r\n",
    "bad Content-Length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 12abc\r\n\r\n{}",
    "Content-Length and Transfer-Encoding": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
                                             b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
    "bad chunk size": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"),
    "unknown Transfer-Encoding": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n"),
    "gzip Content-Encoding on a plain body": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                                              b"Content-Type: application/json\r\nContent-Encoding: gzip\r\n"
                                              b"Content-Length: 15\r\n\r\n{\"prompt\":\"hi\"}"),
    # 64 KiB that would inflate to 64 MiB: refused as it came, never inflated on the event loop
    "gzip bomb": (b"POST /tokenize HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
                  b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(GZIP_BOMB) + GZIP_BOMB),
}


@pytest.mark.parametrize("case", list(MALFORMED))
async def test_malformed_http_gets_an_openai_json_error(stack, case):
    status, headers, body = _parse(await _exchange(stack.port, MALFORMED[case]))
    assert 400 <= status < 500, (case, status, body[:200])
    assert headers.get("content-type", "").startswith("application/json"), (case, headers, body[:200])
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error", error
    if "gzip" in case and "Transfer" not in case:
        assert status == 415 and "Content-Encoding 'gzip' is not supported" in error["message"], error
