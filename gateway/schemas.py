"""Request validation: OpenAI/vLLM request bodies as msgspec Structs, then ranges -> SamplingParams.

Decoding is strict about types (wrong type -> 400 naming the field) and ignores unknown fields, as
vLLM does; known ones the server cannot honour are a 400 (UNSUPPORTED). Every check a request can
fail happens here, at the edge, so the batcher and workers can trust what they get. No I/O.
"""

from __future__ import annotations

import re

import msgspec

from gateway.errors import ApiError, bad_request
from gateway.tokenizer import ModelTokenizer
from laneserve import sampling
from laneserve.wire.protocol import SamplingParams

MAX_SEQUENCES = 256  # prompts x n in one request
ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's message roles
MAX_STOP_STRINGS = 16
SEED_MAX = sampling.SEED_MAX - MAX_SEQUENCES  # children get seed + index
_BOUNDED = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
            "max_tokens", "min_tokens", "top_k", "seed", "stop_token_ids", "prompt_logprobs")


# OpenAI and vLLM request fields laneserve cannot honour: a value that asks for something is a 400, not ignored as
# an unknown field would be (vLLM itself ignores some of them). field -> (the values that ask for nothing, a hint).
# They are fields of the request Structs below (any JSON, UNSET when absent): decoded with the rest, so a bad value
# is parse()'s 400.
_OFF = (None, False, "", [], {})
UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "use_beam_search": (_OFF, ""),
    "allowed_token_ids": (_OFF, "; logit_bias or guided_choice can steer the tokens"),
    "bad_words": (_OFF, "; logit_bias -100 lowers a word's tokens"),
    "truncate_prompt_tokens": (_OFF, "; truncate the prompt before sending it"),
    "logits_processors": (_OFF, ""),
    "guided_whitespace_pattern": (_OFF, ""),
    "guided_decoding_backend": (_OFF + ("auto", "guidance", "llguidance"), " (structured output uses llguidance)"),
    "detokenize": ((None, True), ""),
    "spaces_between_special_tokens": ((None, True), ""),
    "prompt_embeds": (_OFF, ""),
    "cache_salt": (_OFF, ""),
    "mm_processor_kwargs": (_OFF, ""),
    "vllm_xargs": (_OFF, ""),
    "store": (_OFF, ""),
    "prediction": (_OFF, ""),
    "return_token_ids": (_OFF, "; logprobs with return_tokens_as_token_ids name each sampled token's id"),
    "structural_tag": (_OFF, "; response_format json_schema or structured_outputs constrain the output"),
}
UNSUPPORTED_COMPLETION = UNSUPPORTED | {"suffix": (_OFF, "")}
_CHAT_TEMPLATE = {
    "continue_final_message": (_OFF, ""),
    "documents": (_OFF, ""),
    "chat_template": (_OFF, "; the server's template is set with --chat-template"),
}
UNSUPPORTED_CHAT = UNSUPPORTED | _CHAT_TEMPLATE | {
    "echo": (_OFF, ""),
    "functions": (_OFF, "; send them as tools"),
    "function_call": (_OFF + ("none", "auto"), "; use tool_choice"),
    "audio": (_OFF, ""),
    "modalities": (_OFF + (["text"],), ""),
    "web_search_options": (_OFF, ""),
    "reasoning_effort": (_OFF + ("none",), ""),
    "best_of": (_OFF + (1,), " on chat completions (vLLM's V1 refuses it too); /v1/completions takes it"),
}
UNSUPPORTED_TOKENIZE = _CHAT_TEMPLATE | {"mm_processor_kwargs": (_OFF, "")}


def _same(a, b) -> bool:
    """JSON equality that tells true from 1 and "1" from 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def _refusing(name: str, base: type, fields: dict[str, tuple[tuple, str]]) -> type:
    """The request Struct: base's fields and, as any JSON (UNSET when absent), the unsupported ones."""
    return msgspec.defstruct(name, [(f, object, msgspec.UNSET) for f in fields], bases=(base,),
                             namespace={"unsupported": fields})


