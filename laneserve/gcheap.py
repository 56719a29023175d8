"""Garbage-collector pauses on the serving path: each process's start-up heap is frozen once it is built.

CPython's cyclic collector stops its process while it traverses the tracked objects of the generations it collects,
and a full (generation 2) collection traverses all of them. A worker holds torch's ~300k start-up objects: on the
2-core CPU machine its full collections took 59 ms (median) to 107 ms, about every 5 s under a replay, each one a
stall of every step behind it; the gateway's (~50k objects) took 28 ms. `freeze_startup_heap()`, called once a
process has loaded what it keeps for its lifetime (the worker its model, pool and graphs; the batcher its
schedulers; the gateway its tokenizer; the load tester its trace), collects once and moves every surviving object
to the permanent generation (`gc.freeze`), so later collections traverse only what serving allocated since. Frozen
objects are still freed when their last reference goes; only a reference cycle among them would be kept.
`LANESERVE_GC_FREEZE=0` turns it off (to compare).
"""

from __future__ import annotations

import gc
import os

ENV = "LANESERVE_GC_FREEZE"


def enabled(env: dict | None = None) -> bool:
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
