"""The Llama family (Llama incl. Llama-3 RoPE scaling, Mistral, Qwen2) as one plain nn.Module.

Owns the math, written to match HF transformers op for op (RMSNorm in fp32, RoPE from an
fp32 cos/sin table, GQA, SwiGLU). Parameter names equal HF's, so a checkpoint's tensors
load by name. Must not know requests, blocks or sampling: forward() gets packed tokens,
their positions and an AttentionMetadata; attention goes through the bound backend,
which writes K/V into this layer's slice of the pool.

Tensor parallelism (tp_size > 1, docs/tensor_parallel.md), Megatron-style: q/k/v and gate/up are
column-parallel (each rank holds num_heads/T query heads, num_kv_heads/T KV heads, and
intermediate_size/T MLP columns), o_proj and down_proj row-parallel, each followed by the one
all-reduce of its block half. Embedding, norms and lm_head are replicated. Parameter names stay
HF's; each parallel linear says which dim of its weight/bias is sharded (`tp_shard_dims`) so the
loader can slice the checkpoint.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from workers.attention.base import AttentionBackend, AttentionMetadata
from workers.model.config import ModelConfig
from workers.parallel import all_reduce


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """As transformers' ROPE_INIT_FUNCTIONS computes it (default, linear, llama3)."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding:
    """cos/sin tables [max_len, head_dim] in fp32, indexed by position. Not an nn.Module on
    purpose: model.to(dtype) must not round the table (HF computes cos/sin in fp32)."""

    def __init__(self, cfg: ModelConfig, max_len: int, device: torch.device | str = "cpu"):
        freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * rope_inv_freq(cfg)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        cos = self.cos[positions].to(q.dtype)[:, None, :]  # [T, 1, D]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


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


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_size: int = 1):
        super().__init__()
        # this rank's share of the heads; GQA groups stay whole (num_kv_heads % tp_size == 0)
        self.num_heads, self.num_kv_heads = cfg.num_heads // tp_size, cfg.num_kv_heads // tp_size
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = ColumnParallelLinear(h, cfg.num_heads * d, cfg.qkv_bias, tp_size)
        self.k_proj = ColumnParallelLinear(h, cfg.num_kv_heads * d, cfg.qkv_bias, tp_size)
        self.v_proj = ColumnParallelLinear(h, cfg.num_kv_heads * d, cfg.qkv_bias, tp_size)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, h, cfg.o_bias, tp_size)
        self.k_cache: torch.Tensor | None = None  # bound by LlamaForCausalLM.bind()
        self.v_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None
        self.kv_scales = None  # int8 pools: this layer's workers.kv_cache.LayerScales

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        q, k = rope(q, k, positions)
        o = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.kv_scales)
        return self.o_proj(o.reshape(T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_size: int = 1):
        super().__init__()
        h, n, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = ColumnParallelLinear(h, n, bias, tp_size)
        self.up_proj = ColumnParallelLinear(h, n, bias, tp_size)
        self.down_proj = RowParallelLinear(n, h, bias, tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_size: int = 1):
        super().__init__()
        self.self_attn = Attention(cfg, tp_size)
        self.mlp = MLP(cfg, tp_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, positions, rope, meta):
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_size: int = 1):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)  # replicated
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp_size) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Build on the meta device, materialise with to_empty(), fill weights, then bind() the
    KV pool and attention backend before the first forward. tp_size > 1: this rank's shard
    (the caller has joined the process group, workers/parallel.py)."""

    def __init__(self, cfg: ModelConfig, tp_size: int = 1):
        super().__init__()
        self.config = cfg
        self.tp_size = tp_size
        self.model = LlamaModel(cfg, tp_size)
        # Tied: no lm_head parameter at all (to_empty() would silently untie a shared one).
        # Replicated under TP (only rank 0 computes logits, so a vocab split would buy nothing but memory).
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope: RotaryEmbedding | None = None
        self.sliding_window = cfg.sliding_window

    def bind(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: AttentionBackend,
             max_len: int, kv_scales: list | None = None) -> None:
        """Attach each layer's (k_cache, v_cache), the attention backend, and the RoPE table;
        int8 pools also pass each layer's scales (workers.kv_cache.KVCache.layer_scales())."""
        device = self.model.embed_tokens.weight.device
        self.rope = RotaryEmbedding(self.config, max_len, device)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.model.layers, kv_caches)):
            layer.self_attn.k_cache, layer.self_attn.v_cache = k_cache, v_cache
            layer.self_attn.backend = backend
            layer.self_attn.kv_scales = kv_scales[i] if kv_scales is not None else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden] before the final norm; the caller
        picks the rows it samples from and hands only those to compute_logits()."""
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, self.rope, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on the selected rows (the norm is per row, so this is exact)."""
        weight = self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight
        return F.linear(self.model.norm(hidden), weight)

    def shard_dims(self) -> dict[str, int | None]:
        """Parameter name -> the dim of the full (checkpoint) tensor this rank holds a 1/tp_size slice
        of; None: replicated, the whole tensor."""
        dims = {}
        for mod_name, mod in self.named_modules():
            for p_name, _ in mod.named_parameters(recurse=False):
                dims[f"{mod_name}.{p_name}" if mod_name else p_name] = getattr(mod, "tp_shard_dims", {}).get(p_name)
        return dims
