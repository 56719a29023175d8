"""The Compose deployment, checked statically (there is no Docker engine in CI) plus one real batcher probe.

- every compose file validates against the vendored Compose-spec JSON schema;
- every LANESERVE_* variable a service sets is one its `laneserve` command reads;
- every service command parses with the real `laneserve.cli.build_parser()`, and the CPU profile runs the
  same configuration as the tests' `laneserve serve --device cpu`;
- GPU workers, addresses, ports, healthchecks and depends_on agree with each other;
- the gateway image's dependency list is torch-free and covers what gateway/ and batcher/ import;
- docs/deploy.md's env-var table is current; the batcher healthcheck works against a real batcher.
"""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import importlib.metadata
import importlib.util
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from urllib.parse import urlparse

import jsonschema
import pytest
import yaml

from batcher.config import BatcherConfig
from gateway.config import GatewayConfig
from laneserve.cli import build_parser
from laneserve.config import env_vars, from_args
from laneserve.launcher import LauncherConfig
from laneserve.wire.transport import check_address
from tests.stack import free_port
from workers.config import WorkerConfig

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
SCHEMA = json.loads((DOCKER / "compose-spec.schema.json").read_text())
COMPOSE_FILES = ["compose.yaml", "compose.multihost.yaml", "compose.gpu-host.yaml"]
# What a user exports before `docker compose up` (the variables the files require or document).
SHELL_ENV = {"BATCHER_HOST": "10.0.0.5", "HOST_INDEX": "1"}
CONFIGS = {"gateway": GatewayConfig, "batcher": BatcherConfig, "worker": WorkerConfig}
ADDRESS_FIELDS = {"batcher_address", "worker_address"}


def _load_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


healthcheck = _load_module("laneserve_healthcheck", DOCKER / "healthcheck.py")
gen_env_table = _load_module("gen_env_table", DOCKER / "gen_env_table.py")
requirements = _load_module("docker_requirements", DOCKER / "requirements.py")


# ---------------------------------------------------------------- compose file model
_VAR = re.compile(r"\$(?:\$|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
                  r"|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")


def interpolate(value, env: dict[str, str]):
    """Compose's variable substitution ($$, $VAR, ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err})."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group("braced") or m.group("plain")
        op, arg, val = m.group("op"), m.group("arg"), env.get(name)
        unset = val is None or (op is not None and op.startswith(":") and val == "")
        if op in (":-", "-"):
            return arg if unset else val
        if op in (":?", "?") and unset:
            raise KeyError(f"required variable {name}: {arg}")
        return val or ""

    return _VAR.sub(sub, value)


def variables_used(text: str) -> set[str]:
    return {m.group("braced") or m.group("plain") for m in _VAR.finditer(text) if m.group(0) != "$$"}


def load(name: str, env: dict[str, str] | None = None) -> dict:
    return interpolate(yaml.safe_load((DOCKER / name).read_text()), SHELL_ENV if env is None else env)


def environment(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def entrypoint(svc: dict, compose_file: str) -> list[str] | None:
    """The image's ENTRYPOINT (from the Dockerfile the service builds); None for third-party images."""
    if "entrypoint" in svc:
        return list(svc["entrypoint"])
    build = svc.get("build")
    if not build:
        return None
    dockerfile = (DOCKER / compose_file).parent / build["context"] / build["dockerfile"]
    lines = [line for line in dockerfile.read_text().splitlines() if line.startswith("ENTRYPOINT")]
    return json.loads(lines[-1].split(None, 1)[1])


def laneserve_services(compose_file: str):
    """(name, service, argv after `laneserve`) for every service that runs a laneserve command."""
    for name, svc in load(compose_file)["services"].items():
        ep = entrypoint(svc, compose_file)
        if ep is None:
            continue
        assert ep == ["laneserve"], f"{name}: entrypoint {ep}"
        yield name, svc, [*ep[1:], *svc["command"]]


def build_config(argv: list[str], env: dict[str, str]):
    """What the real CLI builds for `laneserve <argv>` with env: (sub-command, config object)."""
    ns = build_parser().parse_args(argv)
    return ns.command, from_args(CONFIGS[ns.command], ns, env=env)


