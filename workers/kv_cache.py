"""The paged KV pool: one preallocated tensor per worker, sliced per layer; int8 pools' scales.

Owns the pool's layout and its sizing (a byte budget on CPU, a share of free GPU memory
after a warm-up on CUDA), and for int8 pools the per-(layer, KV head) scales: where they
come from (a calibration file, or the dynamic fallback), the scales file format, and the
quantise / dequantise rules the torch code shares with the Triton kernels. Must not know
requests: which blocks a request uses is the batcher's business; the runner only turns
block ids into slots.

Layout [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]: each layer's
K and V are contiguous [num_blocks, block_size, Hkv, D] tensors, the layout the Triton
kernels (workers/kernels/paged_attention.py) read. int8 pools store V pages transposed:
the same bytes viewed as [num_blocks, Hkv, D, block_size] (`transpose_v_pages`), so the
decode kernel's p.V reads each (page, head)'s keys contiguously (docs/kv_int8.md).

int8: a stored value q stands for q * scale[head] (scale = the dequantisation step, float32,
one per layer and KV head, for K and V apart). Writes round half away from zero and clamp to
[-127, 127], exactly as the Triton write kernel does. Scales live in one preallocated tensor
per pool that attention reads by pointer: CUDA graphs captured before the scales are known
still read the right values once they are written in place (docs/kv_int8.md).
"""

from __future__ import annotations

import contextlib
import json
import math
import re

import torch

BLOCK_SIZE = 16
DEFAULT_CPU_KV_BYTES = 256 << 20
KV_CACHE_DTYPES = ("auto", "int8")
# Dynamic fallback: scale = absmax of the first step's K (or V) per head / 127 * margin.
# 1.5 > sqrt(2): RoPE rotates each (x_i, x_{i+D/2}) pair with position, so a component can later
# reach sqrt(2) x the largest component a short first chunk showed; the rest is headroom for
# tokens larger than the first chunk's. The floor keeps a head that was all ~0 from dividing by 0.
DYNAMIC_MARGIN = 1.5
SCALE_FLOOR = 1e-6


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype: auto = the model's dtype; int8 = quantised with per-head scales."""
    if name == "auto":
        return model_dtype
    if name == "int8":
        return torch.int8
    raise ValueError(f"--kv-cache-dtype {name!r}: choose {' or '.join(KV_CACHE_DTYPES)}")


# ---------------------------------------------------------------------------------------- int8 rule
def quantize_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., Hkv, D] -> int8 round-half-away(x / scale[Hkv]) clamped to +-127 (the Triton rule)."""
    y = (x.float() / scale[:, None]).clamp(-127.0, 127.0)
    return (torch.sign(y) * torch.floor(y.abs() + 0.5)).to(torch.int8)


def transpose_v_pages(v: torch.Tensor) -> torch.Tensor:
    """V pages [num_blocks, page, Hkv, D] -> an int8 pool's layout [num_blocks, Hkv, D, page] (a copy)."""
    return v.permute(0, 2, 3, 1).contiguous()


def v_rows(v_cache: torch.Tensor) -> torch.Tensor:
    """A layer's V as [num_blocks, page, Hkv, D] rows whatever the pool: int8 pools' transposed pages
    as a strided view (no copy), for indexing by (block, offset)."""
    return v_cache.permute(0, 3, 1, 2) if v_cache.dtype == torch.int8 else v_cache


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered int8 rows [..., Hkv, D] -> dtype. Only a step's working set, never the pool."""
    return (q.to(torch.float32) * scale[:, None]).to(dtype)


