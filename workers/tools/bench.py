"""`laneserve bench`: decode throughput of our engine against the HBM roofline and HF `generate`.

One command runs every part and prints one table; JSON goes to --out. Parts:
  roofline  device copy bandwidth -> weight bytes / bandwidth = batch-1 floor per step
  engine    ModelRunner decode steps at several concurrencies (prefilled to --context), submitted as
            the worker loop does (overlapped steps where the runner overlaps)
  hf        transformers.generate on the same shapes and weights (eager, dynamic cache)
  breakdown GPU kernel time of decode and prefill steps by category vs wall time (breakdown.py)
Timing: CUDA events / synchronised wall clock after warm-up, medians. On CPU it runs the
tiny model's engine part so the code path stays tested (roofline and breakdown need a GPU, hf a
--model checkpoint); the numbers that matter come from a GPU. A bad flag is argparse's error, before the
model loads.
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
import warnings
from dataclasses import asdict, dataclass, field

import torch

from laneserve.modelspec import load_model_config
from workers.config import WorkerConfig
from workers.attention import DECODE_KERNELS
from workers.kernels.gemv import MAX_M as GEMV_MAX_M
from workers.kv_cache import BLOCK_SIZE, KV_CACHE_DTYPES
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
BREAKDOWN_CHUNKS = 4  # its longest prefill: 4 chunks of BREAKDOWN_PREFILL tokens in one sequence
PARTS = ("roofline", "engine", "mixed", "hf", "breakdown")
# EngineDriver gives each request KV blocks for 64 pages (1,024 tokens) past its prompt; the engine part decodes
# 2 x --steps + 6 tokens (warm-up, timed and, when the runner overlaps steps, not-overlapped steps)
MAX_STEPS = 500
DECODE_HEADROOM = 64  # the driver's pages per request past the prompt
HF_PROMPT, HF_NEW_TOKENS = 512, 128  # the hf part's shapes


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


# ---------------------------------------------------------------------------------------------- flags
# argparse types and checks shared with calibrate.py (a bad value is argparse's one-line error, exit status 2)
def whole(low: int, high: int | None = None):
    """argparse type: a whole number >= low (and <= high)."""
    def whole_number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text!r}: must be at least {low}" if high is None else
                                             f"{text!r}: must be {low} to {high}")
        return value
    return whole_number


def counts(text: str) -> list[int]:
    """argparse type: a comma list of whole numbers >= 1 ('1,8,32')."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of whole numbers, e.g. 1,8,32") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be at least 1")
    return values


def token_counts(text: str) -> list[int]:
    """A comma list of whole numbers >= 0, no repeats."""
    values = [whole(0)(t) for t in text.split(",")]
    if len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(f"{text!r}: a value repeats")
    return values


def names(choices: tuple[str, ...], what: str, repeat: bool = True):
    """argparse type: a comma list of names from choices, in order (repeats dropped, or an error if not repeat)."""
    def name_list(text: str) -> list[str]:
        got = [x.strip() for x in text.split(",")]
        bad = [x for x in got if x not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(map(repr, bad))}; choose from "
                                             f"{', '.join(choices)}")
        if not repeat and len(set(got)) < len(got):
            raise argparse.ArgumentTypeError(f"{text!r}: give each {what} once")
        return list(dict.fromkeys(got))
    return name_list


def unwritable(path: str) -> str:
    """Why `path` cannot be written as a file ('' if it can): checked before a long run, not after it. A file
    that did not exist is created to find out, then removed."""
    if os.path.isdir(path):
        return f"{path} is a directory"
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        return f"cannot write {path}: {exc.strerror or exc}"
    if not existed:
        os.remove(path)
    return ""


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


def held_tensors(min_bytes: int = 2**28) -> str:
    """What refers to each live CUDA tensor of at least min_bytes (its referrers' types): a leak's owners."""
    found = []
    with warnings.catch_warnings():  # (isinstance on some of torch's deprecated module proxies warns)
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in tensors:
        if obj.is_cuda and obj.untyped_storage().nbytes() >= min_bytes:
            owners = sorted({type(r).__qualname__ for r in gc.get_referrers(obj) if r is not tensors})
            found.append(f"{tuple(obj.shape)} <- {', '.join(owners) or '?'}")
    return "; ".join(found[:8]) or "no tensor object (a CUDA graph's pool, or C++)"


