"""`laneserve serve`: start batcher, workers and gateway as child processes and supervise them.

Owns process lifetime only: private ipc:// socket directory, readiness (the
gateway's /health answering 200), SIGINT/SIGTERM forwarding, and a clean
shutdown that leaves no child process or socket file behind.

Recovery (docs/reliability.md): once the stack has been ready, a dead worker or
batcher is restarted (the batcher notices a lost worker and fails or requeues its
requests; workers re-register with a restarted batcher; the gateway reconnects), up
to --max-restarts per child within RESTART_WINDOW_S. A child that dies before the
stack was first ready (a startup error), a dead gateway (it holds the clients'
connections: restarting it behind their back would hide the failure), or a child
past its restart budget takes the stack down with a clear message.
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field

from laneserve.config import env_vars, flag, secret_env, to_argv

POLL_S = 0.1
RESTART_WINDOW_S = 60.0


@dataclass
class LauncherConfig:
    num_workers: int = field(default=0, metadata=flag("workers to start; 0 = one per visible GPU, else one CPU worker"))
    startup_timeout: float = field(default=600.0, metadata=flag("seconds to wait for the stack to become healthy"))
    shutdown_timeout: float = field(default=10.0, metadata=flag(
        "seconds each child gets to exit before SIGKILL (the gateway at least its --drain-timeout + 5)"))
    max_restarts: int = field(default=5, metadata=flag(
        "restarts of a dead worker or batcher within a minute before the stack goes down; 0 = a dead child "
        "always takes the stack down"))


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


END_GRACE_S = 5.0  # past --drain-timeout, the gateway's time to end the requests left and close


def remove_stale_run_dirs() -> None:
    """Empty laneserve-* run dirs of launchers that were SIGKILLed (their children removed their sockets, nobody
    removed the dir). A live launcher's dir holds its sockets, so it is never empty."""
    for d in glob.glob(os.path.join(tempfile.gettempdir(), "laneserve-*")):
        try:
            if os.path.isdir(d) and not os.listdir(d):
                os.rmdir(d)
        except OSError:  # another user's, or gone meanwhile
            pass


def cpu_threads(num_workers: int) -> int:
    """torch threads for each of num_workers CPU workers: the cores this process may use, divided among them."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, num_workers))


class Child:
    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None, restartable: bool = True,
                 liveness: str = "", base_env: dict[str, str] | None = None):
        self.name = name
        self.cmd = [sys.executable, "-m", "laneserve.cli", *argv]
        self.env = {**(os.environ if base_env is None else base_env), **(env or {})}
        self.restartable = restartable
        self.restarts: deque[float] = deque()  # monotonic times of recent restarts
        self.liveness = liveness  # a worker's --liveness-file ('' = none)
        self.beat: tuple[float, float] | None = None  # its last mtime seen, and the monotonic time it changed
        self.start()

    def start(self) -> None:
        if self.liveness and os.path.exists(self.liveness):
            os.unlink(self.liveness)  # the new process creates it once its loop runs
        self.beat = None
        self.proc = subprocess.Popen(self.cmd, env=self.env, start_new_session=True, preexec_fn=_die_with_parent)

    def exited(self) -> int | None:
        return self.proc.poll()

    def hung_for(self, limit: float) -> float | None:
        """Seconds since the worker's loop last set its liveness file, if more than limit (None: fine, not started
        yet, or no file). Timed on the monotonic clock from when the mtime last changed: a step of the wall clock
        must not look like a hang."""
        if not self.liveness or limit <= 0 or self.proc.poll() is not None:
            return None
        try:
            mtime = os.stat(self.liveness).st_mtime
        except OSError:  # still loading the model
            self.beat = None
            return None
        now = time.monotonic()
        if self.beat is None or self.beat[0] != mtime:
            self.beat = (mtime, now)
        silent = now - self.beat[1]
        return silent if silent > limit else None

    def stop(self, timeout: float) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                print(f"laneserve: {self.name} did not exit in {timeout:.0f}s; killing it", file=sys.stderr)
                self.proc.kill()
                self.proc.wait()


def check_port(host: str, port: int) -> None:
    """SystemExit (one line) when the gateway could not listen on host:port: taken, say, by another server, whose
    /health the launcher would otherwise have taken for its gateway's (a review found "laneserve ready" printed,
    then the gateway's bind traceback)."""
    import socket

    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, addr in infos:
            with socket.socket(family, kind, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as the gateway binds)
                s.bind(addr)
    except OSError as exc:
        raise SystemExit(f"laneserve serve: --host {host} --port {port}: {exc.strerror or exc}") from None


