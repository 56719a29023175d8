"""The OpenAI-compatible handlers: validate, tokenize, submit to the batcher, answer (JSON or SSE).

One HTTP request becomes prompts x n AddRequests (ids `<base>-<choice index>`) whose deltas share
one queue; the answer merges them by choice index. Whatever way a request ends (finish, stop
string, client disconnect, timeout, error), the `finally` of `_generate` aborts what is still
running in the batcher, so its KV blocks are freed. Must not import torch or batcher internals.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from importlib import metadata

import msgspec
from aiohttp import web

from gateway import schemas as S
from gateway import structured
from gateway.client import BatcherClient, BatcherLost
from gateway.config import GatewayConfig
from gateway.errors import ApiError, bad_request
from gateway.metrics import Metrics
from gateway.output import ChatShape, Choice, CompletionShape, EngineError, InvalidRequest
from gateway.tokenizer import ChatTemplateError, ModelTokenizer
from laneserve.wire.protocol import AddRequest, Rejected

log = logging.getLogger("laneserve.gateway")

try:
    VERSION = metadata.version("laneserve")
except metadata.PackageNotFoundError:  # run from a source tree that was never installed
    VERSION = "unknown"

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"
_json = msgspec.json.encode
ARRIVAL = web.RequestKey("arrival", float)  # monotonic time the request reached the gateway
# A request's prompt work (tokenizing, checking token ids, rendering a chat template, decoding for echo) runs in a
# thread when it has more characters and token ids than this (each costs ~0.2 us; the tokenizer drops the GIL, so
# the event loop streams meanwhile), and inline otherwise: under streaming load the thread's round trip (the GIL's
# hand-over, the loop's queue) cost more than short work (the 2-core CPU machine, 128 streams, 1,900-token id
# prompts in fours: the gateway's arrival to its AddRequest p95 10.6 -> 0.7 ms; docs/perf.md, "CPU-side figures").
INLINE_CHARS = 4096


async def off_loop(size: int, fn, *args):
    """fn(*args), in a thread if `size` (the characters and token ids it works on) is over INLINE_CHARS, else
    inline."""
    if size <= INLINE_CHARS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def _prompt_size(req) -> int:
    """A completion request's prompt work for off_loop: its characters and token ids (more than INLINE_CHARS for
    echo, which decodes, and for more prompts than a request may have, which are refused after a scan)."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return len(prompt)
    if req.echo or not isinstance(prompt, list):
        return INLINE_CHARS + 1
    if prompt and not isinstance(prompt[0], (str, list)):  # one prompt of token ids
        return len(prompt)
    if len(prompt) > S.MAX_SEQUENCES:
        return INLINE_CHARS + 1
    return sum(len(p) if isinstance(p, (str, list)) else 1 for p in prompt)


def json_response(obj, status: int = 200) -> web.Response:
    return web.Response(body=_json(obj), status=status, content_type="application/json")


