"""Step-time breakdown for `laneserve bench --parts breakdown`: where a decode or prefill step's time goes.

Runs steps under torch.profiler and sums GPU kernel time by category (GEMM, attention, KV write,
norm/rope/activation and other elementwise, sampling) against the step's wall time; the rest is
host gap (time the GPU waited on Python). Decode steps are profiled both as CUDA-graph replays
(the serving path) and eager (the same kernels, launched one by one). The steps are driven by
driver.EngineDriver, as in bench.py's engine part.
"""

from __future__ import annotations

import collections
import statistics
import time

import torch

from workers.tools.driver import EngineDriver

# (category, substrings of a kernel name), first match wins
CATEGORIES = [
    ("kv_write", ("write_kv",)),
    ("attention", ("decode_kernel", "reduce_kernel", "flash", "fmha", "attention", "prefill_kernel")),
    ("gemm", ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "splitk", "gemv")),
    ("sampling", ("argmax", "topk", "sort", "softmax", "multinomial", "cumsum", "exponential")),
    ("norm_rope_act", ("rms", "rope", "silu", "fused")),
    ("gather_copy", ("index", "gather", "copy", "cat")),
]


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "elementwise_other"


def profile_kernels(fn, reps: int) -> tuple[dict[str, float], dict[str, float], float]:
    """Run fn() reps times under the profiler -> (ms per rep by category, ms per rep by top kernel names,
    median wall ms per rep)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    walls = []
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) * 1e3)
    by_cat: dict[str, float] = collections.defaultdict(float)
    by_name: dict[str, float] = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            ms = ev.time_range.elapsed_us() / 1e3 / reps
            by_cat[category(ev.name)] += ms
            by_name[ev.name[:90]] += ms
    top = dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:12])
    return dict(by_cat), top, statistics.median(walls)


def breakdown(runner, batches: list[int], context: int, vocab: int, prefill_tokens: int) -> list[dict]:
    rows = []
    for batch in batches:
        drv = EngineDriver(runner, context)
        drv.prefill(batch, vocab, 8192)
        modes = [("graph", runner.graphs), ("eager", None)] if runner.graphs is not None else [("eager", None)]
        for mode, graphs in modes:
            saved, runner.graphs = runner.graphs, graphs
            try:
                cats, top, wall = profile_kernels(drv.decode_step, 10)
            finally:
                runner.graphs = saved
            rows.append(_row(f"decode/{mode}", batch, context, cats, top, wall))
        drv.finish()
    # prefill in chunks of prefill_tokens: one chunk from 0 (plain causal), then 4 chunks (later ones
    # attend to the pages of the earlier ones, as a chunked or prefix-cached prompt does)
    for chunks in (1, 4):
        drv = EngineDriver(runner, chunks * prefill_tokens)

        def step(drv=drv):
            drv.finish()
            drv.prefill(1, vocab, prefill_tokens)
        cats, top, wall = profile_kernels(step, 3)
        rows.append(_row(f"prefill/{chunks}chunk", 1, prefill_tokens, {k: v / chunks for k, v in cats.items()},
                         {k: v / chunks for k, v in top.items()}, wall / chunks))
        drv.finish()
    return rows


def _row(kind: str, batch: int, context: int, cats: dict, top: dict, wall: float) -> dict:
    busy = sum(cats.values())
    line = "  ".join(f"{k} {v:.2f}" for k, v in sorted(cats.items(), key=lambda kv: -kv[1]))
    print(f"  breakdown {kind:18} batch {batch:4d} ctx {context:5d}: wall {wall:7.2f} ms, kernels {busy:7.2f} ms "
          f"(host gap {wall - busy:6.2f}) | {line}", flush=True)
    for name, ms in top.items():
        print(f"      {ms:8.3f} ms  {name}", flush=True)
    return {"kind": kind, "batch": batch, "context": context, "wall_ms": wall, "kernel_ms": busy,
            "by_category_ms": cats, "top_kernels_ms": top}
