"""The tensor-parallel group: rank 0 starts ranks 1..T-1 and keeps them in step.

Owns how a TP group of T processes comes up, stays in step and goes down (docs/tensor_parallel.md).
Rank 0 is the worker process the batcher knows: it starts ranks 1..T-1 as child processes
(`TPGroup`), forwards every batcher message to them over a pipe before acting on it, and all
ranks run the same ModelRunner steps on identical request state. Sits above the runner (the
followers run one); the collectives the ranks use are workers/collectives.py's. Must not know
the model's math (what is sharded is workers/model/layers.py's business) or the batcher's socket
(workers/main.py).

Failure model: a step that fails the same way on every rank (bad input, a sampling error that
rank 0 signals through the token broadcast) fails only that step, on every rank. A rank that
dies or fails inside the forward leaves the group's collectives unmatched: rank 0 raises at its
next send (or the collective errors / times out) and exits, and the launcher restarts the group.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import traceback
from multiprocessing.connection import wait as wait_for_any

import torch
import torch.distributed as dist

from laneserve.modelspec import load_model_config
from laneserve.wire import protocol as P
from workers.collectives import MULTICAST_OFF, init_process_group, rank_device
from workers.loader import resolve_device
from workers.model.layers import check_shardable
from workers.runner import ModelRunner

log = logging.getLogger("laneserve.worker")


def _free_tcp_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


# ---------------------------------------------------------------------------------------- rank 0
class TPGroup:
    """Rank 0's handle on ranks 1..T-1: starts them, joins the process group, forwards messages.

    Construct before ModelRunner(cfg) (which needs the group); send() every batcher message
    before acting on it; close() at exit.
    """

    def __init__(self, cfg):
        self.size = cfg.tensor_parallel_size
        check_shardable(load_model_config(cfg.model), self.size)  # before anything is started
        device = resolve_device(cfg.device)
        if device.type == "cuda" and torch.cuda.device_count() < (device.index or 0) + self.size:
            raise ValueError(f"--tensor-parallel-size {self.size} needs {self.size} GPUs from {device}; "
                             f"{torch.cuda.device_count()} visible (CUDA_VISIBLE_DEVICES)")
        os.environ.update(MULTICAST_OFF)  # before the children start: they inherit the environment
        address = cfg.dist_init_address or _free_tcp_address()
        ctx = mp.get_context("spawn")  # never fork a process that may hold CUDA state
        self.pipes, self.procs = [], []
        self.closing = False
        for rank in range(1, self.size):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=follower_main, name=f"laneserve-tp-rank-{rank}", daemon=True,
                               args=(cfg, rank, address, recv, logging.getLogger().level))
            proc.start()
            recv.close()
            self.pipes.append(send)
            self.procs.append(proc)
        threading.Thread(target=self._exit_if_a_rank_dies, args=(list(self.procs),), daemon=True,
                         name="tp-watch").start()
        try:
            init_process_group(0, self.size, address, rank_device(device, 0))
        except BaseException:
            self.close()
            raise
        log.info("tensor-parallel group of %d ranks up (%s, %s)", self.size, dist.get_backend(), address)

    def _exit_if_a_rank_dies(self, procs) -> None:
        """A lost rank leaves rank 0 blocked in (or headed for) a collective that can never complete,
        at start-up too (the rendezvous waits for every rank). Exit at once instead; the launcher
        restarts the whole group (docs/reliability.md)."""
        sentinels = [p.sentinel for p in procs]
        ready = wait_for_any(sentinels)
        if self.closing:
            return
        rank = sentinels.index(ready[0]) + 1
        procs[rank - 1].join(5)  # the sentinel closes a moment before the process can be reaped
        log.critical("tensor-parallel rank %d exited with code %s: this worker exits too", rank,
                     procs[rank - 1].exitcode)
        logging.shutdown()
        os._exit(1)

    def send(self, msg) -> None:
        """Forward one batcher message (StepInput, Reannounce, Shutdown) to every other rank."""
        for rank, proc in enumerate(self.procs, 1):
            if not proc.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} exited with code {proc.exitcode}")
        frame = P.encode(msg)
        for conn in self.pipes:
            conn.send_bytes(frame)

    def close(self, timeout: float = 10.0) -> None:
        self.closing = True
        for conn in self.pipes:
            try:
                conn.send_bytes(P.encode(P.Shutdown()))
                conn.close()
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.pipes, self.procs = [], []
        if dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------- ranks 1..T-1
def _die_with_parent() -> None:
    """SIGTERM when rank 0 dies, even while this rank is blocked inside a collective (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


def follower_main(cfg, rank: int, address: str, conn, log_level: int) -> None:
    """Rank r >= 1: same runner, no socket. Runs every step rank 0 forwards; its outputs are dropped."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the group stops
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(name)s[tp{rank}] %(levelname)s %(message)s")
    init_process_group(rank, cfg.tensor_parallel_size, address, rank_device(resolve_device(cfg.device), rank))
    try:
        runner = ModelRunner(cfg, tp_rank=rank)
        follow(runner, conn)
    finally:
        dist.destroy_process_group()


def follow(runner, conn) -> None:
    decoder = P.decoder(P.BatcherToWorker)
    while True:
        try:
            msg = decoder.decode(conn.recv_bytes())
        except EOFError:  # rank 0 is gone
            return
        if isinstance(msg, P.Shutdown):
            return
        if isinstance(msg, P.Reannounce):
            runner.reset()
            continue
        try:
            runner.execute(msg)
        except Exception:  # rank 0 fails the same step (same state, or the failed-sample broadcast)
            log.error("step %d failed on this rank:\n%s", msg.step, traceback.format_exc(limit=4))
            runner.reset()
