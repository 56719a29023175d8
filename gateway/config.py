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
