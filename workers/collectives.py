"""Tensor-parallel collectives: joining the process group, rank devices, and the three collectives.

Owns how a rank talks to the others once the group exists (docs/tensor_parallel.md): the
all-reduce of a row-parallel output (CUDA-graph capturable on NCCL), the broadcast of rank 0's
sampled tokens, the MIN of the KV pool size; and the settings every rank's group starts with
(backend, timeout, NVLink multicast off). Torch only, below the model: must not import anything
from workers (the model's layers and the runner call it; starting the ranks is workers/tp_group.py's).
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

# NVLink multicast (NVLS) off in NCCL, PyTorch symmetric memory and NVSHMEM: on a shared host a
# program that uses it can put every GPU of the host out of service, not just the group's.
# Forced, not defaulted, and set before the group exists so the follower ranks inherit them.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# A collective waits at most this long for the slowest rank (start-up includes weight loading).
COLLECTIVE_TIMEOUT_S = 600


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r of a group uses cuda:(base + r): CUDA_VISIBLE_DEVICES lists the group's GPUs."""
    if device.type == "cuda":
        return torch.device("cuda", (device.index or 0) + rank)
    return device


def init_process_group(rank: int, size: int, address: str, device: torch.device) -> None:
    """NCCL on CUDA, gloo on CPU; `device` is this rank's (rank_device)."""
    os.environ.update(MULTICAST_OFF)
    kw = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kw["device_id"] = device  # eager communicator init: nothing lazy left for graph capture
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=address, rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S), **kw)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the group, in place. Capturable in a CUDA graph on NCCL once the communicator
    exists (the warm-up forwards before capture run it eagerly first)."""
    dist.all_reduce(x)
    return x


def min_across_ranks(value: int, device: torch.device) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def broadcast_tokens(tokens: list[int] | None, n: int, rank: int, device: torch.device) -> list[int]:
    """Rank 0's n sampled token ids to every rank. Rank 0 passes None when its sampling failed:
    the others get -1s and raise too, so the step fails on every rank and their states stay equal."""
    t = torch.full((n,), -1, dtype=torch.int64, device=device)
    if rank == 0 and tokens is not None:
        t.copy_(torch.tensor(tokens, dtype=torch.int64))
    dist.broadcast(t, src=0)
    out = t.tolist()
    if rank != 0 and n and out[0] < 0:
        raise RuntimeError("tensor-parallel rank 0 failed to sample this step")
    return out
