"""What structured output costs per step (docs/structured_output.md): the batcher's token masks, and the worker's
sampling with them.

`python -m workers.tools.mask_bench [--device cuda] [--tokenizer MODEL]`:
- sampling: one step's sampling kernels (workers.sampling.sample_on_device) for --batch rows of a --vocab logits
  matrix, with 0 or --constrained rows masked, greedy and temperature 1 rows half and half; on CUDA timed with
  events after warm-up, median of --reps; the masked rows are checked to sample allowed tokens only;
- batcher (with --tokenizer: a model name or path gateway.tokenizer.load_tokenizer takes): building the tokenizer
  and compiling a JSON schema, then the masks of --constrained requests that each follow the schema with random
  allowed tokens for 64 steps (batcher.grammar.Grammars.masks): wall time of one step's call on this host's CPU,
  median and p95 over --reps steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from laneserve.wire.protocol import SamplingParams
from workers.sampling import SampleRow, sample_on_device


def time_sampling(device: str, batch: int, vocab: int, constrained: int, reps: int) -> tuple[float, bool]:
    """Median ms of one step's sampling, and whether every masked row sampled an allowed token."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, vocab, generator=g).to(device)
    words = (vocab + 31) // 32
    allowed = np.random.default_rng(0).integers(0, 1 << 31, size=(constrained, words), dtype=np.int64)
    allowed = allowed.astype(np.int32)  # about half the tokens allowed
    rows = [SampleRow(SamplingParams(temperature=0.0 if i % 2 else 1.0), [1, 2, 3], 1,
                      allowed=allowed[i].tobytes() if i < constrained else None) for i in range(batch)]
    cuda = device.startswith("cuda")
    times = []
    ok = True
    for i in range(reps + 10):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        sampled = sample_on_device(logits, rows)
        if cuda:
            end.record()
        tokens, _ = sampled.collect()
        if i >= 10:
            times.append(start.elapsed_time(end) if cuda else (time.perf_counter() - t0) * 1000)
        for r in range(constrained):
            t = tokens[r]
            ok &= bool((allowed[r, t // 32] >> (t % 32)) & 1)
    return statistics.median(times), ok


def time_masks(model: str, constrained: int, reps: int) -> dict[str, float]:
    from batcher.grammar import Grammars
    from gateway import structured
    from gateway.schemas import CompletionRequest
    from gateway.tokenizer import load_tokenizer
    from laneserve.wire.protocol import Vocabulary

    tok = load_tokenizer(model)
    g = Grammars()
    g.set_vocabulary(Vocabulary(tokenizer_json=tok.tokenizer.to_str(), vocab_size=tok.vocab_size,
                                eos_token_ids=list(tok.eos_token_ids)))
    schema = {"type": "object", "properties": {"answer": {"type": "string"}, "sources": {
        "type": "array", "items": {"type": "integer"}}}, "required": ["answer", "sources"]}
    grammar = structured.constraint(CompletionRequest(guided_json=schema)).grammar
    t0 = time.perf_counter()
    g.compile(structured.constraint(CompletionRequest(guided_regex="a")).grammar)  # builds the tokenizer
    t1 = time.perf_counter()
    first = g.compile(grammar)
    out = {"vocab": tok.vocab_size, "tokenizer_ms": (t1 - t0) * 1000, "compile_ms": (time.perf_counter() - t1) * 1000}
    rng = np.random.default_rng(0)
    times = []
    for _ in range(max(1, reps // 64)):  # generations of 64 tokens: each step's masks, then a random allowed token
        matchers = [first.deep_copy() for _ in range(constrained)]
        for _ in range(64):
            t0 = time.perf_counter()
            masks = g.masks(matchers)
            times.append((time.perf_counter() - t0) * 1000)
            for m, mask in zip(matchers, masks):
                allowed = np.flatnonzero(np.unpackbits(np.frombuffer(mask, np.uint8), bitorder="little"))
                allowed = allowed[allowed != tok.eos_token_ids[0]] if len(allowed) > 1 else allowed
                m.consume_token(int(rng.choice(allowed)))
    out["masks_ms_p50"] = statistics.median(times)
    out["masks_ms_p95"] = float(np.percentile(times, 95))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--constrained", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--tokenizer", default="", help="also time the batcher's masks with this model's tokenizer")
    args = ap.parse_args()
    base, _ = time_sampling(args.device, args.batch, args.vocab, 0, args.reps)
    masked, ok = time_sampling(args.device, args.batch, args.vocab, args.constrained, args.reps)
    print(f"sampling {args.batch} rows x {args.vocab} on {args.device}: {base:.3f} ms plain, {masked:.3f} ms with "
          f"{args.constrained} masked (+{masked - base:.3f} ms); masked rows sampled allowed tokens only: {ok}")
    if args.tokenizer:
        print(f"batcher masks, {args.constrained} requests:", time_masks(args.tokenizer, args.constrained, args.reps))


if __name__ == "__main__":
    main()
