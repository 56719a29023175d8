"""Model loading: pick device and dtype, build the module, fill its weights.

Owns the checks a bad checkpoint fails at start-up (one clear error naming the file and
tensor, never a traceback deep in a forward) and the weight sources: safetensors files
(sharded via model.safetensors.index.json too), GGUF files (dequantized to float32 by
workers/gguf_loader.py, one tensor at a time), seeded random weights for `tiny`, and
`--load-format dummy` (random weights, real shapes, for benchmarks). Tensors are read
one at a time with safe_open and copied straight into the target dtype and device, so at
most one tensor is staged, never a whole host copy; a tensor-parallel rank reads only its
slice of each sharded tensor. Must not know requests or the KV pool.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import time

import torch

from laneserve.modelspec import ModelConfig
from workers.model.llama import LlamaForCausalLM
from workers.model.random_weights import init_random_

log = logging.getLogger("laneserve.worker")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float": torch.float32, "half": torch.float16}  # (the last two: vLLM's aliases)
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# tensors some checkpoints carry that the model recomputes or shares
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightLoadError(ValueError):
    """A checkpoint whose weights don't fit the model; the message names file and tensor."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r}: expected auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: only cpu and cuda are supported")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto = float32 on CPU, bfloat16 on CUDA (float16 where the GPU lacks bf16)."""
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if name not in DTYPES:
        raise ValueError(f"--dtype {name!r}: choose auto, {', '.join(DTYPES)}")
    dtype = DTYPES[name]
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ValueError(f"--dtype bfloat16: {torch.cuda.get_device_name(device)} cannot run bfloat16; use float16")
    try:  # the ops a forward needs, on a tiny tensor, so a gap shows here and not mid-step
        x = torch.ones(2, 4, dtype=dtype, device=device)
        torch.nn.functional.scaled_dot_product_attention(x[None], x[None], x[None])
        (x @ x.T).float().sum().item()
    except RuntimeError as e:
        raise ValueError(f"--dtype {name}: device {device} cannot run it ({e})") from None
    return dtype


def load_model(model: str, model_cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
               load_format: str = "auto", seed: int = 0, tp_rank: int = 0, tp_size: int = 1) -> LlamaForCausalLM:
    """Build on the meta device, materialise in dtype on device, fill the weights under their HF names,
    then merge the projections (LlamaForCausalLM.fuse_projections).
    tp_size > 1: this rank's shard only (LlamaForCausalLM.shard_dims says what is sliced)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format {load_format!r}: choose {', '.join(LOAD_FORMATS)}")
    if model != "tiny":
        from laneserve import gguf_file

        model = gguf_file.resolve_model(model)  # a GGUF name or a directory holding one .gguf: that file
        if load_format == "auto":
            load_format = "gguf" if model.endswith(".gguf") else "safetensors"
        elif load_format == "gguf" and not gguf_file.is_gguf(model):
            raise WeightLoadError(f"--load-format gguf: {model} is not a .gguf file")
        elif load_format == "safetensors" and model.endswith(".gguf"):
            raise WeightLoadError(f"--load-format safetensors: {model} is a GGUF file; use auto or gguf")
        if load_format == "gguf":
            gguf_file.check_sizes(model)  # before the model is built from its metadata's sizes
    with torch.device("meta"):
        net = LlamaForCausalLM(model_cfg, tp_size)
    # (torch.empty, as net.to(dtype).to_empty(device) would give: on meta tensors empty_like runs torch._refs, which
    # imports sympy, ~0.3 s of a worker's start-up)
    net = net._apply(lambda t: torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device))
    net.requires_grad_(False).eval()
    if model == "tiny":
        # generated on CPU so the weights are the same whatever the device (and, sliced, the TP size)
        if tp_size == 1:
            init_random_(net, torch.Generator().manual_seed(seed))
        else:
            full = LlamaForCausalLM(model_cfg)
            init_random_(full, torch.Generator().manual_seed(seed))
            _copy_shards(net, full.state_dict(), tp_rank, tp_size)
    elif load_format == "dummy":
        # per-shard random weights: same on every rank, not the TP=1 model's (benchmarks only)
        init_random_(net, torch.Generator(device=device).manual_seed(seed))
    elif load_format == "gguf":
        load_gguf(net, model, tp_rank, tp_size)
    else:
        load_safetensors(net, model, tp_rank, tp_size)
    net.fuse_projections()  # q/k/v and gate/up into one GEMM each, once every part is filled
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the freed parts' blocks: they fit no merged weight
    return net


def shard_range(full: int, tp_rank: int, tp_size: int) -> slice:
    n = full // tp_size
    return slice(tp_rank * n, (tp_rank + 1) * n)


def _index(dim: int | None, full_shape: tuple[int, ...], tp_rank: int, tp_size: int) -> tuple:
    """The index of this rank's slice of a full tensor (works on tensors and safetensors slices)."""
    if dim is None:
        return (slice(None),) * len(full_shape)
    return (slice(None),) * dim + (shard_range(full_shape[dim], tp_rank, tp_size),)


