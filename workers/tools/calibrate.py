"""`laneserve calibrate-kv`: int8 KV cache scales from a corpus, and what int8 KV costs in accuracy.

Owns the calibration method (docs/kv_int8.md): the corpus (text files, or JSONL with a "text"
field per line) is tokenised with the model's tokenizer, packed into --seq-len sequences the
way a RAG prompt packs retrieved documents, and prefilled through the real ModelRunner with a
full-precision KV pool; the K/V the pool then holds (post-RoPE, exactly what an int8 pool would
quantise) feed per-(layer, KV head) statistics of |x|:
  absmax (default)    scale = max |x| / 127: nothing clips
  percentile P        scale = the P-th percentile of |x| / 127 (nearest rank, exact: a running
                      top-k per head); larger values clamp to +-127 when written
Writes {"k_scale": [[per KV head] per layer], "v_scale": ..., "method": ...}.
Also owns `compare_kv`: teacher-forced logits of an int8-KV runner against a float-KV one.
A tool (workers/tools/): the worker never imports it; it may import the gateway's tokenizer.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from gateway.tokenizer import load_tokenizer
from laneserve.modelspec import load_model_config
from laneserve.wire import protocol as P
from workers.config import WorkerConfig
from workers.kv_cache import BLOCK_SIZE, bytes_per_block, resolve_kv_dtype
from workers.loader import resolve_device, resolve_dtype
from workers.runner import ModelRunner
from workers.tools.bench import unwritable, whole

METHODS = ("absmax", "percentile")


# ------------------------------------------------------------------------------------------ corpus
def read_corpus(paths: list[str]) -> list[str]:
    """Documents: a .jsonl file gives one per line ({"text": ...}); any other file is one document. A file that
    is not UTF-8 text or a line that is not such an object is a ValueError naming the file (and line)."""
    docs = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            try:
                if not path.endswith(".jsonl"):
                    docs.append(f.read())
                    continue
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except ValueError:
                        obj = None
                    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                        raise ValueError(f"{path}:{n}: expected a JSON object with a \"text\" string")
                    docs.append(obj["text"])
            except UnicodeDecodeError:
                raise ValueError(f"{path}: not UTF-8 text") from None
    return [d for d in docs if d.strip()]


def pack(token_docs: list[list[int]], seq_len: int, max_tokens: int) -> list[list[int]]:
    """Concatenate documents (each keeps its own bos) and cut into seq_len sequences, RAG-prompt style."""
    stream = [t for doc in token_docs for t in doc][:max_tokens]
    return [stream[i:i + seq_len] for i in range(0, len(stream), seq_len) if len(stream[i:i + seq_len]) > 1]


# ------------------------------------------------------------------------------------------ runner
def make_runner(model: str, seq_len: int, kv_cache_dtype: str = "auto", kv_scales: str = "", **kw):
    """A ModelRunner holding one seq_len sequence, eager, with the requested KV dtype."""
    mc = load_model_config(model)
    device = resolve_device(kw.get("device", "auto"))
    kv_dtype = resolve_kv_dtype(kv_cache_dtype, resolve_dtype(kw.get("dtype", "auto"), device))
    blocks = -(-seq_len // BLOCK_SIZE) + 1
    budget = blocks * bytes_per_block(mc.num_layers, mc.num_kv_heads, mc.head_dim, kv_dtype)
    cfg = WorkerConfig(model=model, max_model_len=min(seq_len, mc.max_position_embeddings), enforce_eager=True,
                       kv_cache_memory=str(budget), kv_cache_dtype=kv_cache_dtype, kv_scales=kv_scales, **kw)
    return ModelRunner(cfg)


def prefill(runner, ids: list[int], chunk: int, rid: str = "c", n_new: int = 1, step: int = 0) -> int:
    """Prefill ids as one request in chunks (sampling greedily at the end); returns the next step number."""
    params = P.SamplingParams(max_tokens=n_new, temperature=0.0)
    blocks = list(range(-(-(len(ids) + n_new) // runner.block_size)))
    new = [P.NewReq(request_id=rid, prompt_token_ids=ids, params=params, block_ids=blocks)]
    for start in range(0, len(ids), chunk):
        out = runner.execute(P.StepInput(step=step, new_reqs=new, num_scheduled_tokens={
            rid: min(chunk, len(ids) - start)}))
        if out.error:
            raise RuntimeError(out.error)
        new, step = [], step + 1
    return step


class _Stats:
    """Running per-(K/V, layer, head) absmax and, for a percentile, the top-k |x| per head."""

    def __init__(self, num_layers: int, num_kv_heads: int, method: str, percentile: float, max_values: int):
        self.method, self.percentile, self.count = method, percentile, 0
        self.absmax = torch.zeros(2, num_layers, num_kv_heads)
        self.keep = min(max_values, math.ceil(max_values * (1 - percentile / 100)) + 1)
        self.top = [torch.empty(2, num_kv_heads, 0) for _ in range(num_layers)]

    def add(self, kv: torch.Tensor) -> None:
        """kv [L, 2, n, Hkv, D] of one sequence."""
        self.count += kv.shape[2] * kv.shape[4]
        for layer in range(kv.shape[0]):
            a = kv[layer].float().abs().transpose(1, 2).flatten(2)  # [2, Hkv, n*D]
            self.absmax[:, layer] = torch.maximum(self.absmax[:, layer], a.amax(-1).cpu())
            if self.method == "percentile":
                both = torch.cat([self.top[layer].to(a.device), a], -1)
                self.top[layer] = both.topk(min(self.keep, both.shape[-1]), -1).values.cpu()

    def scales(self) -> torch.Tensor:
        """[2, L, Hkv] dequantisation steps (floored so an all-zero head cannot divide by zero)."""
        if self.method == "absmax":
            value = self.absmax
        else:
            rank = min(int(self.count * (1 - self.percentile / 100)), self.keep - 1)
            value = torch.stack([t[..., rank] for t in self.top], 1)
        return (value / 127.0).clamp_min(1e-6)


def calibrate(runner, seqs: list[list[int]], method: str = "absmax", percentile: float = 99.99,
              chunk: int = 2048) -> dict:
    mc = runner.model_config
    stats = _Stats(mc.num_layers, mc.num_kv_heads, method, percentile, sum(map(len, seqs)) * mc.head_dim)
    pool = runner.kv_cache.pool  # [L, 2, blocks, page, Hkv, D], full precision
    step = 0
    for i, ids in enumerate(seqs):
        step = prefill(runner, ids, chunk, rid=f"cal{i}", step=step)
        with torch.inference_mode():
            stats.add(pool[:, :, :-(-len(ids) // runner.block_size)].flatten(2, 3)[:, :, :len(ids)])
        runner.execute(P.StepInput(step=step, finished_req_ids=[f"cal{i}"]))
        step += 1
    s = stats.scales()
    name = "absmax" if method == "absmax" else f"percentile {percentile:g}"
    return {"k_scale": s[0].tolist(), "v_scale": s[1].tolist(), "method": name,
            "num_sequences": len(seqs), "num_tokens": sum(map(len, seqs))}


# ------------------------------------------------------------------------------------------ accuracy
class _LogitTap:
    """Keeps a copy of every logits row the model computes (eager runners only)."""

    def __init__(self, model):
        self.inner, self.rows = model.compute_logits, []
        model.compute_logits = self

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.inner(hidden)
        self.rows.append(logits.float().cpu())
        return logits


def compare_kv(ref, test, prompt: list[int], n_new: int, chunk: int = 2048, targets: list[int] | None = None
               ) -> dict:
    """Greedy decode n_new tokens with `ref` (float KV); `test` (int8 KV) is teacher-forced onto the
    same tokens, so every position compares logits over the same context. Returns the max abs logit
    difference, the share of positions whose argmax agrees, and the logits' spread for scale. With
    `targets` (the text after the prompt) both are teacher-forced onto the text instead, and the text's
    perplexity under float and int8 KV is added."""
    taps = _LogitTap(ref.model), _LogitTap(test.model)
    step = 0
    for r in (ref, test):
        step = prefill(r, prompt, chunk, rid="cmp", n_new=n_new)
    for i in range(n_new - 1):
        if targets is not None:
            ref.requests["cmp"].token_ids[-1] = targets[i]
        test.requests["cmp"].token_ids[-1] = ref.requests["cmp"].token_ids[-1]  # teacher forcing
        for r in (ref, test):
            out = r.execute(P.StepInput(step=step, num_scheduled_tokens={"cmp": 1}))
            if out.error:
                raise RuntimeError(out.error)
        step += 1
    for r in (ref, test):
        r.execute(P.StepInput(step=step, finished_req_ids=["cmp"]))
        r.model.compute_logits = taps[0].inner if r is ref else taps[1].inner
    a, b = torch.cat(taps[0].rows), torch.cat(taps[1].rows)
    out = {"positions": a.shape[0], "max_abs_logit_diff": (a - b).abs().max().item(),
           "greedy_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
           "logit_std": a.std().item()}
    if targets is not None:  # the text's own next tokens: its perplexity under each KV
        t = torch.tensor(targets[:a.shape[0]])
        for name, rows in (("perplexity_float_kv", a), ("perplexity_int8_kv", b)):
            logp = torch.log_softmax(rows[:len(t)].double(), -1)
            out[name] = math.exp(-logp[torch.arange(len(t)), t].mean().item())
        out["perplexity_increase"] = out["perplexity_int8_kv"] / out["perplexity_float_kv"] - 1
    return out


# ------------------------------------------------------------------------------------------ CLI
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="laneserve calibrate-kv", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="checkpoint dir (with tokenizer.json) or 'tiny'")
    ap.add_argument("--data", nargs="+", required=True, help="text file(s) or JSONL with a \"text\" field")
    ap.add_argument("--out", required=True, help="scales JSON to write (put it in the model dir as kv_scales.json "
                                                  "to have workers load it by default)")
    ap.add_argument("--method", choices=METHODS, default="absmax")
    ap.add_argument("--percentile", type=float, default=99.99, help="for --method percentile")
    ap.add_argument("--seq-len", type=whole(2), default=2048,
                    help="tokens per packed calibration sequence (at least 2, at most the model's context)")
    ap.add_argument("--max-tokens", type=whole(2), default=65536, help="calibrate on at most this many tokens")
    ap.add_argument("--eval-tokens", type=whole(0), default=0,
                    help="then decode this many tokens with float vs int8 KV (new scales) and report the difference; "
                         "0 (the default): no evaluation")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--seed", type=whole(0, 2**64 - 1), default=0, help="tiny/dummy weights' seed")
    args = ap.parse_args(argv)
    if not 0 < args.percentile <= 100:
        ap.error("argument --percentile: must be in (0, 100]")
    if problem := unwritable(args.out):
        ap.error(f"argument --out: {problem}")
    try:
        limit = load_model_config(args.model).max_position_embeddings
    except (ValueError, OSError) as exc:
        ap.error(f"argument --model: {exc}")
    if args.seq_len > limit:
        ap.error(f"argument --seq-len: {args.seq_len} exceeds the model's context ({limit} tokens, "
                 "max_position_embeddings)")
    if args.eval_tokens >= limit:
        ap.error(f"argument --eval-tokens: {args.eval_tokens}: at most {limit - 1} (the model's context, {limit} "
                 "tokens, holds a prompt of at least one token and the evaluated tokens)")

    tok = load_tokenizer(args.model)
    try:
        docs = read_corpus(args.data)
    except (OSError, ValueError) as exc:
        ap.error(f"argument --data: {exc}")
    seqs = pack([tok.encode(d) for d in docs], args.seq_len, args.max_tokens)
    if not seqs:
        ap.error(f"argument --data: {' '.join(args.data)}: " + ("no text" if not docs else
                 "fewer than 2 tokens: nothing to calibrate"))
    kw = dict(device=args.device, dtype=args.dtype, load_format=args.load_format, seed=args.seed)
    t0 = time.perf_counter()
    runner = make_runner(args.model, args.seq_len, **kw)
    result = calibrate(runner, seqs, args.method, args.percentile)
    result["model"] = args.model
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"calibrate-kv: {result['method']} over {result['num_tokens']} tokens in {result['num_sequences']} "
          f"sequences ({time.perf_counter() - t0:.1f}s) -> {args.out}")
    if args.eval_tokens > 0:
        prompt = seqs[-1][:max(1, min(len(seqs[-1]), args.seq_len - args.eval_tokens))]
        span = len(prompt) + args.eval_tokens
        ref = make_runner(args.model, span, **kw)
        test = make_runner(args.model, span, kv_cache_dtype="int8", kv_scales=args.out, **kw)
        print("calibrate-kv: int8 vs float KV, teacher-forced:", json.dumps(compare_kv(ref, test, prompt,
                                                                                        args.eval_tokens)))
        seq = seqs[-1]
        if len(seq) > args.eval_tokens:  # the text's last eval_tokens, after the rest: its perplexity under each KV
            head, text = seq[:-args.eval_tokens], seq[-args.eval_tokens:]
            ref, test = (make_runner(args.model, len(seq) + 1, **kw),
                         make_runner(args.model, len(seq) + 1, kv_cache_dtype="int8", kv_scales=args.out, **kw))
            print("calibrate-kv: int8 vs float KV on the text:", json.dumps(compare_kv(
                ref, test, head, args.eval_tokens, targets=text)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
