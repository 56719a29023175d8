"""Attention backends behind one small interface (see base.py); `get_backend(name, ...)` picks one."""

from __future__ import annotations

import torch

from workers.attention.base import AttentionBackend, AttentionMetadata
from workers.attention.torch_ref import TorchAttentionBackend

BACKENDS = ("torch", "triton")
DECODE_KERNELS = ("partitioned", "persistent", "auto")  # the Triton backend's (--decode-attention)


def backend_name(name: str, device: torch.device) -> str:
    """--attention-backend resolved: `auto` is Triton (paged decode kernel, CUDA-graph safe) on CUDA, the torch
    reference elsewhere; an unknown name is a ValueError."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {', '.join(BACKENDS)} or auto")
    return name


def get_backend(name: str, device: torch.device, num_kv_heads: int, decode: str = "auto",
                max_batch: int = 256, cascade: bool = False) -> AttentionBackend:
    """The backend `name` (backend_name). `triton` on CPU runs the same kernels under Triton's interpreter (tests
    only: slow). decode: the Triton backend's decode kernel (`--decode-attention`), for at most max_batch decodes a
    step; cascade: its shared prefixes once per group (`--cascade-attention`, checked by the caller:
    workers.runner.cascade_attention_on)."""
    name = backend_name(name, device)
    if decode not in DECODE_KERNELS:
        raise ValueError(f"--decode-attention {decode!r}: choose partitioned, persistent or auto")
    if name == "torch" and decode == "persistent":  # (auto, the default, picks among Triton kernels: none here)
        raise ValueError(f"--decode-attention {decode} is a Triton kernel: it needs --attention-backend triton (the "
                         "default on CUDA)")
    if name == "torch":
        return TorchAttentionBackend()
    # imported here, not at the top: Triton is optional, and the torch backend must work without it
    from workers.attention.triton_backend import TritonAttentionBackend

    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    return TritonAttentionBackend(num_kv_heads, sms, decode, max_batch, cascade)


__all__ = ["AttentionBackend", "AttentionMetadata", "backend_name", "get_backend"]
