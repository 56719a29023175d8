"""The shape of the code: the import graph (every import, function-level ones included) has no cycle and
crosses folders only where the rules below allow; settings read by several processes are declared once."""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("laneserve", "gateway", "batcher", "workers", "loadtest")

# Each module belongs to the area of its longest matching prefix.
AREAS = {
    "laneserve.wire.protocol": "protocol",  # the messages: msgspec and the standard library only
    "laneserve.wire": "wire",  # + sockets
    "laneserve.cli": "entry",  # the command line and the launcher start every process
    "laneserve.launcher": "entry",
    "laneserve": "core",  # shared facts: config, model spec, sampling bounds
    "gateway.tools": "gateway-tools",
    "gateway": "gateway",
    "batcher.sim": "batcher-sim",
    "batcher": "batcher",
    "workers.tools": "worker-tools",
    "workers": "workers",
    "loadtest": "loadtest",
}
SHARED = {"core", "wire", "protocol"}
# area -> the areas it may import. Runtime areas never import a tool area; tools may reach across.
ALLOWED = {
    "protocol": {"protocol"},
    "wire": {"wire", "protocol"},
    "core": SHARED,
    "entry": set(AREAS.values()),
    "gateway": SHARED | {"gateway"},
    "gateway-tools": SHARED | {"gateway", "gateway-tools"},
    "batcher": SHARED | {"batcher"},
    "batcher-sim": SHARED | {"batcher", "batcher-sim", "loadtest"},  # it replays traces
    "workers": SHARED | {"workers"},
    # calibration tokenizes text; mask_bench times the batcher's grammar masks beside the worker's
    "worker-tools": SHARED | {"workers", "worker-tools", "gateway", "batcher"},
    "loadtest": {"loadtest"},  # a client of any OpenAI-compatible server
}
TORCH = {"torch", "triton"}
TORCH_AREAS = {"workers", "worker-tools"}
THIRD_PARTY_ONLY = {"protocol": {"msgspec"}, "wire": {"msgspec", "zmq"}}


def area(module: str) -> str:
    return next(a for p, a in sorted(AREAS.items(), key=lambda kv: -len(kv[0]))
                if module == p or module.startswith(p + "."))


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = modules()


def imports_of(module: str) -> list[str]:
    """Every module `module` imports anywhere in its body: `from a import b` is a.b when that is a module."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names += [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    return names


def graph() -> dict[str, set[str]]:
    return {m: {n for n in imports_of(m) if n in MODULES and n != m} for m in MODULES}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(g)))
    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_cycle():
    assert not cycles(graph()), "import cycles (function-level imports included):\n" + "\n".join(
        " <-> ".join(c) for c in cycles(graph()))


def test_a_cycle_would_be_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("pkg", PACKAGES)
def test_imports_cross_folders_only_where_the_rules_allow(pkg):
    bad = []
    for m in (m for m in MODULES if m.split(".")[0] == pkg):
        src = area(m)
        for name in imports_of(m):
            top = name.split(".")[0]
            if name in MODULES or top in PACKAGES:
                ok = name.split(".")[0] in PACKAGES and area(name) in ALLOWED[src]
            elif top in TORCH:
                ok = src in TORCH_AREAS
            elif src in THIRD_PARTY_ONLY:
                ok = top in sys.stdlib_module_names or top in THIRD_PARTY_ONLY[src] or top == "__future__"
            else:
                ok = True
            if not ok:
                bad.append(f"{MODULES[m].relative_to(REPO)} ({src}) imports {name}")
    assert not bad, "imports the rules forbid:\n" + "\n".join(bad)


def test_every_module_has_an_area():
    assert all(area(m) in ALLOWED for m in MODULES)


def test_settings_several_processes_read_are_declared_once():
    from batcher.config import BatcherConfig
    from gateway.config import GatewayConfig
    from laneserve.config import SHARED
    from laneserve.launcher import LauncherConfig
    from workers.config import WorkerConfig

    readers: dict[str, list[dataclasses.Field]] = {}
    for cls in (GatewayConfig, BatcherConfig, WorkerConfig, LauncherConfig):
        for f in dataclasses.fields(cls):
            readers.setdefault(f.name, []).append(f)
    for name, fields in readers.items():
        if len(fields) > 1:
            assert name in SHARED, f"{name} is declared in several configs: declare it in laneserve.config.SHARED"
        if name in SHARED:
            assert all((f.default, f.metadata["help"]) == SHARED[name] for f in fields), name