def serve(lc: LauncherConfig, gw, bc, wc, log_level: str = "INFO") -> int:
    if (bc.speculative == "draft") != bool(wc.draft_model):
        raise SystemExit("laneserve serve: --speculative draft and --draft-model go together (the batcher "
                         "schedules the drafts, the workers' draft model proposes them)")
    check_port(gw.host, gw.port)
    gpus = [] if wc.device == "cpu" else visible_gpus()
    if wc.device.startswith("cuda:"):  # that GPU alone: its worker sees it as cuda (cuda:0 there)
        index = wc.device.removeprefix("cuda:")
        if not index.isdigit() or int(index) >= len(gpus):
            raise SystemExit(f"laneserve serve: --device {wc.device}: {len(gpus)} GPUs visible (cuda:0 to cuda:N-1)")
        gpus, wc = [gpus[int(index)]], dataclasses.replace(wc, device="cuda")
    tp = max(1, wc.tensor_parallel_size)  # a worker is a TP group: it starts its other ranks itself
    num_workers = lc.num_workers or max(1, len(gpus) // tp)
    if gpus and num_workers * tp > len(gpus):  # (two workers on one GPU would each budget its memory)
        raise SystemExit(f"laneserve serve: {num_workers} workers x --tensor-parallel-size {tp} need "
                         f"{num_workers * tp} GPUs, {len(gpus)} visible")
    remove_stale_run_dirs()
    run_dir = tempfile.mkdtemp(prefix="laneserve-")
    default_front = type(bc)().batcher_address
    default_back = type(bc)().worker_address
    if bc.batcher_address == default_front:
        bc.batcher_address = gw.batcher_address = f"ipc://{run_dir}/batcher.sock"
    if bc.worker_address == default_back:
        bc.worker_address = wc.worker_address = f"ipc://{run_dir}/workers.sock"
    gw.batcher_address, wc.worker_address = bc.batcher_address, bc.worker_address

    common = ["--log-level", log_level]
    stopping: list[int] = []

    def on_signal(signum, _frame):
        stopping.append(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    # The children get their settings as flags alone: a LANESERVE_* variable of a setting left in their environment
    # would win over a flag that to_argv leaves out for equalling the default (`serve --max-num-seqs 384` with
    # LANESERVE_MAX_NUM_SEQS=64 set ran the batcher at 64). Secrets go by secret_env.
    settings = set(env_vars(type(lc), type(gw), type(bc), type(wc)))
    base = {k: v for k, v in os.environ.items() if k not in settings}
    children: list[Child] = []
    try:
        children.append(Child("batcher", [*common, "batcher", *to_argv(bc)], base_env=base))
        threads = wc.num_threads or cpu_threads(num_workers)
        for i in range(num_workers):
            group = [gpus[(i * tp + r) % len(gpus)] for r in range(tp)] if gpus else []
            env = {"CUDA_VISIBLE_DEVICES": ",".join(group)} if gpus else {}  # rank r uses cuda:r
            worker = dataclasses.replace(wc, worker_id=i, num_threads=threads if not gpus else wc.num_threads,
                                         liveness_file=f"{run_dir}/worker-{i}.alive")
            children.append(Child(f"worker {i}", [*common, "worker", *to_argv(worker)], env,
                                  liveness=worker.liveness_file, base_env=base))
        children.append(Child("gateway", [*common, "gateway", *to_argv(gw)], secret_env(gw), restartable=False,
                              base_env=base))
        code = _supervise(children, gw, num_workers, lc, stopping, bc.worker_timeout)
    finally:
        # Gateway first so it stops accepting and drains (its --drain-timeout, then a terminal event for each
        # request still in flight, then closing), then the engine.
        for child in reversed(children):
            child.stop(max(lc.shutdown_timeout, gw.drain_timeout + END_GRACE_S) if child.name == "gateway"
                       else lc.shutdown_timeout)
        shutil.rmtree(run_dir, ignore_errors=True)
    return code


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _restart(child: Child, code: int, ready: bool, max_restarts: int) -> bool:
    """Restart a dead child if the policy allows it; False: the stack must go down (message printed)."""
    now = time.monotonic()
    while child.restarts and now - child.restarts[0] > RESTART_WINDOW_S:
        child.restarts.popleft()
    why = ("the stack was not ready yet" if not ready else "it is not restarted" if not child.restartable
           else "restarts are off (--max-restarts 0)" if max_restarts <= 0
           else f"it was restarted {len(child.restarts)} times in {RESTART_WINDOW_S:.0f}s"
           if len(child.restarts) >= max_restarts else None)
    if why is not None:
        print(f"laneserve: {child.name} exited with code {code} ({why}); shutting the stack down", file=sys.stderr)
        return False
    child.restarts.append(now)
    print(f"laneserve: {child.name} exited with code {code}; restarting it", file=sys.stderr, flush=True)
    child.start()
    return True


def _supervise(children: list[Child], gw, num_workers: int, lc: LauncherConfig, stopping: list[int],
               worker_timeout: float) -> int:
    """Until a signal: restart dead children (or go down), and kill a worker whose loop stopped for the batcher's
    --worker-timeout (the batcher has declared it lost by then), which then restarts as a dead one."""
    health = f"http://{gw.host}:{gw.port}/health"
    deadline = time.monotonic() + lc.startup_timeout
    ready = False
    while not stopping:
        for child in children:
            code = child.exited()
            if code is not None and not _restart(child, code, ready, lc.max_restarts):
                return 1
            hung = child.hung_for(worker_timeout) if ready else None
            if hung is not None:
                print(f"laneserve: {child.name} hung (its loop silent for {hung:.1f}s); killing it", file=sys.stderr,
                      flush=True)
                child.proc.kill()
        if not ready:
            if _healthy(health):
                ready = True
                model = gw.served_model_name or os.path.basename(gw.model.rstrip("/"))
                print(f"laneserve ready: http://{gw.host}:{gw.port}/v1 (model {model}, {num_workers} worker(s)); "
                      "Ctrl-C stops it", flush=True)
            elif time.monotonic() > deadline:
                print(f"laneserve: not healthy after {lc.startup_timeout:.0f}s; shutting down", file=sys.stderr)
                return 1
        time.sleep(POLL_S)
    return 0
