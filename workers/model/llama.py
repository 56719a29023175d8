"""The Llama family (Llama incl. Llama-3 RoPE scaling, Mistral, Qwen2) as one plain nn.Module.

Owns the math, written to match HF transformers op for op (RMSNorm in fp32, RoPE from an
fp32 cos/sin table, GQA, SwiGLU). Must not know requests, blocks or sampling: forward() gets
packed tokens, their positions and an AttentionMetadata; attention goes through the bound
backend, which writes K/V into this layer's slice of the pool.

Built with HF's parameter names, so a checkpoint's tensors load by name; then the loader calls
fuse_projections(), which merges q/k/v into one `qkv_proj` and gate/up into one `gate_up_proj`
(one GEMM each; the parts' rows concatenated, `MergedLinear`), freeing the parts. The small ops
go through workers/kernels/fused.py: on CUDA one Triton kernel each for residual add + RMSNorm
(the residual stream is carried beside the hidden state, vLLM style, summed by the next norm),
RoPE in place on q/k (views into the qkv output) and SiLU * up; elsewhere the same torch math
as HF, op for op. forward() runs in pieces, head(), then attend(i) and tail(i) per layer, so
that workers/cuda_graphs.py can capture the pieces between attentions as CUDA graphs. Steps of at
most `gemv_rows` tokens (`--decode-gemv-rows`, 8 by default on CUDA in bf16 or fp16) run the linear layers as
workers/kernels/gemv.py's GEMVs instead, with the norms, SiLU * up and residual adds inside them,
and (Triton attention, a pool that is not int8) each qkv GEMV also does its layer's RoPE and K/V
write, the backend told so (`kv_written`); so does each piecewise CUDA graph for the next layer
(`rope_write`, `rope_ahead`).

Tensor parallelism (tp_size > 1, docs/tensor_parallel.md), Megatron-style, with the parallel linear
layers of workers/model/layers.py: q/k/v and gate/up are column-parallel (each rank holds
num_heads/T query heads, num_kv_heads/T KV heads, and intermediate_size/T MLP columns), o_proj and
down_proj row-parallel, each followed by the one all-reduce of its block half. Embedding, norms and
lm_head are replicated. Parameter names stay HF's until fuse_projections(); shard_dims() collects
the sharded dim of each parameter (the layers' `tp_shard_dims`) so the loader can slice the
checkpoint. Each part is this rank's shard, so a rank's merged qkv rows are [its q heads; its k
heads; its v heads], and gate_up [its gate; its up].
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from laneserve.modelspec import ModelConfig
from workers.attention.base import AttentionBackend, AttentionMetadata
from workers.kernels.fused import add_rms_norm, rms_norm, silu_mul
from workers.kernels.gemv import gemv, qkv_rope_gemv
from workers.model.layers import ColumnParallelLinear, MergedLinear, RowParallelLinear


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """As transformers' ROPE_INIT_FUNCTIONS computes it (default, linear, llama3); freq_factors: divided by a GGUF
    file's rope_freqs, as llama.cpp's RoPE divides (its converter writes Llama 3.x's llama3 scaling so)."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "freq_factors":
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
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


# what a qkv GEMV needs to also rotate q / k and write K/V: the step's positions [T], slots [T] and the RoPE tables
KVWrite = tuple[torch.Tensor, torch.Tensor, RotaryEmbedding]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm(x); with a residual: residual += x in place, then RMSNorm(residual) (one kernel on CUDA)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


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
        self.qkv_proj: MergedLinear | None = None  # q/k/v merged by fuse()
        self.k_cache: torch.Tensor | None = None  # bound by LlamaForCausalLM.bind()
        self.v_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None
        self.kv_scales = None  # int8 pools: this layer's workers.kv_cache.LayerScales

    def fuse(self) -> None:
        self.qkv_proj = MergedLinear({"q_proj": self.q_proj, "k_proj": self.k_proj, "v_proj": self.v_proj})
        del self.q_proj, self.k_proj, self.v_proj

    def heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This layer's qkv projection [T, q+k+v] -> q [T, Hq, D], k, v [T, Hkv, D]: views into it (row stride = all
        heads; backends take strided q/k/v)."""
        q, k, v = qkv.split(list(self.qkv_proj.sizes.values()), dim=-1)
        return (q.unflatten(-1, (self.num_heads, self.head_dim)), k.unflatten(-1, (self.num_kv_heads, self.head_dim)),
                v.unflatten(-1, (self.num_kv_heads, self.head_dim)))

    def rope_write(self, qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   rope: RotaryEmbedding) -> None:
        """RoPE on this layer's q and k in its qkv projection [T, q+k+v], in place, and the K/V write into its pool
        at slots [T] (-1: none), as the Triton backend does before attention (one launch on a GPU), so that
        attend(kv_written=True) follows: for a pool that is not int8 on that backend (LlamaForCausalLM.rope_ahead)."""
        q, k, v = self.heads(qkv)
        self.backend.rope_write(q, k, v, self.k_cache, self.v_cache, slots, (positions, rope.cos, rope.sin))

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, meta: AttentionMetadata,
               out: torch.Tensor | None = None, kv_written: bool = False) -> torch.Tensor:
        """This layer's qkv projection [T, q+k+v] -> attention output [T, Hq * D] (into out [T, Hq, D] if given):
        RoPE, the K/V write and attention, all in the backend (RoPE with the K/V write: one launch), or with
        kv_written attention alone (q and k rotated and the pool written ahead: the qkv GEMV's qkv_rope_gemv, or
        rope_write in the piecewise graph before it)."""
        q, k, v = self.heads(qkv)
        o = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.kv_scales,
                                 rope=None if kv_written else (positions, rope.cos, rope.sin), out=out,
                                 kv_written=kv_written)
        return o.flatten(1)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_size: int = 1):
        super().__init__()
        h, n, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = ColumnParallelLinear(h, n, bias, tp_size)
        self.up_proj = ColumnParallelLinear(h, n, bias, tp_size)
        self.down_proj = RowParallelLinear(n, h, bias, tp_size)
        self.gate_up_proj: MergedLinear | None = None  # gate/up merged by fuse()

    def fuse(self) -> None:
        self.gate_up_proj = MergedLinear({"gate_proj": self.gate_proj, "up_proj": self.up_proj})
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_size: int = 1):
        super().__init__()
        self.self_attn = Attention(cfg, tp_size)
        self.mlp = MLP(cfg, tp_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def tail(self, o: torch.Tensor, residual: torch.Tensor, after: DecoderLayer | None,
             qkv_out: torch.Tensor | None = None) -> torch.Tensor:
        """The rest of this layer after attention: o_proj, the MLP and the norms, then the next layer's input norm and
        qkv projection (into qkv_out if given); after the last layer (after None) the hidden states. The residual
        stream, vLLM style: a layer's input is residual + x, a sum left to the norm that needs it (residual += x in
        place, then the norm, one kernel on CUDA; HF's `x + sublayer(x)`, bit for bit)."""
        x = self.post_attention_layernorm(self.self_attn.o_proj(o), residual)
        x = self.mlp(x)
        if after is None:
            return residual.add_(x)  # the last layer's MLP output joins the stream
        return after.self_attn.qkv_proj(after.input_layernorm(x, residual), out=qkv_out)

    def tail_gemv(self, o: torch.Tensor, residual: torch.Tensor, after: DecoderLayer | None,
                  qkv_out: torch.Tensor | None = None, kv: KVWrite | None = None) -> torch.Tensor:
        """tail() at <= 8 tokens in four weight-streaming GEMV launches, each with the small op before or after it
        (workers/kernels/gemv.py): o_proj + the residual add, norm + gate/up + SiLU * up, down_proj + the residual
        add, the next layer's norm + qkv (with kv: and its RoPE and K/V write); at 2-8 tokens each norm is a launch
        of its own before its GEMV (gemv.NORM_PROLOGUE_ROWS). The same math and roundings as
        tail() (to the GEMM's summation order)."""
        o_proj, mlp, post = self.self_attn.o_proj, self.mlp, self.post_attention_layernorm
        gemv(o, o_proj.weight, bias=o_proj.bias, residual=residual)
        act = gemv(residual, mlp.gate_up_proj.weight, bias=mlp.gate_up_proj.bias, norm=(post.weight, post.eps),
                   silu=True)
        gemv(act, mlp.down_proj.weight, bias=mlp.down_proj.bias, residual=residual)
        if after is None:
            return residual
        return after.qkv_gemv(residual, qkv_out, kv)

    def qkv_gemv(self, residual: torch.Tensor, out: torch.Tensor | None = None, kv: KVWrite | None = None
                 ) -> torch.Tensor:
        """This layer's input norm and qkv projection in one GEMV launch (the norm apart at 2-8 tokens); with kv
        (positions, slots, the RoPE tables) RoPE on q and k and the K/V write into this layer's pool in the same
        launch."""
        attn, norm = self.self_attn, self.input_layernorm
        qkv = attn.qkv_proj
        if kv is None:
            return gemv(residual, qkv.weight, bias=qkv.bias, norm=(norm.weight, norm.eps), out=out)
        positions, slots, rope = kv
        return qkv_rope_gemv(residual, qkv.weight, qkv.bias, (norm.weight, norm.eps), attn.num_heads,
                             attn.num_kv_heads, positions, rope.cos, rope.sin, attn.k_cache, attn.v_cache, slots, out)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_size: int = 1):
        super().__init__()
        # replicated; _weight: built as is, not initialised (on the meta device nn.Embedding's normal_ would import
        # torch._dynamo, ~1 s of a worker's start-up on a CPU)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp_size) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Build on the meta device, materialise with to_empty(), fill weights, then bind() the
    KV pool and attention backend before the first forward. tp_size > 1: this rank's shard
    (the caller has joined the process group, workers/tp_group.py)."""

    def __init__(self, cfg: ModelConfig, tp_size: int = 1):
        super().__init__()
        self.config = cfg
        self.tp_size = tp_size
        self.model = LlamaModel(cfg, tp_size)
        # Tied: no lm_head parameter at all (to_empty() would silently untie a shared one).
        # Replicated under TP (only rank 0 computes logits, so a vocab split would buy nothing but memory).
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope: RotaryEmbedding | None = None
        self.backend: AttentionBackend | None = None
        self.sliding_window = cfg.sliding_window
        self.gemv_rows = 0  # --decode-gemv-rows (set by the runner): steps of at most this many tokens take tail_gemv
        # bind(): the Triton backend on a pool that is not int8, where RoPE and the K/V write may run ahead of attention
        # (in the qkv GEMV, or in the piecewise graphs' pieces: workers/cuda_graphs.py)
        self.rope_ahead = False

    def small(self, x: torch.Tensor) -> bool:
        """Whether x's rows take the fused GEMV path (--decode-gemv-rows; the runner checked it can run)."""
        return 0 < x.shape[0] <= self.gemv_rows and x.stride(-1) == 1

    def bind(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: AttentionBackend,
             max_len: int, kv_scales: list | None = None) -> None:
        """Attach each layer's (k_cache, v_cache), the attention backend, and the RoPE table;
        int8 pools also pass each layer's scales (workers.kv_cache.KVCache.layer_scales())."""
        device = self.model.embed_tokens.weight.device
        self.rope = RotaryEmbedding(self.config, max_len, device)
        self.backend = backend
        self.rope_ahead = backend.name == "triton" and kv_scales is None
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.model.layers, kv_caches)):
            layer.self_attn.k_cache, layer.self_attn.v_cache = k_cache, v_cache
            layer.self_attn.backend = backend
            layer.self_attn.kv_scales = kv_scales[i] if kv_scales is not None else None

    def compile_attention(self, any_device: bool = False) -> None:
        """After bind(), on CUDA with the Triton backend: JIT-compile every attention kernel variant a step can pick
        for this model's shapes and pool (a compile mid-serving stalls that step ~1 s). any_device: on the CPU too
        (workers/tools/compile_check.py, which compiles for a GPU without running)."""
        attn = self.model.layers[0].self_attn
        if self.backend.name == "triton" and (any_device or attn.k_cache.device.type == "cuda"):
            self.backend.compile_kernels(attn.num_heads, attn.head_dim, self.model.embed_tokens.weight.dtype,
                                         attn.k_cache, attn.v_cache, attn.kv_scales, self.sliding_window)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                after_layer: Callable[[], None] | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden] before the final norm; the caller
        picks the rows it samples from and hands only those to compute_logits(). after_layer: called on the host
        after each layer's launch (the runner reports a finished step in flight from there)."""
        self.backend.begin(meta)
        # small steps on the GEMV path: each qkv GEMV also does its layer's RoPE and K/V write
        kv = (positions, meta.slot_mapping, self.rope) if self.rope_ahead and self.small(input_ids) else None
        x, residual = self.head(input_ids, kv=kv)
        for i in range(len(self.model.layers)):
            x = self.tail(i, self.attend(i, x, positions, meta, kv_written=kv is not None), residual, kv=kv)
            if after_layer is not None:
                after_layer()
        return x

    # forward() in pieces: the parts between two attentions are what workers/cuda_graphs.py's PiecewiseGraphs
    # captures; the out arguments keep what crosses an attention in static buffers.
    def head(self, input_ids: torch.Tensor, residual_out: torch.Tensor | None = None,
             qkv_out: torch.Tensor | None = None, kv: KVWrite | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The embedding (the residual stream), layer 0's input norm and qkv projection -> (qkv, residual); kv (on
        the GEMV path only): the qkv GEMV does RoPE and the K/V write too (DecoderLayer.qkv_gemv)."""
        weight = self.model.embed_tokens.weight
        residual = (F.embedding(input_ids, weight) if residual_out is None
                    else torch.index_select(weight, 0, input_ids, out=residual_out))
        first = self.model.layers[0]
        if self.small(residual):
            return first.qkv_gemv(residual, qkv_out, kv), residual
        return first.self_attn.qkv_proj(first.input_layernorm(residual), out=qkv_out), residual

    def rope_write(self, i: int, qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Layer i's RoPE and K/V write from its qkv projection, ahead of attend(i, kv_written=True) (rope_ahead
        models only: Attention.rope_write)."""
        self.model.layers[i].self_attn.rope_write(qkv, positions, slots, self.rope)

    def attend(self, i: int, qkv: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
               out: torch.Tensor | None = None, kv_written: bool = False) -> torch.Tensor:
        """Layer i's attention: its qkv projection [T, q+k+v] -> [T, Hq * D] (written to out [T, Hq, D] if given)."""
        return self.model.layers[i].self_attn.attend(qkv, positions, self.rope, meta, out, kv_written)

    def tail(self, i: int, o: torch.Tensor, residual: torch.Tensor, qkv_out: torch.Tensor | None = None,
             kv: KVWrite | None = None) -> torch.Tensor:
        """Layer i after its attention, to layer i+1's qkv projection (the last layer: to the hidden states)."""
        layers = self.model.layers
        after = layers[i + 1] if i + 1 < len(layers) else None
        if self.small(o):
            return layers[i].tail_gemv(o, residual, after, qkv_out, kv)
        return layers[i].tail(o, residual, after, qkv_out)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on the selected rows (the norm is per row, so this is exact)."""
        weight = self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight
        if self.small(hidden):
            return gemv(hidden, weight, norm=(self.model.norm.weight, self.model.norm.eps))
        return F.linear(self.model.norm(hidden), weight)

    def fuse_projections(self) -> None:
        """After the weights are loaded: q/k/v -> qkv_proj and gate/up -> gate_up_proj in every layer,
        the parts freed (one layer's merged copy staged at a time)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def checkpoint_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's weights under the checkpoint's (HF) names: merged projections split back into
        views of their parts, whether fused or not (tests, debugging)."""
        out = {}
        for name, tensor in self.state_dict().items():
            prefix, _, leaf = name.rpartition(".")
            mod = self.get_submodule(prefix)
            if not isinstance(mod, MergedLinear):
                out[name] = tensor
                continue
            parent = prefix.rpartition(".")[0]
            for part, rows in zip(mod.sizes, tensor.split(list(mod.sizes.values()))):
                out[f"{parent}.{part}.{leaf}"] = rows
        return out

    def shard_dims(self) -> dict[str, int | None]:
        """Parameter name -> the dim of the full (checkpoint) tensor this rank holds a 1/tp_size slice
        of; None: replicated, the whole tensor. The loading layout: before fuse_projections()."""
        dims = {}
        for mod_name, mod in self.named_modules():
            for p_name, _ in mod.named_parameters(recurse=False):
                dims[f"{mod_name}.{p_name}" if mod_name else p_name] = getattr(mod, "tp_shard_dims", {}).get(p_name)
        return dims
