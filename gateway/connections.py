"""The gateway's HTTP connections: limits on slow and idle clients, a cap on how many are open, and OpenAI's JSON
error for HTTP that never reaches a handler.

aiohttp alone keeps a connection that trickles its headers or body, or idles between requests, open for about an
hour, and answers malformed HTTP (bad request line, oversized headers, bad chunking, CL+TE, an HTTP/2 preface)
with a text/plain 400. `Connection` (aiohttp's RequestHandler with its public hooks overridden) and `Guard` (the
set of them and one sweep task) close:
- a connection whose request line and headers are not complete `header_timeout` s after it opened, or after the
  first byte that follows its previous response;
- a keep-alive connection idle for `keepalive_timeout` s after a response;
- and `read_body` gives a request's body `body_timeout` s once its headers are in (408, connection closed).
Above `max_connections` open connections, a new one gets a 503 JSON answer and is closed at once.
A handler's own run time is --request-timeout's business, not this module's.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from gateway.errors import ApiError

log = logging.getLogger("laneserve.gateway")
LINGER_S = 1.0  # after an early answer (an error before the body was read, a refusal), the most a connection lingers
FDS_SPARE = 256  # file descriptors kept for everything but client connections (ZeroMQ, threads' files, logs)
MAX_LINGERING = 64  # refused connections kept open for LINGER_S at once; more are closed at once


def _error_bytes(err: ApiError) -> bytes:
    """A whole HTTP/1.1 503 response, for a connection refused before aiohttp parses anything."""
    body = msgspec.json.encode(err.body())
    retry = "".join(f"{k}: {v}\r\n" for k, v in err.retry_headers().items())
    head = (f"HTTP/1.1 {err.status} Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{retry}Connection: close\r\n\r\n")
    return head.encode() + body


class Connection(web.RequestHandler):
    """One client connection. `deadline` is the monotonic time the Guard closes it at unless a request begins (None:
    a request is running, or no limit)."""

    def __init__(self, guard: "Guard", manager: web.Server, **kwargs):
        super().__init__(manager, **kwargs)
        self.guard = guard
        self.refused = False
        self.deadline: float | None = None
        self.idle = False  # between requests of a keep-alive connection with no byte of the next one yet

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.guard.full():
            self.refused = True  # aiohttp never sees it
            transport.write(_error_bytes(ApiError(
                503, f"the gateway has {self.guard.max_connections} connections open (--max-connections); retry",
                retry_after=self.guard.retry_after)))
            # FIN after the answer, then close a moment later: closing at once would reset the connection if the
            # client's request arrives meanwhile, and a reset can discard the answer before the client reads it.
            # A flood of refusals is closed at once: their file descriptors must not starve the rest.
            if self.guard.lingering < MAX_LINGERING and transport.can_write_eof():
                transport.write_eof()
                self.guard.lingering += 1
                asyncio.get_running_loop().call_later(LINGER_S, self._close_refused, transport)
            else:
                transport.close()
            return
        super().connection_made(transport)
        self.deadline = self.guard.after(self.guard.header_timeout)
        self.guard.open.add(self)

    def _close_refused(self, transport: asyncio.BaseTransport) -> None:
        self.guard.lingering -= 1
        transport.close()

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        if self.idle and data:  # the next request began: its headers get header_timeout from now
            self.idle = False
            self.deadline = self.guard.after(self.guard.header_timeout)
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.refused:
            return
        self.guard.open.discard(self)
        super().connection_lost(exc)

    def begin(self) -> None:
        self.deadline = None

    def end(self) -> None:
        self.idle = True
        self.deadline = self.guard.after(self.guard.keepalive_timeout)

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """aiohttp's answer to HTTP it could not parse (or a failure outside any handler), as OpenAI's JSON error."""
        if request.writer.output_size > 0:  # an answer began: no second one on this connection (aiohttp's rule)
            raise ConnectionError("an answer was sent already; cannot send an error after it")
        if status >= 500:
            log.error("error outside a handler from %s", request.remote, exc_info=exc)
            text = "internal server error"
        else:
            text = f"malformed HTTP request: {message or getattr(exc, 'message', '') or 'cannot parse'}"
        resp = ApiError(status, text).response()
        resp.force_close()
        return resp


class Guard:
    """The gateway's open connections and the task that closes those past their deadline."""

    def __init__(self, header_timeout: float, body_timeout: float, keepalive_timeout: float, max_connections: int,
                 retry_after: float = 1.0):
        self.header_timeout, self.body_timeout = header_timeout, body_timeout
        self.keepalive_timeout, self.max_connections = keepalive_timeout, max_connections
        self.retry_after = retry_after
        self.open: set[Connection] = set()
        self.lingering = 0  # connections refused for the cap and still open (closed LINGER_S after their answer)
        self._sweeper: asyncio.Task | None = None

    @staticmethod
    def after(timeout: float) -> float | None:
        return time.monotonic() + timeout if timeout > 0 else None

    def full(self) -> bool:
        return 0 < self.max_connections <= len(self.open)

    def factory(self, server: web.Server):
        """The protocol factory for loop.create_server (aiohttp's own keep-alive timer, about an hour, stays: a
        backstop behind ours). Bodies are read as they come (auto_decompress off): the app refuses a compressed one
        (415) rather than inflate it on the event loop."""
        loop = asyncio.get_running_loop()
        return lambda: Connection(self, server, loop=loop, lingering_time=LINGER_S, access_log=None,
                                  auto_decompress=False)

    def start(self) -> None:
        limits = [t for t in (self.header_timeout, self.keepalive_timeout) if t > 0]
        if limits:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep(min(max(min(limits) / 4, 0.05), 1.0)))

    def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()

    async def _sweep(self, tick: float) -> None:
        while True:
            await asyncio.sleep(tick)  # a periodic timer, not synchronisation
            now = time.monotonic()
            for conn in [c for c in self.open if c.deadline is not None and c.deadline <= now]:
                conn.force_close()

    async def read_body(self, request: web.Request) -> None:
        """Read (and let aiohttp cache) the body within body_timeout: a 408 closing the connection past it; a 400
        for a body aiohttp cannot decode (bad chunked encoding, short Content-Length)."""
        try:
            async with asyncio.timeout(self.body_timeout if self.body_timeout > 0 else None):
                await request.read()
        except TimeoutError:
            request.protocol.close()
            raise ApiError(408, f"the request body did not arrive within {self.body_timeout:g} s "
                                "(--body-timeout)") from None
        except (HttpProcessingError, RequestPayloadError) as exc:
            request.protocol.close()
            raise ApiError(400, f"malformed HTTP request body: {getattr(exc, 'message', exc)}") from None


def raise_fd_limit(max_connections: int) -> int:
    """Raise the soft open-files limit so max_connections fit (up to the hard limit); returns the connections
    that fit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + FDS_SPARE
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        soft = new
    fit = max_connections if soft == resource.RLIM_INFINITY else min(max_connections, soft - FDS_SPARE)
    if fit < max_connections:
        log.warning("open-files limit %d fits %d connections, not --max-connections %d", soft, fit, max_connections)
    return max(fit, 1)
