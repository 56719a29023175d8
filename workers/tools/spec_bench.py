"""Speculative decoding on the GPU (issue 22, docs/speculative.md): what a verify step costs, and what drafts of a
given acceptance rate buy end to end.

`python -m workers.tools.spec_bench --json out.json` on the Mistral-7B shape with dummy bf16 weights:
- verify: the time of one step that verifies K drafts for each of B requests (K = 0 is a plain decode step), for
  B in --batches and K = 0..8, each the median of --reps after warm-up, the requests' state restored after each;
- alpha: tokens/s of greedy decoding of --tokens tokens per request at batch B with K drafts per step, the drafts
  the model's own greedy continuation of each request as it stands (K plain decode steps before each timed step,
  untimed, then rewound), each replaced by a random token with probability 1 - alpha, against decoding without
  drafts (only the verify steps are timed). Random weights cannot show a real acceptance rate; this sets it.
  The measured acceptance is reported too: a verify runs B(K+1) rows where the plain steps ran B, and bf16
  results that differ in the last bit can flip a near-tie, so it falls a little below alpha. (A first version
  took every draft from one continuation computed up front: after the first such flip the request left that
  continuation and nearly every later draft was rejected, 0-10% acceptance at alpha 1.)
- draft (`--draft-model dummy` for a ~0.33B draft of the 7B's vocabulary with dummy weights, or a path): the time
  of one step whose worker's draft model proposes K drafts for each of B requests and the model verifies them
  (`--speculative draft`), and the draft's share of it (StepOutput.draft_time), for K = 1..8; with the verify
  and plain step times of the same call, the speedup K drafts of acceptance alpha would give, E(K) times the
  plain step over the draft-and-verify step (random weights accept nothing, so this is computed, not run).
`python -m workers.tools.spec_bench plot out.json out.png [ACCEPTANCE]` draws the alpha sweep: speedup against the
measured acceptance rate, with a mark at a real model's rate.
Steps go through ModelRunner.execute as the worker runs them (CUDA graphs: a verify is a decode graph replay with
B(K+1) rows while that fits the largest graph, else an eager step); the batcher's round trip is not included.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time

import torch

from laneserve.wire import protocol as P
from workers.config import WorkerConfig
from workers.runner import ModelRunner
from batcher.spec import expected_tokens
from workers.tools.bench import MISTRAL_7B, write_dummy_model_dir
from workers.tools.driver import EngineDriver, sync


# a ~0.33B draft of the Mistral-7B vocabulary (24 layers of 1024, 4 KV heads)
DRAFT_SHAPE = MISTRAL_7B | {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 24,
                            "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64}


class Bench:
    def __init__(self, runner: ModelRunner, batch: int, context: int):
        self.runner = runner
        self.driver = EngineDriver(runner, context)
        self.driver.prefill(batch, runner.model_config.vocab_size, 8192)
        runner.flush()
        runner.take_outputs()
        self.step = 1 << 20
        self.saved = self.snapshot()

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """Each request's token count and num_computed_tokens (steps only append tokens: rewind() undoes them)."""
        return {rid: (len(r.token_ids), r.num_computed_tokens) for rid, r in self.runner.requests.items()}

    def rewind(self, snap: dict[str, tuple[int, int]]) -> None:
        for rid, (n, done) in snap.items():
            r = self.runner.requests[rid]
            del r.token_ids[n:]
            r.num_computed_tokens = done

    def restore(self) -> None:
        """Back to the state after the prefill."""
        self.rewind(self.saved)

    def run(self, drafts: dict[str, list[int]]) -> P.StepOutput:
        """One step: each request its last token plus its drafts (none: a plain decode)."""
        self.step += 1
        sched = {rid: 1 + len(drafts.get(rid, ())) for rid in self.runner.requests}
        return self.runner.execute(P.StepInput(step=self.step, num_scheduled_tokens=sched,
                                               spec_token_ids={r: d for r, d in drafts.items() if d}))


    def run_draft(self, k: int, catch_up: bool = False) -> P.StepOutput:
        """One step whose draft model proposes k drafts per request (its draft K/V complete: catch_up computes it
        for the whole context first, with no drafts)."""
        self.step += 1
        jobs = {rid: P.DraftJob(0 if catch_up else r.num_computed_tokens, r.num_computed_tokens + 1, k)
                for rid, r in self.runner.requests.items()}
        return self.runner.execute(P.StepInput(step=self.step, num_scheduled_tokens={r: 1 + k for r in jobs},
                                               draft_jobs=jobs))