# ---------------------------------------------------------------- schema
@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_file_validates_against_the_compose_spec(name):
    doc = load(name)
    jsonschema.Draft201909Validator.check_schema(SCHEMA)
    errors = sorted(jsonschema.Draft201909Validator(SCHEMA).iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_schema_rejects_what_compose_rejects():
    """The vendored schema is strict (else the test above proves nothing)."""
    doc = load("compose.yaml")
    doc["services"]["worker-0"]["deploy"]["resources"]["reservations"]["devices"][0]["gpu_ids"] = ["0"]
    doc["services"]["gateway"]["depends_on"]["batcher"]["condition"] = "healthy"
    doc["services"]["gateway"]["environment"]["LANESERVE_PORT"] = True
    bad = {tuple(e.absolute_path)[:3] for e in jsonschema.Draft201909Validator(SCHEMA).iter_errors(doc)}
    assert {("services", "worker-0", "deploy"), ("services", "gateway", "depends_on"),
            ("services", "gateway", "environment")} <= bad


# ---------------------------------------------------------------- env vars and commands
@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_every_env_var_set_is_read_by_that_services_command(name):
    readable = set(env_vars(GatewayConfig, BatcherConfig, WorkerConfig, LauncherConfig))
    for svc_name, svc, argv in laneserve_services(name):
        command = build_parser().parse_args(argv).command
        own = set(env_vars(CONFIGS[command]))
        for var in environment(svc):
            assert var in readable, f"{name}: {svc_name} sets {var}, which no laneserve config reads"
            assert var in own, f"{name}: {svc_name} runs `laneserve {command}`, which does not read {var}"
    # Variables taken from the user's shell: a LANESERVE_* one must be real, the others are Compose-only.
    for var in variables_used((DOCKER / name).read_text()):
        assert var in readable or not var.startswith("LANESERVE_"), f"{name}: ${{{var}}} is read by nothing"


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_service_commands_parse_and_addresses_connect(name):
    for svc_name, svc, argv in laneserve_services(name):
        command, cfg = build_config(argv, environment(svc))
        for field in ADDRESS_FIELDS & {f.name for f in dataclasses.fields(cfg)}:
            address = getattr(cfg, field)
            check_address(address)
            assert address.startswith("tcp://"), f"{svc_name}: {field}={address}: containers need tcp://"
            host = urlparse(address).hostname
            if command == "batcher":
                assert host == "0.0.0.0", f"the batcher binds every interface, got {address}"
            else:
                assert host in ("batcher", SHELL_ENV["BATCHER_HOST"]), f"{svc_name} connects to {address}"
        if command == "gateway":
            assert cfg.host == "0.0.0.0" and str(cfg.port) in svc["expose"]


def test_batcher_binds_the_ports_its_clients_connect_to():
    compose = load("compose.yaml")["services"]
    _, batcher = build_config(["batcher"], environment(compose["batcher"]))
    ports = {f: urlparse(getattr(batcher, f)).port for f in ADDRESS_FIELDS}
    for name in COMPOSE_FILES:
        for svc_name, svc, argv in laneserve_services(name):
            _, cfg = build_config(argv, environment(svc))
            for field in ADDRESS_FIELDS & {f.name for f in dataclasses.fields(cfg)}:
                assert urlparse(getattr(cfg, field)).port == ports[field], f"{name}: {svc_name}.{field}"
    published = load("compose.multihost.yaml")["services"]["batcher"]["ports"]
    assert sorted(int(p.rsplit(":", 2)[-1]) for p in published) == sorted(ports.values())
    assert sorted(compose["batcher"]["expose"]) == sorted(str(p) for p in ports.values())


def test_cpu_profile_runs_the_same_configuration_as_the_tests():
    """tests/stack.py starts `laneserve serve --device cpu` (unless WORKER_TEST_DEVICE says otherwise); the cpu
    profile runs its three components."""
    stack = (REPO / "tests" / "stack.py").read_text()
    assert 'device = os.environ.get("WORKER_TEST_DEVICE", "cpu")' in stack and '"serve", "--device", device' in stack
    serve = build_parser().parse_args(["serve", "--device", "cpu"])
    compose = load("compose.yaml", env={})["services"]
    cpu = {n for n, s in compose.items() if "cpu" in s.get("profiles", [])}
    assert cpu == {"lb", "gateway", "batcher", "worker-cpu"}
    seen = set()
    for svc_name, svc, argv in laneserve_services("compose.yaml"):
        if svc_name not in cpu:
            continue
        command, cfg = build_config(argv, environment(svc))
        seen.add(command)
        expected = from_args(CONFIGS[command], serve, env={})
        # Only the transport differs: tcp on the Compose network instead of private ipc:// sockets; and the
        # worker's liveness file, which `laneserve serve` also sets (in its run directory), not by flag.
        transport = ADDRESS_FIELDS | {"host", "liveness_file"}
        for f in dataclasses.fields(cfg):
            if f.name not in transport:
                assert getattr(cfg, f.name) == getattr(expected, f.name), f"{svc_name}: {f.name} differs"
    assert seen == {"gateway", "batcher", "worker"}
    assert build_config(["worker", "--device", "cpu"], {})[1].device == "cpu"


def test_shared_settings_agree_across_services():
    """A field two configs share is one setting (docs/architecture.md), e.g. the model and its length."""
    for name in COMPOSE_FILES:
        values: dict[str, set[str]] = {}
        for _, svc, _ in laneserve_services(name):
            for var, value in environment(svc).items():
                values.setdefault(var, set()).add(value)
        for var, seen in values.items():
            if var.removeprefix("LANESERVE_").lower() not in ADDRESS_FIELDS | {"worker_id"}:
                assert len(seen) == 1, f"{name}: {var} differs between services: {seen}"


# ---------------------------------------------------------------- GPUs, health, restart
@pytest.mark.parametrize("name", ["compose.yaml", "compose.gpu-host.yaml"])
def test_one_gpu_worker_per_device(name):
    services = load(name)["services"]
    ids, devices = [], []
    for svc_name, svc, argv in laneserve_services(name):
        command, cfg = build_config(argv, environment(svc))
        if command != "worker" or cfg.device == "cpu":
            continue
        assert cfg.device == "cuda"
        (dev,) = services[svc_name]["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
        (gpu,) = dev["device_ids"]
        assert svc_name == f"worker-{gpu}"
        ids.append(cfg.worker_id)
        devices.append(gpu)
    assert len(devices) >= 2 and len(set(devices)) == len(devices)
    assert len(set(ids)) == len(ids)
    if name == "compose.gpu-host.yaml":  # head host uses ids 0..9; HOST_INDEX=1 gives 10..17
        assert all(10 <= i < 20 for i in ids)


@pytest.mark.parametrize("name", ["compose.yaml", "compose.gpu-host.yaml"])
def test_restart_policies_and_healthy_dependencies(name):
    services = load(name)["services"]
    for svc_name, svc in services.items():
        assert svc.get("restart") == "unless-stopped", svc_name
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert cond == {"condition": "service_healthy"}, f"{svc_name} -> {dep}"
            assert "test" in services[dep]["healthcheck"], f"{dep} has no healthcheck"


def test_healthchecks_probe_the_configured_endpoints():
    compose = load("compose.yaml")["services"]
    parser = healthcheck.build_parser()
    _, gw = build_config(["gateway"], environment(compose["gateway"]))
    test = compose["gateway"]["healthcheck"]["test"]
    assert test[:2] == ["CMD", "laneserve-healthcheck"]
    args = parser.parse_args(test[2:])
    assert args.kind == "http" and urlparse(args.url).port == gw.port and urlparse(args.url).path == "/health"
    _, bc = build_config(["batcher"], environment(compose["batcher"]))
    test = compose["batcher"]["healthcheck"]["test"]
    args = parser.parse_args(test[2:])
    assert args.kind == "zmq" and urlparse(args.address).port == urlparse(bc.batcher_address).port
    check_address(args.address)
    # Workers: their liveness file (the worker sets it) within the batcher's --worker-timeout.
    for file in ("compose.yaml", "compose.gpu-host.yaml"):
        for svc_name, svc in load(file)["services"].items():
            if not svc_name.startswith("worker"):
                continue
            _, wc = build_config(["worker"], environment(svc))
            args = parser.parse_args(svc["healthcheck"]["test"][2:])
            assert args.kind == "file" and args.path == wc.liveness_file and args.max_age <= bc.worker_timeout, \
                (file, svc_name)
    # The load balancer forwards to the gateway service's port and is published on the host.
    nginx = (DOCKER / "nginx.conf").read_text()
    assert f"http://gateway:{gw.port}" in nginx and "listen 8000;" in nginx
    assert compose["lb"]["ports"] == ["8000:8000"]


def _seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([hms])", duration))


def test_timeouts_fit_the_gateway_config():
    compose = load("compose.yaml")["services"]
    _, gw = build_config(["gateway"], environment(compose["gateway"]))
    # SIGTERM drains in-flight requests for drain_timeout; Docker must not SIGKILL before that.
    assert _seconds(compose["gateway"]["stop_grace_period"]) > gw.drain_timeout
    # The load balancer must not cut a stream the gateway still allows.
    read = re.search(r"proxy_read_timeout\s+(\S+);", (DOCKER / "nginx.conf").read_text()).group(1)
    assert _seconds(read) >= gw.request_timeout
    body = re.search(r"client_max_body_size\s+(\d+)m;", (DOCKER / "nginx.conf").read_text()).group(1)
    from gateway.config import AUTO_BODY_CAP

    # the gateway's 413 is the one users see (0: sized to the context, at most AUTO_BODY_CAP)
    assert int(body) * 2**20 >= (gw.max_body_bytes or AUTO_BODY_CAP)


def test_worker_healthcheck_reads_the_liveness_file(tmp_path):
    import os
    import time

    alive = tmp_path / "worker.alive"
    assert "No such file" in healthcheck.check_file(str(alive), 30)
    alive.touch()
    assert healthcheck.check_file(str(alive), 30) is None
    old = time.time() - 45
    os.utime(alive, (old, old))
    assert "stuck" in healthcheck.check_file(str(alive), 30)
    assert healthcheck.main(["file", str(alive), "--max-age", "60"]) == 0


def test_batcher_healthcheck_against_a_real_batcher():
    front, back = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "laneserve.cli", "--log-level", "WARNING", "batcher",
                             "--batcher-address", front, "--worker-address", back], cwd=REPO)
    try:
        assert healthcheck.check_zmq(front, timeout=30, min_workers=0) is None
        assert healthcheck.check_zmq(front, timeout=30, min_workers=1) == "0 worker(s) alive, want 1"
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(10)
    nobody = f"tcp://127.0.0.1:{free_port()}"
    assert healthcheck.check_zmq(nobody, timeout=0.2, min_workers=0) == f"no Pong from {nobody} in 0.2s"