def check_unsupported(req) -> None:
    """A 400 for the first unsupported field (its Struct's `unsupported`) the request asks for."""
    for name, (nothing, hint) in req.unsupported.items():
        value = getattr(req, name)
        if value is not msgspec.UNSET and not any(_same(value, v) for v in nothing):
            raise bad_request(f"{name} is not supported by this server{hint}.", param=name)


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = True  # vLLM's default: stream_options given at all asks for usage
    continuous_usage_stats: bool | None = None  # vLLM's: usage so far in every chunk (guidellm sends it)


class _Sampling(msgspec.Struct):
    """Fields shared by both endpoints (vLLM's extras included)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    user: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    priority: int | None = None  # lower goes first (vLLM's rule)
    slo_ttft_ms: float | None = None  # this request's SLO targets (else the server's --slo-ttft-ms / --slo-tpot-ms)
    slo_tpot_ms: float | None = None
    speculative: bool | None = None  # false: no speculative drafts for this request (--speculative), laneserve's
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's form) -> bias in [-100, 100]
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name tokens "token_id:N"
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob, rank and the top-k at its position
    request_id: str | None = None  # vLLM's: the response's id is "cmpl-" / "chatcmpl-" and this (response_id)
    # Structured output (OpenAI's response_format; vLLM's guided_* and structured_outputs): constrained decoding,
    # gateway/structured.py
    response_format: dict | None = None
    guided_json: object = None
    guided_regex: object = None
    guided_choice: object = None
    guided_grammar: object = None
    structured_outputs: object = None


class _Completion(_Sampling):
    prompt: str | list | None = None
    best_of: int | None = None  # generate this many per prompt, answer the n with the highest cumulative logprob
    logprobs: int | None = None
    echo: bool | None = None
    add_special_tokens: bool | None = None


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class Message(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers


class _Chat(_Sampling):
    messages: list[Message] | None = None
    tools: list[dict] | None = None  # OpenAI's tool objects, to the chat template as sent (chat_tools)
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = None
    add_special_tokens: bool | None = None
    chat_template_kwargs: dict | None = None  # vLLM's: more variables for the chat template (enable_thinking, ...)


class _Tokenize(msgspec.Struct):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    tools: list[dict] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict | None = None
    return_token_strs: bool | None = None  # vLLM's: each token's string beside its id


CompletionRequest = _refusing("CompletionRequest", _Completion, UNSUPPORTED_COMPLETION)
ChatRequest = _refusing("ChatRequest", _Chat, UNSUPPORTED_CHAT)
TokenizeRequest = _refusing("TokenizeRequest", _Tokenize, UNSUPPORTED_TOKENIZE)


class DetokenizeRequest(msgspec.Struct):
    tokens: list[int]
    model: str | None = None


_decoders: dict[type, msgspec.json.Decoder] = {}
_AT = re.compile(r" - at `\$\.?(.*)`$")


def parse(body: bytes, cls: type):
    """Decode a JSON body into `cls`; any JSON or type error is a 400 naming the field."""
    dec = _decoders.get(cls) or _decoders.setdefault(cls, msgspec.json.Decoder(cls))
    try:
        return dec.decode(body)
    except msgspec.ValidationError as exc:
        text = str(exc)
        m = _AT.search(text)
        param = m.group(1) if m and m.group(1) else None
        raise bad_request(f"Invalid request: {text}", param=param) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"Request body is not valid JSON: {exc}") from None
    except RecursionError:  # msgspec skipping an unknown field of absurdly deep JSON
        raise bad_request("Request body is not valid JSON: nested too deeply.") from None


def check_sampling(req: _Sampling, tok: ModelTokenizer) -> None:
    """Range checks that do not depend on the prompt: the shared sampling bounds, then the API's own."""
    values = {name: getattr(req, name) for name in _BOUNDED}
    values["logit_bias"] = logit_bias(req)
    values["stop_token_ids"] = stop_token_ids(req, tok)  # as the batcher will check them
    bad = sampling.check_sampling(values, tok.vocab_size)
    if bad is not None:
        raise bad_request(bad[1], param=bad[0])
    if req.n is not None and not 1 <= req.n <= MAX_SEQUENCES:
        raise bad_request(f"n must be in [1, {MAX_SEQUENCES}], got {req.n}.", param="n")
    if req.seed is not None and req.seed > SEED_MAX:
        raise bad_request(f"seed must be in [{sampling.SEED_MIN}, {SEED_MAX}].", param="seed")
    stops = stop_strings(req)
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings.", param="stop")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options can only be given when stream is true.", param="stream_options")
    if req.max_tokens == 0 and getattr(req, "max_completion_tokens", None) is None \
            and not getattr(req, "echo", None):  # vLLM's rule: 0 scores an echoed prompt only
        raise bad_request("max_tokens must be at least 1, got 0" + (" (0 is allowed with echo, to score the prompt)."
                          if isinstance(req, CompletionRequest) else "."), param="max_tokens")
    if req.stream and req.prompt_logprobs:  # vLLM's rule (0 is accepted, and not shown)
        raise bad_request("prompt_logprobs are not available when stream is true.", param="prompt_logprobs")
    if req.priority is not None and abs(req.priority) > sampling.MAX_PRIORITY:
        raise bad_request(f"priority must be within +-{sampling.MAX_PRIORITY}.", param="priority")
    for name in ("slo_ttft_ms", "slo_tpot_ms"):
        value = getattr(req, name)
        why = None if value is None else sampling.check_slo_target(name, value)
        if why:
            raise bad_request(why + ".", param=name)


