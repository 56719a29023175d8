"""Seeded random weights: the embedded tiny model's (`--model tiny`, spec in laneserve/modelspec.py) and
`--load-format dummy`'s. Must not read files.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def init_random_(model: nn.Module, generator: torch.Generator) -> None:
    """Fill every parameter from `generator`, in name order so the result depends only on the seed.

    Scales keep activations O(1) through the layers (normal / sqrt(fan_in)), so logits are
    peaked enough that greedy decoding of the tiny model is not a sea of near-ties.
    """
    device = generator.device
    for name, param in sorted(model.named_parameters()):
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        shape = param.shape
        t = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
        if name.endswith("bias"):
            t *= 0.02
        elif "embed_tokens" not in name:
            t /= shape[-1] ** 0.5
        param.copy_(t)
