"""`laneserve bench`: decode throughput of our engine against the HBM roofline and HF `generate`.

One command runs every part and prints one table; JSON goes to --out. Parts:
  roofline  device copy bandwidth -> weight bytes / bandwidth = batch-1 floor per step
  engine    ModelRunner decode steps at several concurrencies (prefilled to --context), submitted as
            the worker loop does (overlapped steps where the runner overlaps)
  hf        transformers.generate on the same shapes and weights (eager, dynamic cache)
  breakdown GPU kernel time of decode and prefill steps by category vs wall time (breakdown.py)
Timing: CUDA events / synchronised wall clock after warm-up, medians. On CPU it runs the
tiny model so the code path stays tested; the numbers that matter come from a GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch

from workers.config import WorkerConfig
from workers.runner import ModelRunner
from workers.tools.breakdown import breakdown
from workers.tools.driver import EngineDriver, sync

MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 32000, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "sliding_window": None, "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
}


BREAKDOWN_PREFILL = 2048  # prefill chunk the breakdown profiles (the default --max-num-batched-tokens)


def write_dummy_model_dir(path: str, config: dict = MISTRAL_7B) -> str:
    """A checkpoint dir with config.json and a word-level tokenizer covering the vocab; weights come
    from --load-format dummy (random), so the compute is that of the real model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, config["vocab_size"])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}, f)
    return path


@dataclass
class Row:
    part: str
    batch: int
    context: int
    ms_per_step: float
    tok_per_s: float
    note: str = ""
    extra: dict = field(default_factory=dict)


def measure_copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy, bytes read + written per second (median of 20)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    times = []
    for i in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times)


# ---------------------------------------------------------------------------------------------- engine
def forward_graph_ms(runner, batch: int, reps: int = 20) -> float:
    """GPU time of the decode step's forward alone (its CUDA graph replayed back to back, inputs as
    the last step left them): the step's busy time, against which the wall time shows host gaps."""
    graphs = runner.graphs
    if graphs is None or not graphs.can_run(batch):
        return 0.0
    bs = next(s for s in graphs.sizes if s >= batch)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graphs.graphs[bs].replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_engine(runner, batches: list[int], context: int, steps: int, vocab: int, chunk: int) -> list[Row]:
    rows = []
    for batch in batches:
        drv = EngineDriver(runner, context)
        drv.prefill(batch, vocab, chunk)
        times = [drv.decode_step() for _ in range(steps + 5)][5:]
        serial_ms = 0.0
        if runner.overlap:  # the same steps without overlap, for the ratio
            runner.overlap = False
            serial_ms = statistics.median([drv.decode_step() for _ in range(steps + 1)][1:]) * 1e3
            runner.overlap = True
        runner.flush()
        drv.check(runner.take_outputs())
        graph_ms = forward_graph_ms(runner, batch)
        drv.finish()
        ms = statistics.median(times) * 1e3
        extra = {"forward_graph_ms": graph_ms, "gpu_busy": graph_ms / ms} if graph_ms else {}
        if serial_ms:
            extra["serial_ms_per_step"] = serial_ms
        full = [(n, t) for n, t in drv.prefill_steps if n == chunk] or drv.prefill_steps
        extra["prefill_ms_per_token"] = statistics.median(t / n for n, t in full) * 1e3
        rows.append(Row("engine", batch, context, ms, batch / ms * 1e3, extra=extra))
        busy = f"  forward graph {graph_ms:.2f} ms = {graph_ms / ms:.0%} of the step" if graph_ms else ""
        busy += f"  (not overlapped: {serial_ms:.2f} ms/step)" if serial_ms else ""
        print(f"  engine  batch {batch:4d}  {ms:8.2f} ms/step  {batch / ms * 1e3:9.0f} tok/s{busy}", flush=True)
    return rows