# ---------------------------------------------------------------- images
def _third_party_imports(package: Path) -> set[str]:
    """Top-level modules imported by a package, except first-party, stdlib, and optional (try/ImportError)."""
    first_party = {"laneserve", "gateway", "batcher", "workers", "loadtest"}
    found = set()
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text())
        optional = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Try) and any(
                    "ImportError" in ast.unparse(h.type or ast.Name("BaseException")) for h in node.handlers):
                optional |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in optional:
                continue
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found - first_party - set(sys.stdlib_module_names) - {"__future__"}


def test_gateway_image_is_torch_free_and_has_what_gateway_and_batcher_import():
    reqs = requirements.runtime_requirements(str(REPO / "pyproject.toml"), ["torch"])
    names = {requirements.requirement_name(r) for r in reqs}
    declared = {requirements.requirement_name(d)
                for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]}
    assert "torch" not in names and names == declared - {"torch"}
    dists = importlib.metadata.packages_distributions()
    for package in ("gateway", "batcher", "laneserve"):
        for module in _third_party_imports(REPO / package):
            provided = {requirements.canonical(d) for d in dists.get(module, [module])}
            assert provided & names, f"{package}/ imports {module}, which the gateway image does not install"
    dockerfile = (DOCKER / "Dockerfile.gateway").read_text()
    assert "docker/requirements.py --exclude torch" in dockerfile and "pip install --no-deps ." in dockerfile
    for name in ("Dockerfile.worker", "Dockerfile.cpu"):
        text = (DOCKER / name).read_text()
        assert "pip install --no-deps ." in text and "requirements.py --exclude torch" in text


