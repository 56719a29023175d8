"""The model's linear layers under tensor parallelism (docs/tensor_parallel.md), Megatron-style.

Owns how a weight is split over T ranks: column-parallel layers hold out_features/T output rows
(weight and bias), row-parallel ones in_features/T input columns, summed by one all-reduce with the
(replicated) bias added once. Each says which dim of its weight/bias is sharded (`tp_shard_dims`,
None: replicated) so the loader can slice the checkpoint. `MergedLinear` runs column-parallel
projections of one input as one GEMM. `check_shardable` is the start-up check that a model splits
evenly over T ranks. Must not know which projections a model has (workers/model/llama.py) or how
the ranks are started (workers/tp_group.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from laneserve.modelspec import ModelConfig
from workers.collectives import all_reduce


def check_shardable(mc: ModelConfig, size: int) -> None:
    """One clear error at start when the model's heads (or MLP width) don't split evenly over `size` ranks."""
    if size < 1:
        raise ValueError(f"--tensor-parallel-size {size}: must be at least 1")
    bad = [f"{what} {n}" for what, n in (("num_attention_heads", mc.num_heads), ("num_key_value_heads",
           mc.num_kv_heads), ("intermediate_size", mc.intermediate_size)) if n % size]
    if bad:
        raise ValueError(f"--tensor-parallel-size {size}: the model's {' and '.join(bad)} must be divisible by "
                         f"{size} (each rank holds an equal share of the query heads, the KV heads and the MLP); "
                         "choose a size that divides them")


class ColumnParallelLinear(nn.Linear):
    """Output features split over ranks: rank r holds rows [r*out/T, (r+1)*out/T) of weight and bias."""

    tp_shard_dims = {"weight": 0, "bias": 0}

    def __init__(self, in_features: int, out_features: int, bias: bool, tp_size: int = 1):
        super().__init__(in_features, out_features // tp_size, bias=bias)


class RowParallelLinear(nn.Linear):
    """Input features split over ranks; the partial outputs are summed by one all-reduce, then the
    (replicated) bias is added once. At tp_size 1 it is exactly nn.Linear."""

    tp_shard_dims = {"weight": 1, "bias": None}

    def __init__(self, in_features: int, out_features: int, bias: bool, tp_size: int = 1):
        super().__init__(in_features // tp_size, out_features, bias=bias)
        self.tp_size = tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.linear(x, self.weight, self.bias)
        y = all_reduce(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y


class MergedLinear(nn.Module):
    """Column-parallel projections of the same input as one GEMM: weight (and bias) rows are the
    parts' rows, concatenated (each part this rank's shard). Built from the loaded parts by the
    model's fuse_projections()."""

    def __init__(self, parts: dict[str, nn.Linear]):
        super().__init__()
        self.sizes = {name: p.out_features for name, p in parts.items()}  # part name -> its rows
        self.weight = nn.Parameter(torch.cat([p.weight for p in parts.values()]), requires_grad=False)
        biases = [p.bias for p in parts.values()]
        self.bias = None if biases[0] is None else nn.Parameter(torch.cat(biases), requires_grad=False)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight.T + bias; into out (a static buffer of a CUDA graph) if given: the same GEMM as F.linear's."""
        if out is None:
            return F.linear(x, self.weight, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight.t(), out=out)
        return torch.addmm(self.bias, x, self.weight.t(), out=out)
