"""BatcherClient: the gateway's one DEALER socket to the batcher and its one reader task.

Sends AddRequest / AbortRequests / Ping frames; the reader decodes TokenBatch / Rejected / Pong
and routes every delta to the asyncio.Queue registered for its request id (several ids of one
HTTP request, n > 1 or many prompts, share one queue). A request's queue is dropped when its
finishing delta (or a Rejected) passes, or when the handler releases it; later deltas for it are
ignored. Liveness (docs/reliability.md): the socket monitor says at once when the connection to the
batcher closes (its process died) — in-flight requests then fail (503 / an error chunk) and new ones
get 503 until the connection is back (ZeroMQ reconnects by itself; the tokenizer, Vocabulary, is sent
first on each connection, for structured output); a Ping every PING_S keeps
workers_alive fresh and catches a batcher that is connected but silent (--batcher-lost-after).
Must not import torch or batcher internals.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from gateway.config import GatewayConfig
from laneserve.wire import protocol as P
from laneserve.wire import transport

log = logging.getLogger("laneserve.gateway")
PING_S = 0.5  # liveness ping period (shorter when --batcher-timeout is under a second)


@dataclass
class BatcherLost:
    """Put in a request's queue when the batcher stopped answering with the request in flight."""

    reason: str


class DeltaQueue(asyncio.Queue):
    """One HTTP request's deltas (and Rejected / BatcherLost). `waiting` until a delta with tokens was put."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = True


class BatcherClient:
    def __init__(self, cfg: GatewayConfig, vocabulary: P.Vocabulary | None = None):
        self.cfg = cfg
        self.vocabulary = vocabulary  # sent first on every connection: the batcher's grammars need the tokenizer
        self.ctx = zmq.asyncio.Context()
        # The monitor says when a ZMTP session with the batcher is up, and when it closes.
        self.sock, self.monitor = transport.connect_monitored(
            self.ctx, zmq.DEALER, cfg.batcher_address, zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED,
            curve_server_public_key=cfg.curve_server_public_key, curve_client_secret_key=cfg.curve_client_secret_key)
        self.connected = False  # a ZMTP session with the batcher is up (from the monitor)
        self.decoder = P.decoder(P.BatcherToGateway)
        self.queues: dict[str, DeltaQueue] = {}
        self.pings: dict[int, asyncio.Future] = {}
        self.nonces = itertools.count(1)
        self.stats = P.EngineStats()
        self.workers_alive = 0
        self.last_rx = 0.0  # monotonic time of the last frame from the batcher
        self.handlers = {P.TokenBatch: self._on_batch, P.Rejected: self._on_rejected, P.Pong: self._on_pong}
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._reader(), name="batcher-reader"),
                       asyncio.create_task(self._watch_connection(), name="batcher-monitor"),
                       asyncio.create_task(self._watchdog(), name="batcher-watchdog")]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.sock.disable_monitor()
        self.monitor.close()
        self.sock.close()
        self.ctx.term()

    # ------------------------------------------------------------------ sending
    def _send(self, msg) -> None:
        # NOBLOCK with HWM 0 never waits: the frame is queued even before the batcher connects.
        # It must go through the asyncio socket, not a sync shadow: a send can swallow the fd's
        # edge-triggered read event, and only pyzmq's own send re-arms the waiting reader.
        fut = self.sock.send(P.encode(msg), flags=zmq.NOBLOCK)
        if fut.done() and fut.exception() is not None:  # resolved at once; retrieving it keeps asyncio quiet
            raise fut.exception()

    def submit(self, requests: list[P.AddRequest]) -> DeltaQueue:
        """Send the requests; their deltas (and Rejected / BatcherLost) arrive on the returned queue."""
        q = DeltaQueue()
        for r in requests:
            self.queues[r.request_id] = q
        try:
            for r in requests:
                self._send(r)
        except zmq.ZMQError as exc:  # the socket closed (shutdown): a 503, and nothing of the request left behind
            self.abort([r.request_id for r in requests])
            q.put_nowait(BatcherLost(f"the batcher connection is closed: {exc}"))
        return q

    def abort(self, request_ids: list[str]) -> None:
        """Cancel requests in the batcher (their KV blocks are freed) and stop routing their deltas."""
        if not request_ids:
            return
        self.release(request_ids)
        try:
            self._send(P.AbortRequests(request_ids=list(request_ids)))
        except zmq.ZMQError as exc:  # socket closed during shutdown
            log.warning("abort of %d requests not sent: %s", len(request_ids), exc)

    def release(self, request_ids) -> None:
        for rid in request_ids:
            self.queues.pop(rid, None)

    @property
    def num_in_flight(self) -> int:
        return len(self.queues)

    async def ping(self, timeout: float | None = None) -> P.Pong | None:
        """A live round trip to the batcher (answered outside its request queue); None on timeout."""
        if not self.connected:  # no session: the frame would only queue up for a later batcher
            return None
        nonce = next(self.nonces)
        fut = asyncio.get_running_loop().create_future()
        self.pings[nonce] = fut
        try:
            self._send(P.Ping(nonce=nonce))
            return await asyncio.wait_for(fut, self.cfg.batcher_timeout if timeout is None else timeout)
        except (asyncio.TimeoutError, zmq.ZMQError):
            return None
        finally:
            self.pings.pop(nonce, None)

    async def alive(self) -> bool:
        """True if the batcher answered recently or answers a ping now (admission check)."""
        if not self.connected:
            return False
        if time.monotonic() - self.last_rx < self.cfg.batcher_timeout:
            return self.workers_alive > 0
        pong = await self.ping()
        return pong is not None and pong.workers_alive > 0

    # ------------------------------------------------------------------ receiving
    async def _reader(self) -> None:
        while True:
            frame = await self.sock.recv()
            self.last_rx = time.monotonic()
            msg = transport.try_decode(self.decoder, frame, "the batcher")
            if msg is None:
                continue
            try:
                self.handlers[type(msg)](msg)
            except Exception:  # one bad message must not stop every request's stream
                log.exception("error handling %s from the batcher", type(msg).__name__)

    def _on_batch(self, batch: P.TokenBatch) -> None:
        """Route each delta to its request's queue, first those of requests still waiting for their first token, so
        their handlers run first: a step's output lists its decodes before the prompts it completed, and each delta's
        handler takes tens of microseconds, so with hundreds of streams a first token last in line waited
        milliseconds. A queue's deltas keep their order (all of a batch's go in one turn)."""
        queues = self.queues
        first, later = [], []
        turn: dict[int, list] = {}  # id(queue) -> its turn in this batch
        for d in batch.deltas:
            q = queues.get(d.request_id)
            if q is None:
                continue  # released (stop string, disconnect, timeout): its ABORT delta lands here
            turn.setdefault(id(q), first if q.waiting else later).append((q, d))
            if d.new_token_ids:
                q.waiting = False
            if d.finish_reason is not None:
                del queues[d.request_id]
        for q, d in first:
            q.put_nowait(d)
        for q, d in later:
            q.put_nowait(d)

    def _on_rejected(self, msg: P.Rejected) -> None:
        q = self.queues.pop(msg.request_id, None)
        if q is not None:
            q.put_nowait(msg)

    def _on_pong(self, pong: P.Pong) -> None:
        self.stats = pong.stats
        self.workers_alive = pong.workers_alive
        if pong.protocol_version != P.PROTOCOL_VERSION:
            log.error("batcher speaks protocol %d, gateway %d", pong.protocol_version, P.PROTOCOL_VERSION)
            self.workers_alive = 0
        fut = self.pings.pop(pong.nonce, None)
        if fut is not None and not fut.done():
            fut.set_result(pong)

    async def _watch_connection(self) -> None:
        """Connection state from the socket monitor; a closed connection fails what is in flight at once."""
        while True:
            event = await recv_monitor_message(self.monitor)
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if not self.connected:
                    log.info("connected to the batcher at %s", self.cfg.batcher_address)
                if self.vocabulary is not None:  # before any request: requests wait for `connected`
                    self._send(self.vocabulary)
                self.connected = True
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.connected = False
                self.workers_alive = 0
                log.error("the batcher at %s went away", self.cfg.batcher_address)
                for fut in self.pings.values():  # their Pongs will not come: answered now, not at --batcher-timeout
                    if not fut.done():
                        fut.set_result(None)
                if self.queues:
                    self.fail_all("the batcher went away")

    async def _watchdog(self) -> None:
        """Ping every PING_S (fresh workers_alive for admission); fail in-flight requests when the
        batcher is connected but went silent, instead of leaving them hanging."""
        limit = self.cfg.batcher_lost_after
        period = max(0.05, min(PING_S, self.cfg.batcher_timeout / 2))
        while True:
            await asyncio.sleep(period)  # a timer tick, not synchronisation
            if self.connected:
                try:
                    self._send(P.Ping(nonce=0))  # any answer refreshes last_rx
                except zmq.ZMQError:
                    pass
            silent = time.monotonic() - self.last_rx
            if limit > 0 and self.queues and silent > limit:
                self.fail_all(f"the batcher did not answer for {silent:.1f}s")

    def fail_all(self, reason: str) -> None:
        log.error("%s: failing %d in-flight requests", reason, len(self.queues))
        lost = BatcherLost(reason)
        for q in {id(q): q for q in self.queues.values()}.values():  # a queue may serve several ids
            q.put_nowait(lost)
        self.queues.clear()
