"""The gateway's one typed config object (flags and LANESERVE_* env vars via laneserve.config)."""

from __future__ import annotations

from dataclasses import dataclass, field


def _h(text: str) -> dict:
    return {"help": text}


@dataclass
class GatewayConfig:
    host: str = field(default="127.0.0.1", metadata=_h("HTTP bind address"))
    port: int = field(default=8000, metadata=_h("HTTP port"))
    batcher_address: str = field(default="ipc:///tmp/laneserve/batcher.sock",
                                 metadata=_h("ZeroMQ address of the sidecar"))
    model: str = field(default="tiny", metadata=_h("'tiny' (embedded random model) or an HF checkpoint dir"))
    served_model_name: str = field(default="", metadata=_h("model id in the API; default 'tiny' or the dir's name"))
    max_model_len: int = field(default=0, metadata=_h("context length; 0 = the model's"))
    api_key: str = field(default="", metadata=_h(
        "require 'Authorization: Bearer KEY' on every route but /health and /metrics ('' = open)"))
    max_body_bytes: int = field(default=16 * 1024 * 1024, metadata=_h("largest request body accepted (413 above)"))
    max_queued_requests: int = field(default=4096, metadata=_h(
        "sequences this gateway keeps in flight at once; over it new requests get 429 + Retry-After (0 = no cap)"))
    request_timeout: float = field(default=600.0, metadata=_h(
        "seconds a request may run before it is aborted (504, or an error chunk in a stream); 0 = no limit"))
    sidecar_timeout: float = field(default=3.0, metadata=_h(
        "seconds to wait for the sidecar's Pong (health, admission after idle); no answer = 503"))
    sidecar_lost_after: float = field(default=10.0, metadata=_h(
        "with requests in flight and no frame from the sidecar for this long, they fail with 503"))
    retry_after: float = field(default=1.0, metadata=_h("Retry-After seconds sent with 429 and 503"))
    drain_timeout: float = field(default=8.0, metadata=_h(
        "on SIGTERM/SIGINT: stop accepting, then wait this long for in-flight requests before closing "
        "(keep it under the launcher's --shutdown-timeout, which then kills the gateway)"))
    curve_server_public_key: str = field(default="", metadata=_h(
        "tcp across hosts: the sidecar's public CURVE certificate (zmq.auth file); set = connect with CURVE"))
    curve_client_secret_key: str = field(default="", metadata=_h(
        "with CURVE: this client's certificate (zmq.auth secret file); '' = a fresh key pair per start"))
