"""Request traces: readers for the public trace formats, synthetic generators, prompt synthesis.

A trace is a list of `TraceRequest` (arrival seconds from the start, token counts, optional
prefix-block ids), sorted by arrival and rebased so the first request arrives at 0. Readers
(format detected from the file name, then its contents; the shipped traces and their sources are in
loadtest/data/README.md, and `load_trace` takes their short names, TRACE_NAMES):
  - BurstGPT CSV: columns read by name (`Timestamp` seconds); failed rows (zero tokens) dropped.
  - Azure LLM inference CSV: `TIMESTAMP` datetime strings, `ContextTokens`, `GeneratedTokens`.
  - Mooncake JSONL: `timestamp` in ms, `hash_ids` with one id per 512-token prefix block.
  - replay JSONL (`*.replay.jsonl`, also what `save_trace` writes): `timestamp` seconds.
Generators: Poisson, Gamma bursts (vLLM benchmark_serving semantics), RAG (shared document
prefixes drawn from a pool with a set hit rate). Prompts: `synth_token_ids` (random tokens, what the
load client sends), `compact_token_ids` (the same prefix sharing, cheap: what the simulator replays).
Pure data: no I/O beyond reading the file, and nothing from gateway/, batcher/ or workers/ (used to
test any OpenAI-compatible server).
"""

from __future__ import annotations

import csv
import datetime as dt
import functools
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRequest:
    arrival: float  # seconds from trace start
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()  # Mooncake: one id per 512-token prefix block; RAG generator: shared-doc block ids


# ---------------------------------------------------------------------------------------- readers

def _finish(reqs: list[TraceRequest], limit: int | None) -> list[TraceRequest]:
    """Sort by arrival (stable), rebase to 0, cut to limit."""
    reqs = sorted(reqs, key=lambda r: r.arrival)
    if limit is not None:
        reqs = reqs[:limit]
    if not reqs:
        return []
    t0 = reqs[0].arrival
    return [TraceRequest(r.arrival - t0, r.input_tokens, r.output_tokens, r.hash_ids) for r in reqs]


def _parse_datetime(s: str) -> float:
    """Azure timestamps: '2023-11-16 18:15:46.6805900' (7 fraction digits), 2024 files add '+00:00'."""
    s = s.strip().replace("T", " ")
    tz = ""
    for sep in ("+", "Z"):
        i = s.find(sep, 10)
        if i >= 0:
            s, tz = s[:i], s[i:]
            break
    if "." in s:
        head, frac = s.split(".", 1)
        s = f"{head}.{frac[:6].ljust(6, '0')}"  # datetime takes at most microseconds
    t = dt.datetime.fromisoformat(s + ("+00:00" if tz == "Z" else tz))
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.timezone.utc)
    return t.timestamp()


