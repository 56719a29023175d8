"""The Compose `cpu` profile, run for real without Docker: the same commands, the same LANESERVE_* env.

Each laneserve service of docker/compose.yaml's cpu profile is started as a process with its Compose
`command` and `environment`; only the network differs (Compose DNS names and 0.0.0.0 become 127.0.0.1 on
free ports). Start order follows `depends_on` + the services' own healthcheck commands, then one request
goes through. Proves the tcp transport, the bind/connect split and the healthchecks, not just the YAML.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from urllib.parse import urlparse

import aiohttp

from tests.stack import REPO, free_port
from tests.test_compose import entrypoint, environment, healthcheck, load

STARTUP_S = 120.0


def _rewire(env: dict[str, str], ports: dict[int, int]) -> dict[str, str]:
    """Compose addresses -> loopback: tcp://batcher:5555 and tcp://0.0.0.0:5555 -> tcp://127.0.0.1:<free>."""
    out = {}
    for key, value in env.items():
        if value.startswith("tcp://"):
            port = urlparse(value).port
            value = f"tcp://127.0.0.1:{ports[port]}"
        out[key] = value
    return out


def _wait_healthy(svc: dict, proc: subprocess.Popen, ports: dict[int, int], name: str) -> None:
    """Run the service's own healthcheck command (as Docker would, at an interval) until it passes."""
    argv = svc["healthcheck"]["test"][2:]  # ["CMD", "laneserve-healthcheck", ...]
    if argv[0] == "http":
        url = urlparse(argv[1])
        argv = [argv[0], url._replace(netloc=f"127.0.0.1:{ports[url.port]}").geturl(), *argv[2:]]
    else:
        argv = [argv[0], _rewire({"a": argv[1]}, ports)["a"], *argv[2:]]
    deadline = time.monotonic() + STARTUP_S
    while healthcheck.main(argv) != 0:
        assert proc.poll() is None, f"{name} exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"{name} not healthy in {STARTUP_S}s"
        time.sleep(0.2)  # the healthcheck interval, not synchronisation: the check itself decides


async def test_cpu_profile_stack_serves_a_request(tmp_path):
    services = load("compose.yaml", env={})["services"]
    gateway_port = int(environment(services["gateway"])["LANESERVE_PORT"])
    ports = {5555: free_port(), 5556: free_port(), gateway_port: free_port()}
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("LANESERVE_")}
    procs: list[subprocess.Popen] = []

    def start(name: str) -> subprocess.Popen:
        svc = services[name]
        env = _rewire(environment(svc), ports)
        if name == "gateway":
            env["LANESERVE_HOST"] = "127.0.0.1"
            env["LANESERVE_PORT"] = str(ports[gateway_port])
        argv = [*entrypoint(svc, "compose.yaml")[1:], *svc["command"]]
        log = open(tmp_path / f"{name}.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "laneserve.cli", "--log-level", "WARNING", *argv],
                                cwd=REPO, env={**base_env, **env}, stdout=log, stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    try:
        batcher = start("batcher")
        _wait_healthy(services["batcher"], batcher, ports, "batcher")
        start("worker-cpu")
        gateway = start("gateway")
        _wait_healthy(services["gateway"], gateway, ports, "gateway")
        async with aiohttp.ClientSession() as session:
            body = {"model": "tiny", "prompt": "Hello, compose", "max_tokens": 8, "ignore_eos": True}
            async with session.post(f"http://127.0.0.1:{ports[gateway_port]}/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                data = await resp.json()
        assert data["usage"]["completion_tokens"] == 8
        assert all(p.poll() is None for p in procs)
    except BaseException:
        for log in sorted(tmp_path.glob("*.log")):
            print(f"---- {log.name}\n{log.read_text()[-3000:]}")
        raise
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
