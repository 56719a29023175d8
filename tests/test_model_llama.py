"""Our Llama-family model + runner against HF transformers on tiny random checkpoints (CPU, fp32).

Per architecture (Llama with Llama-3 RoPE scaling, Mistral with a sliding window, Qwen2 with
qkv bias and tied embeddings, saved sharded): prefill logits within 1e-4 relative, and 64
greedy tokens identical to `generate` whole, in chunks, after a prefix-cache hit and in a
batch of 8 mixed prefill/decode requests.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers_models import ARCHS, DEVICE, Sim, greedy, hf_greedy, make_checkpoint, random_prompt
from workers.attention import AttentionMetadata
from workers.config import WorkerConfig
from workers.runner import ModelRunner

N_NEW = 64
PROMPT = random_prompt(37, seed=1)


@pytest.fixture(scope="module", params=ARCHS)
def setup(request, tmp_path_factory):
    arch = request.param
    path = str(tmp_path_factory.mktemp(arch))
    # qwen2 is saved in several shards so the index path is exercised
    hf = make_checkpoint(path, arch, seed=ARCHS.index(arch), max_shard_size="40KB" if arch == "qwen2" else None)
    runner = ModelRunner(WorkerConfig(model=path, device=DEVICE, dtype="float32", kv_cache_memory="4MiB",
                                       max_model_len=512))
    return arch, path, hf, runner, hf_greedy(hf, PROMPT, N_NEW)


def test_sharded_checkpoint_was_written(setup):
    arch, path, *_ = setup
    if arch == "qwen2":
        import os
        assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
        assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 1


def test_prefill_logits_match_hf(setup):
    _, _, hf, runner, _ = setup
    T = len(PROMPT)
    blocks = list(range(-(-T // 16)))
    dev = runner.device
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, T], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([T], dtype=torch.int32, device=dev),
        block_tables=torch.tensor([blocks], dtype=torch.int32, device=dev), slot_mapping=torch.arange(T, device=dev),
        num_decodes=0, query_lens_cpu=[T], seq_lens_cpu=[T])
    with torch.inference_mode():
        runner.backend.prepare(meta, 16, runner.model_config.sliding_window)
        hidden = runner.model(torch.tensor(PROMPT, device=dev), torch.arange(T, device=dev), meta)
        ours = runner.model.compute_logits(hidden).cpu()
        ref = hf(torch.tensor([PROMPT])).logits[0]
    rel = (ours - ref).abs().max() / ref.abs().max()
    assert rel < 1e-4, f"max relative logit error {rel:.2e}"


def test_greedy_matches_generate(setup):
    *_, runner, ref = setup
    sim = Sim(runner)
    sim.add("a", PROMPT, greedy(N_NEW))
    assert sim.run()["a"] == ref


@pytest.mark.parametrize("chunk", [5, 16])
def test_chunked_prefill_matches_generate(setup, chunk):
    *_, runner, ref = setup
    sim = Sim(runner)
    sim.add("a", PROMPT, greedy(N_NEW), chunk=chunk)
    assert sim.run()["a"] == ref


def test_prefix_cache_hit_matches_generate(setup):
    *_, runner, ref = setup
    sim = Sim(runner)
    # A shares PROMPT's first two full blocks, then diverges; its blocks stay cached after it finishes.
    sim.add("a", PROMPT[:32] + random_prompt(11, seed=99), greedy(3), keep_blocks=True)
    sim.run()
    shared = sim.done["a"].blocks[:2]
    sim.add("b", PROMPT, greedy(N_NEW), cached_blocks=shared, num_cached_tokens=32)
    assert sim.run()["b"] == ref
    assert sim.done["b"].blocks[:2] == shared


@pytest.mark.parametrize("max_gather", [1 << 16, 100])
def test_batch_of_eight_matches_generate(setup, max_gather):
    _, _, hf, runner, ref = setup
    if max_gather != 1 << 16 and setup[0] != "llama":
        pytest.skip("decode grouping is architecture-independent: checked once")
    runner.backend.max_decode_gather = max_gather  # 100: decodes split into several padded groups
    others = {f"r{i}": (random_prompt(n, seed=10 + i), 12 + 3 * i) for i, n in enumerate([3, 9, 17, 24, 33, 50, 70])}
    sim = Sim(runner, budget=48)  # chunked prefills share steps with decodes
    for rid, (prompt, n) in others.items():
        sim.add(rid, prompt, greedy(n), chunk=20 if len(prompt) > 40 else None)
        if rid == "r2":
            sim.add("main", PROMPT, greedy(N_NEW))
    try:
        out = sim.run()
    finally:
        runner.backend.max_decode_gather = 1 << 16
    assert out["main"] == ref
    for rid, (prompt, n) in others.items():
        assert out[rid] == hf_greedy(hf, prompt, n), rid
