"""The gateway's one typed config object (flags and LANESERVE_* env vars via laneserve.config)."""

from __future__ import annotations

from dataclasses import dataclass, field

from laneserve.config import flag, secret, shared


AUTO_BODY_CAP = 64 << 20  # the most --max-body-bytes 0 (sized to the context) allows


@dataclass
class GatewayConfig:
    host: str = field(default="127.0.0.1", metadata=flag("HTTP bind address"))
    port: int = field(default=8000, metadata=flag("HTTP port"))
    batcher_address: str = shared("batcher_address")
    model: str = shared("model")
    served_model_name: str = field(default="", metadata=flag(
        "model id in the API; default 'tiny', the dir's name or the .gguf file's stem"))
    max_model_len: int = shared("max_model_len")
    tokenizer: str = field(default="", metadata=flag(
        "an HF tokenizer dir (tokenizer.json + tokenizer_config.json) to use instead of the model's own tokenizer; "
        "the model still sets the context length ('' = the model's)"))
    allowed_origins: str = field(default="*", metadata=flag(
        "CORS for browser clients, as vLLM's: '*' (the default) or a comma list of origins whose pages may call the "
        "API (a preflight is answered before the API key's check); '' = no CORS headers"))
    generation_config: str = field(default="auto", metadata=flag(
        "auto: the model dir's generation_config.json sampling values (temperature, top_p, top_k, min_p, "
        "repetition_penalty) are the defaults of a request that leaves them out, as vLLM's --generation-config "
        "auto; vllm: they are not (temperature 1, top_p 1, no top_k)"))
    chat_template: str = field(default="", metadata=flag(
        "a Jinja chat template to use instead of the tokenizer's: a file's path, or the template itself (as vLLM's "
        "--chat-template); '' = the tokenizer's own"))
    tool_call_parser: str = field(default="", metadata=flag(
        "hermes | mistral | llama3_json: how the model writes tool calls (vLLM's --tool-call-parser), which lets "
        "chat requests with tools use tool_choice auto (the default with tools); '' = none, then tool_choice auto "
        "is a 400 while none, required and a named function work (docs/structured_output.md)"))
    trust_message_special_tokens: bool = field(default=False, metadata=flag(
        "tokenize special-token text inside chat message contents (e.g. '<|im_end|>') as the control tokens; off: as "
        "plain text, so a user cannot forge turns (turn on only for trusted callers)"))
    metrics_prefix: str = field(default="laneserve", metadata=flag(
        "laneserve | vllm: the prefix of the /metrics series' names (vllm: for dashboards written for vLLM that "
        "cannot be edited; the names after it are vLLM's either way)"))
    api_key: str = field(default="", metadata=secret(
        "require 'Authorization: Bearer KEY' on every route but /health, /metrics and /version ('' = open, unless "
        "vLLM's VLLM_API_KEY is set: then that is the key); `laneserve serve` hands it to the gateway in its "
        "environment, never on a command line"))
    api_key_file: str = field(default="", metadata=flag(
        "a file holding the API key (a Compose or Kubernetes secret); its contents, stripped, as --api-key"))
    max_body_bytes: int = field(default=0, metadata=flag(
        "largest request body accepted (413 above); 0 = sized to the context: 6 bytes for every character a prompt "
        "that fits max_model_len can have, plus 1 MiB, at least 16 MiB and at most 64 MiB"))
    header_timeout: float = field(default=10.0, metadata=flag(
        "seconds a connection has to send a request's line and headers, from its opening or from the first byte "
        "after its previous response; slower ones are closed (slowloris); 0 = aiohttp's own limit of about an hour"))
    body_timeout: float = field(default=30.0, metadata=flag(
        "seconds a request's body has to arrive once its headers are in; slower ones get 408 and the connection is "
        "closed; 0 = no limit"))
    keepalive_timeout: float = field(default=30.0, metadata=flag(
        "seconds an idle keep-alive connection stays open after a response (clients' pools usually close theirs "
        "sooner: aiohttp's after 15 s, httpx's after 5 s); 0 = aiohttp's own limit of about an hour"))
    max_connections: int = field(default=4096, metadata=flag(
        "client connections open at once; a new one above it gets 503 + Retry-After and is closed (0 = no cap; "
        "the open-files limit is raised to fit, up to its hard limit)"))
    max_queued_requests: int = field(default=4096, metadata=flag(
        "sequences this gateway keeps in flight at once; over it new requests get 429 + Retry-After (0 = no cap)"))
    request_timeout: float = field(default=600.0, metadata=flag(
        "seconds a request may run before it is aborted (504, or an error chunk in a stream); 0 = no limit"))
    batcher_timeout: float = field(default=3.0, metadata=flag(
        "seconds to wait for the batcher's Pong (health, admission after idle); no answer = 503"))
    batcher_lost_after: float = field(default=10.0, metadata=flag(
        "with requests in flight and no frame from the batcher for this long, they fail with 503"))
    retry_after: float = field(default=1.0, metadata=flag("Retry-After seconds sent with 429 and 503"))
    drain_timeout: float = field(default=8.0, metadata=flag(
        "on SIGTERM/SIGINT: stop accepting (503 + Retry-After), wait this long for in-flight requests, then end "
        "those left with a 503 (an error event and [DONE] if they stream) and close; `laneserve serve` waits this "
        "+ 5 s before it kills the gateway"))
    curve_server_public_key: str = shared("curve_server_public_key")
    curve_client_secret_key: str = shared("curve_client_secret_key")
