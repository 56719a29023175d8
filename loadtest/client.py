"""The open-loop HTTP client: replays a trace against any OpenAI-compatible server.

Owns: probing the server (model id, max_model_len, a token alphabet from /tokenize), turning
trace rows into requests (token-id prompts from `synth_token_ids`, or text through /detokenize),
sending each at its scaled arrival time whatever the completions do, streaming the answer and
recording per-request timings (`RequestRecord`). Bounded: the trace is finite, the connection
pool has a size, and a wall-clock limit cancels what is still running (recorded as errors), so
the run always stops by itself and every sent request ends up finished or errored. With `client_procs` > 1 the
trace is dealt round-robin to that many processes, each with its own event loop, started together: one Python loop
reading hundreds of streams delays the chunks it reads (TTFT measured late), several share the work.
Must not import gateway/, batcher/, workers/: it talks HTTP only (vLLM's server works unchanged).
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import multiprocessing as mp
import resource
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import aiohttp

from loadtest.traces import TraceRequest, synth_token_ids

# Text tokenized once to learn ordinary (non-special) token ids of the server's vocabulary; fewer distinct ids
# than MIN_ALPHABET and the fallback alphabet is used instead.
MIN_ALPHABET = 32
JSON_HEADERS = {"Content-Type": "application/json"}  # (bodies are encoded before the run's clock: _prepare)
PROBE_TIMEOUT = 30.0  # s for each request of the probe (a server that takes the connection and never answers)
PROBE_TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs! "
    "0123456789 +-*/=<>()[]{} retrieval augmented generation answers questions about documents; "
    "serving systems batch requests, cache prefixes, and stream tokens back to every client, "
    "while latency budgets: time to first token, time per output token, end to end, throughput."
)


@dataclass
class LoadConfig:
    url: str  # base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)
    model: str | None = None  # None: the first id from GET /v1/models
    endpoint: str = "completions"  # or "chat"
    speedup: float = 1.0  # arrival times are divided by this
    max_connections: int = 4096  # bounded pool; a request beyond it waits for a connection (in its TTFT)
    request_timeout: float = 600.0
    time_limit: float | None = None  # wall seconds for the whole run; None: trace span + request_timeout
    ignore_eos: bool = True
    prompt_mode: str = "ids"  # "ids": token-id prompts; "text": /detokenize'd text (chat always uses text)
    seed: int = 0  # of the synthesised prompts: shared prefix blocks are a function of (seed, hash id)
    salt: int = 0  # told apart from other runs' prompts (their unique parts), e.g. the run's index in a sweep
    vocab_size: int = 256  # fallback alphabet range(vocab_size) when /tokenize is unavailable or degenerate
    api_key: str | None = None
    client_procs: int = 1  # processes sending and reading the requests (round-robin shares of the trace)


@dataclass
class ServerInfo:
    model: str
    max_model_len: int | None
    alphabet: list[int]  # ordinary token ids that synthesised prompts are mapped onto
    tokenize_ok: bool


@dataclass
class RequestRecord:
    index: int
    scheduled: float  # intended send time, s from run start (after --speedup)
    input_tokens: int  # prompt length asked for (after any clamp)
    max_tokens: int
    trace_input_tokens: int
    trace_output_tokens: int
    clamped: bool = False  # shortened to fit max_model_len
    sent: float | None = None  # when the request was handed to the pool, s from run start
    sent_wall: float | None = None  # the same on the host's wall clock (time.time()), to join a server's --step-trace
    pool_wait: float = 0.0  # s of its TTFT spent waiting for one of --max-connections connections
    status: int = 0  # HTTP status; 0: no response
    error: str | None = None
    ttft: float | None = None  # s from sent to the first generated text
    e2e: float | None = None  # s from sent to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between successive streamed chunks
    output_tokens: int = 0  # usage.completion_tokens, else the number of chunks
    prompt_tokens: int | None = None  # usage.prompt_tokens
    response_id: str | None = None  # the stream's "id" (laneserve: its batcher request ids are "<id>-<choice>")

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.e2e is not None

    @property
    def tpot(self) -> float | None:
        if self.ok and self.ttft is not None and self.output_tokens > 1:
            return (self.e2e - self.ttft) / (self.output_tokens - 1)
        return None


def _role_only(choice: dict) -> bool:
    delta = choice.get("delta") or {}
    return not delta.get("content") and choice.get("finish_reason") is None and "role" in delta


def _base(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def _error_detail(body: bytes) -> str:
    """': message' of an OpenAI-style JSON error body, or of a short text one, on one line; '' for an HTML page."""
    try:
        err = json.loads(body).get("error")
        msg = err.get("message") if isinstance(err, dict) else err
    except AttributeError:  # JSON, not an object
        return ""
    except ValueError:
        msg = body.decode(errors="replace")
        msg = "" if msg.lstrip().startswith("<") else msg
    return f": {' '.join(str(msg).split())[:200]}" if msg else ""


async def _json(session: aiohttp.ClientSession, method: str, url: str, timeout: float | None = None, **kw):
    """The JSON reply of one request; a RuntimeError of one line for an HTTP error, a reply that is not JSON, or no
    reply within timeout seconds (default: the session's)."""
    limit = aiohttp.ClientTimeout(total=timeout) if timeout else session.timeout
    try:
        async with session.request(method, url, timeout=limit, **kw) as resp:
            body = await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"{method} {url}: HTTP {resp.status} {resp.reason}{_error_detail(body)}")
    except asyncio.TimeoutError:
        raise RuntimeError(f"{method} {url}: no response within {limit.total:g} s") from None
    try:
        return json.loads(body)
    except ValueError:
        raise RuntimeError(f"{method} {url}: the reply is not JSON (is this an OpenAI-compatible server?)") from None


