"""Walk the ast imports of every module to enforce the design's "must not import" rules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# package -> (forbidden top-level modules, allowed exceptions)
RULES = {
    "gateway": ({"torch", "workers", "batcher"}, {"laneserve.wire.protocol"}),
    "batcher": ({"torch", "workers", "gateway"}, set()),
    "loadtest": ({"torch", "workers", "batcher", "gateway"}, set()),
    "laneserve": ({"torch"}, set()),
}


def imports_of(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from laneserve.wire import protocol` counts as laneserve.wire.protocol, not as all of batcher
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


@pytest.mark.parametrize("package", sorted(RULES))
def test_package_does_not_import_forbidden_modules(package):
    forbidden, allowed = RULES[package]
    files = sorted((REPO / package).rglob("*.py"))
    assert files, f"{package} has no modules"
    bad = []
    for path in files:
        for name in imports_of(path):
            if name.split(".")[0] in forbidden and not any(name == a or name.startswith(a + ".") for a in allowed):
                bad.append(f"{path.relative_to(REPO)}: {name}")
    assert not bad, "forbidden imports:\n" + "\n".join(bad)


def test_protocol_imports_only_msgspec_and_stdlib():
    names = {n.split(".")[0] for n in imports_of(REPO / "batcher" / "protocol.py")}
    assert names <= {"msgspec", "enum", "__future__", "typing"}, names
