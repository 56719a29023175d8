"""The sidecar's asyncio loop: the only place where transport meets scheduling.

inputs (gateway ROUTER, worker ROUTER) -> Scheduler.schedule() -> StepInput to the
worker -> StepOutput -> Scheduler.update() -> TokenBatch to each gateway.
One Scheduler per worker, each owning that worker's KV block pool; batcher.router
picks the worker for a new request. With --async-scheduling each worker has up to
two steps in flight: the next one waits in the worker's socket while it runs the
current one, so the sidecar's work and the round trip are off the GPU's path.
Must not import torch.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from batcher import protocol as P
from batcher import transport
from batcher.config import BatcherConfig
from batcher.router import pick_worker
from batcher.scheduler import Scheduler

log = logging.getLogger("laneserve.batcher")


@dataclass
class WorkerSlot:
    worker_id: int
    identity: bytes
    scheduler: Scheduler
    in_flight: deque[int] = field(default_factory=deque)  # step numbers sent, oldest first
    stale: set[int] = field(default_factory=set)  # steps in flight when fail_all() ran: their outputs are dropped
    last_seen: float = field(default_factory=time.monotonic)


class Batcher:
    def __init__(self, cfg: BatcherConfig):
        self.cfg = cfg
        self.ctx = zmq.asyncio.Context()
        self.front = transport.bind(self.ctx, zmq.ROUTER, cfg.batcher_address)
        self.back = transport.bind(self.ctx, zmq.ROUTER, cfg.worker_address)
        self.front_decoder = P.decoder(P.GatewayToBatcher)
        self.back_decoder = P.decoder(P.WorkerToBatcher)
        self.workers: dict[int, WorkerSlot] = {}
        # request id -> (gateway identity, worker id)
        self.owner: dict[str, tuple[bytes, int]] = {}
        self.step_counter = 0
        self.on_front = {P.AddRequest: self.add_request, P.AbortRequests: self.abort_requests, P.Ping: self.ping}
        self.on_back = {P.WorkerReady: self.worker_ready, P.StepOutput: self.step_output, P.Heartbeat: self.heartbeat}
        self._stop = asyncio.Event()

    # ------------------------------------------------------------------ gateway side
    async def add_request(self, ident: bytes, msg: P.AddRequest) -> None:
        alive = {wid: slot.scheduler for wid, slot in self.workers.items()}
        if not alive:
            await self._send_front(ident, P.Rejected(request_id=msg.request_id, reason="no worker is ready",
                                                     retryable=True))
            return
        if msg.request_id in self.owner:
            await self._send_front(ident, P.Rejected(request_id=msg.request_id, reason="duplicate request id",
                                                     retryable=False))
            return
        wid = pick_worker(alive, msg.prompt_token_ids)
        why = self.workers[wid].scheduler.reject_reason(msg)
        if why is not None:  # can never run (too long for the context or the pool): a 400, not an engine error
            await self._send_front(ident, P.Rejected(request_id=msg.request_id, reason=why, retryable=False))
            return
        self.owner[msg.request_id] = (ident, wid)
        self.workers[wid].scheduler.add_request(msg)
        await self.kick(wid)

    async def abort_requests(self, ident: bytes, msg: P.AbortRequests) -> None:
        by_worker: dict[int, list[str]] = {}
        for rid in msg.request_ids:
            if rid in self.owner:
                by_worker.setdefault(self.owner[rid][1], []).append(rid)
        for wid, rids in by_worker.items():
            await self.emit(self.workers[wid].scheduler.abort_requests(rids))
            await self.kick(wid)

    async def ping(self, ident: bytes, msg: P.Ping) -> None:
        await self._send_front(ident, P.Pong(nonce=msg.nonce, workers_alive=len(self.workers), stats=self.stats()))

    def stats(self) -> P.EngineStats:
        total = P.EngineStats()
        for slot in self.workers.values():
            s = slot.scheduler.stats()
            for name in P.EngineStats.__struct_fields__:
                setattr(total, name, getattr(total, name) + getattr(s, name))
        return total

    # ------------------------------------------------------------------ worker side
    async def worker_ready(self, ident: bytes, msg: P.WorkerReady) -> None:
        if msg.protocol_version != P.PROTOCOL_VERSION:
            log.error("worker %d speaks protocol %d, sidecar %d: ignored", msg.worker_id, msg.protocol_version,
                      P.PROTOCOL_VERSION)
            return
        if msg.worker_id in self.workers:
            await self.worker_lost(msg.worker_id, "worker restarted")
        sched = Scheduler(self.cfg, msg.num_blocks, msg.block_size, msg.max_model_len)
        self.workers[msg.worker_id] = WorkerSlot(msg.worker_id, ident, sched)
        log.info("worker %d ready: %s, %d KV blocks of %d tokens, max_model_len %d", msg.worker_id, msg.model,
                 msg.num_blocks, msg.block_size, msg.max_model_len)

    async def step_output(self, ident: bytes, msg: P.StepOutput) -> None:
        slot = self.workers.get(msg.worker_id)
        if slot is None or slot.identity != ident:
            log.warning("step output from unknown worker %d dropped", msg.worker_id)
            return
        slot.last_seen = time.monotonic()
        if msg.step in slot.stale:  # scheduled before a fail_all(): its requests are gone
            slot.stale.discard(msg.step)
            return
        if not slot.in_flight or msg.step != slot.in_flight[0]:
            expected = slot.in_flight[0] if slot.in_flight else None
            log.error("worker %d returned step %d, expected %s: failing its requests", msg.worker_id, msg.step,
                      expected)
            await self.fail_worker(slot, f"worker {msg.worker_id} returned step {msg.step}, expected {expected}")
            return
        slot.in_flight.popleft()
        if msg.error is not None:
            log.error("worker %d failed step %d: %s", msg.worker_id, msg.step, msg.error)
            await self.fail_worker(slot, f"worker error: {msg.error.splitlines()[-1]}")
            return
        await self.emit(slot.scheduler.update(msg, time.monotonic()))
        await self.kick(msg.worker_id)

    async def fail_worker(self, slot: WorkerSlot, error: str) -> None:
        """ERROR for all of the worker's requests; outputs of the steps it still has queued are dropped."""
        slot.stale.update(slot.in_flight)
        slot.in_flight.clear()
        await self.emit(slot.scheduler.fail_all(error))

    async def heartbeat(self, ident: bytes, msg: P.Heartbeat) -> None:
        slot = self.workers.get(msg.worker_id)
        if slot is not None:
            slot.last_seen = time.monotonic()

    async def worker_lost(self, worker_id: int, why: str) -> None:
        slot = self.workers.pop(worker_id, None)
        if slot is None:  # already handled (two sends failed at once)
            return
        log.error("worker %d lost (%s): failing its %d requests", worker_id, why, slot.scheduler.num_unfinished)
        await self.emit(slot.scheduler.fail_all(f"worker {worker_id} lost: {why}"))

    async def kick(self, worker_id: int) -> None:
        """Keep up to max_inflight_steps steps at the worker while there is work (1 without async scheduling).

        The worker runs them in order and appends its own sampled tokens, so step N+1, scheduled before
        N's output is back, can already decode the token N samples.
        """
        while True:
            slot = self.workers.get(worker_id)  # re-read: a send may yield to a handler that replaced the worker
            if slot is None or len(slot.in_flight) >= slot.scheduler.max_inflight_steps:
                return
            step = slot.scheduler.schedule(time.monotonic())
            if step is None:
                return
            slot.in_flight.append(step.step)
            try:  # sends queue in order on the socket, so concurrent kicks keep the step order
                await self.back.send_multipart([slot.identity, P.encode(step)])
            except zmq.ZMQError as exc:  # the worker's socket is gone (ROUTER_MANDATORY)
                await self.worker_lost(worker_id, f"send failed: {exc}")
                return

    # ------------------------------------------------------------------ output
    async def emit(self, deltas: list[P.TokenDelta]) -> None:
        """Send deltas to the gateways that own them, one TokenBatch per gateway."""
        if not deltas:
            return
        by_gateway: dict[bytes, list[P.TokenDelta]] = {}
        for d in deltas:
            owner = self.owner.get(d.request_id)
            if owner is None:
                continue
            by_gateway.setdefault(owner[0], []).append(d)
            if d.finish_reason is not None:
                del self.owner[d.request_id]
        self.step_counter += 1
        now = time.time()
        for ident, ds in by_gateway.items():
            await self._send_front(ident, P.TokenBatch(step=self.step_counter, deltas=ds, timestamp=now))

    async def _send_front(self, ident: bytes, msg) -> None:
        try:
            await self.front.send_multipart([ident, P.encode(msg)])
        except zmq.ZMQError as exc:  # that gateway went away; its requests are aborted below
            log.warning("gateway %r unreachable: %s", ident, exc)
            lost = [rid for rid, (g, _) in self.owner.items() if g == ident]
            if lost:
                await self.abort_requests(ident, P.AbortRequests(request_ids=lost))

    # ------------------------------------------------------------------ loops
    async def _serve(self, sock: zmq.asyncio.Socket, decoder, handlers: dict, peer: str) -> None:
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 2:
                log.error("dropped %d-frame message from a %s", len(frames), peer)
                continue
            ident, frame = frames
            msg = transport.try_decode(decoder, frame, peer)
            if msg is None:
                continue
            try:
                await handlers[type(msg)](ident, msg)
            except Exception:  # a bug in one message's handling must not take the sidecar down
                log.exception("error handling %s from %s", type(msg).__name__, peer)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stop.set)
        tasks = [asyncio.create_task(self._serve(self.front, self.front_decoder, self.on_front, "gateway")),
                 asyncio.create_task(self._serve(self.back, self.back_decoder, self.on_back, "worker"))]
        log.info("batcher listening on %s (gateways) and %s (workers)", self.cfg.batcher_address,
                 self.cfg.worker_address)
        await self._stop.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.close()

    def close(self) -> None:
        self.front.close()
        self.back.close()
        self.ctx.term()
        for address in (self.cfg.batcher_address, self.cfg.worker_address):
            path = transport.ipc_path(address)
            if path and os.path.exists(path):
                os.unlink(path)


def run(cfg: BatcherConfig) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(Batcher(cfg).run())
