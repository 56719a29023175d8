"""Request traces: readers for the public trace formats, synthetic generators, prompt synthesis.

A trace is a list of `TraceRequest` (arrival seconds from the start, token counts, optional
prefix-block ids), sorted by arrival and rebased so the first request arrives at 0 (only the timestamps'
differences matter: they may start anywhere, negative too). Readers (format detected from the file's
contents, UTF-8 with or without a BOM; the shipped traces and their sources are in
loadtest/data/README.md, and `load_trace` takes their short names, TRACE_NAMES) check every row: a
timestamp a finite number within MAX_SECONDS, an input of 1 to MAX_TOKENS tokens, an output of 0 to
MAX_TOKENS (whole numbers), and at least one request; TraceFileError names the file and line otherwise.
  - BurstGPT CSV: columns read by name (`Timestamp` seconds); failed rows (zero tokens) dropped.
  - Azure LLM inference CSV: `TIMESTAMP` datetime strings, `ContextTokens`, `GeneratedTokens`.
  - JSONL rows `{timestamp, input_length, output_length[, hash_ids]}` (Mooncake's format: `hash_ids`
    has one id per 512-token prefix block). The timestamps' unit is never guessed: it is the one a
    first-line header names (`{"trace_format": "laneserve-replay", "time_unit": "s"}`, which
    `save_trace` writes), that of a shipped file (SHIPPED_TIME_UNITS: Mooncake's in ms, the derived
    `*.replay.jsonl` in s), or the one the caller passes (`time_unit`, the CLIs' `--time-unit`);
    otherwise `load_trace` raises TraceUnitError.
Generators: Poisson, Gamma bursts (vLLM benchmark_serving semantics), RAG (shared document
prefixes drawn from a pool with a set hit rate). Prompts: `synth_token_ids` (random tokens, what the
load client sends), `compact_token_ids` (the same prefix sharing, cheap: what the simulator replays).
Pure data: no I/O beyond reading and writing trace files, and nothing from gateway/, batcher/ or workers/ (used to
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


MAX_TOKENS = 10_000_000  # the most tokens one request of a trace may have, in or out: a sanity bound, not a model's
MAX_SECONDS = 1e11  # the largest timestamp (s, either sign): epoch times fit; beyond, a float blurs step times
MAX_REQUESTS = 10_000_000  # the longest generated trace (the simulator runs ~2k requests/s)


class TraceFileError(ValueError):
    """A trace file that cannot be read: the file and line, and what is wrong there."""


def _number(value, what: str) -> int | float:
    """A JSON number or a CSV field's text as a number (ValueError naming `what` if it is neither)."""
    if isinstance(value, str):
        for kind in (int, float):
            try:
                return kind(value.strip())
            except ValueError:
                pass
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    raise ValueError(f"{what} {json.dumps(value)[:40]}: not a number")


def tokens(value, what: str, lowest: int = 1) -> int:
    """A token count: a whole number from lowest to MAX_TOKENS (ValueError naming `what` otherwise)."""
    x = _number(value, what)
    if isinstance(x, float) and not x.is_integer():
        raise ValueError(f"{what} {value}: not a whole number")
    if not lowest <= x <= MAX_TOKENS:
        raise ValueError(f"{what} {value}: must be from {lowest} to {MAX_TOKENS:,}")
    return int(x)


def _seconds(value, what: str, scale: float = 1.0) -> float:
    """A timestamp in seconds (value x scale): finite, within MAX_SECONDS."""
    try:
        t = float(_number(value, what)) * scale
    except OverflowError:  # an int too large for a float
        t = math.inf
    if not math.isfinite(t):
        raise ValueError(f"{what} {value}: must be a finite number")
    if abs(t) > MAX_SECONDS:
        raise ValueError(f"{what} {value}: out of range (at most {MAX_SECONDS:g} s either way)")
    return t