class LayerScales:
    """One layer's K and V scales: views [Hkv] into the pool's scale tensor, plus whether they are
    set. A dynamic pool sets them from the first forward that reaches this layer, then never again."""

    def __init__(self, owner: "KVScales", k: torch.Tensor, v: torch.Tensor, ready: bool):
        self.owner, self.k, self.v, self.ready = owner, k, v, ready

    def observe(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Called by attention with this step's new K/V [T, Hkv, D] before they are written."""
        if self.ready or self.owner.held or k.shape[0] == 0:
            return
        # in place, on the device, no host sync: graphs hold pointers to these tensors
        self.k.copy_(_dynamic_scale(k))
        self.v.copy_(_dynamic_scale(v))
        self.ready = True


def _dynamic_scale(x: torch.Tensor) -> torch.Tensor:
    return (x.detach().float().abs().amax(dim=(0, 2)) / 127.0 * DYNAMIC_MARGIN).clamp_min(SCALE_FLOOR)


class KVScales:
    """All scales of an int8 pool: k/v [num_layers, Hkv] float32 on the pool's device."""

    def __init__(self, num_layers: int, num_kv_heads: int, device: torch.device | str):
        self.k = torch.ones(num_layers, num_kv_heads, dtype=torch.float32, device=device)
        self.v = torch.ones_like(self.k)
        self.held = False
        self.source = "dynamic"
        self.layers = [LayerScales(self, self.k[i], self.v[i], False) for i in range(num_layers)]

    def load(self, k: list[list[float]], v: list[list[float]], source: str) -> None:
        self.k.copy_(torch.tensor(k, dtype=torch.float32))
        self.v.copy_(torch.tensor(v, dtype=torch.float32))
        for layer in self.layers:
            layer.ready = True
        self.source = source

    @property
    def ready(self) -> bool:
        return all(layer.ready for layer in self.layers)

    @contextlib.contextmanager
    def hold(self):
        """No dynamic calibration inside: warm-ups and graph capture run on placeholder inputs."""
        self.held = True
        try:
            yield
        finally:
            self.held = False


# ---------------------------------------------------------------------------------------- the pool
class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, block_size: int = BLOCK_SIZE):
        self.num_blocks, self.block_size = num_blocks, block_size
        # zeros, not empty: padded gathers read unused slots, and 0 * NaN garbage would poison SDPA
        self.pool = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim,
                                dtype=dtype, device=device)
        self.scales = KVScales(num_layers, num_kv_heads, device) if dtype == torch.int8 else None

    def layer_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k [num_blocks, page, Hkv, D], v): v has that shape too, or, in an int8 pool,
        [num_blocks, Hkv, D, page] (pages transposed; the same memory)."""
        if self.scales is None:
            return [(layer[0], layer[1]) for layer in self.pool]
        return [(layer[0], layer[1].view(layer[1].shape[0], *layer[1].shape[2:], layer[1].shape[1]))
                for layer in self.pool]

    def layer_scales(self) -> list[LayerScales] | None:
        return self.scales.layers if self.scales is not None else None

    @property
    def nbytes(self) -> int:
        extra = 2 * self.scales.k.numel() * 4 if self.scales is not None else 0
        return self.pool.numel() * self.pool.element_size() + extra


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                    block_size: int = BLOCK_SIZE) -> int:
    """int8: 1 byte per element; its scales are per pool, not per block (2 * layers * Hkv floats)."""
    return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


# ---------------------------------------------------------------------------------------- scales file
def save_kv_scales(path: str, k: list[list[float]], v: list[list[float]], method: str, **info) -> None:
    with open(path, "w") as f:
        json.dump({"k_scale": k, "v_scale": v, "method": method, **info}, f, indent=1)


def load_kv_scales(path: str, num_layers: int, num_kv_heads: int) -> tuple[list[list[float]], list[list[float]]]:
    """{"k_scale": [[per KV head] per layer], "v_scale": ..., "method": ...}; the error names the file."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"KV scales {path}: cannot read JSON: {exc}") from None
    out = []
    for key in ("k_scale", "v_scale"):
        rows = data.get(key) if isinstance(data, dict) else None
        if not isinstance(rows, list) or len(rows) != num_layers or any(
                not isinstance(r, list) or len(r) != num_kv_heads for r in rows):
            raise ValueError(f"KV scales {path}: {key!r} must be {num_layers} layers x {num_kv_heads} KV heads")
        if not all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for r in rows for x in r):
            raise ValueError(f"KV scales {path}: {key!r} holds a value that is not a finite positive number")
        out.append([[float(x) for x in r] for r in rows])
    return out[0], out[1]


# ---------------------------------------------------------------------------------------- sizing
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
          "g": 1000**3, "gb": 1000**3, "gib": 1 << 30}


def parse_bytes(text: str) -> int:
    """'256MiB', '2GiB', '1.5GB', '1048576' -> bytes; '' or '0' -> 0 (= auto)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?|\.[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
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
