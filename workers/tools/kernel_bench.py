"""Attention kernel bench: paged decode and paged prefill on one layer of a 7B shape, with launch-config sweeps.

`python -m workers.tools.kernel_bench [--sweep] [--persistent] [--rope-kv] [--out FILE]` on a GPU. Decode is
reported as bytes of K/V read per second (its roofline is the copy bandwidth); prefill as attention TFLOP/s (causal: half the
QK^T and PV work), against SDPA's flash attention on the same chunk (contiguous K/V, no pages) as
the baseline. CUDA events around CUDA-graph replays after warm-up, medians. --sweep times each config of the grid below and
prints the best; workers/kernels/paged_attention.py holds the chosen defaults. --persistent times the persistent
decode kernel (issue 25) against the partitioned one on skewed and uniform batches (SKEWED below); --rope-kv the
RoPE + K/V write in one launch against today's two; --gemv the small-batch linear (workers/kernels/gemv.py) against
cuBLAS on the 7B's weight shapes, as bytes of weights read per second against the copy bandwidth, then a whole
step's weights layer by layer with the decoder layer's small ops fused into the GEMVs (`--decode-gemv-rows`);
--cascade decodes that share a prefix (`--cascade-attention`) against the partitioned kernel reading it per sequence.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys

import numpy as np
import torch
import torch.nn.functional as F

from workers.kernels.paged_attention import (DECODE_CONFIG, PREFILL_CONFIG, CascadeBuffers, PersistentDecodeBuffers,
                                             cascade_plan, num_partitions,
                                             paged_decode, paged_decode_persistent, paged_prefill,
                                             plan_persistent_decode, target_chunks)
from workers.kv_cache import transpose_v_pages
from workers.tools.bench import measure_copy_bandwidth

HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16
LAYERS = 32  # the 7B shape's: the persistent kernel's plan is built once per step for all of them
DECODE_GRID = {"BLOCK_N": [32, 64, 128], "num_warps": [4, 8], "num_stages": [2, 3]}
INT8_GRID = {"INT8_PV": [True, False], "BLOCK_N": [32, 64, 128], "num_warps": [1, 2], "num_stages": [2, 3]}
PARTS_SHAPES = [(1, 1024), (1, 2048), (4, 2048), (8, 1024), (32, 1024), (64, 1024), (32, 2048), (64, 2048),
                (128, 1024), (128, 2048), (256, 1024)]
# issue 25's batches: (count, context) groups; the first three skewed, the last two uniform
# (groups, each of members x shared prefix, then each member's own tokens): the shared-prefix replay's decode batch at
# ~50 req/s (one 1,536-token document) and at lower rates, the group sizes between, the 16-document RAG shape's batch
# at its knee (2-3 decodes a document), and no sharing (the graph's cost)
CASCADE_SHAPES = [[(192, 1536, 370)], [(96, 1536, 370)], [(64, 1536, 370)], [(32, 1536, 370)], [(16, 1536, 300)],
                  [(16, 1536, 400)] * 4, [(8, 1536, 400)] * 8, [(4, 1536, 400)] * 16, [(3, 1536, 400)] * 16,
                  [(2, 1536, 400)] * 16 + [(1, 0, 1900)] * 8, [(1, 0, 1900)] * 128]
SKEWED = [[(1, 32768), (63, 512)], [(8, 16384), (120, 256)], [(1, 8192), (7, 128)], [(32, 1024)], [(128, 2048)]]
# the Mistral-7B shape's weights [N, K]: merged qkv, o, merged gate/up, down (each x 32 layers), lm_head
GEMV_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
               "lm_head": (32000, 4096)}
PREFILL_GRID = {"BLOCK_M": [64, 128], "BLOCK_N": [64, 128], "num_warps": [4, 8], "num_stages": [2, 3]}


def time_ms(fn, reps: int = 20, per_graph: int = 10) -> float:
    """GPU time of one fn() call: per_graph calls captured in a CUDA graph (no host launch gaps, as in
    the decode graphs), median over reps replays."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / per_graph)
    return statistics.median(times)