# ---------------------------------------------------------------------------------------------- HF baseline
def bench_hf(model_dir: str, batches: list[int], prompt_len: int, new_tokens: int, device: str, dtype) -> list[Row]:
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    rows = []
    for batch in batches:
        ids = torch.randint(3, cfg.vocab_size, (batch, prompt_len), device=device)
        kw = dict(do_sample=False, min_new_tokens=new_tokens, max_new_tokens=new_tokens, pad_token_id=0)
        with torch.inference_mode():
            model.generate(ids, **{**kw, "min_new_tokens": 4, "max_new_tokens": 4})  # warm-up
            sync()
            t0 = time.perf_counter()
            model.generate(ids, **kw)
            sync()
            t_gen = time.perf_counter() - t0
            t0 = time.perf_counter()
            model.generate(ids, **{**kw, "min_new_tokens": 1, "max_new_tokens": 1})  # prefill alone
            sync()
            t_pre = time.perf_counter() - t0
        decode_s = max(t_gen - t_pre, 1e-9) / (new_tokens - 1)
        rows.append(Row("hf", batch, prompt_len, decode_s * 1e3, batch / decode_s,
                        note=f"generate {new_tokens} tokens, prefill excluded"))
        print(f"  hf      batch {batch:4d}  {decode_s * 1e3:8.2f} ms/step  {batch / decode_s:9.0f} tok/s", flush=True)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def fit_cost_model(rows: list[Row]) -> dict:
    """Least squares of the simulator's step cost t = a + b*prefill_tokens + c*decode_seqs +
    d*kv_tokens_read (ms) on the engine rows: decode steps give a, c, d; prefill steps give b."""
    import numpy as np

    eng = [r for r in rows if r.part == "engine"]
    if len({(r.batch, r.context) for r in eng}) < 3:
        return {}
    x = np.array([[1.0, r.batch, r.batch * r.context] for r in eng])
    y = np.array([r.ms_per_step for r in eng])
    (a, c, d), *_ = np.linalg.lstsq(x, y, rcond=None)
    b = statistics.median(r.extra["prefill_ms_per_token"] for r in eng)
    return {"a": float(a), "b": float(b), "c": float(c), "d": float(d)}


def print_table(rows: list[Row], roofline: dict) -> None:
    print()
    if roofline:
        print(f"copy bandwidth {roofline['copy_bw_tb_s']:.2f} TB/s; weights {roofline['weight_gb']:.2f} GB; "
              f"batch-1 roofline {roofline['roofline_ms']:.2f} ms/step = {roofline['roofline_tok_s']:.0f} tok/s")
    hf = {r.batch: r for r in rows if r.part == "hf"}
    print(f"{'part':8} {'batch':>6} {'context':>8} {'ms/step':>9} {'tok/s':>10} {'vs HF':>7} {'vs roofline':>12}")
    for r in rows:
        vs_hf = f"{r.tok_per_s / hf[r.batch].tok_per_s:6.1f}x" if r.part != "hf" and r.batch in hf else ""
        vs_roof = (f"{roofline['roofline_ms'] / r.ms_per_step * 100:10.0f}%" if roofline and r.batch == 1 else "")
        print(f"{r.part:8} {r.batch:6d} {r.context:8d} {r.ms_per_step:9.2f} {r.tok_per_s:10.0f} {vs_hf:>7} {vs_roof:>12}"
              + (f"  {r.note}" if r.part == "engine" and r.note else ""))