# ---------------------------------------------------------------------------------------------- engine
def forward_graph_ms(runner, batch: int, reps: int = 20) -> float:
    """GPU time of the decode step's forward alone (its CUDA graph replayed back to back, inputs as
    the last step left them): the step's busy time, against which the wall time shows host gaps."""
    graphs = runner.graphs
    if graphs is None or not graphs.can_run(batch) or graphs.last is None:
        return 0.0
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graphs.graphs[graphs.last].replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_engine(runner, batches: list[int], context: int, steps: int, vocab: int, chunk: int,
                 long_context: int = 0) -> list[Row]:
    rows = []
    for batch in batches:
        drv = EngineDriver(runner, context, long_context=long_context)
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


def bench_mixed(runner, batches: list[int], context: int, chunks: list[int], steps: int, vocab: int) -> list[Row]:
    """Steps with a prompt chunk (eager, or piecewise CUDA graphs): `batch` decodes beside a new prompt's chunk of
    each size, nothing in flight before them; the median host launch time and device time (from the GPU's start on
    the step: a launch slower than the GPU shows there) of `steps` such steps after 3 warm-ups."""
    rows = []
    for batch in batches:
        drv = EngineDriver(runner, context)
        drv.prefill(batch, vocab, 8192)
        for chunk in chunks:
            outs = [drv.mixed_step(chunk, vocab) for _ in range(steps + 3)][3:]
            launch = statistics.median(o.launch_time for o in outs) * 1e3
            ms = statistics.median(o.execute_time for o in outs) * 1e3
            piecewise = runner.pieces is not None and runner.pieces.can_run(batch + chunk)
            how = "piecewise graphs" if piecewise else "eager"
            rows.append(Row("mixed", batch, context, ms, (batch + chunk) / ms * 1e3, note=f"chunk {chunk}, {how}",
                            extra={"chunk": chunk, "launch_ms": launch, "piecewise": piecewise}))
            print(f"  mixed   batch {batch:4d} + chunk {chunk:5d}  {ms:8.2f} ms/step (device)  launch {launch:6.2f} ms"
                  f"  ({how})", flush=True)
        drv.finish()
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
        vs_roof = (f"{roofline['roofline_ms'] / r.ms_per_step * 100:10.0f}%"
                   if roofline and r.batch == 1 and r.part == "engine" else "")
        print(f"{r.part:8} {r.batch:6d} {r.context:8d} {r.ms_per_step:9.2f} {r.tok_per_s:10.0f} {vs_hf:>7} "
              f"{vs_roof:>12}"
              + (f"  {r.note}" if r.part in ("engine", "mixed") and r.note else ""))


def variant_ratios(rows: list[Row], labels: list[str]) -> list[str]:
    """Engine tok/s and mixed-step speed of each later variant (KV dtype, decode attention, piecewise graphs)
    against the first, per (batch, context, chunk): issue 8's int8 comparison, issue 25's persistent one."""
    keyed = {(r.part, r.extra.get("variant"), r.batch, r.context, r.extra.get("chunk")): r for r in rows
             if r.part in ("engine", "mixed")}
    out = []
    for label in labels[1:]:
        for (part, v, batch, context, chunk), r in keyed.items():
            base = keyed.get((part, labels[0], batch, context, chunk))
            if v != label or base is None:
                continue
            if part == "engine":
                out.append(f"{v} vs {labels[0]}: batch {batch}, context {context}: "
                           f"{r.tok_per_s:.0f} / {base.tok_per_s:.0f} tok/s = {r.tok_per_s / base.tok_per_s:.2f}x")
            else:
                speed = base.ms_per_step / r.ms_per_step
                out.append(f"{v} vs {labels[0]}: mixed step, batch {batch} + chunk {chunk}: device "
                           f"{r.ms_per_step:.2f} / {base.ms_per_step:.2f} ms = {speed:.2f}x, "
                           f"launch {r.extra['launch_ms']:.2f} / {base.extra['launch_ms']:.2f} ms")
    return out


def skipped_parts(gpu: bool, tiny: bool) -> dict[str, str]:
    """The parts this machine and model cannot run -> why, in the user's terms."""
    why = {}
    if not gpu:
        why["roofline"] = "needs a GPU (it times device memory copies)"
        why["breakdown"] = "needs a GPU (it profiles CUDA kernels)"
    if tiny:
        why["hf"] = "needs a checkpoint that transformers can build (--model DIR), which tiny is not"
    return why


