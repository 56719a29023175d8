"""The batcher's asyncio loop: the only place where transport meets scheduling.

inputs (gateway ROUTER, worker ROUTER) -> Scheduler.schedule() -> StepInput to the
worker -> StepOutput -> Scheduler.update() -> TokenBatch to each gateway.
One Scheduler per worker, each owning that worker's KV block pool; batcher.router
picks the worker for a new request. With --async-scheduling each worker has up to
two steps in flight: the next one waits in the worker's socket while it runs the
current one, so the batcher's work and the round trip are off the GPU's path.

Reliability (docs/reliability.md): a worker is lost when its connection closes (socket
monitor, matched to the worker by the connection's fd) or it is silent for --worker-timeout;
its requests then fail (ERROR delta) or, with --on-worker-loss requeue, are recomputed once on
another live worker from the original AddRequest plus the tokens already streamed. A worker the
batcher does not know (after a batcher restart) is told to Reannounce. Every frame from a peer
is decoded against the receiving socket's Union and range-checked before it is acted on; new
requests beyond --max-waiting-requests per worker are Rejected as retryable.
Must not import torch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import signal
import time
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from batcher.config import BatcherConfig, load_warm_prefixes
from batcher.cost_model import CostModel, default_cost_model
from batcher.grammar import GrammarError, Grammars, follow
from batcher.router import pick_worker
from batcher.scheduler import LANES, Scheduler, StepFailed, StepOrderError
from batcher.slo import SloPolicy
from batcher.spec import SpecPolicy
from batcher.trace import StepTrace
from laneserve.gcheap import freeze_startup_heap
from laneserve.sampling import MAX_PRIORITY, check_sampling, check_slo_target
from laneserve.wire import protocol as P
from laneserve.wire import transport

log = logging.getLogger("laneserve.batcher")
TICK_S = 0.25  # period of the silent-worker check
COST_MODEL_EVERY_S = 10.0  # --cost-model-out is rewritten this often
REANNOUNCE_EVERY_S = 1.0  # at most one Reannounce per unknown peer identity per second
MAX_BLOCKS, MAX_BLOCK_SIZE, MAX_LEN = 1 << 24, 1024, 1 << 24  # sanity bounds on a WorkerReady


@dataclass
class WorkerSlot:
    worker_id: int
    identity: bytes
    scheduler: Scheduler  # also the judge of each StepOutput's place in the order of the steps in flight
    last_seen: float = field(default_factory=time.monotonic)
    vocab_size: int = 0  # 0 = unknown (token ids are not range-checked)
    wake: asyncio.TimerHandle | None = None  # --schedule-lead-ms: the kick() that composes the next step late


GAUGES = ("num_running", "num_waiting", "kv_blocks_total", "kv_blocks_free")  # EngineStats' fields that are not counts
COUNTERS = tuple(name for name in P.EngineStats.__struct_fields__ if name not in GAUGES)


def _add_stats(total: P.EngineStats, s: P.EngineStats, fields: tuple[str, ...]) -> None:
    """total += s, field by field (a histogram's buckets one by one)."""
    for name in fields:
        mine, theirs = getattr(total, name), getattr(s, name)
        if isinstance(theirs, list):
            setattr(total, name, [a + b for a, b in zip(mine, theirs)] if mine else list(theirs))
        else:
            setattr(total, name, mine + theirs)


class Batcher:
    def __init__(self, cfg: BatcherConfig):
        self.cfg = cfg
        self.ctx = zmq.asyncio.Context()
        if cfg.on_worker_loss not in ("fail", "requeue"):
            raise SystemExit(f"--on-worker-loss must be fail or requeue, got {cfg.on_worker_loss!r}")
        if cfg.lanes not in LANES:
            raise SystemExit(f"--lanes must be one of {', '.join(LANES)}, got {cfg.lanes!r}")
        try:  # the policy's settings, the cost model and the warm prefixes, checked before anything listens
            SloPolicy(cfg)
            # read once: a worker that (re)starts later gets the same ones, whatever became of the file since
            self.warm_prefixes = load_warm_prefixes(cfg.warm_prefix) if cfg.warm_prefix else []
            SpecPolicy(cfg.speculative, cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            # the scheduler's prior per lanes (a worker's, with --lanes auto, known when it is ready)
            self.cost_prior = {lanes: CostModel.load(cfg.cost_model or default_cost_model(lanes))
                               for lanes in ("mixed", "streams")}
        except (ValueError, OSError, KeyError, TypeError) as exc:
            raise SystemExit(f"batcher: {exc}") from None
        try:
            self.trace = StepTrace(cfg.step_trace) if cfg.step_trace else None  # --step-trace (batcher/trace.py)
        except OSError as exc:
            raise SystemExit(f"batcher: --step-trace {cfg.step_trace}: {exc}") from None
        key = cfg.curve_server_secret_key
        self.auth = self._start_auth()  # before binding: no handshake may slip past the key list
        self.front = transport.bind(self.ctx, zmq.ROUTER, cfg.batcher_address, key)
        self.back = transport.bind(self.ctx, zmq.ROUTER, cfg.worker_address, key)
        self.back_monitor = self.back.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.fd_of: dict[bytes, int] = {}  # worker identity -> fd of the connection it last spoke on
        self.reannounced: dict[bytes, float] = {}  # unknown worker identity -> when it was told to Reannounce
        self.requeue = cfg.on_worker_loss == "requeue"
        self.originals: dict[str, tuple[P.AddRequest, list[int]]] = {}  # requeue: request, tokens emitted
        self.requeued: set[str] = set()  # recomputed once already: a second loss fails them
        # requeue with no live worker: request id -> (the request to re-add, its matcher), until a worker is ready
        self.orphans: dict[str, tuple[P.AddRequest, object]] = {}
        self.front_decoder = P.decoder(P.GatewayToBatcher)
        self.back_decoder = P.decoder(P.WorkerToBatcher)
        self.workers: dict[int, WorkerSlot] = {}
        self.retired = P.EngineStats()  # the counters of lost workers' schedulers: the totals never go back
        # request id -> (gateway identity, worker id)
        self.owner: dict[str, tuple[bytes, int]] = {}
        self.step_counter = 0
        self.grammars = Grammars()  # structured output: the tokenizer and the compiled grammars
        self.compiling: set[str] = set()  # requests whose grammar compiles (an abort takes them out)
        self._tasks: set[asyncio.Task] = set()  # compiles' and timers' tasks (the loop holds only weak references)
        self.on_front = {P.AddRequest: self.add_request, P.AbortRequests: self.abort_requests, P.Ping: self.ping,
                         P.Vocabulary: self.vocabulary}
        self.on_back = {P.WorkerReady: self.worker_ready, P.StepOutput: self.step_output, P.Heartbeat: self.heartbeat}
        self._stop = asyncio.Event()

    # ------------------------------------------------------------------ gateway side
    async def add_request(self, ident: bytes, msg: P.AddRequest) -> None:
        if not msg.grammar:
            await self._add(ident, msg)
            return
        matcher = self.grammars.cached(msg.grammar)
        if matcher is not None:
            await self._add(ident, msg, matcher)
        elif msg.request_id in self.compiling:
            await self._send_front(ident, P.Rejected(request_id=msg.request_id, reason="duplicate request id",
                                                     retryable=False))
        else:  # compiled off the event loop; meanwhile other requests go on, and an abort drops it
            self.compiling.add(msg.request_id)
            task = asyncio.create_task(self._add_compiled(ident, msg, time.monotonic()))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _add_compiled(self, ident: bytes, msg: P.AddRequest, received: float) -> None:
        try:
            matcher = await self.grammars.matcher(msg.grammar)
        except Exception as exc:  # GrammarError, or llguidance failing on the tokenizer: an answer either way
            self.compiling.discard(msg.request_id)
            await self._send_front(ident, P.Rejected(request_id=msg.request_id, reason=f"grammar: {exc}",
                                                     retryable=False))
            return
        if msg.request_id in self.compiling:  # else aborted meanwhile
            self.compiling.discard(msg.request_id)
            await self._add(ident, msg, matcher, received)  # its queue time includes the compile

    async def vocabulary(self, ident: bytes, msg: P.Vocabulary) -> None:
        self.grammars.set_vocabulary(msg)

    async def _add(self, ident: bytes, msg: P.AddRequest, grammar=None, received: float | None = None) -> None:
        alive = {wid: slot.scheduler for wid, slot in self.workers.items()}
        if not alive:
            await self._send_front(ident, P.Rejected(request_id=msg.request_id, reason="no worker is ready",
                                                     retryable=True))
            return
        if msg.request_id in self.owner:
            await self._send_front(ident, P.Rejected(request_id=msg.request_id, reason="duplicate request id",
                                                     retryable=False))
            return
        # can never run (malformed, too long for the context or the pool): a 400, not an engine error; only where no
        # worker can take it (workers' pools and vocabularies may differ), the first's reason
        why = {wid: invalid_request(msg, self.workers[wid].vocab_size) or s.reject_reason(msg)
               for wid, s in alive.items()}
        able = {wid: s for wid, s in alive.items() if why[wid] is None}
        if not able:
            reason = why[min(why)]
            log.warning("rejected request %.80r: %s", msg.request_id, reason)
            await self._send_front(ident, P.Rejected(request_id=msg.request_id, reason=reason, retryable=False))
            return
        wid = pick_worker(able, msg.prompt_token_ids)
        sched = self.workers[wid].scheduler
        cap = self.cfg.max_waiting_requests
        if cap and sched.stats().num_waiting >= cap:  # the least loaded worker is full: shed, don't queue
            await self._send_front(ident, P.Rejected(request_id=msg.request_id, retryable=True,
                                                     reason=f"{cap} requests already wait for a worker"))
            return
        shed = sched.add_request(msg, time.monotonic(), grammar, received)
        if shed is not None:  # predictive SLO admission: the others keep their SLO
            await self._send_front(ident, P.Rejected(request_id=msg.request_id, reason=shed, retryable=True))
            return
        self.owner[msg.request_id] = (ident, wid)
        if self.requeue:
            self.originals[msg.request_id] = (msg, [])
        if self.trace is not None:
            self.trace.added(msg.request_id, msg.arrival_time)
        await self.kick(wid)

    async def abort_requests(self, ident: bytes, msg: P.AbortRequests) -> None:
        by_worker: dict[int, list[str]] = {}
        held = [rid for rid in msg.request_ids if self.orphans.pop(rid, None) is not None]
        await self.emit([P.TokenDelta(rid, [], P.FinishReason.ABORT) for rid in held])
        for rid in msg.request_ids:
            self.compiling.discard(rid)
            if rid in self.owner:
                by_worker.setdefault(self.owner[rid][1], []).append(rid)
        for wid, rids in by_worker.items():
            await self.emit(self.workers[wid].scheduler.abort_requests(rids))
            await self.kick(wid)

    async def ping(self, ident: bytes, msg: P.Ping) -> None:
        await self._send_front(ident, P.Pong(nonce=msg.nonce, workers_alive=len(self.workers), stats=self.stats()))

    def stats(self) -> P.EngineStats:
        """The workers' schedulers' stats summed (a histogram's bucket counts bucket by bucket); the counters also
        count what lost workers did, so a restart never looks like a counter reset."""
        total = msgspec.structs.replace(self.retired)
        for slot in self.workers.values():
            _add_stats(total, slot.scheduler.stats(), P.EngineStats.__struct_fields__)
        return total

    # ------------------------------------------------------------------ worker side
    async def worker_ready(self, ident: bytes, msg: P.WorkerReady) -> None:
        if msg.protocol_version != P.PROTOCOL_VERSION:
            log.error("worker %d speaks protocol %d, batcher %d: ignored", msg.worker_id, msg.protocol_version,
                      P.PROTOCOL_VERSION)
            return
        if not (1 <= msg.num_blocks <= MAX_BLOCKS and 1 <= msg.block_size <= MAX_BLOCK_SIZE
                and 1 <= msg.max_model_len <= MAX_LEN and 0 <= msg.vocab_size <= MAX_LEN):
            log.error("WorkerReady with out-of-range sizes ignored: %r", msg)
            return
        self.reannounced.pop(ident, None)
        if msg.worker_id in self.workers:
            await self.worker_lost(msg.worker_id, "worker restarted")
        lanes = self.cfg.lanes
        if lanes == "auto":
            lanes = "streams" if msg.concurrent_lanes else "mixed"
        speculative = self.cfg.speculative
        if speculative not in ("", "off") and not msg.speculative:
            log.warning("worker %d cannot verify drafts (tensor parallel): no speculative decoding there",
                        msg.worker_id)
            speculative = "off"
        elif speculative == "draft" and not msg.draft_model:
            log.warning("worker %d has no --draft-model: no speculative decoding there", msg.worker_id)
            speculative = "off"
        if self.cfg.schedule_lead_ms and (lanes == "streams" or not self.cfg.async_scheduling):
            log.warning("worker %d: --schedule-lead-ms applies to mixed lanes with --async-scheduling only: "
                        "ignored there", msg.worker_id)
        warm = [ids for ids in self.warm_prefixes if not msg.vocab_size or all(0 <= t < msg.vocab_size for t in ids)]
        if len(warm) < len(self.warm_prefixes):
            log.warning("worker %d: %d of the %d warm prefixes hold ids outside its vocabulary (%d): not prefilled",
                        msg.worker_id, len(self.warm_prefixes) - len(warm), len(self.warm_prefixes), msg.vocab_size)
        sched = Scheduler(dataclasses.replace(self.cfg, lanes=lanes, speculative=speculative), msg.num_blocks,
                          msg.block_size, msg.max_model_len, warm_prefixes=warm, cost=self.cost_prior[lanes],
                          grammars=self.grammars, draft_size=msg.draft_size)
        self.workers[msg.worker_id] = WorkerSlot(msg.worker_id, ident, sched, vocab_size=msg.vocab_size)
        if not self.owner:  # (nothing serving yet: the scheduler's block table is start-up heap)
            freeze_startup_heap()
        log.info("worker %d ready: %s, %d KV blocks of %d tokens, max_model_len %d, %s lanes", msg.worker_id,
                 msg.model, msg.num_blocks, msg.block_size, msg.max_model_len, lanes)
        if self.orphans:
            await self._adopt(msg.worker_id)

    async def _adopt(self, wid: int) -> None:
        """A lost worker's requests that waited for a live one (requeue, no worker left) go to this one."""
        failed = [P.TokenDelta(rid, [], P.FinishReason.ERROR, error=f"requeue failed: worker {wid} cannot take it")
                  for rid, (again, grammar) in self.orphans.items() if not self._place(wid, rid, again, grammar)]
        log.warning("worker %d ready: %d requests that waited for a worker resume on it", wid, len(self.orphans))
        self.orphans.clear()
        await self.emit(failed)
        await self.kick(wid)

    async def step_output(self, ident: bytes, msg: P.StepOutput) -> None:
        slot = self.workers.get(msg.worker_id)
        if slot is None or slot.identity != ident:
            log.warning("step output from unknown worker %d dropped", msg.worker_id)
            await self.reannounce(ident, "step output from a worker the batcher does not know")
            return
        slot.last_seen = time.monotonic()
        # The worker's K/V state is unknown after a failed step or one out of order: all its requests fail (the
        # outputs of its other steps in flight are then void: update() drops them).
        fenced = bool(slot.scheduler.fence)
        try:
            deltas = slot.scheduler.update(msg, time.monotonic())
        except (StepFailed, StepOrderError) as exc:
            log.error("worker %d, step %d: %s: failing its requests", msg.worker_id, msg.step, msg.error or exc)
            await self.emit(slot.scheduler.fail_all(str(exc), worker_failed=msg.error is not None))
            return
        if deltas is not None:  # None: a void step's output, nothing changed
            if self.trace is not None:
                self.trace.write("out", worker=msg.worker_id, step=msg.step, execute_ms=msg.execute_time * 1000.0,
                                 launch_ms=msg.launch_time * 1000.0, idle_ms=msg.idle_time * 1000.0,
                                 **({"draft_ms": msg.draft_time * 1000.0} if msg.draft_time > 0.0 else {}))
                self.trace.first_tokens(msg.worker_id, msg.step, deltas)
            await self.emit(deltas)
        if deltas is not None or fenced:  # (a void step back may lift a fence: scheduler.fail_all)
            await self.kick(msg.worker_id)

    async def heartbeat(self, ident: bytes, msg: P.Heartbeat) -> None:
        slot = self.workers.get(msg.worker_id)
        if slot is not None and slot.identity == ident:
            slot.last_seen = time.monotonic()
        else:  # the batcher restarted, or declared this worker lost: it must register again
            await self.reannounce(ident, "heartbeat from a worker the batcher does not know")

    async def reannounce(self, ident: bytes, why: str) -> None:
        now = time.monotonic()
        if now - self.reannounced.get(ident, -math.inf) < REANNOUNCE_EVERY_S:
            return
        if len(self.reannounced) > 1024:  # rogue identities must not grow this without bound
            self.reannounced = {k: t for k, t in self.reannounced.items() if now - t < REANNOUNCE_EVERY_S}
        self.reannounced[ident] = now
        log.info("asking %r to re-register: %s", ident, why)
        try:
            await self.back.send_multipart([ident, P.encode(P.Reannounce(reason=why))])
        except zmq.ZMQError as exc:
            log.warning("Reannounce to %r not sent: %s", ident, exc)

    async def worker_lost(self, worker_id: int, why: str) -> None:
        slot = self.workers.pop(worker_id, None)
        if slot is None:  # already handled (two sends failed at once)
            return
        if slot.wake is not None:
            slot.wake.cancel()
        n = slot.scheduler.num_unfinished
        _add_stats(self.retired, slot.scheduler.stats(), COUNTERS)
        deltas = slot.scheduler.fail_all(f"worker {worker_id} lost: {why}")
        kicked: set[int] = set()
        if self.requeue:
            kept = []
            for d in deltas:
                wid = self._requeue(d.request_id) if d.finish_reason == P.FinishReason.ERROR else None
                if wid is None:
                    kept.append(d)
                elif wid >= 0:
                    kicked.add(wid)
            deltas = kept
        # an error when requests were on it; a warning otherwise (e.g. workers stopping first at shutdown)
        log.log(logging.ERROR if n else logging.WARNING, "worker %d lost (%s): %d requests, %d requeued (%d wait for "
                "a worker), %d failed", worker_id, why, n, n - len(deltas), len(self.orphans), len(deltas))
        await self.emit(deltas)
        for wid in kicked:
            await self.kick(wid)

    def _requeue(self, rid: str) -> int | None:
        """Re-add a lost request to a live worker as prompt + the tokens already streamed (recomputed),
        once; with no live worker it waits for one (the gateway's --request-timeout aborts it if none comes).
        Returns the worker id, -1 (waits), or None (not requeueable: the caller fails it)."""
        entry = self.originals.get(rid)
        if entry is None or rid in self.requeued or rid not in self.owner:
            return None
        orig, done = entry
        params = orig.params
        left = params.max_tokens - len(done)
        if left < 1 and params.max_tokens:  # (max_tokens 0 scores its prompt: run again, as it was)
            return None
        params = msgspec.structs.replace(params, max_tokens=left, min_tokens=max(0, params.min_tokens - len(done)))
        again = msgspec.structs.replace(orig, prompt_token_ids=orig.prompt_token_ids + done, params=params)
        grammar = None
        if orig.grammar:  # a matcher at the tokens streamed (compiled already: this one was running)
            try:
                grammar = self.grammars.cached(orig.grammar) or self.grammars.compile(orig.grammar)
                if any(follow(grammar, t) for t in done):
                    return None
            except GrammarError:
                return None
        self.requeued.add(rid)
        if not self.workers:
            self.orphans[rid] = (again, grammar)
            return -1
        able = {w: slot.scheduler for w, slot in self.workers.items() if slot.scheduler.reject_reason(again) is None}
        if not able:  # (the others' pools may be larger than the lost worker's replacement's)
            return None
        wid = pick_worker(able, again.prompt_token_ids)
        return wid if self._place(wid, rid, again, grammar) else None

    def _place(self, wid: int, rid: str, again: P.AddRequest, grammar) -> bool:
        """Add a lost request's continuation to worker wid; False if it cannot take it (too long for its pool, or
        shed by SLO admission): the caller fails it."""
        sched = self.workers[wid].scheduler
        if sched.reject_reason(again) is not None or sched.add_request(again, time.monotonic(), grammar) is not None:
            return False
        self.owner[rid] = (self.owner[rid][0], wid)
        return True

    async def kick(self, worker_id: int) -> None:
        """Keep up to max_inflight_steps steps at the worker while there is work (1 without async scheduling).

        The worker runs them in order and appends its own sampled tokens, so step N+1, scheduled before
        N's output is back, can already decode the token N samples.
        """
        while True:
            slot = self.workers.get(worker_id)  # re-read: a send may yield to a handler that replaced the worker
            if slot is None:
                return
            step = slot.scheduler.schedule(time.monotonic())  # None also when max_inflight_steps are in flight
            if step is None:
                if slot.scheduler.wake_at is not None:  # compose it later (--schedule-lead-ms): kick again then
                    if slot.wake is not None:
                        slot.wake.cancel()
                    slot.wake = asyncio.get_running_loop().call_later(
                        max(0.0, slot.scheduler.wake_at - time.monotonic()), self._wake, slot)
                return
            if self.trace is not None:
                entry = slot.scheduler.in_flight[-1]
                self.trace.write("step", worker=worker_id, step=step.step, lane=step.lane,
                                 predicted_ms=round(entry.predicted, 3), features=list(entry.features))
            try:  # sends queue in order on the socket, so concurrent kicks keep the step order
                await self.back.send_multipart([slot.identity, P.encode(step)])
            except zmq.ZMQError as exc:  # the worker's socket is gone (ROUTER_MANDATORY)
                await self.worker_lost(worker_id, f"send failed: {exc}")
                return

    def _wake(self, slot: WorkerSlot) -> None:
        slot.wake = None
        if self.workers.get(slot.worker_id) is slot:  # (not lost or replaced since)
            task = asyncio.create_task(self.kick(slot.worker_id))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

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
                if self.trace is not None:
                    self.trace.waiting_first.discard(d.request_id)
                if self.requeue:
                    self.originals.pop(d.request_id, None)
                    self.requeued.discard(d.request_id)
            elif self.requeue and d.new_token_ids and d.request_id in self.originals:
                self.originals[d.request_id][1].extend(d.new_token_ids)
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
        track_fd = sock is self.back
        while True:
            frames = await sock.recv_multipart(copy=False)
            if len(frames) != 2:
                log.error("dropped %d-frame message from a %s", len(frames), peer)
                continue
            ident, frame = frames[0].bytes, frames[1]
            msg = transport.try_decode(decoder, frame.buffer, peer)
            if msg is None:
                continue
            if track_fd:  # which connection this worker speaks on: its disconnect event names the fd
                self.fd_of[ident] = frame.get(zmq.SRCFD)
            try:
                await handlers[type(msg)](ident, msg)
            except Exception:  # a bug in one message's handling must not take the batcher down
                log.exception("error handling %s from %s", type(msg).__name__, peer)

    async def _watch_disconnects(self) -> None:
        """A worker whose connection closed (process died, ZMTP heartbeat timed out) is lost at once."""
        while True:
            event = await recv_monitor_message(self.back_monitor)
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            fd = int(event["value"])
            gone = {ident for ident, f in self.fd_of.items() if f == fd}
            for ident in gone:  # forgotten, so identities of past peers do not pile up
                del self.fd_of[ident]
            for slot in list(self.workers.values()):
                if slot.identity in gone:
                    await self.worker_lost(slot.worker_id, "its connection closed")

    async def _watch_silence(self) -> None:
        """Backstop for a worker that is connected but stuck: silent for --worker-timeout is lost."""
        limit = self.cfg.worker_timeout
        if limit <= 0:
            return
        while True:
            await asyncio.sleep(TICK_S)  # a timer tick, not synchronisation
            now = time.monotonic()
            for slot in list(self.workers.values()):
                if now - slot.last_seen > limit:
                    await self.worker_lost(slot.worker_id, f"silent for {now - slot.last_seen:.1f}s")

    def _start_auth(self):
        """ZAP authenticator (when client certificates are restricted): a thread on a shadow of our
        context, so it serves our sockets' handshakes whether or not an event loop runs yet."""
        if not (self.cfg.curve_server_secret_key and self.cfg.curve_client_keys_dir):
            return None
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(zmq.Context.shadow(self.ctx.underlying))
        auth.start()
        auth.configure_curve(domain="*", location=self.cfg.curve_client_keys_dir)
        return auth

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stop.set)
        tasks = [asyncio.create_task(self._serve(self.front, self.front_decoder, self.on_front, "gateway")),
                 asyncio.create_task(self._serve(self.back, self.back_decoder, self.on_back, "worker")),
                 asyncio.create_task(self._watch_disconnects()),
                 asyncio.create_task(self._watch_silence()),
                 asyncio.create_task(self._write_cost_model())]
        log.info("batcher listening on %s (gateways) and %s (workers)", self.cfg.batcher_address,
                 self.cfg.worker_address)
        await self._stop.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.save_cost_model()
        self.close()

    def save_cost_model(self) -> None:
        """Worker 0's (else the lowest id's) online-fitted step-cost model to --cost-model-out."""
        if not (self.cfg.cost_model_out and self.workers):
            return
        wid = min(self.workers)
        fit = self.workers[wid].scheduler.fit
        fit.model.save(self.cfg.cost_model_out, lanes="streams" if self.workers[wid].scheduler.streams else "mixed",
                       _comment=(
            f"fitted online by the batcher from worker {wid}'s step times over its last {len(fit.rows)} of "
            f"{fit.steps} timed steps (batcher/cost_model.py), and h from {fit.gaps} host gaps; a, b, c, d, e, g, h in "
            f"ms; samples: that window as "
            f"[prefill_tokens, attention_pairs, decode_seqs, kv_tokens_read, mixed, measured ms]"),
            samples=fit.samples())

    async def _write_cost_model(self) -> None:
        if not self.cfg.cost_model_out:
            return
        while True:
            await asyncio.sleep(COST_MODEL_EVERY_S)  # a timer, not synchronisation
            try:
                self.save_cost_model()
            except OSError as exc:
                log.warning("could not write --cost-model-out: %s", exc)

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
        if self.auth is not None:
            self.auth.stop()
        self.back.disable_monitor()
        self.back_monitor.close()
        self.front.close()
        self.back.close()
        self.ctx.term()
        for address in (self.cfg.batcher_address, self.cfg.worker_address):
            path = transport.ipc_path(address)
            if path and os.path.exists(path):
                os.unlink(path)


def invalid_request(msg: P.AddRequest, vocab_size: int) -> str | None:
    """Checks on a request from a peer (the gateway made them, a rogue peer did not): values that would fail or
    stall a worker's step, and with it every request in that step."""
    ids = msg.prompt_token_ids
    if not 0 < len(msg.request_id) <= 256:
        return "request id must have 1 to 256 characters"
    if ids and (min(ids) < 0 or (vocab_size and max(ids) >= vocab_size)):
        return f"prompt token ids must be in [0, {vocab_size or 'vocab size'})"
    if abs(msg.priority) > MAX_PRIORITY:
        return f"priority must be within +-{MAX_PRIORITY}"
    why = check_slo_target("slo_ttft_ms", msg.slo_ttft_ms) or check_slo_target("slo_tpot_ms", msg.slo_tpot_ms)
    if why:
        return why
    bad = check_sampling(msgspec.structs.asdict(msg.params), vocab_size)
    return None if bad is None else bad[1]


def run(cfg: BatcherConfig) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(Batcher(cfg).run())