def draft_costs(bench: Bench, ks: list[int], reps: int) -> dict[int, tuple[float, float]]:
    """K -> (ms of a draft-and-verify step, ms of its draft part), medians after warm-up."""
    bench.run_draft(0, catch_up=True)
    bench.restore()
    out = {}
    for k in ks:
        steps, drafts = [], []
        for i in range(reps + 3):
            bench.restore()
            sync()
            t0 = time.perf_counter()
            result = bench.run_draft(k)
            sync()
            if i >= 3:
                steps.append(time.perf_counter() - t0)
                drafts.append(result.draft_time)
        out[k] = (statistics.median(steps) * 1000.0, statistics.median(drafts) * 1000.0)
    bench.restore()
    return out


def verify_costs(bench: Bench, ks: list[int], reps: int) -> dict[int, float]:
    out = {}
    vocab = bench.runner.model_config.vocab_size
    for k in ks:
        drafts = {rid: [random.randrange(3, vocab) for _ in range(k)] for rid in bench.runner.requests}
        times = []
        for i in range(reps + 3):
            bench.restore()
            sync()
            t0 = time.perf_counter()
            bench.run(drafts)
            sync()
            if i >= 3:
                times.append(time.perf_counter() - t0)
        out[k] = statistics.median(times) * 1000.0
    bench.restore()
    return out


def decode_with_drafts(bench: Bench, k: int, alpha: float, tokens: int, seed: int = 0) -> dict:
    """Generate `tokens` per request; each timed step verifies k drafts per request: the model's own greedy
    continuation of the request as it stands (k plain decode steps, untimed, then rewound), each draft replaced
    by a random token with probability 1 - alpha. k = 0: plain decode steps."""
    rng = random.Random(seed)
    vocab = bench.runner.model_config.vocab_size
    made = dict.fromkeys(bench.runner.requests, 0)
    drafted = accepted = steps = 0
    seconds = 0.0
    while min(made.values()) < tokens:
        drafts = {}
        if k:
            snap = bench.snapshot()
            ahead = {rid: [] for rid in made}
            for _ in range(k):
                out = bench.run({})
                for rid, toks in zip(out.request_ids, out.sampled_token_ids):
                    ahead[rid] += toks
            bench.rewind(snap)
            drafts = {rid: [t if rng.random() < alpha else rng.randrange(3, vocab) for t in ahead[rid]]
                      for rid in made}
        sync()
        t0 = time.perf_counter()
        out = bench.run(drafts)
        sync()
        seconds += time.perf_counter() - t0
        steps += 1
        for rid, toks in zip(out.request_ids, out.sampled_token_ids):
            made[rid] += len(toks)
            if rid in drafts:
                drafted += len(drafts[rid])
                accepted += len(toks) - 1
    bench.restore()
    return {"k": k, "alpha": alpha, "tok_s": sum(made.values()) / seconds, "steps": steps,
            "acceptance": accepted / drafted if drafted else None}