class Api:
    def __init__(self, cfg: GatewayConfig, tok: ModelTokenizer, metrics: Metrics):
        self.cfg = cfg
        self.tok = tok
        self.metrics = metrics
        # the names a request's `model` may give: the served id, and without --served-model-name the --model string
        # as given too (vLLM's served name; lm-eval and LiteLLM configs send the path)
        self.model_names = {tok.model_id} | (set() if cfg.served_model_name else {cfg.model, cfg.model.rstrip("/")})
        self.client: BatcherClient | None = None  # set on startup (needs the running loop)
        self.in_flight = 0  # sequences submitted and not finished (admission cap)
        self.active = 0  # generation handlers running (graceful drain waits for 0)
        self.runs: set[_Run] = set()  # those handlers' requests (end_all ends them at shutdown)
        self.draining = False
        self.created = int(time.time())
        self.completion_shape = CompletionShape(tok)
        self.chat_shape = ChatShape(tok)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)

    # ------------------------------------------------------------------ small routes
    def _card(self) -> dict:
        return {"id": self.tok.model_id, "object": "model", "created": self.created, "owned_by": "laneserve",
                "root": self.cfg.model, "parent": None, "max_model_len": self.tok.max_model_len}

    async def models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": [self._card()]})

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{id} (the openai SDK's models.retrieve)."""
        self._check_model(request.match_info["model"])
        return json_response(self._card())

    async def version(self, request: web.Request) -> web.Response:
        """vLLM's /version: the server's version (laneserve's, as installed)."""
        return json_response({"version": VERSION})

    async def health(self, request: web.Request) -> web.Response:
        if self.draining:
            raise ApiError(503, "the gateway is shutting down", retry_after=self.cfg.retry_after)
        pong = await self.client.ping()
        if pong is None:
            raise ApiError(503, "the batcher did not answer", retry_after=self.cfg.retry_after)
        if pong.workers_alive < 1:
            raise ApiError(503, "no model worker is ready", retry_after=self.cfg.retry_after)
        return json_response({"status": "ok", "workers_alive": pong.workers_alive})

    async def prometheus(self, request: web.Request) -> web.Response:
        await self.client.ping()  # refresh the engine gauges; stale values if the batcher is silent
        return web.Response(body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})

    async def tokenize(self, request: web.Request) -> web.Response:
        req = S.parse(await request.read(), S.TokenizeRequest)
        S.check_unsupported(req)
        self._check_model(req.model)
        if req.messages is not None:  # as a chat request's prompt is made
            ids = await asyncio.to_thread(self._chat_ids, S.chat_messages(req.messages), req.add_generation_prompt,
                                          S.chat_tools(req.tools), bool(req.add_special_tokens),
                                          self._template_kwargs(req.chat_template_kwargs))
        elif req.prompt is not None:
            S.check_text_length(self.tok, req.prompt)
            ids = await asyncio.to_thread(self.tok.encode, req.prompt, req.add_special_tokens is not False)
        else:
            raise bad_request("either prompt or messages is required.", param="prompt")
        strs = [self.tok.id_to_token(i) for i in ids] if req.return_token_strs else None
        return json_response({"count": len(ids), "max_model_len": self.tok.max_model_len, "tokens": ids,
                              "token_strs": strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        req = S.parse(await request.read(), S.DetokenizeRequest)
        self._check_model(req.model)
        bad = next((t for t in req.tokens if not 0 <= t < self.tok.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is out of vocabulary (size {self.tok.vocab_size}).", param="tokens")
        return json_response({"prompt": await asyncio.to_thread(self.tok.decode_long, req.tokens)})  # (GIL released)

    # ------------------------------------------------------------------ generation routes
    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = S.parse(await request.read(), S.CompletionRequest)
        S.check_unsupported(req)
        self._check_model(req.model)
        S.check_sampling(req, self.tok)
        S.check_logprobs("logprobs", req.logprobs)
        logprobs = req.logprobs
        if req.best_of is not None:
            if not (req.n or 1) <= req.best_of <= S.MAX_SEQUENCES:
                raise bad_request(f"best_of must be in [n, {S.MAX_SEQUENCES}], got {req.best_of}.", param="best_of")
            if req.stream and req.best_of > (req.n or 1):
                raise bad_request("best_of greater than n cannot be streamed.", param="best_of")
            if logprobs is None and req.best_of > (req.n or 1):
                logprobs = 0  # the sampled tokens' logprobs rank the sequences (not shown)
        constraint = await self._constraint(req)
        # tokenizing (and decoding for echo) a long prompt in a thread: it must not stall the event loop
        prompts, echo = await off_loop(_prompt_size(req), self._completion_prompts, req)
        max_tokens = [S.resolve_max_tokens(req.max_tokens, 16, len(p), self.tok.max_model_len) for p in prompts]
        return await self._generate(request, req, "cmpl", self.completion_shape, prompts, max_tokens, logprobs,
                                    echo, constraint)

    def _completion_prompts(self, req: S.CompletionRequest) -> tuple[list[list[int]], list[str] | None]:
        prompts = S.prompt_token_lists(req, self.tok)
        echo = None
        if req.echo:
            strings = [req.prompt] if isinstance(req.prompt, str) else req.prompt
            echo = [s if isinstance(s, str) else self.tok.decode_long(p) for s, p in zip(strings, prompts)] \
                if all(isinstance(s, str) for s in strings) else [self.tok.decode_long(p) for p in prompts]
        return prompts, echo

    def _chat_ids(self, messages: list[dict], add_generation_prompt: bool | None, tools: list[dict] | None,
                  add_special_tokens: bool, kwargs: dict | None = None) -> list[int]:
        """The conversation rendered and tokenized (run in a thread); 400 before any work for content longer than
        any prompt that fits the context. Special-token text inside a message's content is tokenized as plain text
        (unless --trust-message-special-tokens): such contents are rendered as placeholders, and the text between
        them (the template's) is tokenized with its control tokens, theirs as text."""
        S.check_text_length(self.tok, "".join(m["content"] or "" for m in messages), param="messages")
        trusted = self.cfg.trust_message_special_tokens
        held = [] if trusted else [i for i, m in enumerate(messages)
                                   if m["content"] and self.tok.has_special_text(m["content"])]
        if not trusted:  # other strings of the request that reach the template: special-token text is refused there
            other = [json.dumps(m.get("tool_calls", ""), ensure_ascii=False) + (m.get("name") or "")
                     + (m.get("tool_call_id") or "") for m in messages]
            if tools:
                other.append(json.dumps(tools, ensure_ascii=False))
            if any(self.tok.has_special_text(s) for s in other):
                raise bad_request("special-token text is not allowed in tool calls, tool call ids, names or tool "
                                  "descriptions.",
                                  param="messages")
            if kwargs and self.tok.has_special_text(json.dumps(kwargs, ensure_ascii=False)):
                raise bad_request("special-token text is not allowed in chat_template_kwargs.",
                                  param="chat_template_kwargs")
        if not held:
            text = self._render_chat(messages, add_generation_prompt, tools, kwargs)
            S.check_text_length(self.tok, text, param="messages")
            return self.tok.encode(text, add_special_tokens=add_special_tokens)
        marks = {f"\ue000{i}\ue001": messages[i]["content"] for i in held}
        shown = [dict(m, content=f"\ue000{i}\ue001") if i in held else m for i, m in enumerate(messages)]
        text = self._render_chat(shown, add_generation_prompt, tools, kwargs)
        pieces = re.split("(\ue000\\d+\ue001)", text)
        if sorted(p for p in pieces if p in marks) != sorted(marks):
            raise bad_request("a message's content holds special-token text, which this chat template cannot keep "
                              "as plain text.", param="messages")
        ids: list[int] = self.tok.prefix_ids if add_special_tokens else []  # BOS, once, for tokenizers that add it
        for piece in pieces:
            if piece in marks:
                ids += self.tok.encode_as_text(marks[piece])
            elif piece:
                ids += self.tok.encode(piece, add_special_tokens=False)
        return ids

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = S.parse(await request.read(), S.ChatRequest)
        S.check_unsupported(req)
        self._check_model(req.model)
        S.check_sampling(req, self.tok)
        S.check_logprobs("top_logprobs", req.top_logprobs)
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true.", param="top_logprobs")
        if req.max_completion_tokens is not None and req.max_completion_tokens < 1:
            raise bad_request("max_completion_tokens must be at least 1.", param="max_completion_tokens")
        tools = S.chat_tools(req.tools)
        constraint = await self._constraint(req)
        messages = S.chat_messages(req.messages)
        size = sum(len(m["content"] or "") for m in messages) if not tools else INLINE_CHARS + 1
        ids = await off_loop(size, self._chat_ids, messages, req.add_generation_prompt, tools,
                             bool(req.add_special_tokens), self._template_kwargs(req.chat_template_kwargs))
        if not ids:
            raise bad_request("the rendered conversation is empty.", param="messages")
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = [S.resolve_max_tokens(requested, None, len(ids), self.tok.max_model_len)]
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return await self._generate(request, req, "chatcmpl", self.chat_shape, [ids], max_tokens, logprobs, None,
                                    constraint)

    async def _constraint(self, req) -> structured.Constraint | None:
        """The request's structured output or tool calling (gateway/structured.py), its grammar checked in a
        thread (a large schema must not stall the event loop)."""
        c = structured.constraint(req, self.cfg.tool_call_parser)
        if c is not None and c.grammar:
            for name in ("min_tokens", "ignore_eos"):
                if getattr(req, name):
                    raise bad_request(f"{name} cannot be combined with structured output (the grammar decides "
                                      "where the output ends).", param=name)
            if self.tok.has_special_text(c.source):
                raise bad_request(f"{c.param}: special-token text (an end-of-turn marker, say) cannot be generated as "
                                  "text; the output would end or break there.", param=c.param)
            await asyncio.to_thread(structured.check, c)
        return c

    def end_all(self, reason: str) -> None:
        """Shutdown past the drain timeout: every request still in flight ends now with a 503 (an error event and
        [DONE] if it streams), and what it ran in the batcher is aborted."""
        for run in self.runs:
            run.queue.put_nowait(BatcherLost(reason))

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def _template_kwargs(self, kwargs: dict | None) -> dict:
        return S.template_kwargs(kwargs, ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                          "self", *self.tok.template_vars))  # (self: jinja's render takes it)

    def _render_chat(self, messages: list[dict], add_generation_prompt: bool | None,
                     tools: list[dict] | None = None, kwargs: dict | None = None) -> str:
        try:
            return self.tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt is not False,
                                                tools=tools, variables=kwargs)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), param="messages") from None

    async def _generate(self, request: web.Request, req, prefix: str, shape, prompts: list[list[int]],
                        max_tokens: list[int], logprobs: int | None, echo: list[str] | None,
                        constraint: structured.Constraint | None = None) -> web.StreamResponse:
        arrival = request.get(ARRIVAL, time.monotonic())
        n = S.sequences_per_prompt(req)
        if self.draining:
            raise ApiError(503, "the gateway is shutting down", retry_after=self.cfg.retry_after)
        num_seqs = len(prompts) * n
        if num_seqs > S.MAX_SEQUENCES:
            raise bad_request(f"prompts x n must be at most {S.MAX_SEQUENCES}, got {num_seqs}.", param="n")
        cap = self.cfg.max_queued_requests
        if cap and num_seqs > cap:  # it can never fit: retrying would not help
            raise bad_request(f"prompts x n is {num_seqs}, more than this server ever runs for one request "
                              f"({cap}, --max-queued-requests).", param="n")
        if cap and self.in_flight + num_seqs > cap:
            raise ApiError(429, f"too many requests in flight ({self.in_flight} of {cap}); retry later.",
                           retry_after=self.cfg.retry_after)
        named = S.response_id(req, request.headers.get("X-Request-Id"), prefix)
        base = f"{prefix}-{uuid.uuid4().hex}"
        choices, adds = self._choices(req, base, prompts, max_tokens, logprobs, echo, constraint)
        if not await self.client.alive():
            raise ApiError(503, "the batcher is not answering or has no ready worker; retry later.",
                           retry_after=self.cfg.retry_after)
        by_id = {ch.request_id: ch for ch in choices}
        unfinished = set(by_id)
        self.in_flight += num_seqs
        self.active += 1
        self.metrics.in_flight.inc()
        queue = self.client.submit(adds)
        prompt_tokens = sum(len(p) for p in prompts)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        run = _Run(self, request, req, shape, named or base, choices, by_id, unfinished, queue, prompt_tokens, arrival)
        run.sizes = {ch.request_id: (len(prompts[i // n]), max_tokens[i // n]) for i, ch in enumerate(choices)}
        self.runs.add(run)
        try:
            async with asyncio.timeout(self.cfg.request_timeout or None):
                return await (run.stream() if req.stream else run.collect())
        except TimeoutError:
            if run.response is not None:  # the stream began: end it with an error event
                err = ApiError(504, f"request timed out after {self.cfg.request_timeout:g}s")
                await run.end_with_error(err)
                return run.response
            raise ApiError(504, f"request timed out after {self.cfg.request_timeout:g}s") from None
        finally:
            self.runs.discard(run)
            self.in_flight -= num_seqs
            self.active -= 1
            self.metrics.in_flight.dec()
            # Disconnect, timeout, stop string, error: whatever still runs in the batcher is aborted.
            to_abort = [ch.request_id for ch in choices if ch.request_id in unfinished or ch.needs_abort]
            self.client.abort(to_abort)
            self.client.release(by_id)
            generated = sum(ch.num_tokens for ch in choices)
            self.metrics.generation_tokens.inc(generated)

    def _choices(self, req, base: str, prompts: list[list[int]], max_tokens: list[int], logprobs: int | None,
                 echo: list[str] | None, constraint: structured.Constraint | None
                 ) -> tuple[list[Choice], list[AddRequest]]:
        """One Choice (the response side) and one AddRequest (the engine side) per prompt x n (best_of, if more),
        index p * n + j."""
        grammar = constraint.grammar if constraint is not None else ""
        n = S.sequences_per_prompt(req)
        stops = S.stop_strings(req)
        include_stop, skip_special = bool(req.include_stop_str_in_output), req.skip_special_tokens is not False
        if constraint is not None and constraint.tools == "auto":
            # [TOOL_CALLS] and <|python_tag|> are special tokens, and some tokenizers make hermes' <tool_call> one
            # (vLLM's hermes parser turns skip_special_tokens off too): the parser must see them
            skip_special = False
        scoring = S.prompt_scoring(req)  # the prompt logprobs shown: the engine computes the larger top-k
        prompt_k = max((k for k in scoring if k is not None), default=None)
        if prompt_k is not None:
            S.check_prompt_scoring_size(sum(map(len, prompts)) * n, prompt_k)
        if logprobs is not None and not req.stream:  # a stream holds none: each chunk sends its own
            S.check_sampled_scores_size(sum(max_tokens) * n, logprobs)
        choices, adds = [], []
        now = time.time()
        for p, ids in enumerate(prompts):
            for j in range(n):
                index = p * n + j
                params = S.sampling_params(req, self.tok, max_tokens[p], logprobs, index=j, prompt_logprobs=prompt_k)
                tools = structured.ToolOutput(constraint, self.cfg.tool_call_parser) \
                    if constraint is not None and constraint.tools else None
                ch = Choice(index, f"{base}-{index}", self.tok, ids, stops, include_stop, skip_special,
                            logprobs is not None, echo[p] if echo else "", params.stop_token_ids, tools,
                            bool(req.return_tokens_as_token_ids), scoring, params.min_tokens, not req.stream)
                choices.append(ch)
                adds.append(AddRequest(request_id=ch.request_id, prompt_token_ids=ids, params=params,
                                       arrival_time=now, priority=req.priority or 0,
                                       slo_ttft_ms=req.slo_ttft_ms or 0.0, slo_tpot_ms=req.slo_tpot_ms or 0.0,
                                       grammar=grammar, speculative=req.speculative is not False))
        return choices, adds


class _Run:
    """One HTTP generation request in flight: consumes its queue, writes JSON or SSE."""

    def __init__(self, api: Api, request, req, shape, base, choices, by_id, unfinished, queue, prompt_tokens,
                 arrival):
        self.api, self.request, self.req, self.shape = api, request, req, shape
        self.base, self.choices, self.by_id, self.unfinished = base, choices, by_id, unfinished
        self.queue, self.prompt_tokens, self.arrival = queue, prompt_tokens, arrival
        self.created = int(time.time())
        self.model = api.tok.model_id
        self.response: web.StreamResponse | None = None
        opts = req.stream_options if req.stream else None
        self.include_usage = bool(opts and opts.include_usage)
        self.continuous_usage = self.include_usage and bool(opts.continuous_usage_stats)  # (vLLM's: it needs both)
        self.submitted = time.monotonic()  # handed to the batcher
        self.sizes: dict[str, tuple[int, int]] = {}  # request id -> (prompt tokens, max_tokens), for the metrics
        # request id -> when a step first scheduled it, on this clock: the hand-off plus the batcher's wait
        self.scheduled: dict[str, float] = {}

    def _item_choice(self, item) -> Choice:
        """Raise for a terminal error item; return the choice a delta belongs to."""
        if isinstance(item, Rejected):
            if item.retryable:
                raise ApiError(429, f"the engine cannot take the request now: {item.reason}",
                               retry_after=self.api.cfg.retry_after)
            raise bad_request(f"the engine rejected the request: {item.reason}")
        if isinstance(item, BatcherLost):
            raise ApiError(503, item.reason, retry_after=self.api.cfg.retry_after)
        return self.by_id[item.request_id]

    def _feed(self, ch: Choice, d) -> tuple[str, list, list]:
        if d.queued_ms is not None and ch.request_id not in self.scheduled:
            self.scheduled[ch.request_id] = self.submitted + d.queued_ms / 1000.0
        try:
            piece, ids, lps = ch.feed(d)
        except EngineError as exc:
            raise ApiError(500, f"the engine failed this request: {exc}") from None
        except InvalidRequest as exc:
            raise bad_request(f"the request failed: {exc}") from None
        if ids:
            now = time.monotonic()
            if ch.first_token_at is None:
                ch.first_token_at = now
                self.api.metrics.ttft.observe(now - self.arrival)
            else:
                self.api.metrics.itl.observe(now - ch.last_token_at)
            ch.last_token_at = now
        if ch.finish_reason is not None:
            self.unfinished.discard(ch.request_id)
            self._observe_finish(ch)
        return piece, ids, lps

    def _observe_finish(self, ch: Choice) -> None:
        m, now = self.api.metrics, time.monotonic()
        m.e2e.observe(now - self.arrival)
        scheduled = self.scheduled.get(ch.request_id, self.submitted)  # an older batcher sends no queued_ms
        m.queue.observe(scheduled - self.arrival)
        m.inference_time.observe(now - scheduled)
        if ch.first_token_at is not None:
            m.prefill_time.observe(ch.first_token_at - scheduled)
            m.decode_time.observe(now - ch.first_token_at)
            if ch.num_tokens > 1:
                m.tpot.observe((now - ch.first_token_at) / (ch.num_tokens - 1))
        prompt, max_tokens = self.sizes.get(ch.request_id, (0, 0))
        m.request_prompt_tokens.observe(prompt)
        m.request_max_tokens.observe(max_tokens)
        m.request_generation_tokens.observe(ch.num_tokens)
        m.success(ch.finish_reason)

    def usage(self) -> dict:
        completion = sum(ch.num_tokens for ch in self.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    async def collect(self) -> web.Response:
        while self.unfinished:
            item = await self.queue.get()
            ch = self._item_choice(item)
            if ch.finish_reason is None:
                self._feed(ch, item)
        answered = self._answered()
        return json_response({"id": self.base, "object": self.shape.object, "created": self.created,
                              "model": self.model, "choices": [self.shape.choice(ch) for ch in answered],
                              "usage": self.usage(),  # usage counts every sequence generated, best_of's too
                              **self.shape.response_fields(answered)})

    def _answered(self) -> list[Choice]:
        """The choices answered: all of them, or with best_of the n of each prompt's best_of sequences with the
        highest cumulative logprob (renumbered; logprobs shown only if asked)."""
        best_of, n = S.sequences_per_prompt(self.req), self.req.n or 1
        if best_of == n:
            return self.choices
        out = []
        for p in range(0, len(self.choices), best_of):
            group = sorted(self.choices[p:p + best_of], key=lambda ch: -sum(lp.logprob for lp in ch.lp_entries))
            for j, ch in enumerate(group[:n]):
                ch.index = p // best_of * n + j
                ch.want_logprobs = self.req.logprobs is not None
                out.append(ch)
        return out

    def _chunk(self, choices: list[dict], usage=None) -> bytes:
        obj = {"id": self.base, "object": self.shape.chunk_object, "created": self.created, "model": self.model,
               "choices": choices}
        if self.include_usage:
            obj["usage"] = usage if usage is not None or not self.continuous_usage else self.usage()
        return b"data: " + _json(obj) + b"\n\n"

    async def stream(self) -> web.StreamResponse:
        # Wait for the first answer before sending headers: a Rejected then is still a real 429/400.
        first = await self.queue.get()
        self._item_choice(first)
        self.response = web.StreamResponse(headers=SSE_HEADERS)
        await self.response.prepare(self.request)
        out = [self._chunk([c]) for ch in self.choices if (c := self.shape.first_chunk_choice(ch))]
        item = first
        try:
            while True:
                ch = self._item_choice(item)
                if ch.finish_reason is None:
                    piece, ids, lps = self._feed(ch, item)
                    if ch.prefix and not ch.echoed and (c := self.shape.first_chunk_choice(ch)):
                        out.append(self._chunk([c]))  # echo scoring: the prompt's logprobs are all in now
                    finished = ch.finish_reason is not None
                    calls = None
                    if ch.tools is not None:  # text -> tool calls (gateway/structured.py)
                        piece, calls = ch.tools.feed(piece)
                        if finished:
                            tail, more = ch.tools.finish()
                            piece, calls = piece + tail, calls + more
                        if calls:
                            out.append(self._chunk([self.shape.chunk_choice(ch, piece, ids, lps, False, calls)]))
                            piece, lps, calls = "", [], None
                    if piece or lps or finished:
                        out.append(self._chunk([self.shape.chunk_choice(ch, piece, ids, lps, finished)]))
                if not self.unfinished:
                    break
                if self.queue.empty() and out:  # write once per batch of deltas, not per delta
                    await self.response.write(b"".join(out))
                    out.clear()
                item = await self.queue.get()
        except ApiError as err:
            out.append(err.sse())
            await self.response.write(b"".join(out) + DONE)
            return self.response
        except ConnectionError:
            raise  # the client went away
        except Exception:  # a bug: the headers are out, so an error event ends the stream (not a second response)
            log.exception("unexpected error in a stream of %s", self.request.path)
            self.api.metrics.error(500)
            await self.response.write(b"".join(out) + ApiError(500, "internal server error").sse() + DONE)
            return self.response
        if self.include_usage:
            out.append(self._chunk([], self.usage()))
        out.append(DONE)
        await self.response.write(b"".join(out))
        await self.response.write_eof()
        return self.response

    async def end_with_error(self, err: ApiError) -> None:
        try:
            await self.response.write(err.sse() + DONE)
        except (ConnectionError, RuntimeError):
            pass