def pages(num_seqs: int, ctx: int, kv_dtype: torch.dtype):
    """A one-layer pool holding num_seqs contexts of ctx tokens in shuffled blocks."""
    per_seq = -(-ctx // PAGE)
    blocks = torch.randperm(num_seqs * per_seq, device="cuda").view(num_seqs, per_seq).to(torch.int32)
    shape = (num_seqs * per_seq, PAGE, KV_HEADS, DIM)
    if kv_dtype == torch.int8:
        k = torch.randint(-127, 128, shape, dtype=torch.int8, device="cuda")
        v = transpose_v_pages(torch.randint(-127, 128, shape, dtype=torch.int8, device="cuda"))
        scales = (torch.full((KV_HEADS,), 0.01, device="cuda"), torch.full((KV_HEADS,), 0.01, device="cuda"))
    else:
        k = torch.randn(shape, dtype=kv_dtype, device="cuda")
        v = torch.randn(shape, dtype=kv_dtype, device="cuda")
        scales = (None, None)
    return k, v, blocks, scales


def bench_decode(batch: int, ctx: int, kv_dtype: torch.dtype, config: dict | None, parts: int | None = None) -> dict:
    """Also reports the output's max error relative to the exact-dequantisation path's (int8: K/V converted
    to bf16 for tl.dot; the int8 tensor-core default also rounds q, and p to two int8 digits)."""
    torch.manual_seed(batch * ctx)
    k, v, bt, (ks, vs) = pages(batch, ctx, kv_dtype)
    q = torch.randn(batch, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    parts = parts or num_partitions(batch, KV_HEADS, ctx)
    run = lambda cfg: paged_decode(q, k, v, bt, lens, DIM ** -0.5, num_parts=parts, k_scale=ks, v_scale=vs,  # noqa: E731
                                   out=out, config=cfg)
    ms = time_ms(lambda: run(config))
    got = out.float().clone()
    ref = run({"INT8_QK": False, "INT8_PV": False}).float()
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    nbytes = 2 * batch * ctx * KV_HEADS * DIM * k.element_size()
    return {"batch": batch, "ctx": ctx, "kv": str(kv_dtype).split(".")[-1], "parts": parts, "config": config,
            "us": ms * 1e3, "tb_s": nbytes / ms / 1e9, "rel_err_vs_dequant": err}


def bench_persistent(groups: list[tuple[int, int]], kv_dtype: torch.dtype = torch.bfloat16) -> dict:
    """One layer's decode attention over a batch of these (count, context) groups: the partitioned kernel at the
    partition count the backend would pick (from the batch size and the longest context) against the persistent
    kernel (decode + merge; its plan, built once per step for every layer, timed apart)."""
    lens_list = [ctx for count, ctx in groups for _ in range(count)]
    batch = len(lens_list)
    torch.manual_seed(batch)
    k, v, _, (ks, vs) = pages(1, sum(-(-n // PAGE) * PAGE for n in lens_list), kv_dtype)
    bt = torch.zeros(batch, -(-max(lens_list) // PAGE), dtype=torch.int32, device="cuda")
    perm = torch.randperm(k.shape[0], device="cuda").to(torch.int32)
    at = 0
    for i, n in enumerate(lens_list):
        bt[i, :-(-n // PAGE)] = perm[at:at - (-n // PAGE)]
        at += -(-n // PAGE)
    q = torch.randn(batch, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    lens = torch.tensor(lens_list, dtype=torch.int32, device="cuda")
    parts = num_partitions(batch, KV_HEADS, max(lens_list))
    out_a, out_b = torch.empty_like(q), torch.empty_like(q)
    sms = torch.cuda.get_device_properties("cuda").multi_processor_count
    buffers = PersistentDecodeBuffers(batch, HEADS, DIM, "cuda", target_chunks(sms, KV_HEADS),
                                      quant=kv_dtype == torch.int8)
    plan_persistent_decode(lens, buffers)
    partitioned = time_ms(lambda: paged_decode(q, k, v, bt, lens, DIM ** -0.5, num_parts=parts, k_scale=ks,
                                               v_scale=vs, out=out_a))
    persistent = time_ms(lambda: paged_decode_persistent(q, k, v, bt, lens, DIM ** -0.5, buffers, sms, k_scale=ks,
                                                         v_scale=vs, out=out_b))
    plan = time_ms(lambda: plan_persistent_decode(lens, buffers))
    err = ((out_a.float() - out_b.float()).abs().max() / out_a.float().abs().max()).item()
    chunk, chunks = int(buffers.plan[0]), int(buffers.plan[1 + batch])
    nbytes = 2 * sum(lens_list) * KV_HEADS * DIM * k.element_size()
    return {"groups": groups, "kv": str(kv_dtype).split(".")[-1], "parts": parts, "partitioned_us": partitioned * 1e3,
            "persistent_us": persistent * 1e3, "plan_us": plan * 1e3, "chunk": chunk, "chunks": chunks,
            "speedup": partitioned / (persistent + plan / LAYERS), "persistent_tb_s": nbytes / persistent / 1e9,
            "rel_err_vs_partitioned": err}


def bench_rope_kv(tokens: int) -> dict:
    """One layer's RoPE on q and k then the K/V write (two launches, today's path) against rope_write_kv_ (one;
    issue 25): bf16, views into one qkv output as the model has them, a 32k-position table."""
    from workers.kernels.fused import rope_, rope_write_kv_
    from workers.kernels.paged_attention import write_kv

    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM, dtype=torch.bfloat16, device="cuda")
    q, k, v = (t.unflatten(-1, (-1, DIM)) for t in qkv.split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], -1))
    blocks = -(-tokens // PAGE) + 1
    kc = torch.zeros(blocks, PAGE, KV_HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    vc = torch.zeros_like(kc)
    cos, sin = torch.rand(32768, DIM, device="cuda"), torch.rand(32768, DIM, device="cuda")
    positions = torch.randint(0, 32768, (tokens,), device="cuda")
    slots = torch.randperm(blocks * PAGE, device="cuda")[:tokens]

    def two() -> None:
        rope_(q, k, positions, cos, sin)
        write_kv(k, v, kc, vc, slots)

    two_ms = time_ms(two)
    one_ms = time_ms(lambda: rope_write_kv_(q, k, v, positions, cos, sin, kc, vc, slots))
    return {"tokens": tokens, "rope_then_write_us": two_ms * 1e3, "fused_us": one_ms * 1e3,
            "speedup": two_ms / one_ms, "per_step_saving_us": (two_ms - one_ms) * 1e3 * LAYERS}


def bench_gemv(copy: float) -> dict:
    """Per 7B weight shape: the config sweep at batch 1, then cuBLAS against gemv (default and best config) at
    batch 1 / 4 / 8, and a decode step's weight time (32 layers' four GEMMs + lm_head) from each."""
    from workers.kernels.gemv import GEMV_CONFIG, GEMV_GRID, gemv

    rows, step = [], {}
    for name, (n, k) in GEMV_SHAPES.items():
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
        x1 = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")

        def run(c: dict) -> dict:
            us = time_ms(lambda: gemv(x1, w, c)) * 1e3
            return {"config": c, "us": us, "neg_us": -us}

        best = sweep(run, GEMV_GRID, "neg_us", f"gemv {name}")
        for m in (1, 4, 8):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            ref = F.linear(x, w)
            err = ((gemv(x, w, best["config"]).float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            us = {"cublas": time_ms(lambda: F.linear(x, w)) * 1e3,
                  "gemv": time_ms(lambda: gemv(x, w, GEMV_CONFIG)) * 1e3,
                  "gemv_best": time_ms(lambda: gemv(x, w, best["config"])) * 1e3}
            row = {"shape": name, "n": n, "k": k, "m": m, "config": best["config"], "rel_err": err,
                   **{f"{key}_us": v for key, v in us.items()},
                   **{f"{key}_of_copy": n * k * 2 / (v * 1e-6) / 1e12 / copy for key, v in us.items()}}
            rows.append(row)
            times = step.setdefault(m, {key: 0.0 for key in us})
            for key, v in us.items():
                times[key] += v * (1 if name == "lm_head" else LAYERS)
            print(f"  gemv {name:8} {n:5d}x{k:5d} batch {m}: cuBLAS {us['cublas']:7.1f} us "
                  f"({row['cublas_of_copy']:.0%} of copy), gemv {us['gemv']:7.1f} ({row['gemv_of_copy']:.0%}), "
                  f"best {us['gemv_best']:7.1f} ({row['gemv_best_of_copy']:.0%}) {best['config']} err {err:.1e}",
                  flush=True)
    for m, times in step.items():
        print(f"  gemv step batch {m}: weights cuBLAS {times['cublas'] / 1e3:.3f} ms, gemv {times['gemv'] / 1e3:.3f}, "
              f"per-shape best {times['gemv_best'] / 1e3:.3f}", flush=True)
    return {"copy_tb_s": copy, "rows": rows, "step_us": step}


def gemv_timer(name: str):
    """A function of a launch config giving the us per call at one row of the GEMV a decode step runs for weight
    shape `name` (GEMV_SHAPES): qkv_rope_gemv (norm + qkv + RoPE + the K/V write into a bf16 pool) for qkv, gemv
    for the others."""
    from workers.kernels.gemv import gemv, qkv_rope_gemv

    n, k = GEMV_SHAPES[name]
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * k ** -0.5
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    if name != "qkv":
        return lambda c: time_ms(lambda: gemv(x, w, c)) * 1e3
    kv_heads = (n // DIM - k // DIM) // 2
    norm = torch.ones(k, dtype=torch.bfloat16, device="cuda")
    kc, vc = (torch.zeros(64, PAGE, kv_heads, DIM, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    cos, sin = (torch.rand(4096, DIM, device="cuda") for _ in range(2))
    positions = torch.tensor([100], device="cuda")
    slots = torch.tensor([7], device="cuda")
    return lambda c: time_ms(lambda: qkv_rope_gemv(x, w, None, (norm, 1e-5), k // DIM, kv_heads, positions, cos, sin,
                                                   kc, vc, slots, config=c)) * 1e3


def bench_qkv_rope_sweep() -> dict:
    """The fused norm + qkv + RoPE + K/V-write GEMV (`qkv_rope_gemv`) over GEMV_GRID at batch 1 on the qkv shape,
    against the config it runs with (`qkv_rope_config`): its epilogue needs more registers than the plain GEMV the
    per-shape configs were swept for (`python -m workers.tools.compile_check` lists the variants that spill), so its
    best config may differ."""
    from workers.kernels.gemv import GEMV_GRID, qkv_rope_config

    timer = gemv_timer("qkv")

    def run(c: dict) -> dict:
        us = timer(c)
        return {"config": c, "us": us, "neg_us": -us}

    tuned = run(qkv_rope_config(*GEMV_SHAPES["qkv"]))
    print(f"  qkv_rope with its config {tuned['config']}: {tuned['us']:.1f} us", flush=True)
    best = sweep(run, GEMV_GRID, "neg_us", "qkv_rope")
    return {"tuned": tuned, "best": best}


def bench_gemv_layers() -> list[dict]:
    """A decode step's weights, layer by layer: 32 layers' tails (o, the residual add and norm, gate/up, SiLU * up,
    down, the residual add and the next layer's norm, qkv, RoPE and the K/V write) with distinct weights (no L2 reuse
    across layers, as in a step), then the final norm and lm_head, at batch 1 / 4 / 8, four ways: cuBLAS with the
    separate kernels (the model's path), the GEMV with the separate kernels, the fused GEMV path
    (`--decode-gemv-rows`) with RoPE + the K/V write apart, and with them in the qkv GEMV (the path on a pool that
    is not int8). No attention."""
    from workers.kernels.fused import add_rms_norm, rms_norm, rope_write_kv_, silu_mul
    from workers.kernels.gemv import gemv, qkv_rope_gemv

    hidden, eps = GEMV_SHAPES["o"][0], 1e-5
    heads, kv_heads = hidden // DIM, (GEMV_SHAPES["qkv"][0] // DIM - hidden // DIM) // 2
    kc, vc = (torch.zeros(64, PAGE, kv_heads, DIM, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    cos, sin = (torch.rand(4096, DIM, device="cuda") for _ in range(2))

    def weight(name: str) -> torch.Tensor:
        n, k = GEMV_SHAPES[name]
        return torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * k ** -0.5

    layers = [{name: weight(name) for name in ("qkv", "o", "gate_up", "down")} for _ in range(LAYERS)]
    lm_head = weight("lm_head")
    norm = torch.ones(hidden, dtype=torch.bfloat16, device="cuda")

    def rope_kv(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (-1, DIM)) for t in qkv.split([hidden, kv_heads * DIM, kv_heads * DIM], -1))
        rope_write_kv_(q, k, v, positions, cos, sin, kc, vc, slots)
        return qkv

    def separate(linear):
        def step(o: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
            for w in layers:
                h = add_rms_norm(linear(o, w["o"]), residual, norm, eps)
                h = add_rms_norm(linear(silu_mul(linear(h, w["gate_up"])), w["down"]), residual, norm, eps)
                o = rope_kv(linear(h, w["qkv"]), positions, slots)[:, :hidden]  # (q stands in for attention's output)
            linear(rms_norm(residual, norm, eps), lm_head)
        return step

    def fused(in_qkv: bool):
        def step(o: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
            for w in layers:
                gemv(o, w["o"], residual=residual)
                gemv(gemv(residual, w["gate_up"], norm=(norm, eps), silu=True), w["down"], residual=residual)
                o = (qkv_rope_gemv(residual, w["qkv"], None, (norm, eps), heads, kv_heads, positions, cos, sin, kc, vc,
                                   slots) if in_qkv else rope_kv(gemv(residual, w["qkv"], norm=(norm, eps)), positions,
                                                                 slots))[:, :hidden]
            gemv(residual, lm_head, norm=(norm, eps))
        return step

    steps = {"cublas": separate(F.linear), "gemv": separate(lambda x, w: gemv(x, w)), "gemv_fused": fused(False),
             "gemv_fused_rope": fused(True)}
    rows = []
    for m in (1, 4, 8):
        o = torch.randn(m, hidden, dtype=torch.bfloat16, device="cuda")
        residual = torch.randn(m, hidden, dtype=torch.bfloat16, device="cuda")
        positions = torch.arange(100, 100 + m, device="cuda")
        slots = torch.arange(m, device="cuda") * 7
        ms = {name: time_ms(lambda: step(o, residual, positions, slots), reps=10, per_graph=1)
              for name, step in steps.items()}
        rows.append({"m": m, **{f"{name}_ms": v for name, v in ms.items()}})
        print(f"  gemv layers batch {m}: {LAYERS} layers + lm_head, cuBLAS + separate kernels {ms['cublas']:.3f} ms, "
              f"gemv + separate {ms['gemv']:.3f} ({ms['cublas'] / ms['gemv']:.2f}x), fused gemv "
              f"{ms['gemv_fused']:.3f} ({ms['cublas'] / ms['gemv_fused']:.2f}x), RoPE + K/V in the qkv gemv too "
              f"{ms['gemv_fused_rope']:.3f} ({ms['cublas'] / ms['gemv_fused_rope']:.2f}x)", flush=True)
    return rows


def bench_prefill(num_seqs: int, chunk: int, prefix: int, kv_dtype: torch.dtype, config: dict | None) -> dict:
    ctx = prefix + chunk
    k, v, bt, (ks, vs) = pages(num_seqs, ctx, kv_dtype)
    q = torch.randn(num_seqs * chunk, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device="cuda")
    qsl = torch.arange(0, num_seqs + 1, dtype=torch.int32, device="cuda") * chunk
    out = torch.empty_like(q)
    ms = time_ms(lambda: paged_prefill(q, k, v, bt, lens, qsl, 0, num_seqs, chunk, DIM ** -0.5, out, ks, vs,
                                       config=config))
    flops = num_seqs * HEADS * 4 * DIM * chunk * (prefix + chunk / 2)  # QK^T + PV over the causal half
    return {"seqs": num_seqs, "chunk": chunk, "prefix": prefix, "kv": str(kv_dtype).split(".")[-1],
            "config": config, "us": ms * 1e3, "tflops": flops / ms / 1e9}


def bench_sdpa(num_seqs: int, chunk: int) -> dict:
    """Baseline: flash attention (SDPA) on contiguous K/V of a chunk from position 0."""
    q = torch.randn(num_seqs, HEADS, chunk, DIM, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(num_seqs, HEADS, chunk, DIM, dtype=torch.bfloat16, device="cuda")  # GQA expanded
    v = torch.randn_like(k)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        ms = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    flops = num_seqs * HEADS * 4 * DIM * chunk * chunk / 2
    return {"seqs": num_seqs, "chunk": chunk, "prefix": 0, "kv": "sdpa-flash", "us": ms * 1e3,
            "tflops": flops / ms / 1e9}


def grid(space: dict) -> list[dict]:
    return [dict(zip(space, values)) for values in itertools.product(*space.values())]


def sweep(run, space: dict, key: str, label: str) -> dict:
    """Time run(config) for every config; print each; return the best row (max of key)."""
    best = None
    for cfg in grid(space):
        try:
            row = run(cfg)
        except Exception as exc:  # a config Triton cannot compile (shared memory): skip it
            print(f"    {label} {cfg}: {type(exc).__name__}", flush=True)
            continue
        err = f"  err {row['rel_err_vs_dequant']:.1e}" if "rel_err_vs_dequant" in row else ""
        print(f"    {label} {cfg}: {row['us']:9.1f} us  {row[key]:7.2f}{err}", flush=True)
        if best is None or row[key] > best[key]:
            best = row
    print(f"  best {label}: {best['config']} {best['us']:.1f} us {key} {best[key]:.2f}", flush=True)
    return best


def bench_cascade(groups: list[tuple[int, int, int]]) -> dict:
    """One layer's decode attention (bf16) over groups of (members, shared prefix tokens, own tokens each): the
    partitioned kernel at the backend's partition count, reading each context in full, against the cascade
    (the shared prefixes once per group; its host plan, made once per step for every layer, timed apart)."""
    import time

    lens_list, rows = [], []
    torch.manual_seed(len(groups))
    n_blocks = sum(-(-shared // PAGE) + members * -(-own // PAGE) for members, shared, own in groups) + 1
    k, v, _, _ = pages(1, n_blocks * PAGE, torch.bfloat16)
    perm = iter(torch.randperm(n_blocks).tolist())
    for members, shared, own in groups:
        common = [next(perm) for _ in range(shared // PAGE)]
        for _ in range(members):
            rows.append(common + [next(perm) for _ in range(-(-(shared + own) // PAGE) - len(common))])
            lens_list.append(shared + own)
    batch = len(rows)
    bt_host = torch.zeros(batch, max(map(len, rows)), dtype=torch.int32)
    for i, r in enumerate(rows):
        bt_host[i, :len(r)] = torch.tensor(r, dtype=torch.int32)
    bt = bt_host.cuda()
    q = torch.randn(batch, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    lens = torch.tensor(lens_list, dtype=torch.int32, device="cuda")
    parts = num_partitions(batch, KV_HEADS, max(lens_list))
    out_a, out_b = torch.empty_like(q), torch.empty_like(q)
    buffers = CascadeBuffers(batch, HEADS // KV_HEADS, "cuda")
    t0 = time.perf_counter()
    grouped = buffers.fill(bt_host.numpy(), np.array(lens_list), PAGE, min_members=2, min_grouped=2)
    plan_us = (time.perf_counter() - t0) * 1e6
    # (the kernel timed on every group of two and up; what a worker would group, with the thresholds)
    by_default = len(cascade_plan(bt_host.numpy(), np.array(lens_list), PAGE, buffers.per_item, buffers.max_items)[1])
    partitioned = time_ms(lambda: paged_decode(q, k, v, bt, lens, DIM ** -0.5, num_parts=parts, out=out_a))
    cascade = time_ms(lambda: paged_decode(q, k, v, bt, lens, DIM ** -0.5, num_parts=parts, out=out_b,
                                           cascade=buffers))
    err = ((out_a.float() - out_b.float()).abs().max() / out_a.float().abs().max()).item()
    return {"groups": groups, "batch": batch, "grouped": grouped, "grouped_by_default": by_default, "parts": parts,
            "partitioned_us": partitioned * 1e3, "cascade_us": cascade * 1e3, "plan_us": plan_us,
            "speedup": partitioned / cascade, "rel_err_vs_partitioned": err}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workers.tools.kernel_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="sweep launch configs (slow: compiles each)")
    ap.add_argument("--parts", action="store_true", help="time decode at 1 to 32 partitions over batch x context")
    ap.add_argument("--int8", action="store_true", help="sweep the int8 decode launch configs")
    ap.add_argument("--persistent", action="store_true", help="the persistent decode kernel against the partitioned "
                    "one on skewed and uniform batches")
    ap.add_argument("--rope-kv", action="store_true", help="RoPE + K/V write fused in one launch against the two "
                    "launches the model makes (issue 25)")
    ap.add_argument("--gemv", action="store_true", help="the small-batch linear against cuBLAS on the 7B's weight "
                    "shapes (issue 25)")
    ap.add_argument("--cascade", action="store_true", help="decodes sharing a prefix: cascade against partitioned")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    result: dict = {"device": torch.cuda.get_device_name(), "decode": [], "prefill": [], "best": {}, "parts": []}
    bf16, i8 = torch.bfloat16, torch.int8
    if args.persistent:
        result["persistent"] = []
        for groups, kv in itertools.product(SKEWED, (bf16, i8)):
            row = bench_persistent(groups, kv)
            result["persistent"].append(row)
            print(f"  persistent {row['kv']:9} {' + '.join(f'{c}x{n}' for c, n in groups):16}: partitioned "
                  f"({row['parts']} parts) {row['partitioned_us']:8.1f} us, persistent {row['persistent_us']:8.1f} us "
                  f"(+ plan {row['plan_us']:.1f} us per step; {row['chunks']} chunks of {row['chunk']}): "
                  f"{row['speedup']:.2f}x, err {row['rel_err_vs_partitioned']:.1e}", flush=True)
    if args.cascade:
        result["cascade"] = []
        for groups in CASCADE_SHAPES:
            row = bench_cascade(groups)
            result["cascade"].append(row)
            shape = " + ".join(f"{groups.count(g)} x {g[0]} x ({g[1]} shared + {g[2]})" for g in dict.fromkeys(groups))
            print(f"  cascade {shape}: partitioned "
                  f"({row['parts']} parts) {row['partitioned_us']:8.1f} us, cascade {row['cascade_us']:8.1f} us "
                  f"({row['grouped']} of {row['batch']} grouped, {row['grouped_by_default']} by default; host plan "
                  f"{row['plan_us']:.0f} us per step): "
                  f"{row['speedup']:.2f}x, err {row['rel_err_vs_partitioned']:.1e}", flush=True)
    if args.rope_kv:
        result["rope_kv"] = []
        for tokens in (1, 8, 32, 128, 2048):
            row = bench_rope_kv(tokens)
            result["rope_kv"].append(row)
            print(f"  rope+kv {tokens:5d} tokens: two launches {row['rope_then_write_us']:7.2f} us, fused "
                  f"{row['fused_us']:7.2f} us: {row['speedup']:.2f}x, {row['per_step_saving_us']:+.0f} us per "
                  f"{LAYERS}-layer step", flush=True)
    if args.gemv:
        copy = measure_copy_bandwidth() / 1e12
        print(f"  copy bandwidth {copy:.2f} TB/s", flush=True)
        result["gemv"] = bench_gemv(copy)
        result["qkv_rope_sweep"] = bench_qkv_rope_sweep()
        result["gemv_layers"] = bench_gemv_layers()
    if args.parts:
        for batch, ctx in PARTS_SHAPES:
            rows = [bench_decode(batch, ctx, bf16, None, parts) for parts in (1, 2, 4, 8, 16, 32)]
            result["parts"] += rows
            best = max(rows, key=lambda r: r["tb_s"])
            print(f"  parts  batch {batch:4d} ctx {ctx:5d}: " + "  ".join(f"{r['parts']}:{r['us']:.0f}us"
                  for r in rows) + f"  best {best['parts']} (heuristic {num_partitions(batch, KV_HEADS, ctx)})",
                  flush=True)
    if args.int8:
        for batch, ctx in [(128, 2048)]:
            name = f"decode {batch}x{ctx} int8 variants"
            result["best"][name] = sweep(lambda c: bench_decode(batch, ctx, i8, c), INT8_GRID, "tb_s", name)
    if args.sweep:
        for kv in (bf16, i8):
            for parts in (1, 2):
                name = f"decode 128x2048 {str(kv).split('.')[-1]} parts {parts}"
                result["best"][name] = sweep(lambda c: bench_decode(128, 2048, kv, c, parts), DECODE_GRID, "tb_s", name)
        name = "decode 32x1024 bfloat16"
        result["best"][name] = sweep(lambda c: bench_decode(32, 1024, bf16, c), DECODE_GRID, "tb_s", name)
        name = "prefill 1x2048 bfloat16"
        result["best"][name] = sweep(lambda c: bench_prefill(1, 2048, 0, bf16, c), PREFILL_GRID, "tflops", name)
        name = "prefill 8x384 after 1536"
        result["best"][name] = sweep(lambda c: bench_prefill(8, 384, 1536, bf16, c), PREFILL_GRID, "tflops", name)
    print(f"defaults: decode {DECODE_CONFIG}, prefill {PREFILL_CONFIG}")
    for kv, (batch, ctx) in itertools.product((bf16, i8), [(1, 2048), (32, 1024), (128, 1024), (128, 2048)]):
        row = bench_decode(batch, ctx, kv, None)
        result["decode"].append(row)
        print(f"  decode  {row['kv']:9} batch {batch:4d} ctx {ctx:5d} parts {row['parts']:2d}: "
              f"{row['us']:8.1f} us  {row['tb_s']:5.2f} TB/s of K/V", flush=True)
    for seqs, chunk, prefix, kv in [(1, 2048, 0, bf16), (1, 2048, 0, i8), (8, 384, 1536, bf16), (4, 512, 0, bf16)]:
        row = bench_prefill(seqs, chunk, prefix, kv, None)
        result["prefill"].append(row)
        print(f"  prefill {row['kv']:10} {seqs} x {chunk:4d} after {prefix:4d}: {row['us']:8.1f} us  "
              f"{row['tflops']:6.1f} TFLOP/s", flush=True)
    for seqs, chunk in [(1, 2048), (4, 512)]:
        row = bench_sdpa(seqs, chunk)
        result["prefill"].append(row)
        print(f"  prefill {row['kv']:10} {seqs} x {chunk:4d} after    0: {row['us']:8.1f} us  "
              f"{row['tflops']:6.1f} TFLOP/s (baseline)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