def plot(result: dict, path: str, real_acceptance: float | None = None) -> None:
    """Speedup against the measured acceptance rate, a line per (batch, K); a mark at a real model's rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for batch, rows in result["alpha"].items():
        for k in sorted({r["k"] for r in rows if r["k"]}):
            pts = sorted((r["acceptance"], r["speedup"]) for r in rows if r["k"] == k)
            ax.plot(*zip(*pts), marker="o", label=f"batch {batch}, K {k}")
    ax.axhline(1.0, color="grey", lw=0.8)
    if real_acceptance is not None:
        ax.axvline(real_acceptance, color="black", ls="--", lw=1)
        ax.annotate(f"SmolLM2-135M, prompt lookup: {real_acceptance:.2f}", (real_acceptance, ax.get_ylim()[1]),
                    xytext=(4, -12), textcoords="offset points", fontsize=8)
    ax.set_xlabel("acceptance rate (draft tokens accepted)")
    ax.set_ylabel("output tok/s against no drafts")
    ax.set_title(f"Verify with drafts of set acceptance, {result['device']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "plot":  # plot JSON PNG [REAL_ACCEPTANCE]
        plot(json.load(open(sys.argv[2])), sys.argv[3], float(sys.argv[4]) if len(sys.argv) > 4 else None)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--alpha-batches", default="1,8,32")
    ap.add_argument("--alphas", default="0,0.5,0.7,0.8,0.9,1.0")
    ap.add_argument("--ks", default="2,4,8", help="draft tokens per step for the alpha sweep")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=96, help="tokens generated per request in the alpha sweep")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--model", default="", help="default: the Mistral-7B shape with dummy bf16 weights")
    ap.add_argument("--draft-model", default="", help="also time draft-model steps: 'dummy' (a ~0.33B shape, dummy "
                    "weights) or a model path")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    draft = args.draft_model
    if draft == "dummy":
        draft = write_dummy_model_dir(tempfile.mkdtemp(), DRAFT_SHAPE)
    if args.model:  # e.g. tiny, to try the tool on a CPU
        runner = ModelRunner(WorkerConfig(model=args.model, max_model_len=4096, kv_cache_memory="64MiB",
                                          draft_model=draft))
    else:
        runner = ModelRunner(WorkerConfig(model=write_dummy_model_dir(tempfile.mkdtemp()), load_format="dummy",
                                          dtype="bfloat16", max_model_len=4096, max_num_seqs=256, draft_model=draft))
    device = torch.cuda.get_device_name() if runner.device.type == "cuda" else "cpu"
    result = {"device": device, "context": args.context, "verify_ms": {}, "alpha": {}, "draft_ms": {}}
    alpha_batches = {int(b) for b in args.alpha_batches.split(",")}
    for b in (int(x) for x in args.batches.split(",")):
        runner.reset()
        bench = Bench(runner, b, args.context)
        costs = verify_costs(bench, list(range(9)), args.reps)
        result["verify_ms"][b] = costs
        print(f"batch {b}: verify ms by K " + " ".join(f"{k}:{v:.2f}" for k, v in costs.items()), flush=True)
        if draft:
            drafted = draft_costs(bench, list(range(1, 9)), args.reps)
            result["draft_ms"][b] = {k: {"step": step, "draft": part, "speedup": {
                a: round(expected_tokens(k, float(a)) * costs[0] / step, 3) for a in args.alphas.split(",")}}
                for k, (step, part) in drafted.items()}
            print(f"batch {b}: draft+verify ms (draft part) by K " + " ".join(
                f"{k}:{step:.2f}({part:.2f})" for k, (step, part) in drafted.items()), flush=True)
        if b not in alpha_batches:
            continue
        base = decode_with_drafts(bench, 0, 0.0, args.tokens)
        rows = [base]
        for k in (int(x) for x in args.ks.split(",")):
            for a in (float(x) for x in args.alphas.split(",")):
                r = decode_with_drafts(bench, k, a, args.tokens)
                r["speedup"] = r["tok_s"] / base["tok_s"]
                rows.append(r)
                print(f"  batch {b} K {k} alpha {a:.2f}: {r['tok_s']:.0f} tok/s ({r['speedup']:.2f}x), "
                      f"acceptance {r['acceptance']}", flush=True)
        print(f"  batch {b} no drafts: {base['tok_s']:.0f} tok/s", flush=True)
        result["alpha"][b] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