def _read_csv(path: Path) -> list[TraceRequest]:
    with open(path, newline="") as f:
        rows = csv.DictReader(f)
        cols = set(rows.fieldnames or ())
        out: list[TraceRequest] = []
        if {"Timestamp", "Request tokens", "Response tokens"} <= cols:  # BurstGPT
            for r in rows:
                inp, outp = int(float(r["Request tokens"])), int(float(r["Response tokens"]))
                if inp > 0 and outp > 0:  # zero tokens = a failed request upstream
                    out.append(TraceRequest(float(r["Timestamp"]), inp, outp))
        elif {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= cols:  # Azure
            for r in rows:
                out.append(TraceRequest(_parse_datetime(r["TIMESTAMP"]), int(r["ContextTokens"]),
                                        int(r["GeneratedTokens"])))
        else:
            raise ValueError(f"{path}: unknown CSV trace columns {sorted(cols)}")
    return out


def _read_jsonl(path: Path) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    scale: float | None = 1.0 if path.name.endswith(".replay.jsonl") else None
    if scale is None and "mooncake" in path.name.lower():
        scale = 1e-3
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            d = json.loads(line)
            if scale is None:  # unknown name: Mooncake's rows are the ones carrying hash_ids
                scale = 1e-3 if "hash_ids" in d else 1.0
            out.append(TraceRequest(float(d["timestamp"]) * scale, int(d["input_length"]), int(d["output_length"]),
                                    tuple(int(h) for h in d.get("hash_ids", ()))))
    return out


DATA_DIR = Path(__file__).with_name("data")
# short name -> a trace shipped in DATA_DIR (loadtest/data/README.md: source, licence, attribution)
TRACE_NAMES = {
    "azure-code": "AzureLLMInferenceTrace_code.csv",
    "azure-conv": "AzureLLMInferenceTrace_conv.csv",
    "burstgpt-1": "BurstGPT_1_first400.csv",
    "burstgpt-3": "BurstGPT_3_first400.csv",
    "mooncake-conversation": "mooncake_conversation_trace.jsonl",
    "mooncake-synthetic": "mooncake_synthetic_trace.jsonl",
}


def trace_path(name_or_path: str) -> Path:
    """The file of a shipped trace's short name (TRACE_NAMES), or the path itself if it is a file."""
    if name_or_path in TRACE_NAMES:
        return DATA_DIR / TRACE_NAMES[name_or_path]
    p = Path(name_or_path)
    if not p.is_file():
        raise FileNotFoundError(f"trace {name_or_path!r} is neither a file nor a shipped trace; shipped traces: "
                                f"{', '.join(TRACE_NAMES)} (loadtest/data/README.md)")
    return p


def load_trace(path: str, limit: int | None = None) -> list[TraceRequest]:
    """Read a trace (a short name or a file; format detected from its name/contents); sorted, rebased to 0,
    first `limit` rows."""
    p = trace_path(path)
    with open(p) as f:
        first = f.readline().lstrip()
    reqs = _read_jsonl(p) if first.startswith("{") else _read_csv(p)
    return _finish(reqs, limit)


def save_trace(path: str, reqs: list[TraceRequest]) -> None:
    """Write the replay JSONL format (seconds), with hash_ids when present."""
    with open(path, "w") as f:
        for r in reqs:
            d = {"timestamp": round(r.arrival, 6), "input_length": r.input_tokens, "output_length": r.output_tokens}
            if r.hash_ids:
                d["hash_ids"] = list(r.hash_ids)
            f.write(json.dumps(d) + "\n")


# ------------------------------------------------------------------------------------- generators

def _lengths(rng: np.random.Generator, spec: int | tuple[int, int], n: int) -> np.ndarray:
    """An int is a fixed length; a (lo, hi) tuple is uniform on [lo, hi] inclusive."""
    if isinstance(spec, (tuple, list)):
        lo, hi = int(spec[0]), int(spec[1])
        return rng.integers(lo, hi + 1, size=n)
    return np.full(n, int(spec))


def _arrivals(rng: np.random.Generator, rate: float, n: int, burstiness: float) -> np.ndarray:
    """vLLM benchmark_serving: gamma inter-arrivals with shape=burstiness, scale=1/(rate*burstiness),
    so the mean gap is 1/rate and the gaps' coefficient of variation is 1/sqrt(burstiness)
    (burstiness 1 = Poisson, < 1 burstier). The first request arrives at 0."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be > 0")
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=max(n - 1, 0))
    return np.concatenate([[0.0], np.cumsum(gaps)])[:n]


def gamma_bursts(rate: float, n: int, burstiness: float, input_tokens, output_tokens,
                 seed: int = 0) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    t = _arrivals(rng, rate, n, burstiness)
    ins, outs = _lengths(rng, input_tokens, n), _lengths(rng, output_tokens, n)
    return [TraceRequest(float(a), int(i), int(o)) for a, i, o in zip(t, ins, outs)]


def poisson(rate: float, n: int, input_tokens: int | tuple, output_tokens: int | tuple,
            seed: int = 0) -> list[TraceRequest]:
    return gamma_bursts(rate, n, 1.0, input_tokens, output_tokens, seed)


def rag(rate: float, n: int, num_docs: int, doc_tokens: int, question_tokens: int, output_tokens, hit_rate: float,
        burstiness: float = 1.0, seed: int = 0) -> list[TraceRequest]:
    """RAG prompts: a document prefix then a unique question. With probability hit_rate the document
    is drawn (uniformly) from a pool of num_docs shared ones, otherwise it is a fresh one never seen
    again. The document is a whole number of 512-token blocks (doc_tokens rounded up) whose ids go in
    hash_ids, so `synth_token_ids` shares exactly the document and nothing of the question."""
    if not 0.0 <= hit_rate <= 1.0:
        raise ValueError("hit_rate must be in [0, 1]")
    rng = np.random.default_rng(seed)
    t = _arrivals(rng, rate, n, burstiness)
    outs = _lengths(rng, output_tokens, n)
    qs = _lengths(rng, question_tokens, n)
    blocks = max(1, math.ceil(doc_tokens / MOONCAKE_BLOCK_TOKENS))
    hits = rng.random(n) < hit_rate
    docs = rng.integers(0, max(num_docs, 1), size=n)
    out = []
    for i in range(n):
        doc = int(docs[i]) if hits[i] and num_docs > 0 else num_docs + i  # misses: a fresh doc id
        ids = tuple(doc * blocks + b for b in range(blocks))
        out.append(TraceRequest(float(t[i]), blocks * MOONCAKE_BLOCK_TOKENS + int(qs[i]), int(outs[i]), ids))
    return out


# -------------------------------------------------------------------------------- prompt synthesis

@functools.lru_cache(maxsize=4096)  # shared blocks (Mooncake, RAG documents) recur across requests
def _block(vocab_size: int, block_tokens: int, seed: int, h: int) -> tuple[int, ...]:
    return tuple(_stream(vocab_size, block_tokens, "block", seed, block_tokens, h))


def _stream(vocab_size: int, n: int, *key: int | str) -> list[int]:
    digest = hashlib.blake2b(repr(key).encode(), digest_size=16).digest()
    rng = np.random.default_rng(list(digest))
    return rng.integers(0, vocab_size, size=n).tolist()


def _hash_blocks(req: TraceRequest, block_tokens: int, vocab_size: int, seed: int) -> list[int]:
    """The prompt's leading tokens given by its hash_ids (at most input_tokens of them)."""
    n = req.input_tokens
    ids: list[int] = []
    for h in req.hash_ids:
        if len(ids) >= n:
            break
        # the full block then a cut, so a partial last block is a prefix of the full one
        ids += _block(vocab_size, block_tokens, seed, h)[: n - len(ids)]
    return ids


def synth_token_ids(req: TraceRequest, block_tokens: int = MOONCAKE_BLOCK_TOKENS, vocab_size: int = 32000,
                    seed: int = 0, *, salt: int = 0) -> list[int]:
    """Deterministic prompt ids of length input_tokens, in [0, vocab_size).

    Block i of a request with hash_ids is a function of (seed, hash_ids[i]) only, so requests with
    equal leading hash_ids get identical leading blocks (the last block may be partial, as in
    Mooncake). Tokens past the hash blocks depend on the whole request (and `salt`, which a client
    can set to a request index to tell apart otherwise identical rows), so they are unique.
    """
    n = req.input_tokens
    ids = _hash_blocks(req, block_tokens, vocab_size, seed)
    if len(ids) < n:
        ids += _stream(vocab_size, n - len(ids), "tail", seed, salt, repr(req.arrival), req.input_tokens,
                       req.output_tokens, req.hash_ids)
    return ids


SALT_DIGITS = 3  # tokens of the unique head of a compact tail: salts below vocab_size ** 3


@functools.lru_cache(maxsize=32)  # one per power of two: a prompt takes a prefix of the next size up
def _filler(vocab_size: int, seed: int, size: int) -> list[int]:
    return _stream(vocab_size, size, "filler", seed)


def compact_token_ids(req: TraceRequest, block_tokens: int = MOONCAKE_BLOCK_TOKENS, vocab_size: int = 32000,
                      seed: int = 0, *, salt: int) -> list[int]:
    """`synth_token_ids` for a chained-hash prefix cache (the simulator's): the same sharing, ~50x cheaper.

    The hash_ids blocks are synth_token_ids' own tokens, so shared prefixes are the same tokens with the
    same block hashes. The rest, unique to the request there, is here a head that spells out `salt`
    (which must tell the trace's rows apart: the row index) followed by a filler that every request
    shares, as the same int objects: no per-token work. A prefix cache whose block hash chains in the
    hash of the block before (vLLM's, batcher/block_manager.py) can match a block only after matching
    every block before it, so nothing from the unique head on is ever found, as with synth_token_ids'
    random tail: replaying a trace gives the same hits, and the same results, with either (for cache
    block sizes that divide block_tokens, so that the head starts a block).
    """
    if not 0 <= salt < vocab_size ** SALT_DIGITS:
        raise ValueError(f"salt {salt} out of range for a {SALT_DIGITS}-token head")
    n = req.input_tokens
    ids = _hash_blocks(req, block_tokens, vocab_size, seed)
    if len(ids) < n:
        head = [salt // vocab_size ** k % vocab_size for k in range(SALT_DIGITS)]
        filler = _filler(vocab_size, seed, 1 << max(n, 4096).bit_length())
        ids += head[: n - len(ids)]
        ids += filler[: n - len(ids)]
    return ids


def window(reqs: list[TraceRequest], start: float = 0.0, duration: float | None = None,
           max_requests: int | None = None) -> list[TraceRequest]:
    """Rows with start <= arrival < start + duration (trace seconds), rebased to 0, at most max_requests."""
    end = math.inf if duration is None else start + duration
    picked = [r for r in reqs if start <= r.arrival < end]
    return _finish(picked, max_requests)


def cap(reqs: list[TraceRequest], max_input: int | None = None, max_output: int | None = None) -> list[TraceRequest]:
    """Clip token counts (e.g. to replay a real trace's timing on a small model); hash_ids are kept,
    so shared prefixes stay shared up to the cut."""
    mi, mo = max_input or math.inf, max_output or math.inf
    return [TraceRequest(r.arrival, int(min(r.input_tokens, mi)), int(min(r.output_tokens, mo)), r.hash_ids)
            for r in reqs]
