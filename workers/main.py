"""The worker process: one per GPU. Connects to the sidecar, announces itself, runs steps.

Owns the socket loop only; the model, KV pool and sampling live in workers.runner.
Blocking and single-threaded on purpose: one step at a time, the GPU is the bottleneck.
Liveness (docs/reliability.md): a Heartbeat every HEARTBEAT_S while idle; a sidecar that does
not know this worker (it restarted) answers with Reannounce, and the worker then forgets every
request and registers again with WorkerReady. ZeroMQ reconnects to a restarted sidecar by itself.
"""

from __future__ import annotations

import logging
import signal
import traceback

import zmq

from batcher import protocol as P
from batcher import transport
from workers.config import WorkerConfig

log = logging.getLogger("laneserve.worker")
HEARTBEAT_S = 0.5


def run(cfg: WorkerConfig) -> None:
    from workers.parallel import TPGroup
    from workers.runner import ModelRunner  # heavy import after argument parsing

    tp = TPGroup(cfg) if cfg.tensor_parallel_size > 1 else None  # this is rank 0; it starts ranks 1..T-1
    runner = ModelRunner(cfg)
    ctx = zmq.Context()
    sock = transport.connect(ctx, zmq.DEALER, cfg.worker_address, identity=f"worker-{cfg.worker_id}".encode(),
                             curve_server_public_key=cfg.curve_server_public_key,
                             curve_client_secret_key=cfg.curve_client_secret_key)
    decoder = P.decoder(P.BatcherToWorker)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(True))
    ready = P.encode(P.WorkerReady(worker_id=cfg.worker_id, num_blocks=runner.num_blocks,
                                   block_size=runner.block_size, max_model_len=runner.max_model_len,
                                   protocol_version=P.PROTOCOL_VERSION, model=runner.model_name,
                                   vocab_size=runner.model_config.vocab_size))
    sock.send(ready)
    log.info("worker %d ready: %d KV blocks", cfg.worker_id, runner.num_blocks)
    try:
        while not stopping:
            if not sock.poll(int(HEARTBEAT_S * 1000)):
                sock.send(P.encode(P.Heartbeat(worker_id=cfg.worker_id)))
                continue
            msg = transport.try_decode(decoder, sock.recv(), "sidecar")
            if msg is None:
                continue
            if tp is not None:
                tp.send(msg)  # the other ranks run every step too (workers/parallel.py)
            if isinstance(msg, P.Shutdown):
                break
            if isinstance(msg, P.Reannounce):  # a new sidecar: none of our requests exist there
                log.warning("worker %d re-registering with the sidecar: %s", cfg.worker_id, msg.reason)
                runner.reset()
                sock.send(ready)
                continue
            sock.send(P.encode(execute(runner, msg, cfg.worker_id)))
    finally:
        sock.close()
        ctx.term()
        if tp is not None:
            tp.close()


def execute(runner, step: P.StepInput, worker_id: int) -> P.StepOutput:
    """Run one step; an exception fails the step (the sidecar fails its requests), not the worker."""
    try:
        return runner.execute(step)
    except Exception:
        log.exception("step %d failed", step.step)
        runner.reset()
        return P.StepOutput(step=step.step, worker_id=worker_id, error=traceback.format_exc(limit=4))
