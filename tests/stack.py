"""Start the real stack (`laneserve serve`) in a subprocess for tests; no mocks, real sockets."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
READY = "laneserve ready:"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every live process whose parent chain leads to pid (children run in their own sessions)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        found += kids
        frontier += kids
    return found


class Stack:
    def __init__(self, *flags: str, timeout: float = 120.0, env: dict[str, str] | None = None):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        # WORKER_TEST_DEVICE=cuda (tests/helpers_models.py) serves on the GPU too, in fp32 like the model checks
        device = os.environ.get("WORKER_TEST_DEVICE", "cpu")
        level = (env or {}).get("LANESERVE_LOG_LEVEL", "WARNING")
        cmd = [sys.executable, "-m", "laneserve.cli", "--log-level", level, "serve", "--device", device,
               *(["--dtype", "float32"] if device != "cpu" else []), "--port", str(self.port), *flags]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._drain, daemon=True).start()
        try:
            while True:
                line = self._q.get(timeout=timeout)
                if line is None:
                    raise RuntimeError("laneserve exited before ready:\n" + "".join(self.lines[-60:]))
                if line.startswith(READY):
                    break
        except queue.Empty:
            self.stop()
            raise RuntimeError(f"laneserve not ready in {timeout}s:\n" + "".join(self.lines[-60:])) from None
        self.children = descendants(self.proc.pid)

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            self._q.put(line)
        self._q.put(None)

    def url(self, path: str) -> str:
        return self.base_url + path

    @property
    def api(self) -> str:
        return self.base_url + "/v1"

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                for pid in [self.proc.pid, *descendants(self.proc.pid)]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                self.proc.wait()
                raise
        return self.proc.returncode


def cmdline(pid: int) -> bytes:
    """A process's argv, NUL-separated ('' once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def alive(pid: int) -> bool:
    """Running and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
