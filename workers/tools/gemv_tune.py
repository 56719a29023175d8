"""Whole-step tuning of the GEMV path's launch configs (issue 25), for workers/kernels/gemv.py's tables.

`python -m workers.tools.gemv_tune [--shapes gate_up,down,qkv,o,lm_head] [--top 3] [--reps 2] [--out F]` on a GPU.
A config's time alone (kernel_bench --gemv's sweep: one weight read again and again) does not rank configs as a
decode step does, where each layer's weights arrive cold after other kernels: on an H100 (2026-12-07, docs/perf.md)
the gate/up config best alone was 5% faster there and 1.5-1.9% faster on whole batch-1 steps, and lm_head's best
alone made no difference. So, per weight shape of the 7B model: every config of GEMV_GRID timed alone at one row,
the --top fastest kept (with the device's own), then each of those timed on whole decode steps of the 7B shape
(random weights, batch 1 and 8 at 1k context, --reps runs each, alternated), one shape at a time from the device's
table; a config replaces the table's where its batch-1 step is the fastest, at least MIN_GAIN faster, and its
batch-8 step at most BATCH8_SLACK slower (qkv: configs with BLOCK_K <= 256, as its fused kernel runs them). Last,
if anything changed, the chosen table against the device's, alternated --final-reps times at batch 1-8; then the
table's lines to paste into gemv.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile

import torch

# kernel_bench.GEMV_SHAPES' names; qkv's GEMV is qkv_rope_gemv, which runs its config with BLOCK_K <= 256
SHAPES = ("qkv", "o", "gate_up", "down", "lm_head")
QKV_MAX_BLOCK_K = 256  # (gemv.qkv_rope_config's cap)
# A candidate replaces the device's config only where its batch-1 step is at least MIN_GAIN faster and its batch-8
# step at most BATCH8_SLACK slower (the H100's spread over alternated runs in one call: ~0.2%; 2026-12-07, the first
# run's rule, any gain and 1% at batch 8, took two changes of 0.0-0.3% that together made batch 2-8 0.3-0.5% slower)
MIN_GAIN = 0.005
BATCH8_SLACK = 1.0025


def shortlist(times: dict[str, float], own: str, top: int) -> list[str]:
    """The `top` fastest configs (JSON keys) of an isolated sweep, and the device's own config, first: the
    candidates a shape's whole-step rounds time."""
    fastest = sorted(times, key=times.__getitem__)[:top]
    return [own] + [c for c in fastest if c != own]


def pick(steps: dict[str, dict[int, float]], own: str) -> str:
    """The candidate whose batch-1 step is fastest among those at least MIN_GAIN faster there than the device's own
    config and at most BATCH8_SLACK slower at batch 8; else own (`steps`: config -> batch -> median ms)."""
    ok = [c for c, t in steps.items() if c == own or t[1] <= steps[own][1] * (1 - MIN_GAIN)
          and t[8] <= steps[own][8] * BATCH8_SLACK]
    return min(ok, key=lambda c: steps[c][1])


def step_times(model: str, table: dict, batches: list[int], steps: int) -> dict[int, float]:
    """Median ms per decode step at each batch (1k context) with `table`'s GEMV configs over the device's."""
    from workers.config import WorkerConfig
    from workers.kernels import gemv
    from workers.runner import ModelRunner
    from workers.tools.bench import bench_engine

    gemv.use_configs(table)
    try:
        runner = ModelRunner(WorkerConfig(model=model, load_format="dummy", dtype="bfloat16",
                                          max_num_seqs=max(batches), max_model_len=2048, max_num_batched_tokens=8192))
        rows = bench_engine(runner, batches, 1024, steps, 32000, 8192)
        del runner
    finally:
        gemv.use_configs(None)
        gc.collect()
        torch.cuda.empty_cache()
    return {r.batch: r.ms_per_step for r in rows}


