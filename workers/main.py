"""The worker process: one per GPU. Connects to the batcher, announces itself, runs steps.

Owns the socket loop only; the model, KV pool and sampling live in workers.runner.
Blocking and single-threaded on purpose, the GPU is the bottleneck. With overlapped steps
(ModelRunner.submit; --overlap-steps) at most one step is in flight: while it runs the loop polls
the socket and the step's event in turn, and a StepInput that comes first (queued at once, or sent
late by --schedule-lead-ms) is launched before the one in flight is collected and reported (an eager step's
launch reports it from between its layers once it is done: ModelRunner.publish). With two
lanes on their own streams (--lanes streams) one step of each lane may be in flight, polled the same way.
Liveness (docs/reliability.md): a Heartbeat every HEARTBEAT_S while idle, and --liveness-file's mtime set as
often while the loop runs (the launcher restarts a worker whose loop stopped); a batcher that does
not know this worker (it restarted) answers with Reannounce, and the worker then forgets every
request and registers again with WorkerReady. ZeroMQ reconnects to a restarted batcher by itself.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback

import zmq

from laneserve.gcheap import freeze_startup_heap
from laneserve.wire import protocol as P
from laneserve.wire import transport
from workers.config import WorkerConfig
from workers.runner import ModelRunner
from workers.tp_group import TPGroup

log = logging.getLogger("laneserve.worker")
HEARTBEAT_S = 0.5


def run(cfg: WorkerConfig) -> None:
    tp = TPGroup(cfg) if cfg.tensor_parallel_size > 1 else None  # this is rank 0; it starts ranks 1..T-1
    try:
        runner = ModelRunner(cfg)
    except (ValueError, OSError) as exc:  # a bad setting or file: one line (the launcher says the worker exited)
        if tp is not None:
            tp.close()
        raise SystemExit(f"laneserve worker {cfg.worker_id}: {exc}") from None
    frozen = freeze_startup_heap()  # (the model, the pool, the graphs: laneserve/gcheap.py)
    ctx = zmq.Context()
    sock = transport.connect(ctx, zmq.DEALER, cfg.worker_address, identity=f"worker-{cfg.worker_id}".encode(),
                             curve_server_public_key=cfg.curve_server_public_key,
                             curve_client_secret_key=cfg.curve_client_secret_key)
    decoder = P.decoder(P.BatcherToWorker)

    def send(outs: list[P.StepOutput]) -> None:
        for out in outs:
            sock.send(P.encode(out))

    runner.publish = send  # (an eager step's launch publishes the step in flight before it once done)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(True))
    # A signal wakes the idle poll below at once (its byte on this pipe), not after the heartbeat's HEARTBEAT_S.
    wake, wake_w = os.pipe()
    os.set_blocking(wake, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(wake, zmq.POLLIN)
    ready = P.encode(P.WorkerReady(worker_id=cfg.worker_id, num_blocks=runner.num_blocks,
                                   block_size=runner.block_size, max_model_len=runner.max_model_len,
                                   protocol_version=P.PROTOCOL_VERSION, model=runner.model_name,
                                   vocab_size=runner.model_config.vocab_size,
                                   concurrent_lanes=bool(runner.lane_streams),
                                   speculative=runner.tp_size == 1, draft_model=cfg.draft_model,
                                   draft_size=runner.draft_size()))
    sock.send(ready)
    log.info("worker %d ready: %d KV blocks; %d start-up objects frozen", cfg.worker_id, runner.num_blocks, frozen)
    alive = Liveness(cfg.liveness_file)
    try:
        while not stopping:
            alive.touch()
            if runner.in_flight and not sock.poll(0):  # no step queued behind the one in flight: report it once done,
                # polling the socket meanwhile, so a step that comes first still launches behind it
                send(finish(runner, cfg.worker_id))
                continue
            events = dict(poller.poll(int(HEARTBEAT_S * 1000)))
            if wake in events:  # a signal: its handler has run, and `stopping` says whether to go
                os.read(wake, 4096)
            elif sock not in events:
                sock.send(P.encode(P.Heartbeat(worker_id=cfg.worker_id)))
            if sock not in events:
                continue
            msg = transport.try_decode(decoder, sock.recv(), "batcher")
            if msg is None:
                continue
            if tp is not None:
                tp.send(msg)  # the other ranks run every step too (workers/tp_group.py)
            if isinstance(msg, P.Shutdown):
                break
            if isinstance(msg, P.Reannounce):  # a new batcher: none of our requests exist there
                log.warning("worker %d re-registering with the batcher: %s", cfg.worker_id, msg.reason)
                runner.reset()
                sock.send(ready)
                continue
            send(submit(runner, msg, cfg.worker_id))
    finally:
        alive.remove()  # (a launcher killed outright leaves its run dir to the next start, which removes empty ones)
        signal.set_wakeup_fd(-1)
        os.close(wake)
        os.close(wake_w)
        sock.close()
        ctx.term()
        if tp is not None:
            tp.close()


class Liveness:
    """Sets a file's mtime, at most every HEARTBEAT_S (a syscall per step would show at batch 1 on a GPU)."""

    def __init__(self, path: str):
        self.path, self.last = path, -HEARTBEAT_S
        if path:
            open(path, "a").close()

    def touch(self) -> None:
        now = time.monotonic()
        if self.path and now - self.last >= HEARTBEAT_S:
            self.last = now
            try:
                os.utime(self.path)
            except OSError:  # removed (a launcher's cleanup): recreated
                open(self.path, "a").close()

    def remove(self) -> None:
        if self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def submit(runner, step: P.StepInput, worker_id: int) -> list[P.StepOutput]:
    """Start one step; returns the outputs that are ready (in step order: the step that was in flight,
    then, without overlap, this one). An exception fails the steps it cut short (the batcher fails
    their requests), not the worker."""
    try:
        runner.submit(step)
        return runner.take_outputs()
    except Exception:
        log.exception("step %d failed", step.step)
        return _failed(runner, worker_id, traceback.format_exc(limit=4), step.step)


def finish(runner, worker_id: int) -> list[P.StepOutput]:
    """The outputs of the steps in flight that are done already (no wait)."""
    try:
        runner.flush_ready()
        return runner.take_outputs()
    except Exception:
        log.exception("step in flight failed")
        return _failed(runner, worker_id, traceback.format_exc(limit=4))


def _failed(runner, worker_id: int, error: str, step: int | None = None) -> list[P.StepOutput]:
    done = runner.take_outputs()  # finished before the error: still valid
    lost = runner.abandon()
    if step is not None and step not in lost:
        lost.append(step)
    return done + [P.StepOutput(step=s, worker_id=worker_id, error=error) for s in lost]
