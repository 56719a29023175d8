"""Garbage-collector pauses on the serving path: each process's start-up heap is frozen once it is built.

CPython's cyclic collector stops its process while it traverses the tracked objects of the generations it collects,
and a full (generation 2) collection traverses all of them. A worker holds torch's ~300k start-up objects: on the
2-core CPU machine its full collections during start-up took 11 ms to 132 ms (growing with the heap), and one
while serving would stall every step behind it as long; the gateway's (~50k objects) took 11-28 ms. (None fell
inside a 25-s replay there: a full collection waits until the survivors since the last one are a quarter of the
long-lived heap, so a large heap makes them rare and long.) `freeze_startup_heap()`, called once a process has
loaded what it keeps for its lifetime (the worker its model, pool and graphs; the batcher its schedulers; the
gateway its tokenizer), collects once and moves every surviving object to the permanent generation (`gc.freeze`,
as vLLM's engine core and API server do), so later collections traverse only what serving allocated since. Frozen
objects are still freed when their last reference goes; only a reference cycle among them would be kept.
`LANESERVE_GC_FREEZE=0` turns it off (to compare); `laneserve serve` checks the value at start. The load tester
(loadtest/client.py) freezes its trace the same way with the stdlib alone.
"""

from __future__ import annotations

import gc
import os

ENV = "LANESERVE_GC_FREEZE"


def enabled(env: dict | None = None) -> bool:
    """LANESERVE_GC_FREEZE as a bool (default on); a value that is not a boolean is a ValueError."""
    value = (os.environ if env is None else env).get(ENV, "1").strip().lower()
    if value not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
        raise ValueError(f"{ENV} must be 0 or 1, got {value!r}")
    return value in ("1", "true", "yes", "on")


def freeze_startup_heap() -> int:
    """Collect, then freeze what survives (see the module docstring); returns how many objects are frozen in all
    (0 with LANESERVE_GC_FREEZE=0)."""
    if not enabled():
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
