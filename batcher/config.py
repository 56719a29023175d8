"""The sidecar's one typed config object (flags and LANESERVE_* env vars via laneserve.config)."""

from __future__ import annotations

from dataclasses import dataclass, field


def _h(text: str) -> dict:
    return {"help": text}


@dataclass
class BatcherConfig:
    batcher_address: str = field(default="ipc:///tmp/laneserve/batcher.sock",
                                 metadata=_h("ZeroMQ address the sidecar binds for gateways"))
    worker_address: str = field(default="ipc:///tmp/laneserve/workers.sock",
                                metadata=_h("ZeroMQ address the sidecar binds for workers"))
    # scheduling policy (batcher/scheduler.py)
    max_num_batched_tokens: int = field(default=2048, metadata=_h("token budget of one step"))
    max_num_seqs: int = field(default=256, metadata=_h("most sequences in one step"))
