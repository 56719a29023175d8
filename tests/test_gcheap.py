"""laneserve/gcheap.py: each process's start-up heap is frozen, so the collector's full passes skip it."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from laneserve import gcheap


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_freezing_moves_the_live_heap_out_of_the_collectors_passes(unfrozen, monkeypatch):
    monkeypatch.delenv(gcheap.ENV, raising=False)
    kept = [[i] for i in range(10_000)]  # live, tracked: frozen
    before = len(gc.get_objects())
    frozen = gcheap.freeze_startup_heap()
    # A frozen object is still freed when its last reference goes, so the count can only fall after the call
    # returns: a thread left by an earlier test freed two frozen objects in between once (CI, Python 3.11).
    assert frozen >= gc.get_freeze_count() >= len(kept)
    assert len(gc.get_objects()) < before - len(kept)  # a full pass no longer visits them
    assert all(x == [i] for i, x in enumerate(kept))


def test_it_can_be_turned_off(unfrozen, monkeypatch):
    monkeypatch.setenv(gcheap.ENV, "0")
    assert gcheap.freeze_startup_heap() == 0 and gc.get_freeze_count() == 0
    for value, on in (("1", True), ("off", False), (" TRUE ", True), ("no", False)):
        assert gcheap.enabled({gcheap.ENV: value}) is on


def test_a_bad_value_stops_serve_at_once_with_a_clear_error():
    env = {"PATH": "/usr/bin:/bin", gcheap.ENV: "sometimes"}
    proc = subprocess.run([sys.executable, "-m", "laneserve.cli", "serve", "--model", "tiny"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "LANESERVE_GC_FREEZE must be 0 or 1, got 'sometimes'" in proc.stderr