@torch.no_grad()
def _copy_shards(net: LlamaForCausalLM, full: dict[str, torch.Tensor], tp_rank: int, tp_size: int) -> None:
    dims = net.shard_dims()
    for name, param in net.named_parameters():
        t = full[name]
        param.copy_(t[_index(dims[name], tuple(t.shape), tp_rank, tp_size)])


def _checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise WeightLoadError(f"{index}: cannot read the weight map: {e}") from None
        files = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise WeightLoadError(f"{index}: lists shard {os.path.basename(missing[0])}, which is not in {path}")
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise WeightLoadError(f"{path}: no *.safetensors files (other weight formats are not supported; "
                              "use --load-format dummy for random weights)")
    return files


@torch.no_grad()
def load_safetensors(net: LlamaForCausalLM, path: str, tp_rank: int = 0, tp_size: int = 1) -> None:
    """Copy every checkpoint tensor into the parameter of the same name, checking names and shapes.
    Under TP each rank reads only its slice (safe_open get_slice): never the whole tensor."""
    from safetensors import safe_open

    params = dict(net.named_parameters())
    dims = net.shard_dims()
    tied = net.config.tie_word_embeddings
    loaded: set[str] = set()
    problems: list[str] = []
    device = next(iter(params.values())).device
    for file in _checkpoint_files(path):
        name_of_file = os.path.basename(file)
        try:
            handle = safe_open(file, framework="pt", device=str(device))
        except Exception as e:  # safetensors raises its own error types
            raise WeightLoadError(f"{file}: not a readable safetensors file: {e}") from None
        with handle as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                    continue
                param = params.get(name)
                if param is None:
                    problems.append(f"{name_of_file}: unexpected tensor {name!r}")
                    continue
                tensor = f.get_slice(name)
                shape = tuple(tensor.get_shape())
                want = _full_shape(param, dims[name], tp_size)
                if shape != want:
                    problems.append(f"{name_of_file}: tensor {name!r} has shape {list(shape)}, "
                                    f"the config ({path}/config.json) implies {list(want)}")
                    continue
                if tp_size == 1 or dims[name] is None:
                    param.copy_(f.get_tensor(name))
                else:
                    param.copy_(tensor[_index(dims[name], shape, tp_rank, tp_size)])
                loaded.add(name)
    problems += [f"tensor {name!r} (shape {list(_full_shape(params[name], dims[name], tp_size))}) is missing "
                 "from every *.safetensors file" for name in params if name not in loaded]
    if problems:
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise WeightLoadError(f"checkpoint {path} does not match its config:\n  " + "\n  ".join(problems[:10]) + more)


@torch.no_grad()
def load_gguf(net: LlamaForCausalLM, path: str, tp_rank: int = 0, tp_size: int = 1) -> float:
    """Copy every GGUF tensor, dequantized to float32 under its HF name (workers.gguf_loader), into its
    parameter, checking names and shapes as load_safetensors does; this rank's slice under TP.
    Logs the load (dequantization) time once and returns it in seconds."""
    from laneserve import gguf_file
    from workers.gguf_loader import GGUFWeightError, hf_tensors

    start = time.perf_counter()
    params = dict(net.named_parameters())
    dims = net.shard_dims()
    tied = net.config.tie_word_embeddings
    loaded: set[str] = set()
    problems: list[str] = []
    try:
        for name, w in hf_tensors(path, net.config.num_heads, net.config.num_kv_heads):
            if tied and name == "lm_head.weight":
                continue
            param = params.get(name)
            if param is None:
                problems.append(f"unexpected tensor {name!r}")
                continue
            want = _full_shape(param, dims[name], tp_size)
            if tuple(w.shape) != want:
                problems.append(f"tensor {name!r} has shape {list(w.shape)}, its metadata implies {list(want)}")
                continue
            t = torch.from_numpy(w)
            param.copy_(t if tp_size == 1 or dims[name] is None else t[_index(dims[name], want, tp_rank, tp_size)])
            loaded.add(name)
    except GGUFWeightError as e:
        raise WeightLoadError(str(e)) from None
    problems += [f"tensor {name!r} (shape {list(_full_shape(params[name], dims[name], tp_size))}) is missing"
                 for name in params if name not in loaded]
    if problems:  # one line, like every GGUF error
        more = f"; ... and {len(problems) - 5} more" if len(problems) > 5 else ""
        raise WeightLoadError(f"{path} does not match its metadata: " + "; ".join(problems[:5]) + more)
    elapsed = time.perf_counter() - start
    counts: dict[str, int] = {}
    for t in gguf_file.reader(path).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    log.info("GGUF %s: %d tensors (%s) dequantized and loaded in %.2f s", os.path.basename(path), len(loaded),
             ", ".join(f"{n} {k}" for k, n in sorted(counts.items())), elapsed)
    return elapsed


def _full_shape(param: torch.Tensor, dim: int | None, tp_size: int) -> tuple[int, ...]:
    shape = list(param.shape)
    if dim is not None:
        shape[dim] *= tp_size
    return tuple(shape)