def check_lengths(ap: argparse.ArgumentParser, args: argparse.Namespace, parts: set[str], limit: int) -> int:
    """The runner's --max-model-len for the parts, or an error in bench's own flags if the model cannot hold it
    (`limit`: its max_position_embeddings)."""
    longest = max(args.contexts)
    if "engine" in parts and (need := longest + 2 * args.steps + 7) > limit:
        ap.error(f"--contexts {longest} with --steps {args.steps} needs {need} tokens of context (context + "
                 f"2 x steps + 7); the model holds {limit} (max_position_embeddings): lower --contexts")
    if "engine" in parts and (need := args.long_context + 2 * args.steps + 7) > limit:
        ap.error(f"--long-context {args.long_context} with --steps {args.steps} needs {need} tokens of context; the "
                 f"model holds {limit} (max_position_embeddings): lower --long-context")
    if "engine" in parts:
        longest = max(longest, args.long_context)
    if "breakdown" in parts:
        need = max(BREAKDOWN_CHUNKS * BREAKDOWN_PREFILL + 1, args.contexts[0] + 23)
        if need > limit:
            ap.error(f"--parts breakdown needs {need} tokens of context (a {BREAKDOWN_CHUNKS} x {BREAKDOWN_PREFILL}-"
                     f"token prefill, and decode at --contexts {args.contexts[0]}); the model holds {limit} "
                     f"(max_position_embeddings): leave breakdown out of --parts or lower --contexts")
        longest = max(longest, BREAKDOWN_CHUNKS * BREAKDOWN_PREFILL)
    if "hf" in parts and HF_PROMPT + HF_NEW_TOKENS > limit:
        ap.error(f"--parts hf generates {HF_NEW_TOKENS} tokens after a {HF_PROMPT}-token prompt; the model holds "
                 f"{limit} (max_position_embeddings): leave hf out of --parts")
    return min(limit, longest + 2 * args.steps + 128)


