"""The paged KV pool: one preallocated tensor per worker, sliced per layer.

Owns the pool's layout and its sizing (a byte budget on CPU, a share of free GPU memory
after a warm-up on CUDA). Must not know requests: which blocks a request uses is the
sidecar's business; the runner only turns block ids into slots.

Layout [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]: each layer's
K and V are contiguous [num_blocks, block_size, Hkv, D] tensors, the layout the Triton
kernels (workers/kernels/paged_attention.py) read.
"""

from __future__ import annotations

import re

import torch

BLOCK_SIZE = 16
DEFAULT_CPU_KV_BYTES = 256 << 20


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, block_size: int = BLOCK_SIZE):
        self.num_blocks, self.block_size = num_blocks, block_size
        # zeros, not empty: padded gathers read unused slots, and 0 * NaN garbage would poison SDPA
        self.pool = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim,
                                dtype=dtype, device=device)

    def layer_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer[0], layer[1]) for layer in self.pool]

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                    block_size: int = BLOCK_SIZE) -> int:
    return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
          "g": 1000**3, "gb": 1000**3, "gib": 1 << 30}


def parse_bytes(text: str) -> int:
    """'256MiB', '2GiB', '1.5GB', '1048576' -> bytes; '' or '0' -> 0 (= auto)."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not str(text).strip():
        return 0
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"--kv-cache-memory {text!r}: expected bytes like 268435456, 256MiB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def gpu_kv_budget(device: torch.device, utilization: float) -> int:
    """Bytes the pool may take: utilization * total, minus what is in use now (weights, other
    processes) and the activation peak the warm-up forward left in max_memory_allocated."""
    free, total = torch.cuda.mem_get_info(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    return int(total * utilization - (total - free) - activation_peak)