def kv_ratios(rows: list[Row], kv_dtypes: list[str]) -> list[str]:
    """Engine tok/s of each later KV dtype against the first, per (batch, context) (issue 8's comparison)."""
    engine = {(r.extra.get("kv_cache_dtype"), r.batch, r.context): r for r in rows if r.part == "engine"}
    out = []
    for kv_dtype in kv_dtypes[1:]:
        for (dt, batch, context), r in engine.items():
            base = engine.get((kv_dtypes[0], batch, context))
            if dt == kv_dtype and base is not None:
                out.append(f"KV {kv_dtype} vs {kv_dtypes[0]}: batch {batch}, context {context}: "
                           f"{r.tok_per_s:.0f} / {base.tok_per_s:.0f} tok/s = {r.tok_per_s / base.tok_per_s:.2f}x")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="laneserve bench", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="checkpoint dir; default: a Mistral-7B-shaped dummy on GPU, tiny on CPU")
    ap.add_argument("--parts", default="roofline,engine,hf", help="comma list of roofline,engine,hf,breakdown")
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--hf-batches", default="1,32,64")
    ap.add_argument("--breakdown-batches", default="1,32,128")
    ap.add_argument("--contexts", default="1024", help="comma list of context lengths for the engine part")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="auto | int8, or a comma list (auto,int8): the engine part runs once per KV dtype, same "
                         "shapes, and prints each batch's tok/s ratio against the first")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--out", default="", help="write JSON here")
    args = ap.parse_args(argv)

    gpu = torch.cuda.is_available()
    parts = set(args.parts.split(","))
    model = args.model
    if not model:
        model = write_dummy_model_dir(tempfile.mkdtemp(prefix="bench-model-")) if gpu else "tiny"
    rows: list[Row] = []
    roofline: dict = {}
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    result: dict = {"argv": sys.argv, "date": time.strftime("%Y-%m-%d"), "device": (
        torch.cuda.get_device_name() if gpu else "cpu"), "torch": torch.__version__}
    kv_dtypes = args.kv_cache_dtype.split(",")
    for kv_dtype in kv_dtypes if parts & {"engine", "breakdown"} else kv_dtypes[:1]:
        if not parts & {"engine", "roofline", "breakdown"}:
            break
        cfg = WorkerConfig(model=model, load_format="dummy" if model != "tiny" else "auto",
                           dtype="bfloat16" if gpu else "float32", max_num_seqs=max(batches),
                           max_model_len=max(contexts + [BREAKDOWN_PREFILL * 4] * ('breakdown' in parts)) + args.steps + 128,
                           max_num_batched_tokens=8192, kv_cache_dtype=kv_dtype, enforce_eager=args.enforce_eager)
        t0 = time.perf_counter()
        runner = ModelRunner(cfg)
        result.setdefault("startup_s", {})[kv_dtype] = time.perf_counter() - t0
        if runner.graphs is not None:
            result.setdefault("graph_capture", {})[kv_dtype] = {
                "seconds": runner.graphs.capture_seconds, "mib": runner.graphs.capture_bytes / 2**20,
                "sizes": runner.graphs.sizes}
            print(f"decode graphs: {len(runner.graphs.sizes)} sizes captured in {runner.graphs.capture_seconds:.1f}s, "
                  f"{runner.graphs.capture_bytes / 2**20:.0f} MiB", flush=True)
        weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        if "roofline" in parts and gpu and not roofline:
            bw = measure_copy_bandwidth()
            roofline = {"copy_bw_tb_s": bw / 1e12, "weight_gb": weight_bytes / 1e9,
                        "roofline_ms": weight_bytes / bw * 1e3, "roofline_tok_s": bw / weight_bytes}
        if "engine" in parts:
            print(f"engine: KV cache {kv_dtype} ({runner.num_blocks} blocks)", flush=True)
            vocab = min(runner.model_config.vocab_size, 32000)
            got = [r for context in contexts for r in bench_engine(runner, batches, context, args.steps, vocab, 8192)]
            for r in got:
                r.extra["kv_cache_dtype"] = kv_dtype
                r.note = f"kv {kv_dtype}" if len(kv_dtypes) > 1 else r.note
            rows += got
        if "breakdown" in parts and gpu:
            print(f"breakdown: KV cache {kv_dtype}", flush=True)
            vocab = min(runner.model_config.vocab_size, 32000)
            got = breakdown(runner, [int(b) for b in args.breakdown_batches.split(",")], contexts[0], vocab, BREAKDOWN_PREFILL)
            result.setdefault("breakdown", {})[kv_dtype] = got
        del runner
        gc.collect()  # the runner's CUDA graphs and KV pool must go before the next runner / HF's model
        if gpu:
            torch.cuda.empty_cache()
    if "hf" in parts and model != "tiny":
        rows += bench_hf(model, [int(b) for b in args.hf_batches.split(",")], 512, 128,
                         "cuda" if gpu else "cpu", torch.bfloat16 if gpu else torch.float32)
    print_table(rows, roofline)
    ratios = kv_ratios(rows, kv_dtypes)
    for line in ratios:
        print(line)
    result["kv_ratios"] = ratios
    cost = fit_cost_model([r for r in rows if r.extra.get("kv_cache_dtype", kv_dtypes[0]) == kv_dtypes[0]])
    if cost:
        print("simulator step cost (ms): " + ", ".join(f"{k}={v:.4g}" for k, v in cost.items()))
    result.update(roofline=roofline, rows=[asdict(r) for r in rows], cost_model=cost)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
