"""The gateway process: `create_app(cfg)` builds the aiohttp Application, `run(cfg)` serves it.

Owns the middlewares (OpenAI error JSON for every failure, API-key check) and the lifecycle:
the BatcherClient starts with the app; on SIGINT/SIGTERM the gateway stops accepting
connections, lets in-flight requests finish up to --drain-timeout, then closes.
Must not import torch, workers.*, or batcher.* other than laneserve.wire.protocol.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import signal
import time

from aiohttp import web

from gateway import cors, tool_calls
from gateway.client import BatcherClient
from gateway.config import AUTO_BODY_CAP, GatewayConfig
from gateway.connections import Connection, Guard, raise_fd_limit
from gateway.errors import ApiError
from gateway.memory import HeapTrimmer, mmap_large_blocks
from gateway.metrics import PREFIXES, Metrics, watch_loop_lag
from gateway.routes import ARRIVAL, Api
from gateway.tokenizer import ModelTokenizer, load_tokenizer, read_chat_template
from laneserve import sampling
from laneserve.gcheap import freeze_startup_heap
from laneserve.wire.protocol import EngineStats, Vocabulary

log = logging.getLogger("laneserve.gateway")
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})
BIG_BODY = 1 << 20  # a Content-Length this large: the connection is closed after its (unstreamed) answer
API_KEY = web.AppKey("api", Api)
GUARD_KEY = web.AppKey("guard", Guard)
TRIM_KEY = web.AppKey("trim", HeapTrimmer)


def _http_error(exc: web.HTTPException, request: web.Request) -> ApiError:
    if exc.status == 404:
        return ApiError(404, f"Not found: {request.method} {request.path}")
    if exc.status == 405:
        return ApiError(405, f"Method {request.method} is not allowed on {request.path}.")
    if exc.status == 413:
        return ApiError(413, f"Request body too large: {exc.text or ''}".strip())
    return ApiError(exc.status, exc.reason or "request failed")


@web.middleware
async def error_middleware(request: web.Request, handler):
    request[ARRIVAL] = time.monotonic()
    conn = request.protocol if isinstance(request.protocol, Connection) else None
    if conn is not None:
        conn.begin()  # no header or keep-alive deadline while the request runs
    try:
        resp = await _answer(request, handler)
    finally:
        if conn is not None:
            conn.end()
    if (request.content_length or 0) >= BIG_BODY and not resp.prepared:
        resp.force_close()  # an idle keep-alive connection keeps its last request's body alive (aiohttp)
    return resp


async def _answer(request: web.Request, handler) -> web.StreamResponse:
    """The handler's response, or OpenAI's error JSON for whatever it raised (counted in the metrics)."""
    api = request.app[API_KEY]
    counted = request.path not in OPEN_PATHS  # a probe's 503 during start-up is no request error
    try:
        return await handler(request)
    except ApiError as err:
        if counted:
            api.metrics.error(err.status)
        return err.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        err = _http_error(exc, request)
        if counted:
            api.metrics.error(err.status)
        return err.response()
    except (asyncio.CancelledError, ConnectionError):
        raise  # the client went away; nothing to answer
    except Exception:
        log.exception("unexpected error in %s %s", request.method, request.path)
        api.metrics.error(500)
        return ApiError(500, "internal server error").response()


@web.middleware
async def body_middleware(request: web.Request, handler):
    """The body, read within --body-timeout before any handler runs (handlers' request.read() gets it cached). A
    compressed body is refused (415) as it came, never inflated: that would let a small request cost the event
    loop seconds."""
    if request.body_exists:
        request.app[TRIM_KEY].dirty = True
        await request.app[GUARD_KEY].read_body(request)
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise ApiError(415, f"Content-Encoding {encoding!r} is not supported: send the request body uncompressed.")
    return await handler(request)


def auth_middleware(api_key: str):
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path not in OPEN_PATHS:
            given = request.headers.get("Authorization", "").encode("utf-8", "replace")
            if not hmac.compare_digest(given, expected):  # constant time in the key's content
                raise ApiError(401, "Invalid or missing API key (send 'Authorization: Bearer <key>').")
        return await handler(request)

    return check


def read_api_key(cfg: GatewayConfig) -> str:
    """--api-key, or the contents of --api-key-file (not both); with neither, vLLM's VLLM_API_KEY variable (as
    `vllm serve` reads it: a deployment moved from vLLM keeps its key)."""
    if not cfg.api_key_file:
        return cfg.api_key or os.environ.get("VLLM_API_KEY", "").strip()
    if cfg.api_key:
        raise SystemExit("give --api-key or --api-key-file, not both")
    try:
        with open(cfg.api_key_file, encoding="utf-8") as f:
            key = f.read().strip()
    except OSError as exc:
        raise SystemExit(f"--api-key-file: {exc}") from None
    if not key:
        raise SystemExit(f"--api-key-file {cfg.api_key_file}: empty")
    return key


def body_limit(cfg: GatewayConfig, tok: ModelTokenizer) -> int:
    """--max-body-bytes, or (0) one sized to the context: JSON escapes a character in at most 6 bytes; at least
    16 MiB (a batch of prompts, each of which fits), at most AUTO_BODY_CAP."""
    if cfg.max_body_bytes > 0:
        return cfg.max_body_bytes
    return min(AUTO_BODY_CAP, max(16 << 20, 6 * tok.max_prompt_chars + (1 << 20)))


def create_app(cfg: GatewayConfig, tokenizer: ModelTokenizer | None = None) -> web.Application:
    if cfg.tool_call_parser and cfg.tool_call_parser not in tool_calls.PARSERS:
        raise SystemExit(f"--tool-call-parser must be one of {', '.join(tool_calls.PARSERS)} (or ''), got "
                         f"{cfg.tool_call_parser!r}")
    tok = tokenizer or load_tokenizer(cfg.model, cfg.served_model_name, cfg.max_model_len, cfg.tokenizer)
    if cfg.generation_config not in ("auto", "vllm"):
        raise SystemExit(f"--generation-config must be auto or vllm, got {cfg.generation_config!r}")
    if cfg.generation_config == "vllm":  # (the loader read an HF model dir's generation_config.json's)
        tok.sampling_defaults = {}
    elif tok.sampling_defaults:
        bad = sampling.check_sampling(tok.sampling_defaults)  # checked as a request's values are
        if bad is not None:
            raise SystemExit(f"{cfg.model}: its generation_config.json: {bad[1]} (--generation-config vllm ignores "
                             "the file's sampling values)")
        log.warning("the model's generation_config.json sets the sampling defaults %s: --generation-config vllm "
                    "to use laneserve's", tok.sampling_defaults)  # (as vLLM says it)
    if cfg.chat_template:
        tok.chat_template = read_chat_template(cfg.chat_template)
    middlewares = [error_middleware]
    api_key = read_api_key(cfg)
    if api_key:
        middlewares.append(auth_middleware(api_key))
    middlewares.append(body_middleware)
    app = web.Application(client_max_size=body_limit(cfg, tok))
    preflight = cors.install(app, cors.parse_origins(cfg.allowed_origins))  # (before the API key's check)
    app.middlewares.extend(([preflight] if preflight else []) + middlewares)
    if cfg.metrics_prefix not in PREFIXES:
        raise SystemExit(f"--metrics-prefix must be one of {', '.join(PREFIXES)}, got {cfg.metrics_prefix!r}")
    metrics = Metrics(lambda: (api.client.stats, api.client.workers_alive) if api.client
                      else (EngineStats(), 0), tok.model_id, cfg.metrics_prefix)
    api = Api(cfg, tok, metrics)
    app[API_KEY] = api
    app[GUARD_KEY] = Guard(cfg.header_timeout, cfg.body_timeout, cfg.keepalive_timeout, cfg.max_connections,
                           cfg.retry_after)
    app[TRIM_KEY] = HeapTrimmer()
    api.add_routes(app)

    async def start_client(app: web.Application) -> None:
        api.client = BatcherClient(cfg, Vocabulary(tokenizer_json=tok.tokenizer.to_str(), vocab_size=tok.vocab_size,
                                                   eos_token_ids=list(tok.eos_token_ids)))
        api.client.start()

    async def stop_client(app: web.Application) -> None:
        if api.client is not None:
            await api.client.close()

    app.on_startup.append(start_client)
    app.on_cleanup.append(stop_client)
    return app


async def serve(cfg: GatewayConfig, stop: asyncio.Event | None = None) -> None:
    """Serve until `stop` is set (or SIGINT/SIGTERM), then drain and close."""
    app = create_app(cfg)
    api, guard = app[API_KEY], app[GUARD_KEY]
    if guard.max_connections > 0:
        guard.max_connections = raise_fd_limit(guard.max_connections)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    loop = asyncio.get_running_loop()
    try:
        server = await loop.create_server(guard.factory(runner.server), cfg.host, cfg.port, reuse_address=True)
    except OSError as exc:  # one line, not a traceback (laneserve serve checks the port before it starts anything)
        await runner.cleanup()
        raise SystemExit(f"laneserve gateway: --host {cfg.host} --port {cfg.port}: {exc.strerror or exc}") from None
    guard.start()
    freeze_startup_heap()  # (the tokenizer, the app: laneserve/gcheap.py)
    trimming = loop.create_task(app[TRIM_KEY].run())
    watching = loop.create_task(watch_loop_lag(api.metrics.loop_lag.observe))
    log.info("gateway listening on http://%s:%d", cfg.host, cfg.port)
    stop = stop or asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    api.draining = True
    server.close()  # no new connections; in-flight handlers keep running
    deadline = time.monotonic() + cfg.drain_timeout
    while api.active and time.monotonic() < deadline:
        await asyncio.sleep(0.05)  # polling a counter during shutdown only
    if api.active:
        log.warning("drain deadline passed with %d requests in flight; ending them with an error", api.active)
        api.end_all("the server is shutting down")
        deadline = time.monotonic() + 2.0
        while api.active and time.monotonic() < deadline:  # they write their last event and return
            await asyncio.sleep(0.05)
    guard.stop()
    trimming.cancel()
    watching.cancel()
    await runner.cleanup()


def run(cfg: GatewayConfig) -> None:
    mmap_large_blocks()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(cfg))
