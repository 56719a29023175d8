"""GGUF weights: dequantize a llama.cpp checkpoint into the model's HF-named parameters.

Owns the llama.cpp -> HF tensor names (`hf_name`), the quant types we accept (`SUPPORTED_TYPES`,
dequantized with the gguf package's numpy code to float32, then cast to the serving dtype), and
undoing llama.cpp's q/k row permutation (convert_hf_to_gguf.py permutes attn_q/attn_k rows of
llama and mistral for its interleaved RoPE; qwen2 files are not permuted). GGUF lists dims
innermost first (tensor.shape = [ne0, ne1]); the numpy data is [ne1, ne0], HF's [out, in].
Metadata comes from laneserve.gguf_file, the head counts from the model config. Tensors are
dequantized one at a time; workers.loader.load_gguf copies them in (under tensor parallelism
each rank dequantizes the whole tensor and keeps its slice). Errors are GGUFWeightError, one line naming the file;
the loader re-raises them as its WeightLoadError.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np

from laneserve import gguf_file

# the types the gguf package dequantizes in numpy and transformers' GGUF loader also reads
SUPPORTED_TYPE_NAMES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# architectures whose converter permuted attn_q / attn_k rows (LlamaModel.permute in convert_hf_to_gguf.py)
PERMUTED_ARCHS = ("llama", "mistral")

_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_BLK_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
# tensors some GGUF files carry that the model recomputes (llama.cpp's llama-3 rope factors)
_IGNORED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


class GGUFWeightError(ValueError):
    """A tensor we cannot dequantize; the message names the file, the tensor and its type (one line)."""


def supported_types() -> set:
    from gguf import GGMLQuantizationType

    return {GGMLQuantizationType[name] for name in SUPPORTED_TYPE_NAMES}


def hf_name(name: str) -> str | None:
    """The HF parameter name of a llama.cpp tensor name, or None if we don't know it."""
    if name in _TOP:
        return _TOP[name]
    m = _BLK_RE.fullmatch(name)
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"
    return None


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf.py's LlamaModel.permute on the rows (dim 0) of a q/k weight or bias."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(path: str, tensor) -> np.ndarray:
    """A ReaderTensor as float32 in HF layout ([out, in] for a matrix), or WeightLoadError naming file and type."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    qtype = tensor.tensor_type
    if qtype not in supported_types():
        raise GGUFWeightError(f"{path}: tensor {tensor.name!r} has quant type {qtype.name}, which we cannot load "
                              f"(supported: {', '.join(SUPPORTED_TYPE_NAMES)})")
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    block, type_size = GGML_QUANT_SIZES[qtype]
    want_bytes = int(np.prod(shape)) // block * type_size
    if tensor.data.nbytes != want_bytes:  # the reader clips a tensor that runs past the end of a truncated file
        raise GGUFWeightError(f"{path}: tensor {tensor.name!r} has {tensor.data.nbytes} bytes of data, its "
                              f"{qtype.name} shape {list(shape)} needs {want_bytes} (truncated or corrupt file)")
    try:
        out = dequantize(tensor.data, qtype)
    except Exception as e:  # noqa: BLE001 - numpy shape errors on corrupt data
        raise GGUFWeightError(f"{path}: tensor {tensor.name!r} ({qtype.name}) cannot be dequantized: {e}") from None
    out = np.asarray(out, dtype=np.float32).reshape(shape)
    return out if out.flags.writeable else out.copy()  # F32 data is a view of the read-only memory map


def hf_tensors(path: str, num_heads: int, num_kv_heads: int) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array) for every tensor of the file, q/k unpermuted (the model config's head
    counts); unknown names pass through (the caller reports them)."""
    reader = gguf_file.reader(path)
    arch = gguf_file.metadata(path).get("general.architecture")
    for tensor in reader.tensors:
        if tensor.name in _IGNORED:
            continue
        name = hf_name(tensor.name) or tensor.name
        w = dequantize_tensor(path, tensor)
        heads = num_heads if name.endswith(("q_proj.weight", "q_proj.bias")) else \
            num_kv_heads if name.endswith(("k_proj.weight", "k_proj.bias")) else 0
        if arch in PERMUTED_ARCHS and heads:
            if w.shape[0] % (2 * heads):
                raise GGUFWeightError(f"{path}: tensor {tensor.name!r} has {w.shape[0]} rows, not a multiple of 2 x "
                                      f"{heads} heads")
            w = unpermute(w, heads)
        yield name, w