def test_gateway_and_batcher_start_without_torch():
    """What the slim image runs (CLI parsing, configs, the healthcheck) must not import torch."""
    code = (
        "import sys, importlib.abc\n"
        "class NoTorch(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'torch': raise ImportError('torch is not in the gateway image')\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        "from laneserve.cli import build_parser, _configs\n"
        "from laneserve.config import from_args\n"
        "gw, bc, _ = _configs()\n"
        "from_args(gw, build_parser().parse_args(['gateway'])); from_args(bc, build_parser().parse_args(['batcher']))\n"
        "import batcher.core\n"
        "import importlib.util\n"
        "if importlib.util.find_spec('gateway.app'): import gateway.app\n"
        "spec = importlib.util.spec_from_file_location('hc', 'docker/healthcheck.py')\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "assert 'torch' not in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def _ignored(path: str, patterns: list[str]) -> bool:
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").strip("/")
        if any(fnmatch.fnmatchcase(p, pat) or fnmatch.fnmatchcase(p, pat.removeprefix("**/")) for p in prefixes):
            result = not negate
    return result


def test_dockerignore_keeps_what_the_images_install():
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in include}
    needed = ["pyproject.toml", "README.md", "docker/requirements.py", "docker/healthcheck.py"]
    needed += [str(p.relative_to(REPO)) for pkg in packages for p in (REPO / pkg).rglob("*")
               if p.is_file() and "__pycache__" not in p.parts]
    assert len(needed) > 20
    kept_out = [p for p in needed if _ignored(p, patterns)]
    assert not kept_out, f".dockerignore drops files the images need: {kept_out[:10]}"
    assert _ignored(".venv/bin/python", patterns) and _ignored("batcher/__pycache__/core.pyc", patterns)


# ---------------------------------------------------------------- docs
def test_env_table_in_deploy_docs_is_current():
    doc = (REPO / "docs" / "deploy.md").read_text()
    assert gen_env_table.render(doc) == doc, "docs/deploy.md is stale: run python docker/gen_env_table.py --write"
    for var in env_vars(GatewayConfig, BatcherConfig, WorkerConfig, LauncherConfig):
        assert f"`{var}`" in doc
