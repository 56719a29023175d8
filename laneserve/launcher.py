"""`laneserve serve`: start sidecar, workers and gateway as child processes and supervise them.

Owns process lifetime only: private ipc:// socket directory, readiness (the
gateway's /health answering 200), SIGINT/SIGTERM forwarding, and a clean
shutdown that leaves no child process or socket file behind. A child that dies
takes the stack down with a clear message (recovery is a later feature).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from laneserve.config import to_argv

POLL_S = 0.1


@dataclass
class LauncherConfig:
    num_workers: int = field(default=0, metadata={"help": "workers to start; 0 = one per visible GPU, else one CPU worker"})
    startup_timeout: float = field(default=600.0, metadata={"help": "seconds to wait for the stack to become healthy"})
    shutdown_timeout: float = field(default=10.0, metadata={"help": "seconds each child gets to exit before SIGKILL"})


def _die_with_parent() -> None:
    """Children get SIGTERM if the launcher itself is killed (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


def visible_gpus() -> list[str]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d for d in env.split(",") if d.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")]


class Child:
    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None):
        self.name = name
        cmd = [sys.executable, "-m", "laneserve.cli", *argv]
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, start_new_session=True,
                                     preexec_fn=_die_with_parent)

    def exited(self) -> int | None:
        return self.proc.poll()

    def stop(self, timeout: float) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                print(f"laneserve: {self.name} did not exit in {timeout:.0f}s; killing it", file=sys.stderr)
                self.proc.kill()
                self.proc.wait()


def serve(lc: LauncherConfig, gw, bc, wc, log_level: str = "INFO") -> int:
    run_dir = tempfile.mkdtemp(prefix="laneserve-")
    default_front = type(bc)().batcher_address
    default_back = type(bc)().worker_address
    if bc.batcher_address == default_front:
        bc.batcher_address = gw.batcher_address = f"ipc://{run_dir}/batcher.sock"
    if bc.worker_address == default_back:
        bc.worker_address = wc.worker_address = f"ipc://{run_dir}/workers.sock"
    gw.batcher_address, wc.worker_address = bc.batcher_address, bc.worker_address

    gpus = [] if wc.device == "cpu" else visible_gpus()
    num_workers = lc.num_workers or max(1, len(gpus))
    common = ["--log-level", log_level]
    stopping: list[int] = []

    def on_signal(signum, _frame):
        stopping.append(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    children: list[Child] = []
    try:
        children.append(Child("batcher", [*common, "batcher", *to_argv(bc)]))
        for i in range(num_workers):
            env = {"CUDA_VISIBLE_DEVICES": gpus[i % len(gpus)]} if gpus else {}
            worker = dataclasses.replace(wc, worker_id=i)
            children.append(Child(f"worker {i}", [*common, "worker", *to_argv(worker)], env))
        children.append(Child("gateway", [*common, "gateway", *to_argv(gw)]))
        code = _supervise(children, gw, num_workers, lc.startup_timeout, stopping)
    finally:
        # Gateway first so it stops accepting and drains, then the engine.
        for child in reversed(children):
            child.stop(lc.shutdown_timeout)
        shutil.rmtree(run_dir, ignore_errors=True)
    return code


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _supervise(children: list[Child], gw, num_workers: int, startup_timeout: float, stopping: list[int]) -> int:
    health = f"http://{gw.host}:{gw.port}/health"
    deadline = time.monotonic() + startup_timeout
    ready = False
    while not stopping:
        for child in children:
            code = child.exited()
            if code is not None:
                print(f"laneserve: {child.name} exited with code {code}; shutting the stack down", file=sys.stderr)
                return 1
        if not ready:
            if _healthy(health):
                ready = True
                print(f"laneserve ready: http://{gw.host}:{gw.port}/v1 (model {gw.served_model_name or gw.model}, "
                      f"{num_workers} worker(s)); Ctrl-C stops it", flush=True)
            elif time.monotonic() > deadline:
                print(f"laneserve: not healthy after {startup_timeout:.0f}s; shutting down", file=sys.stderr)
                return 1
        time.sleep(POLL_S)
    return 0
