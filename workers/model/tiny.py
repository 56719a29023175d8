"""The embedded tiny model (`--model tiny`): a Llama-shaped config and seeded random weights.

Owns the tiny spec (docs/architecture.md, "Tiny model"; it must cover gateway/tokenizer.py's
byte-level vocab and eos ids) and the random weight fill shared with `--load-format dummy`.
Must not read files.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.model.config import ModelConfig

TINY_BOS_ID = 256
TINY_EOS_IDS = (257, 259)  # </s>, <|im_end|>

TINY_CONFIG = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=320, hidden_size=128, intermediate_size=384, num_layers=4,
    num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=8192, rope_theta=10000.0,
    rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_ids=TINY_EOS_IDS,
)


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