def logit_bias(req: _Sampling) -> tuple[tuple[int, float], ...]:
    """logit_bias as (token id, bias) pairs; a key that is not a token id is a 400."""
    out: dict[int, float] = {}
    for key, bias in (req.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key[:20]!r}.", param="logit_bias") from None
        if token in out:  # "65" and "065": one token given twice
            raise bad_request(f"logit_bias names token {token} twice.", param="logit_bias")
        out[token] = float(bias)
    return tuple(out.items())


def stop_token_ids(req: _Sampling, tok: ModelTokenizer) -> tuple[int, ...]:
    """The request's stop_token_ids and, unless ignore_eos, the model's EOS ids, each once."""
    return tuple(dict.fromkeys([*(req.stop_token_ids or ()), *(() if req.ignore_eos else tok.eos_token_ids)]))


def stop_strings(req: _Sampling) -> list[str]:
    if req.stop is None:
        return []
    stops = [req.stop] if isinstance(req.stop, str) else req.stop
    return [s for s in stops if s]


def check_logprobs(name: str, value: int | None) -> None:
    bad = sampling.check_sampling({"logprobs": value})
    if bad is not None:
        raise bad_request(bad[1].replace("logprobs", name, 1), param=name)


def context_error(max_model_len: int, prompt_len: int, max_tokens: int) -> ApiError:
    # vLLM's wording, which clients match with a regex.
    return bad_request(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the completion). "
        "Please reduce the length of the messages or completion.", param=None,
        code="context_length_exceeded")


def resolve_max_tokens(requested: int | None, default: int | None, prompt_len: int, max_model_len: int) -> int:
    """The max_tokens to run with; None default = the remaining context (chat)."""
    remaining = max_model_len - prompt_len
    if requested is not None:
        if prompt_len + requested > max_model_len:
            raise context_error(max_model_len, prompt_len, requested)
        return requested
    if remaining < 1:
        raise context_error(max_model_len, prompt_len, 1 if default is None else default)
    return remaining if default is None else min(default, remaining)


def prompt_scoring(req: _Sampling) -> tuple[int | None, int | None]:
    """The prompt logprobs a request shows: (top-k of the `prompt_logprobs` field, top-k of the prompt part of echo's
    logprobs), None where not shown. vLLM's rules: echo with logprobs scores the prompt (its first token null) and
    then fills the `prompt_logprobs` field too, with the logprobs' k unless the request gives its own; the field
    is not shown in a stream. The engine computes the larger k."""
    echo = req.logprobs if getattr(req, "echo", None) else None  # (completions: logprobs is an int)
    field = None if req.stream else req.prompt_logprobs if req.prompt_logprobs is not None else echo
    return field, echo


MAX_PROMPT_SCORES = 1 << 20  # prompt tokens x (k + 1) x sequences: ~75 MB of response objects at most
# generated tokens x (k + 1), non-streamed: ~300 MB at most; a 32k context's worth of top-20 for 5 sequences
MAX_SAMPLED_SCORES = 1 << 22