def _lines(path: Path):
    """(line number, text) of each line of a UTF-8 file (a BOM skipped); TraceFileError at one that is not UTF-8."""
    with open(path, "rb") as f:
        for no, raw in enumerate(f, 1):
            try:
                yield no, raw.decode("utf-8-sig" if no == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise TraceFileError(f"{path}:{no}: not UTF-8 text ({exc.reason}, byte {exc.start + 1})") from None


def _rows(path: Path, rows, parse) -> list[TraceRequest]:
    """parse(row) for each (line number, row); a ValueError becomes a TraceFileError naming the file and line.
    parse returns None for a row to drop."""
    out = []
    for no, row in rows:
        try:
            req = parse(row)
        except ValueError as exc:
            raise TraceFileError(f"{path}:{no}: {exc}") from None
        if req is not None:
            out.append(req)
    return out


def _burstgpt_row(r: dict) -> TraceRequest | None:
    inp, outp = tokens(r["Request tokens"], "Request tokens", 0), tokens(r["Response tokens"], "Response tokens", 0)
    if inp == 0 or outp == 0:  # zero tokens = a failed request upstream
        return None
    return TraceRequest(_seconds(r["Timestamp"], "Timestamp"), inp, outp)


def _azure_row(r: dict) -> TraceRequest:
    try:
        t = _parse_datetime(r["TIMESTAMP"])
    except ValueError:
        raise ValueError(f"TIMESTAMP {r['TIMESTAMP']!r}: not a date and time like 2023-11-16 18:15:46.68") from None
    return TraceRequest(t, tokens(r["ContextTokens"], "ContextTokens"),
                        tokens(r["GeneratedTokens"], "GeneratedTokens", 0))


CSV_FORMATS = {("Timestamp", "Request tokens", "Response tokens"): _burstgpt_row,  # BurstGPT
               ("TIMESTAMP", "ContextTokens", "GeneratedTokens"): _azure_row}  # Azure


def _read_csv(path: Path) -> list[TraceRequest]:
    lines = _lines(path)
    rows = csv.DictReader(text for _, text in lines)
    cols = set(rows.fieldnames or ())
    parse = next((f for need, f in CSV_FORMATS.items() if set(need) <= cols), None)
    if parse is None:
        raise TraceFileError(f"{path}: unknown CSV trace columns {sorted(cols)}; expected "
                             + " or ".join(", ".join(need) for need in CSV_FORMATS))

    def numbered():
        for r in rows:
            if None in r.values() or None in r:  # a short row, or one with more fields than the header
                n = sum(v is not None for k, v in r.items() if k is not None) + len(r.get(None, ()))
                raise TraceFileError(f"{path}:{rows.line_num}: {n} fields where the header has {len(rows.fieldnames)}")
            yield rows.line_num, r

    out = _rows(path, numbered(), parse)
    if not out and rows.line_num > 1:
        raise TraceFileError(f"{path}: no requests in the trace (rows with zero tokens, failed requests, are dropped)")
    return out


REPLAY_FORMAT = "laneserve-replay"  # the header's trace_format
TIME_UNITS = {"s": 1.0, "ms": 1e-3}  # a JSONL trace's timestamp unit -> seconds


class TraceUnitError(ValueError):
    """A JSONL trace whose timestamps' unit is not known (or is given twice, differently)."""


def replay_header(time_unit: str = "s") -> dict:
    """The first line `save_trace` writes: names the format and the timestamps' unit."""
    return {"trace_format": REPLAY_FORMAT, "version": 1, "time_unit": time_unit}


def _header_unit(path: Path, first: dict) -> str | None:
    """The unit a header line names; None if `first` is a data row."""
    if "trace_format" not in first:
        return None
    if first["trace_format"] != REPLAY_FORMAT or first.get("time_unit") not in TIME_UNITS:
        raise TraceUnitError(f"{path}: bad header line {json.dumps(first)}; expected e.g. "
                             f"{json.dumps(replay_header())} (time_unit one of {', '.join(TIME_UNITS)})")
    return first["time_unit"]


def _shipped_unit(path: Path) -> str | None:
    """The unit of a shipped JSONL file (known, as the files cannot carry a header: loadtest/data/README.md)."""
    if path.name in SHIPPED_TIME_UNITS and path.resolve().parent == DATA_DIR.resolve():
        return SHIPPED_TIME_UNITS[path.name]
    return None


def _read_jsonl(path: Path, time_unit: str | None = None) -> list[TraceRequest]:
    """Rows of a JSONL trace, timestamps in seconds; the unit from the header, the shipped table or
    `time_unit`, which must agree when several say it (TraceUnitError otherwise, or when none does)."""
    if time_unit is not None and time_unit not in TIME_UNITS:
        raise TraceUnitError(f"unknown time unit {time_unit!r}; one of {', '.join(TIME_UNITS)}")
    rows = []
    for no, line in _lines(path):
        if line.strip():
            try:
                rows.append((no, json.loads(line)))
            except ValueError as exc:
                raise TraceFileError(f"{path}:{no}: not a JSON line ({exc})") from None
    header = _header_unit(path, rows[0][1]) if rows and isinstance(rows[0][1], dict) else None
    if header is not None:
        rows = rows[1:]
    known = header or _shipped_unit(path)
    if known is not None and time_unit is not None and time_unit != known:
        where = "its header line" if header else "the shipped-trace table"
        raise TraceUnitError(f"{path}: --time-unit {time_unit} contradicts {where}, which says {known!r}")
    unit = known or time_unit
    if unit is None:
        raise TraceUnitError(
            f"{path}: the unit of its timestamps is not marked (no header line, not a shipped trace). Pass "
            f"--time-unit s or --time-unit ms (time_unit= in Python; Mooncake's traces count milliseconds), "
            f"or make its first line {json.dumps(replay_header())} (what save_trace writes)")
    scale = TIME_UNITS[unit]
    return _rows(path, rows, lambda d: _jsonl_row(d, scale))


JSONL_KEYS = ("timestamp", "input_length", "output_length")  # and optionally hash_ids


def _jsonl_row(d, scale: float) -> TraceRequest:
    if not isinstance(d, dict):
        raise ValueError(f"expected a JSON object with {', '.join(JSONL_KEYS)}[, hash_ids], got {json.dumps(d)[:60]}")
    if "trace_format" in d:
        raise ValueError("a header line (trace_format) may only be the first line")
    missing = [k for k in JSONL_KEYS if k not in d]
    if missing:
        raise ValueError(f"no {' or '.join(missing)} in the row")
    ids = d.get("hash_ids", [])
    if not isinstance(ids, list) or not all(type(h) is int for h in ids):
        raise ValueError(f"hash_ids {json.dumps(ids)[:60]}: must be a list of whole numbers")
    return TraceRequest(_seconds(d["timestamp"], "timestamp", scale), tokens(d["input_length"], "input_length"),
                        tokens(d["output_length"], "output_length", 0), tuple(ids))


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
# the timestamps' unit of each shipped JSONL file (they are kept byte for byte, so they carry no header)
SHIPPED_TIME_UNITS = {
    "mooncake_conversation_trace.jsonl": "ms",
    "mooncake_synthetic_trace.jsonl": "ms",
    "AzureLLMInferenceTrace_code.replay.jsonl": "s",
    "AzureLLMInferenceTrace_conv.replay.jsonl": "s",
    "BurstGPT_1_first400.replay.jsonl": "s",
    "BurstGPT_3_first400.replay.jsonl": "s",
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


def load_trace(path: str, limit: int | None = None, time_unit: str | None = None) -> list[TraceRequest]:
    """Read a trace (a short name or a file; format detected from its contents); sorted, rebased to 0,
    first `limit` rows. time_unit ('s' or 'ms'): the timestamps' unit of a JSONL file that does not say
    it (see the module doc); CSV formats have theirs fixed, so it is an error there."""
    p = trace_path(path)
    first = next((text.lstrip() for _, text in _lines(p) if text.strip()), None)
    if first is None:
        raise TraceFileError(f"{p}: empty trace file")
    if first.startswith("{"):
        reqs = _read_jsonl(p, time_unit)
    elif time_unit is not None:
        raise TraceUnitError(f"{p}: --time-unit applies to JSONL traces; a CSV format's timestamps have a fixed unit")
    else:
        reqs = _read_csv(p)
    if not reqs:
        raise TraceFileError(f"{p}: no requests in the trace")
    return _finish(reqs, limit)


def save_trace(path: str, reqs: list[TraceRequest]) -> None:
    """Write a JSONL trace: the header line (format, timestamps in seconds), then one row per request,
    with hash_ids when present."""
    with open(path, "w") as f:
        f.write(json.dumps(replay_header("s")) + "\n")
        for r in reqs:
            d = {"timestamp": round(r.arrival, 6), "input_length": r.input_tokens, "output_length": r.output_tokens}
            if r.hash_ids:
                d["hash_ids"] = list(r.hash_ids)
            f.write(json.dumps(d) + "\n")


# ------------------------------------------------------------------------------------- generators

def _lengths(rng: np.random.Generator, spec: int | tuple[int, int], n: int, flag: str, lowest: int = 1) -> np.ndarray:
    """An int is a fixed length; a (lo, hi) tuple is uniform on [lo, hi] inclusive. Each from lowest to MAX_TOKENS
    (ValueError naming `flag`, the command-line flag of the spec, otherwise)."""
    lo, hi = _span(spec, flag, lowest)
    return rng.integers(lo, hi + 1, size=n) if isinstance(spec, (tuple, list)) else np.full(n, lo)


def _span(spec: int | tuple[int, int], flag: str, lowest: int) -> tuple[int, int]:
    """The (lo, hi) of a length spec, checked (see _lengths)."""
    pair = isinstance(spec, (tuple, list))
    text = _spec_text(spec)
    lo, hi = spec if pair and len(spec) == 2 else (None, None) if pair else (spec, spec)
    if not (_whole(lo, lowest, MAX_TOKENS) and _whole(hi, lowest, MAX_TOKENS)):
        raise ValueError(f"{flag} {text}: must be N or LO:HI, whole numbers from {lowest} to {MAX_TOKENS:,}")
    if lo > hi:
        raise ValueError(f"{flag} {text}: LO must not be more than HI")
    return int(lo), int(hi)


def _spec_text(spec) -> str:
    """A length spec as its flag writes it: 128 or 64:512."""
    return ":".join(map(str, spec)) if isinstance(spec, (tuple, list)) else str(spec)


def _whole(x, lowest: int, highest: float = math.inf) -> bool:
    """x is a whole number (not a bool) from lowest to highest."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool) and lowest <= x <= highest


def _rng(seed: int) -> np.random.Generator:
    if not _whole(seed, 0):
        raise ValueError(f"--seed {seed}: must be a whole number >= 0")
    return np.random.default_rng(seed)


def _arrivals(rng: np.random.Generator, rate: float, n: int, burstiness: float) -> np.ndarray:
    """vLLM benchmark_serving: gamma inter-arrivals with shape=burstiness, scale=1/(rate*burstiness),
    so the mean gap is 1/rate and the gaps' coefficient of variation is 1/sqrt(burstiness)
    (burstiness 1 = Poisson, < 1 burstier). The first request arrives at 0."""
    for flag, value in (("--rate", rate), ("--burstiness", burstiness)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag} {value}: must be a finite number > 0")
    if not _whole(n, 0, MAX_REQUESTS):
        raise ValueError(f"--num-requests {n}: must be a whole number up to {MAX_REQUESTS:,}")
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=max(n - 1, 0))
    t = np.concatenate([[0.0], np.cumsum(gaps)])[:n]
    if n and not t[-1] <= MAX_SECONDS:  # (NaN fails too)
        raise ValueError(f"--rate {rate}: {n} requests would span {t[-1]:.3g} s, more than {MAX_SECONDS:g}")
    return t


def gamma_bursts(rate: float, n: int, burstiness: float, input_tokens, output_tokens,
                 seed: int = 0) -> list[TraceRequest]:
    """A bad value is a ValueError naming its command-line flag (--rate, --input-tokens, ...), as for rag()."""
    rng = _rng(seed)
    t = _arrivals(rng, rate, n, burstiness)
    ins, outs = _lengths(rng, input_tokens, n, "--input-tokens"), _lengths(rng, output_tokens, n, "--output-tokens", 0)
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
    if not 0.0 <= hit_rate <= 1.0:  # (NaN fails too)
        raise ValueError(f"--hit-rate {hit_rate}: must be in [0, 1]")
    if not _whole(num_docs, 0):
        raise ValueError(f"--num-docs {num_docs}: must be a whole number >= 0")
    if not _whole(doc_tokens, 0, MAX_TOKENS):
        raise ValueError(f"--doc-tokens {doc_tokens}: must be a whole number from 0 to {MAX_TOKENS:,}")
    blocks = rag_doc_blocks(doc_tokens)
    if blocks * MOONCAKE_BLOCK_TOKENS + _span(question_tokens, "--question-tokens", 0)[1] > MAX_TOKENS:
        raise ValueError(f"--doc-tokens {doc_tokens} and --question-tokens {_spec_text(question_tokens)}: prompts over "
                         f"{MAX_TOKENS:,} tokens")
    rng = _rng(seed)
    t = _arrivals(rng, rate, n, burstiness)
    outs = _lengths(rng, output_tokens, n, "--output-tokens", 0)
    qs = _lengths(rng, question_tokens, n, "--question-tokens", 0)
    hits = rng.random(n) < hit_rate
    docs = rng.integers(0, max(num_docs, 1), size=n)
    out = []
    for i in range(n):
        doc = int(docs[i]) if hits[i] and num_docs > 0 else num_docs + i  # misses: a fresh doc id
        ids = tuple(doc * blocks + b for b in range(blocks))
        out.append(TraceRequest(float(t[i]), blocks * MOONCAKE_BLOCK_TOKENS + int(qs[i]), int(outs[i]), ids))
    return out


def rag_doc_blocks(doc_tokens: int) -> int:
    """512-token blocks of one rag() document (doc_tokens rounded up)."""
    return max(1, math.ceil(doc_tokens / MOONCAKE_BLOCK_TOKENS))


FRESH_DOC_STRIDE = 1 << 40  # rag_fresh_docs_apart: hash-id distance between two runs' fresh documents


def rag_fresh_docs_apart(reqs: list[TraceRequest], num_docs: int, doc_tokens: int, run: int) -> list[TraceRequest]:
    """A rag() trace whose fresh (never-seen-again) documents are renumbered for run `run`, so that runs
    replayed one after another against one server never find another run's fresh documents in its
    prefix cache (rag() numbers them by request index, the same in every trace of that length). The
    pooled documents keep their ids: every run shares the pool, as the hit rate means."""
    pooled = num_docs * rag_doc_blocks(doc_tokens)
    shift = run * FRESH_DOC_STRIDE
    return [r if not r.hash_ids or r.hash_ids[0] < pooled else
            TraceRequest(r.arrival, r.input_tokens, r.output_tokens, tuple(h + shift for h in r.hash_ids))
            for r in reqs]


def rag_cover_pool(reqs: list[TraceRequest], num_docs: int, doc_tokens: int) -> list[TraceRequest]:
    """The rows of a rag() trace with request i on pooled document i mod num_docs: a warm-up of
    num_docs requests or more touches every pooled document."""
    blocks = rag_doc_blocks(doc_tokens)
    if num_docs <= 0:
        return list(reqs)
    return [TraceRequest(r.arrival, r.input_tokens, r.output_tokens,
                         tuple((i % num_docs) * blocks + b for b in range(blocks))) for i, r in enumerate(reqs)]


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


def at_rate(reqs: list[TraceRequest], rate: float) -> list[TraceRequest]:
    """reqs (sorted) rebased to 0, their gaps scaled alike so the mean rate ((n - 1) / span) is rate: the trace's own
    bursts at another load (a sweep over a trace file)."""
    if not reqs:
        return []
    t0, span = reqs[0].arrival, reqs[-1].arrival - reqs[0].arrival
    scale = (len(reqs) - 1) / span / rate if span > 0 else 0.0
    return [TraceRequest((r.arrival - t0) * scale, r.input_tokens, r.output_tokens, r.hash_ids) for r in reqs]


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
