"""Start-up failures are one clear error naming the file and tensor; dummy weights; device/dtype choice."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from laneserve.modelspec import ModelConfig, ModelConfigError, load_model_config
from tests.helpers_models import DEVICE, Sim, edit_config, greedy, make_checkpoint
from workers.config import WorkerConfig
from workers.loader import WeightLoadError, load_model, resolve_device, resolve_dtype
from workers.runner import ModelRunner


def runner_for(path: str, **kw) -> ModelRunner:
    return ModelRunner(WorkerConfig(model=path, device=DEVICE, kv_cache_memory="2MiB", max_model_len=256, **kw))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    make_checkpoint(path, "llama")
    return path


def copy_ckpt(src: str, dst) -> str:
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
            g.write(f.read())
    return str(dst)


def test_unsupported_architecture_names_file_and_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ModelConfigError, match=r"config\.json.*GPT2LMHeadModel"):
        runner_for(str(tmp_path))


def test_missing_directory_and_unsupported_rope(tmp_path):
    with pytest.raises(ModelConfigError, match="not found"):
        runner_for(str(tmp_path / "nope"))
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "vocab_size": 10,
           "num_hidden_layers": 1, "num_attention_heads": 4, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(ModelConfigError, match="yarn"):
        ModelConfig.from_dict(cfg, source="x/config.json")


@pytest.mark.parametrize("extra, window", [
    ({}, None),  # max_window_layers 28 (transformers' default) of 4 layers: every layer full
    ({"max_window_layers": 4}, None), ({"max_window_layers": 0}, 64),
    ({"layer_types": ["sliding_attention"] * 4}, 64), ({"use_sliding_window": False, "max_window_layers": 0}, None),
    ({"max_window_layers": 2}, "some layers only"), ({"layer_types": ["full_attention", "sliding_attention"] * 2},
                                                     "some layers only"),
])
def test_qwen2_sliding_windows_follow_transformers_layer_rule(extra, window):
    """A review found the rule the wrong way round: a window on every layer where transformers has it on none."""
    from transformers import Qwen2Config

    d = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "vocab_size": 10,
         "num_hidden_layers": 4, "num_attention_heads": 4, "use_sliding_window": True, "sliding_window": 64, **extra}
    if isinstance(window, str):
        with pytest.raises(ModelConfigError, match=window):
            ModelConfig.from_dict(d)
        return
    assert ModelConfig.from_dict(d).sliding_window == window
    hf = Qwen2Config(**{k: v for k, v in d.items() if k != "architectures"})  # the reference
    assert {hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types} == {window}


def test_a_config_without_a_field_the_family_always_has_is_one_line():
    d = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
         "vocab_size": 10}
    with pytest.raises(ModelConfigError, match=r"^x/config\.json: no 'intermediate_size'$"):
        ModelConfig.from_dict(d, source="x/config.json")


def test_missing_tensor_is_named(ckpt, tmp_path):
    path = copy_ckpt(ckpt, tmp_path / "m")
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, file)
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        runner_for(path)


def test_unexpected_tensor_names_file_and_tensor(ckpt, tmp_path):
    path = copy_ckpt(ckpt, tmp_path / "m")
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    save_file(tensors, file)
    with pytest.raises(WeightLoadError, match=r"model\.safetensors: unexpected tensor 'model\.layers\.0\.self_attn"):
        runner_for(path)


def test_mismatched_shape_names_file_and_tensor(ckpt, tmp_path):
    path = copy_ckpt(ckpt, tmp_path / "m")
    edit_config(path, intermediate_size=96)
    with pytest.raises(WeightLoadError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' "
                                              r"has shape \[160, 64\].*\[96, 64\]"):
        runner_for(path)


def test_no_weights_at_all(ckpt, tmp_path):
    path = copy_ckpt(ckpt, tmp_path / "m")
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(WeightLoadError, match=r"no \*\.safetensors"):
        runner_for(path)


def test_dummy_load_format_builds_the_shapes_without_weights(ckpt, tmp_path):
    path = copy_ckpt(ckpt, tmp_path / "m")
    os.remove(os.path.join(path, "model.safetensors"))
    a, b = runner_for(path, load_format="dummy"), runner_for(path, load_format="dummy")
    real = load_file(os.path.join(ckpt, "model.safetensors"))
    params = a.model.checkpoint_state_dict()  # the merged projections split back into the HF tensors
    assert {k: tuple(v.shape) for k, v in real.items()} == {k: tuple(v.shape) for k, v in params.items()}
    assert all(torch.equal(params[k], v) for k, v in b.model.checkpoint_state_dict().items())  # seeded
    sim = Sim(a)
    sim.add("x", [1, 2, 3, 4, 5], greedy(3))
    assert len(sim.run()["x"]) == 3


def test_merged_projections_hold_the_checkpoint_rows(tmp_path):
    """qkv_proj / gate_up_proj rows are the checkpoint's q, k, v / gate, up (biases too), and
    checkpoint_state_dict() gives every checkpoint tensor back under its name."""
    make_checkpoint(str(tmp_path), "qwen2", seed=4)  # qkv bias, tied embeddings
    model = load_model(str(tmp_path), load_model_config(str(tmp_path)), torch.float32, torch.device("cpu"))
    ckpt = load_file(str(tmp_path / "model.safetensors"))
    layer = model.model.layers[1]
    attn = "model.layers.1.self_attn."
    assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "up_proj")
    assert torch.equal(layer.self_attn.qkv_proj.weight,
                       torch.cat([ckpt[attn + p + ".weight"] for p in ("q_proj", "k_proj", "v_proj")]))
    assert torch.equal(layer.self_attn.qkv_proj.bias,
                       torch.cat([ckpt[attn + p + ".bias"] for p in ("q_proj", "k_proj", "v_proj")]))
    assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat([ckpt["model.layers.1.mlp.gate_proj.weight"],
                                                                  ckpt["model.layers.1.mlp.up_proj.weight"]]))
    mine = model.checkpoint_state_dict()
    assert mine.keys() == ckpt.keys() - {"lm_head.weight"}  # tied: no lm_head parameter
    assert all(torch.equal(mine[k], ckpt[k]) for k in mine)


def test_device_and_dtype_errors():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    with pytest.raises(ValueError, match="--dtype 'float64'"):
        resolve_dtype("float64", torch.device("cpu"))
    with pytest.raises(ValueError, match="--device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ModelRunner(WorkerConfig(max_model_len=100_000))
    with pytest.raises(ValueError, match="kv-cache-memory"):
        ModelRunner(WorkerConfig(kv_cache_memory="1MiB"))  # smaller than one 8192-token sequence


def test_kv_cache_memory_parsing():
    from workers.kv_cache import parse_bytes

    assert [parse_bytes(t) for t in ("", "0", "1048576", "256MiB", "2GiB", "1.5GB", "64k")] == [
        0, 0, 1 << 20, 256 << 20, 2 << 30, 1_500_000_000, 64_000]
    for bad in ("lots", "1.2.3", "."):  # (1.2.3 was float()'s error, naming no flag)
        with pytest.raises(ValueError, match="kv-cache-memory"):
            parse_bytes(bad)


def test_vllms_dtype_aliases_are_the_same_dtypes():
    from workers.loader import resolve_dtype

    cpu = torch.device("cpu")
    assert resolve_dtype("float", cpu) == torch.float32 and resolve_dtype("half", cpu) == torch.float16
    with pytest.raises(ValueError, match="--dtype 'double'"):
        resolve_dtype("double", cpu)