def check_sampled_scores_size(tokens: int, k: int) -> None:
    """400 for a whole (not streamed) answer's logprobs too many to hold: max_tokens of each sequence, top-k + the
    sampled token each (a stream holds none)."""
    if tokens * (k + 1) > MAX_SAMPLED_SCORES:
        raise bad_request(f"logprobs for up to {tokens} generated tokens (max_tokens over all prompts and sequences) x "
                          f"{k + 1} entries is more than {MAX_SAMPLED_SCORES} to hold for one answer: ask for fewer "
                          "tokens or sequences or a smaller top-k, or stream the answer.", param="logprobs")


def check_prompt_scoring_size(scored_tokens: int, k: int) -> None:
    """400 for prompt scores too many to hold: each sequence scores its whole prompt (top-k + its own token)."""
    if scored_tokens * (k + 1) > MAX_PROMPT_SCORES:
        raise bad_request(f"prompt scoring of {scored_tokens} prompt tokens (over all prompts and sequences) x "
                          f"{k + 1} entries is more than {MAX_PROMPT_SCORES}: score fewer tokens or fewer "
                          "sequences, or ask for a smaller k.", param="prompt_logprobs")


MIN_TEMPERATURE = 0.01  # vLLM's: a temperature above 0 and below it samples at it (smaller ones overflow)


def sampling_params(req: _Sampling, tok: ModelTokenizer, max_tokens: int, logprobs: int | None,
                    index: int = 0, prompt_logprobs: int | None = None) -> SamplingParams:
    """The SamplingParams of choice `index` (seeded choices get seed + index, as vLLM does)."""
    min_tokens = req.min_tokens or 0
    if min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({min_tokens}) must be <= max_tokens ({max_tokens}).", param="min_tokens")
    given = tok.sampling_defaults  # (the model's generation_config.json, --generation-config auto)
    top_k = int(given.get("top_k", 0) if req.top_k is None else req.top_k)
    temperature = float(given.get("temperature", 1.0) if req.temperature is None else req.temperature)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=max(temperature, MIN_TEMPERATURE) if temperature > 0 else 0.0,
        top_p=float(given.get("top_p", 1.0) if req.top_p is None else req.top_p),
        top_k=0 if top_k < 0 else min(top_k, tok.vocab_size),
        min_p=float(given.get("min_p", 0.0) if req.min_p is None else req.min_p),
        seed=None if req.seed in (None, -1) else req.seed + index,  # (-1: none, as vLLM)
        stop_token_ids=stop_token_ids(req, tok),
        min_tokens=min_tokens,
        repetition_penalty=float(given.get("repetition_penalty", 1.0) if req.repetition_penalty is None
                                 else req.repetition_penalty),
        presence_penalty=float(req.presence_penalty or 0.0),
        frequency_penalty=float(req.frequency_penalty or 0.0),
        logprobs=logprobs,
        logit_bias=logit_bias(req),
        prompt_logprobs=prompt_logprobs,
    )


