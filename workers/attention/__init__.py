"""Attention backends behind one small interface (see base.py); `get_backend(name)` picks one."""

from __future__ import annotations

from workers.attention.base import AttentionBackend, AttentionMetadata
from workers.attention.torch_ref import TorchAttentionBackend

BACKENDS = {"torch": TorchAttentionBackend}


def get_backend(name: str = "auto") -> AttentionBackend:
    """`auto` is the torch reference backend until the Triton/CUDA-graph backend lands."""
    if name == "auto":
        name = "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {', '.join(BACKENDS)} or auto")
    return BACKENDS[name]()


__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend"]
