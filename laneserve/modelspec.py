"""What the gateway and the worker must agree on about the served model, in one torch-free place.

Owns ModelConfig (the few numbers our Llama-family module needs, parsed and validated from an HF
config.json: architecture, RoPE scaling, biases), the context limit (`--max-model-len` against the
model's max_position_embeddings, and the fallback when config.json has none), and the tiny model's
spec: its shape and its special tokens, which the gateway's byte-level tokenizer and the worker's
random model both build from. Must not import torch or touch weights or devices. An unsupported
checkpoint fails here, once, naming the file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")  # freq_factors: a GGUF file's rope_freqs
DEFAULT_MAX_POSITION_EMBEDDINGS = 4096  # the context limit of a config.json that does not give one


QWEN2_MAX_WINDOW_LAYERS = 28  # transformers' Qwen2Config default


class ModelConfigError(ValueError):
    """A checkpoint whose config.json we cannot serve; the message names the file."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3"|"linear"|"freq_factors", ...}; None = default RoPE
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama with attention_bias
    o_bias: bool = False  # Llama with attention_bias
    mlp_bias: bool = False
    sliding_window: int | None = None  # Mistral: keys older than this many positions are not attended
    torch_dtype: str = "float32"  # the checkpoint's dtype (informational)
    eos_token_ids: tuple[int, ...] = field(default=())

    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        file = os.path.join(path, "config.json")
        if not os.path.isfile(file):
            raise ModelConfigError(f"{file}: not found (--model must be 'tiny' or a checkpoint directory)")
        try:
            with open(file) as f:
                raw = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ModelConfigError(f"{file}: cannot read: {e}") from None
        return cls.from_dict(raw, source=file)

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "ModelConfig":
        try:
            return cls._from_dict(d, source)
        except KeyError as exc:  # a field the family's configs always have: one line, not a traceback
            raise ModelConfigError(f"{source}: no {exc.args[0]!r}") from None

    @classmethod
    def _from_dict(cls, d: dict, source: str) -> "ModelConfig":
        archs = d.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelConfigError(f"{source}: unsupported architecture {archs or d.get('model_type')!r}; "
                                   f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if "text_config" in d:  # multimodal wrappers are not in the family
            raise ModelConfigError(f"{source}: multimodal configs are not supported")
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ModelConfigError(f"{source}: hidden_act {act!r} is not supported (only silu)")
        num_heads = d["num_attention_heads"]
        hidden = d["hidden_size"]
        # transformers >= 5 folds rope_theta into rope_parameters; older files use rope_scaling.
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelConfigError(f"{source}: rope type {rope_type!r} is not supported "
                                   f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        head_dim = d.get("head_dim") or hidden // num_heads
        if rope_type == "freq_factors" and len(rope["factors"]) != head_dim // 2:
            raise ModelConfigError(f"{source}: {len(rope['factors'])} RoPE frequency factors for a head_dim of "
                                   f"{head_dim} (it needs {head_dim // 2})")
        if arch == "Qwen2ForCausalLM":
            qkv_bias, o_bias = True, False
            window = d.get("sliding_window") if d.get("use_sliding_window") else None
            if window is not None:  # transformers' rule: layer i has the window from max_window_layers (28) on
                first = d.get("max_window_layers", QWEN2_MAX_WINDOW_LAYERS)
                kinds = set(d.get("layer_types") or ("sliding_attention" if i >= first else "full_attention"
                                                     for i in range(d["num_hidden_layers"])))
                if kinds == {"full_attention"}:
                    window = None
                elif kinds != {"sliding_attention"}:
                    raise ModelConfigError(f"{source}: a sliding window on some layers only (max_window_layers "
                                           f"{first} of {d['num_hidden_layers']}, or layer_types) is not supported")
        else:
            qkv_bias = o_bias = bool(d.get("attention_bias", False))
            window = d.get("sliding_window") if arch == "MistralForCausalLM" else None
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch, vocab_size=d["vocab_size"], hidden_size=hidden,
            intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"], num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=max_position_embeddings(d), rope_theta=theta,
            rope_scaling=rope_scaling, rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), qkv_bias=qkv_bias, o_bias=o_bias,
            mlp_bias=bool(d.get("mlp_bias", False)), sliding_window=window,
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"), eos_token_ids=eos_ids,
        )


def max_position_embeddings(config_json: dict) -> int:
    """The model's context limit as an HF config.json (or its text_config) gives it."""
    return int(config_json.get("max_position_embeddings") or DEFAULT_MAX_POSITION_EMBEDDINGS)


def resolve_max_model_len(model_limit: int, requested: int) -> int:
    """The context length served: --max-model-len (0 = the model's), never above the model's limit."""
    if requested > model_limit:
        raise ValueError(f"--max-model-len {requested} exceeds the model's max_position_embeddings {model_limit}")
    return requested or model_limit


# ---------------------------------------------------------------- the tiny model (`--model tiny`)
# Byte-level: token id == byte value for 0..255, then these special tokens from id 256 on.
TINY_SPECIAL_TOKENS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")
TINY_BOS_ID = 256  # <s>
TINY_EOS_IDS = (257, 259)  # </s>, <|im_end|>: generation stops at either
TINY_CONFIG = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=320,  # 260 ids, padded
    hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
    max_position_embeddings=8192, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    eos_token_ids=TINY_EOS_IDS,
)


def load_model_config(model: str) -> ModelConfig:
    """'tiny', a GGUF file (or its name / directory: laneserve.gguf_file.resolve_model), or an HF checkpoint
    directory."""
    if model == "tiny":
        return TINY_CONFIG
    from laneserve import gguf_file  # reads GGUF metadata (numpy): only for GGUF models

    path = gguf_file.resolve_model(model)
    if path.endswith(".gguf"):
        return ModelConfig.from_dict(gguf_file.hf_config(path), source=path)
    return ModelConfig.from_dir(path)