def prompt_token_lists(req: _Completion, tok: ModelTokenizer) -> list[list[int]]:
    """prompt as a string, list of strings, token ids or list of token-id lists -> token-id lists."""
    prompt = req.prompt
    add_special = True if req.add_special_tokens is None else req.add_special_tokens
    if prompt is None:
        raise bad_request("prompt is required.", param="prompt")
    if isinstance(prompt, str):
        items: list = [prompt]
    elif not prompt:
        raise bad_request("prompt must not be empty.", param="prompt")
    elif all(_is_token(t) for t in prompt):
        items = [prompt]
    elif all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        items = prompt
    else:
        raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of "
                          "token-id lists.", param="prompt")
    per_prompt = sequences_per_prompt(req)
    if len(items) * per_prompt > MAX_SEQUENCES:  # before any tokenizing
        raise bad_request(f"prompts x {'best_of' if req.best_of else 'n'} must be at most {MAX_SEQUENCES}, got "
                          f"{len(items) * per_prompt}.", param="best_of" if req.best_of else "n")
    check_text_length(tok, *(p for p in items if isinstance(p, str)))
    out = []
    for p in items:
        if isinstance(p, str):
            if not p:
                raise bad_request("prompt must not be empty.", param="prompt")
            ids = tok.encode(p, add_special_tokens=add_special)
        else:
            if not all(_is_token(t) for t in p):
                raise bad_request("a token-id prompt must be a list of integers.", param="prompt")
            ids = p
        if not ids:
            raise bad_request("prompt must not be empty.", param="prompt")
        bad = next((t for t in ids if not 0 <= t < tok.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is out of vocabulary (size {tok.vocab_size}).", param="prompt")
        out.append(ids)
    return out


MAX_REQUEST_ID = 256


def response_id(req, header: str | None, prefix: str) -> str | None:
    """The response id a client named, as vLLM forms it: the X-Request-Id header, else the body's request_id, after
    "cmpl-" / "chatcmpl-"; None when neither is given (the server makes one). Printable ASCII up to MAX_REQUEST_ID
    characters (it goes into every chunk and log line); else a 400. The engine's own ids stay the server's, so two
    requests may name the same id."""
    given, param = (header, "X-Request-Id") if header is not None else (req.request_id, "request_id")
    if given is None:
        return None
    if not 0 < len(given) <= MAX_REQUEST_ID or not given.isascii() or not given.isprintable():
        raise bad_request(f"{param} must be 1 to {MAX_REQUEST_ID} printable ASCII characters.", param=param)
    return f"{prefix}-{given}"


def sequences_per_prompt(req: _Sampling) -> int:
    """Sequences generated per prompt: best_of when it is given (completions), else n."""
    return getattr(req, "best_of", None) or req.n or 1


def check_text_length(tok: ModelTokenizer, *texts: str, param: str = "prompt") -> None:
    """400 for a text with more characters than any prompt that fits the context can have, before tokenizing it."""
    for text in texts:
        if len(text) > tok.max_prompt_chars:
            raise bad_request(f"the {param} has {len(text)} characters: more than any text of at most "
                              f"{tok.max_model_len} tokens (this model's context) can have.", param=param,
                              code="context_length_exceeded")


def _is_token(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Tools for the chat template, as sent (transformers' apply_chat_template(tools=...) takes OpenAI's form): each
    {"type": "function", "function": {"name": str, "description"?: str, "parameters"?: object}}."""
    if not tools:
        return None
    for i, t in enumerate(tools):
        fn = t.get("function")
        if t.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("description", ""), str) or not isinstance(fn.get("parameters", {}), dict):
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': str, 'description'?: "
                              "str, 'parameters'?: object}}.", param=f"tools[{i}]")
    return tools


MAX_TEMPLATE_KWARGS_BYTES = 64 << 10


def template_kwargs(kwargs: dict | None, reserved) -> dict:
    """chat_template_kwargs checked: names the template does not already get (`reserved`), at most 64 KiB of JSON."""
    if not kwargs:
        return {}
    taken = sorted(set(kwargs) & set(reserved))
    if taken:
        raise bad_request(f"chat_template_kwargs cannot set {taken[0]!r}: the server sets it.",
                          param="chat_template_kwargs")
    if len(msgspec.json.encode(kwargs)) > MAX_TEMPLATE_KWARGS_BYTES:
        raise bad_request(f"chat_template_kwargs is over {MAX_TEMPLATE_KWARGS_BYTES >> 10} KiB of JSON.",
                          param="chat_template_kwargs")
    return kwargs


def chat_messages(messages: list[Message] | None) -> list[dict]:
    """Messages as the chat template expects them: content flattened to text; an assistant turn's tool calls and a
    tool turn's tool_call_id kept (in OpenAI's form, as transformers' apply_chat_template takes them)."""
    if not messages:
        raise bad_request("messages must be a non-empty list.", param="messages")
    out = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m.role[:40]!r}.",
                              param=f"messages[{i}].role")
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise bad_request(f"messages[{i}].content is required (a {m.role} message"
                              f"{' without tool_calls' if m.role == 'assistant' else ''}).",
                              param=f"messages[{i}].content")
        if m.role == "tool" and not m.tool_call_id:
            raise bad_request(f"messages[{i}] is a tool message: tool_call_id is required.",
                              param=f"messages[{i}].tool_call_id")
        if isinstance(m.content, list):
            parts = []
            for part in m.content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages[{i}]: only text content parts are supported, got {part.type!r}.",
                                      param=f"messages[{i}].content")
                parts.append(part.text)
            content = "".join(parts)
        else:
            content = m.content if m.content is not None else (None if m.tool_calls else "")
        msg = {"role": m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": c.type, "function": {"name": c.function.name,
                                                                            "arguments": c.function.arguments}}
                                 for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out
