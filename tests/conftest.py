"""Shared fixtures: the real stack on the tiny model, started once per session."""

from __future__ import annotations

import os
import shutil

import pytest

if not shutil.which("nvidia-smi"):
    # Triton kernels run under the interpreter on CPU; it must be chosen before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.stack import Stack


@pytest.fixture(scope="session")
def stack():
    s = Stack()
    yield s
    s.stop()


@pytest.fixture
def make_stack():
    """Factory for a stack with extra flags, e.g. make_stack("--api-key", "k"); stopped after the test."""
    started: list[Stack] = []

    def make(*flags: str, **kw) -> Stack:
        s = Stack(*flags, **kw)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()