def check_kv_pool(ap: argparse.ArgumentParser, args: argparse.Namespace, parts: set[str], runner) -> None:
    """The KV blocks EngineDriver hands out fit the runner's pool (its size is known only once it is built)."""
    page = runner.block_size

    def blocks(batch: int, context: int, long: int = 0) -> int:
        return (batch - bool(long)) * ((context + 1 + page) // page + DECODE_HEADROOM) + bool(long) * (
            (long + 1 + page) // page + DECODE_HEADROOM)
    checks = []
    if "engine" in parts:
        checks.append(("--batches", max(args.batches), max(args.contexts), args.long_context))
    if "breakdown" in parts:
        checks.append(("--breakdown-batches", max(args.breakdown_batches), args.contexts[0], 0))
    for flag, batch, context, long in checks:
        if (need := blocks(batch, context, long)) > runner.num_blocks:
            ap.error(f"{flag} {batch} at --contexts {context}{f' and --long-context {long}' if long else ''} needs "
                     f"{need} KV blocks of {page} tokens; the pool holds {runner.num_blocks}: lower {flag} or "
                     "--contexts")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="laneserve bench", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="",
                    help="checkpoint dir; default: a Mistral-7B-shaped dummy on GPU, tiny on CPU")
    ap.add_argument("--parts", type=names(PARTS, "part"), default="roofline,engine,hf",
                    help="comma list of roofline,engine,mixed,hf,breakdown (mixed: steps with a prompt chunk; "
                         "roofline and breakdown need a GPU, hf a checkpoint: on CPU without --model only engine and "
                         "mixed run)")
    ap.add_argument("--batches", type=counts, default="1,8,32,64,128,256", help="engine concurrencies, comma list")
    ap.add_argument("--hf-batches", type=counts, default="1,32,64", help="hf concurrencies, comma list")
    ap.add_argument("--breakdown-batches", type=counts, default="1,32,128", help="breakdown concurrencies, comma list")
    ap.add_argument("--contexts", type=counts, default="1024",
                    help="comma list of context lengths for the engine part (the first one for breakdown)")
    ap.add_argument("--long-context", type=whole(0), default=0,
                    help="engine part: the first request of each batch has this context instead of --contexts' (a "
                         "skewed batch, issue 25's 1 x 32k + 63 x 512, say); 0: none (default)")
    ap.add_argument("--steps", type=whole(1, MAX_STEPS), default=30,
                    help=f"timed decode steps per engine row, 1 to {MAX_STEPS} (each benchmark request holds KV "
                         f"for {DECODE_HEADROOM * BLOCK_SIZE} decoded tokens; default 30)")
    ap.add_argument("--kv-cache-dtype", type=names(KV_CACHE_DTYPES, "KV cache dtype", repeat=False), default="auto",
                    help="auto | int8, or a comma list (auto,int8): the engine part runs once per KV dtype, same "
                         "shapes, and prints each batch's tok/s ratio against the first")
    ap.add_argument("--decode-attention", type=names(DECODE_KERNELS, "decode attention", repeat=False),
                    default="auto", help="auto | partitioned | persistent, or a comma list: the Triton decode "
                    "kernel (a GPU's; --decode-attention of laneserve serve); with a list, or with several KV dtypes, "
                    "the engine part runs once per combination and prints each batch's tok/s ratio against the first")
    ap.add_argument("--chunks", type=counts, default="256,1024,1920",
                    help="mixed part: prompt-chunk sizes, each beside every --batches' decodes, comma list (a step of "
                         "more than --piecewise-graph-tokens tokens runs eagerly: its row says so)")
    ap.add_argument("--piecewise-graph-tokens", type=token_counts, default="2048",
                    help="laneserve serve's --piecewise-graph-tokens (CUDA graphs for steps with a prompt chunk; 0: "
                         "eager), or a comma list (0,2048): the engine and mixed parts run once per value and print "
                         "the ratios against the first")
    ap.add_argument("--decode-gemv-rows", type=token_counts, default=[-1],
                    help="laneserve serve's --decode-gemv-rows (a GPU's fused GEMV path for steps of <= 8 tokens; 0: "
                         "cuBLAS; by default serve's auto: 8 on a GPU with a bf16 or fp16 model), or a comma list "
                         "(0,8): the engine part runs once per value and prints the ratios against the first")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--out", default="", help="write JSON here")
    args = ap.parse_args(argv)
    if args.out and (problem := unwritable(args.out)):
        ap.error(f"argument --out: {problem}")

    gpu = torch.cuda.is_available()
    if len(args.piecewise_graph_tokens) > 1 and not gpu:
        ap.error("argument --piecewise-graph-tokens: a list compares CUDA graphs with eager steps; this machine has "
                 "no GPU")
    if max(args.decode_gemv_rows) > GEMV_MAX_M:
        ap.error(f"argument --decode-gemv-rows: {max(args.decode_gemv_rows)}: each value must be 0 to {GEMV_MAX_M}")
    if args.decode_gemv_rows not in ([0], [-1]) and not gpu:
        ap.error(f"argument --decode-gemv-rows: {','.join(map(str, args.decode_gemv_rows))} runs the GPU's Triton "
                 "GEMV kernels; this machine has no GPU")
    if (len(args.decode_attention) > 1 or "persistent" in args.decode_attention) and not gpu:
        ap.error(f"argument --decode-attention: {','.join(args.decode_attention)} picks among the GPU attention "
                 "backend's Triton kernels; this machine has no GPU")
    tiny = args.model == "tiny" or (not args.model and not gpu)
    why = skipped_parts(gpu, tiny)
    if all(p in why for p in args.parts):
        ap.error("--parts: " + "; ".join(f"{p} {why[p]}" for p in args.parts))
    for p in args.parts:
        if p in why:
            print(f"laneserve bench: note: skipping --parts {p}: it {why[p]}", file=sys.stderr, flush=True)
    parts = {p for p in args.parts if p not in why}
    model = args.model
    if not model:
        model = write_dummy_model_dir(tempfile.mkdtemp(prefix="bench-model-")) if gpu else "tiny"
    try:
        limit = load_model_config(model).max_position_embeddings
    except (ValueError, OSError) as exc:
        ap.error(f"argument --model: {exc}")
    max_model_len = check_lengths(ap, args, parts, limit)
    rows: list[Row] = []
    roofline: dict = {}
    batches, contexts = args.batches, args.contexts
    result: dict = {"argv": sys.argv, "date": time.strftime("%Y-%m-%d"), "device": (
        torch.cuda.get_device_name() if gpu else "cpu"), "torch": torch.__version__}
    pieces = args.piecewise_graph_tokens
    gemv_rows = args.decode_gemv_rows
    variants = {(f"KV {kv}" + (f", {da} decode" if len(args.decode_attention) > 1 else "")
                 + (f", pieces {pw}" if len(pieces) > 1 else "") + (f", gemv {g}" if len(gemv_rows) > 1 else "")
                 ): (kv, da, pw, g)
                for kv in args.kv_cache_dtype for da in args.decode_attention for pw in pieces for g in gemv_rows}
    labels = list(variants)  # name -> (KV dtype, decode kernel, piecewise graph tokens, GEMV rows)
    # before any model is loaded: its KV pool takes the memory the copy needs (an H100's 80 GB ran out)
    bw = measure_copy_bandwidth() if "roofline" in parts and gpu else None
    for name in labels if parts & {"engine", "mixed", "breakdown"} else labels[:1]:
        kv_dtype, decode_attention, piecewise, gemv = variants[name]
        if not parts & {"engine", "mixed", "roofline", "breakdown"}:
            break
        cfg = WorkerConfig(model=model, load_format="dummy" if model != "tiny" else "auto",
                           dtype="bfloat16" if gpu else "float32", max_num_seqs=max(batches),
                           max_model_len=max_model_len, max_num_batched_tokens=8192, kv_cache_dtype=kv_dtype,
                           decode_attention=decode_attention, enforce_eager=args.enforce_eager,
                           piecewise_graph_tokens=piecewise, decode_gemv_rows=gemv)
        t0 = time.perf_counter()
        runner = ModelRunner(cfg)
        check_kv_pool(ap, args, parts, runner)
        result.setdefault("startup_s", {})[name] = time.perf_counter() - t0
        if runner.graphs is not None:
            result.setdefault("graph_capture", {})[name] = {
                "seconds": runner.graphs.capture_seconds, "mib": runner.graphs.capture_bytes / 2**20,
                "sizes": runner.graphs.sizes}
            print(f"decode graphs: {len(runner.graphs.sizes)} sizes captured in {runner.graphs.capture_seconds:.1f}s, "
                  f"{runner.graphs.capture_bytes / 2**20:.0f} MiB", flush=True)
        if runner.pieces is not None:  # (no local name for it: one would keep the runner's model and pool alive)
            result.setdefault("piecewise_capture", {})[name] = {
                "seconds": runner.pieces.capture_seconds, "mib": runner.pieces.capture_bytes / 2**20,
                "sizes": runner.pieces.sizes}
            print(f"piecewise graphs: {len(runner.pieces.sizes)} token counts up to {runner.pieces.sizes[-1]} captured "
                  f"in {runner.pieces.capture_seconds:.1f}s, {runner.pieces.capture_bytes / 2**20:.0f} MiB", flush=True)
        vocab = min(runner.model_config.vocab_size, 32000)
        weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        if bw and not roofline:
            roofline = {"copy_bw_tb_s": bw / 1e12, "weight_gb": weight_bytes / 1e9,
                        "roofline_ms": weight_bytes / bw * 1e3, "roofline_tok_s": bw / weight_bytes}
        if "engine" in parts:
            print(f"engine: {name} ({runner.num_blocks} blocks)", flush=True)
            got = [r for context in contexts for r in bench_engine(runner, batches, context, args.steps, vocab, 8192,
                                                                   args.long_context)]
            for r in got:
                r.extra["variant"] = name
                if args.long_context:
                    r.extra["long_context"] = args.long_context
                    r.note = f"{r.note}, first at {args.long_context}".lstrip(", ")
                r.note = name if len(variants) > 1 else r.note
            rows += got
        if "mixed" in parts:
            print(f"mixed: {name}", flush=True)
            got = bench_mixed(runner, batches, contexts[0], args.chunks, args.steps, vocab)
            for r in got:
                r.extra["variant"] = name
                r.note = f"{r.note}, {name}" if len(variants) > 1 else r.note
            rows += got
        if "breakdown" in parts and gpu:
            print(f"breakdown: {name}", flush=True)
            got = breakdown(runner, args.breakdown_batches, contexts[0], vocab, BREAKDOWN_PREFILL)
            result.setdefault("breakdown", {})[name] = got
        del runner
        gc.collect()  # the runner's CUDA graphs and KV pool must go before the next runner / HF's model
        if gpu:
            torch.cuda.empty_cache()
            if torch.cuda.memory_allocated() > 2**30:  # (an H100 ran out in the next variant's load, 2026-12-05)
                print(f"warning: {torch.cuda.memory_allocated() / 2**30:.1f} GiB still allocated after the runner of "
                      f"{name} was freed, held by: {held_tensors()}", flush=True)
    if "hf" in parts:
        rows += bench_hf(model, args.hf_batches, HF_PROMPT, HF_NEW_TOKENS,
                         "cuda" if gpu else "cpu", torch.bfloat16 if gpu else torch.float32)
    print_table(rows, roofline)
    ratios = variant_ratios(rows, labels)
    for line in ratios:
        print(line)
    result["ratios"] = ratios
    cost = fit_cost_model([r for r in rows if r.extra.get("variant") == labels[0]])
    if cost:
        print("simulator step cost (ms): " + ", ".join(f"{k}={v:.4g}" for k, v in cost.items()))
    result.update(roofline=roofline, rows=[asdict(r) for r in rows], cost_model=cost)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