def isolated(name: str) -> dict[str, float]:
    """us per call at one row for each config of GEMV_GRID that compiles and the step would run as given
    (kernel_bench's timing of the step's kernel for that shape)."""
    from workers.kernels.gemv import GEMV_GRID
    from workers.tools.kernel_bench import gemv_timer, grid

    timer = gemv_timer(name)
    out = {}
    for cfg in grid(GEMV_GRID):
        if name == "qkv" and cfg["BLOCK_K"] > QKV_MAX_BLOCK_K:
            continue
        try:
            out[json.dumps(cfg)] = timer(cfg)
        except Exception as exc:  # a config Triton refuses (shared memory)
            print(f"    {cfg}: {type(exc).__name__}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workers.tools.gemv_tune", description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="gate_up,down,qkv,o,lm_head",
                    help=f"weight shapes to tune, in order, a comma list of {', '.join(SHAPES)}")
    ap.add_argument("--top", type=int, default=3, help="configs kept per shape from the isolated sweep (default 3)")
    ap.add_argument("--reps", type=int, default=2, help="whole-step runs per candidate (default 2)")
    ap.add_argument("--final-reps", type=int, default=3, help="alternated runs of the chosen table and the "
                    "device's (default 3)")
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps per run (default 40)")
    ap.add_argument("--out", default="", help="write JSON here")
    args = ap.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",")]
    if bad := [s for s in shapes if s not in SHAPES]:
        ap.error(f"argument --shapes: unknown shape {bad[0]!r}; choose from {', '.join(SHAPES)}")
    for name in ("top", "reps", "final_reps", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"argument --{name.replace('_', '-')}: must be at least 1")
    from workers.tools.bench import unwritable, write_dummy_model_dir

    if args.out and (problem := unwritable(args.out)):
        ap.error(f"argument --out: {problem}")
    if not torch.cuda.is_available():
        ap.error("it times Triton GEMVs on whole decode steps; this machine has no GPU")

    from workers.kernels import gemv
    from workers.tools.kernel_bench import GEMV_SHAPES

    model = write_dummy_model_dir(tempfile.mkdtemp(prefix="gemv-tune-"))
    own = {shape: gemv.gemv_config(*shape) for shape in (GEMV_SHAPES[s] for s in SHAPES)}
    table = dict(own)
    result: dict = {"device": torch.cuda.get_device_name(), "argv": sys.argv, "shapes": {}}
    for name in shapes:
        shape = GEMV_SHAPES[name]
        alone = isolated(name)
        cands = shortlist(alone, json.dumps(table[shape]), args.top)
        print(f"{name} {shape}: alone " + ", ".join(f"{c} {alone.get(c, float('nan')):.1f} us" for c in cands),
              flush=True)
        runs: dict[str, list[dict[int, float]]] = {c: [] for c in cands}
        for _ in range(args.reps):
            for c in cands:
                runs[c].append(step_times(model, {**table, shape: json.loads(c)}, [1, 8], args.steps))
        med = {c: {b: statistics.median(r[b] for r in rs) for b in (1, 8)} for c, rs in runs.items()}
        for c, m in med.items():
            print(f"  {name} {c}: batch 1 {m[1]:.3f} ms, batch 8 {m[8]:.3f} ms", flush=True)
        table[shape] = json.loads(pick(med, cands[0]))
        result["shapes"][name] = {"alone_us": alone, "steps_ms": med, "chosen": table[shape]}
    final: dict[str, list[dict[int, float]]] = {"device's": [], "chosen": []}
    if table == own:
        print("no change: no candidate met the rule, the device's table stands", flush=True)
    else:
        batches = [1, 2, 4, 8]
        for _ in range(args.final_reps):
            for label, t in (("device's", own), ("chosen", table)):
                final[label].append(step_times(model, t, batches, args.steps))
        for b in batches:
            spreads = [f"{label} {min(x[b] for x in rs):.3f}/{statistics.median(x[b] for x in rs):.3f}/"
                       f"{max(x[b] for x in rs):.3f} ms" for label, rs in final.items()]
            print(f"batch {b} (min/median/max): " + ", ".join(spreads), flush=True)
    print(f"table for {torch.cuda.get_device_name()}:")
    for shape, c in table.items():
        print(f"    {shape}: {c},{'' if c == own[shape] else '  # was ' + json.dumps(own[shape])}")
    result.update(final={k: [{str(b): t for b, t in r.items()} for r in v] for k, v in final.items()},
                  table={str(k): v for k, v in table.items()})
    result["shapes"] = {n: {**r, "steps_ms": {c: {str(b): t for b, t in m.items()} for c, m in r["steps_ms"].items()}}
                        for n, r in result["shapes"].items()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