def _max_model_len(value, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value < 2**63 or value % 1:
        raise RuntimeError(f"{where}: the server reports max_model_len {value!r}, not a whole number >= 1")
    return int(value)


async def probe(session: aiohttp.ClientSession, cfg: LoadConfig) -> ServerInfo:
    """The server's model (cfg.model, which it must list, or the first it lists), max_model_len and a token
    alphabet; a RuntimeError of one line when it is not an OpenAI-compatible server. Each request is bounded by
    PROBE_TIMEOUT (or the request timeout, if shorter)."""
    base = _base(cfg.url)
    timeout = min(PROBE_TIMEOUT, cfg.request_timeout)
    models = await _json(session, "GET", base + "/v1/models", timeout)
    cards = models.get("data") if isinstance(models, dict) else None
    if not isinstance(cards, list) or not all(isinstance(c, dict) and isinstance(c.get("id"), str) for c in cards):
        raise RuntimeError(f'GET {base}/v1/models: not an OpenAI model list {{"data": [{{"id": ...}}, ...]}}')
    ids = [c["id"] for c in cards]
    if cfg.model is not None and ids and cfg.model not in ids:
        raise RuntimeError(f"--model {cfg.model}: {base} serves {', '.join(ids)}")
    model = cfg.model or (ids[0] if ids else None)
    if model is None:
        raise RuntimeError(f"{base}/v1/models lists no model; pass --model")
    card = next((c for c in cards if c["id"] == model), {})
    max_len = _max_model_len(card.get("max_model_len"), f"GET {base}/v1/models")
    try:
        tok = await _json(session, "POST", base + "/tokenize", timeout,
                          json={"model": model, "prompt": PROBE_TEXT, "add_special_tokens": False})
        alphabet = sorted(set(int(t) for t in tok["tokens"]))
        # A tokenizer that maps the probe to a handful of ids (a word-level one missing English words maps it
        # all to <unk>) would make every prompt the same few ids, and every block a prefix-cache hit.
        tokenize_ok = len(alphabet) >= MIN_ALPHABET
        if not tokenize_ok:
            alphabet = []
    except (RuntimeError, aiohttp.ClientError, KeyError, ValueError, TypeError):
        tok, alphabet, tokenize_ok = {}, [], False
    max_len = _max_model_len(tok.get("max_model_len"), f"POST {base}/tokenize") or max_len
    return ServerInfo(model, max_len, alphabet or list(range(cfg.vocab_size)), tokenize_ok)


def fit_to_context(req: TraceRequest, max_model_len: int | None) -> tuple[TraceRequest, bool]:
    """Shorten input (then output) so input + output <= max_model_len; keeps at least one of each."""
    if max_model_len is None or req.input_tokens + req.output_tokens <= max_model_len:
        return req, False
    out = max(1, min(req.output_tokens, max_model_len // 2))
    inp = max(1, min(req.input_tokens, max_model_len - out))
    return replace(req, input_tokens=inp, output_tokens=out), True


class LoadRunner:
    """One run: dispatcher task + one task per sent request, all on one event loop."""

    def __init__(self, trace: list[TraceRequest], cfg: LoadConfig,
                 on_progress: Callable[[int, int, int], None] | None = None, indices: list[int] | None = None,
                 start_gate: Callable[[], float] | None = None):
        """indices: each row's index in the whole trace (a share of it: its prompts and records keep those);
        start_gate: called (in a thread) once the server is probed, returns the wall-clock time to start at."""
        self.trace, self.cfg, self.on_progress = trace, cfg, on_progress
        self.indices = indices if indices is not None else range(len(trace))
        self.start_gate = start_gate
        self.records: list[RequestRecord] = []
        self.info: ServerInfo | None = None
        self.meta: dict = {}
        self.sent = self.finished = self.errored = 0
        # The connection pool: a completion holds one of these while it streams (the connector itself is
        # unbounded, so /detokenize calls are not counted), and the time it waited for one is measured.
        self.pool = asyncio.Semaphore(cfg.max_connections)

    # ------------------------------------------------------------------ prompts and payloads
    async def _prompt(self, session, req: TraceRequest, index: int):
        ids = synth_token_ids(req, seed=self.cfg.seed, vocab_size=1 << 30, salt=(self.cfg.salt << 32) + index)
        alpha = self.info.alphabet
        ids = [alpha[i % len(alpha)] for i in ids]
        if self.cfg.prompt_mode == "ids" and self.cfg.endpoint == "completions":
            return ids
        out = await _json(session, "POST", _base(self.cfg.url) + "/detokenize",
                          json={"model": self.info.model, "tokens": ids})
        return out["prompt"]

    def _payload(self, prompt, max_tokens: int) -> tuple[str, bytes]:
        """(path, the JSON body encoded)."""
        body = {"model": self.info.model, "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": 0.0}
        if self.cfg.ignore_eos:
            body["ignore_eos"] = True
        if self.cfg.endpoint == "chat":
            path, body = "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
        else:
            path, body = "/v1/completions", {**body, "prompt": prompt}
        return path, json.dumps(body, separators=(",", ":")).encode()

    # ------------------------------------------------------------------ one request
    async def _prepare(self, session, rows: list[tuple[int, TraceRequest, TraceRequest, bool]]
                       ) -> dict[int, tuple[str, bytes]]:
        """Every request's body, encoded, before the run's clock starts, {trace row: _payload()}: the run's event
        loop then only sends and reads. Text prompts (`--prompt-mode text`, and chat) are made with the server's
        /detokenize here, so that a run sends the server its completions alone (made at each request's send time,
        as before 2026-12-07, the /detokenize calls loaded the gateway in the trace's own bursts); token-id prompts
        were made and encoded at send time until 2026-12-07 too, ~2.5 ms a Mooncake prompt on the loop that times
        the other streams. A prompt that fails here is made again at its send time, where its error is recorded.
        rows: run()'s (trace row, request, request fitted to the context, clamped) of the requests it will send."""
        gate = asyncio.Semaphore(8)

        async def one(i: int, fitted: TraceRequest) -> tuple[int, tuple[str, bytes] | None]:
            async with gate:
                try:
                    prompt = await self._prompt(session, fitted, self.indices[i])
                except (aiohttp.ClientError, RuntimeError, KeyError, TypeError):
                    return i, None
            return i, self._payload(prompt, fitted.output_tokens)

        made = await asyncio.gather(*(one(i, fitted) for i, _, fitted, _ in rows))
        return {i: p for i, p in made if p is not None}

    async def _one(self, session, rec: RequestRecord, req: TraceRequest, t0: float,
                   payload: tuple[str, bytes] | None = None) -> None:
        loop = asyncio.get_running_loop()
        try:
            if payload is None:  # (_prepare could not make it)
                payload = self._payload(await self._prompt(session, req, rec.index), rec.max_tokens)
            path, body = payload
            rec.sent = loop.time() - t0
            start = loop.time()
            rec.sent_wall = time.time()
            full = self.pool.locked()
            async with self.pool:
                rec.pool_wait = loop.time() - start if full else 0.0
                async with session.post(_base(self.cfg.url) + path, data=body, headers=JSON_HEADERS) as resp:
                    rec.status = resp.status
                    if resp.status != 200:
                        rec.error = f"HTTP {resp.status} {resp.reason}{_error_detail(await resp.read())}"
                        return
                    await self._read_stream(resp, rec, start)
        except asyncio.CancelledError:
            rec.error = rec.error or "cancelled: the run stopped (time limit or interrupt)"
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError, KeyError, TypeError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"[:500] or type(exc).__name__
        finally:
            if rec.ok:
                self.finished += 1
            else:
                self.errored += 1
            self._progress()

    async def _read_stream(self, resp, rec: RequestRecord, start: float) -> None:
        loop = asyncio.get_running_loop()
        last = None
        chunks = 0
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                rec.e2e = loop.time() - start
                break
            now = loop.time()
            try:
                obj = json.loads(data)
                err, usage, choices = obj.get("error"), obj.get("usage"), list(obj.get("choices") or ())
                rec.response_id = rec.response_id or obj.get("id")
                if err:
                    rec.error = (err.get("message") if isinstance(err, dict) else str(err)) or "stream error"
                    return
                if usage:
                    rec.output_tokens = int(usage.get("completion_tokens") or 0)
                    rec.prompt_tokens = usage.get("prompt_tokens")
                role_only = self.cfg.endpoint == "chat" and bool(choices) and _role_only(choices[0])
            except (ValueError, TypeError, AttributeError):
                raise ValueError(f"not an OpenAI stream chunk: {data[:80].decode(errors='replace')}") from None
            # As vLLM's benchmark: every chunk with choices is a token event, text or not (a byte-level
            # tokenizer may hold back a partial UTF-8 character). The chat role chunk comes first and
            # carries no content, so it does not count.
            if choices and not role_only:
                chunks += 1
                if last is None:
                    rec.ttft = now - start
                else:
                    rec.itl.append(now - last)
                last = now
        if rec.e2e is None:
            rec.error = "stream ended without [DONE]"
        elif rec.output_tokens == 0:
            rec.output_tokens = chunks

    # ------------------------------------------------------------------ the run
    def _progress(self) -> None:
        if self.on_progress:
            self.on_progress(self.sent, self.finished, self.errored)

    async def run(self) -> dict:
        cfg = self.cfg
        span = (self.trace[-1].arrival / cfg.speedup) if self.trace else 0.0
        limit = cfg.time_limit if cfg.time_limit is not None else span + cfg.request_timeout
        timeout = aiohttp.ClientTimeout(total=cfg.request_timeout)
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
        _raise_fd_limit(cfg.max_connections)
        connector = aiohttp.TCPConnector(limit=0)  # (self.pool bounds the completions)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
            self.info = await probe(session, cfg)
            # the requests sent: those due before the time limit, each fitted to the context
            rows = [(i, tr, *fit_to_context(tr, self.info.max_model_len)) for i, tr in
                    enumerate(itertools.takewhile(lambda tr: tr.arrival / cfg.speedup < limit, self.trace))]
            prompts = await self._prepare(session, rows)
            loop = asyncio.get_running_loop()
            gc.collect()  # the trace and the probe's data out of the collector's full passes: a pause there is a
            gc.freeze()  # late send (laneserve/gcheap.py does the same for the server; loadtest imports only itself)
            if self.start_gate is not None:
                await asyncio.sleep(max(0.0, await asyncio.to_thread(self.start_gate) - time.time()))
            t0 = loop.time()
            deadline = t0 + limit
            self.meta = {"url": cfg.url, "model": self.info.model, "endpoint": cfg.endpoint, "speedup": cfg.speedup,
                         "max_model_len": self.info.max_model_len, "tokenizer_probe": self.info.tokenize_ok,
                         "alphabet_size": len(self.info.alphabet), "prompt_mode": cfg.prompt_mode,
                         "ignore_eos": cfg.ignore_eos, "planned": len(self.trace),
                         "max_connections": cfg.max_connections, "time_limit_s": limit,
                         "started_at": time.time(), "wall_s": None, "interrupted": False}
            tasks: list[asyncio.Task] = []
            for i, tr, fitted, clamped in rows:
                when = t0 + tr.arrival / cfg.speedup
                if when > loop.time():
                    await asyncio.sleep(when - loop.time())
                rec = RequestRecord(self.indices[i], when - t0, fitted.input_tokens, fitted.output_tokens,
                                    tr.input_tokens, tr.output_tokens, clamped)
                self.records.append(rec)
                self.sent += 1
                tasks.append(asyncio.create_task(self._one(session, rec, fitted, t0, prompts.pop(i, None))))
                self._progress()
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - loop.time()))
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
            self.meta["wall_s"] = loop.time() - t0
        return self.meta


def _raise_fd_limit(connections: int, spare: int = 64) -> None:
    """Raise the soft open-files limit so the pool fits, up to the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + spare
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))


def run_load(trace: list[TraceRequest], cfg: LoadConfig,
             on_progress: Callable[[int, int, int], None] | None = None) -> tuple[list[RequestRecord], dict]:
    procs = min(cfg.client_procs, len(trace))
    if procs > 1:
        return _run_shared(trace, cfg, procs, on_progress)
    runner = LoadRunner(trace, cfg, on_progress)
    try:
        meta = asyncio.run(runner.run())
    except KeyboardInterrupt:  # asyncio.run cancelled the tasks: keep what was measured
        if not runner.meta:
            raise
        meta = {**runner.meta, "interrupted": True}
    return runner.records, meta


def _run_shared(trace: list[TraceRequest], cfg: LoadConfig, procs: int,
                on_progress: Callable[[int, int, int], None] | None) -> tuple[list[RequestRecord], dict]:
    """run_load over `procs` processes: process k sends rows k, k + procs, ...; all start at one wall-clock time,
    set once each has probed the server. Records come back in the trace's order; progress is reported at the end."""
    ctx = mp.get_context("spawn")
    share = replace(cfg, client_procs=1, max_connections=max(1, cfg.max_connections // procs))
    conns, workers = [], []
    for k in range(procs):
        mine, theirs = ctx.Pipe()
        idx = list(range(k, len(trace), procs))
        workers.append(ctx.Process(target=_share_main, args=([trace[i] for i in idx], idx, share, theirs),
                                   daemon=True))
        workers[-1].start()
        theirs.close()
        conns.append(mine)
    interrupted = False

    def recv(conn):
        nonlocal interrupted
        while True:
            try:
                return conn.recv()
            except KeyboardInterrupt:  # (Ctrl-C reaches the processes too: they stop and send what they measured)
                interrupted = True
            except EOFError:
                return ("error", "a load-tester process died")

    done: list = []
    try:
        ready = [recv(c) for c in conns]
        failed = next((r[1] for r in ready if r[0] == "error"), None)
        if failed is not None:  # (the others wait for a start that will not come)
            raise RuntimeError(failed)
        start = time.time() + 0.2
        for c in conns:
            c.send(start)
        done = [recv(c) for c in conns]
    finally:
        for w in workers:
            w.join(10 if done else 0)  # (each has sent its records and is exiting)
            if w.is_alive():
                w.kill()
    failed = next((r[1] for r in done if r[0] == "error"), None)
    if failed is not None:
        raise RuntimeError(failed)
    records = sorted((rec for _, recs, _ in done for rec in recs), key=lambda r: r.index)
    metas = [meta for _, _, meta in done]
    meta = {**metas[0], "planned": len(trace), "client_procs": procs,
            "wall_s": max(m["wall_s"] for m in metas) if all(m["wall_s"] for m in metas) else None,
            "interrupted": interrupted or any(m["interrupted"] for m in metas)}
    if on_progress:
        on_progress(len(records), sum(r.ok for r in records), sum(not r.ok for r in records))
    return records, meta


def _share_main(trace: list[TraceRequest], indices: list[int], cfg: LoadConfig, conn) -> None:
    """One process of _run_shared: probe, say ready, start when told, send back ("done", records, meta) or
    ("error", message)."""
    def gate() -> float:
        conn.send(("ready",))
        return conn.recv()

    runner = LoadRunner(trace, cfg, indices=indices, start_gate=gate)
    try:
        meta = asyncio.run(runner.run())
    except KeyboardInterrupt:
        meta = {**runner.meta, "interrupted": True} if runner.meta else None
    except Exception as exc:  # (RuntimeError from the probe: one line for the user)
        conn.send(("error", str(exc) or type(exc).__name__))
        return
    conn.send(("done", runner.records, meta) if meta else ("error", "interrupted before the run began"))
