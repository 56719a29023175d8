"""The Triton attention backend (paged decode + KV write kernels, SDPA prefill) inside the real
runner gives HF's greedy tokens. On CPU the kernels run under Triton's interpreter (conftest sets
TRITON_INTERPRET before triton is imported), so CI checks the GPU path's logic end to end."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.helpers_models import (DEVICE, Sim, edit_config, greedy, hf_greedy, make_checkpoint,  # noqa: E402
                                  random_prompt)
from workers.config import WorkerConfig  # noqa: E402
from workers.kernels import fused  # noqa: E402
from workers.runner import ModelRunner, cascade_attention_on  # noqa: E402

N_NEW = 12


@pytest.mark.parametrize("arch,decode,fused_kernels,gemv_rows", [
    ("mistral", "partitioned", None, 0), ("qwen2", "partitioned", None, 0),  # sliding window; qkv bias + GQA group 2
    ("mistral", "persistent", None, 0),  # issue 25's kernel
    ("llama", "partitioned", True, 0),  # every fused kernel too, RoPE in the K/V write's launch (on CPU: interpreted)
    ("qwen2", "partitioned", True, 8)])  # the fused GEMV path for steps of <= 8 tokens (qkv bias in its epilogue)
def test_triton_backend_matches_hf_greedy_in_a_chunked_batch(arch, decode, fused_kernels, gemv_rows, tmp_path,
                                                             monkeypatch):
    from workers.model import llama

    monkeypatch.setattr(fused, "USE_TRITON", fused_kernels)
    gemvs, qkv_ropes = [], []  # the model's launches of the fused GEMVs: rows of each
    monkeypatch.setattr(llama, "gemv", lambda *a, _f=llama.gemv, **kw: gemvs.append(a[0].shape[0]) or _f(*a, **kw))
    monkeypatch.setattr(llama, "qkv_rope_gemv", lambda *a, _f=llama.qkv_rope_gemv: qkv_ropes.append(a[0].shape[0])
                        or _f(*a))
    hf = make_checkpoint(str(tmp_path), arch, seed=3)
    runner = ModelRunner(WorkerConfig(model=str(tmp_path), device=DEVICE, dtype="float32", kv_cache_memory="2MiB",
                                      max_model_len=512, attention_backend="triton", decode_attention=decode,
                                      max_num_seqs=8, decode_gemv_rows=gemv_rows))
    assert runner.backend.name == "triton"
    prompts = [random_prompt(n, seed=n) for n in (90, 9, 23)]  # persistent: the first one's context split in two
    sim = Sim(runner, budget=32)  # chunked prefill mixed with decodes in the same steps
    for i, p in enumerate(prompts):
        sim.add(f"r{i}", p, greedy(N_NEW))
    out = sim.run()
    for i, p in enumerate(prompts):
        assert out[f"r{i}"] == hf_greedy(hf, p, N_NEW), f"request {i}"
    assert bool(runner.backend.buffers) == (decode == "persistent")  # the persistent kernel ran
    assert bool(gemvs) == bool(gemv_rows) and all(rows <= gemv_rows for rows in gemvs)  # decode steps took it
    assert bool(qkv_ropes) == bool(gemv_rows) and all(rows <= gemv_rows for rows in qkv_ropes)  # RoPE + K/V in it


def cascade_runner(tmp_path, monkeypatch, seed: int, checkpoint: dict | None = None, **cfg):
    """A llama checkpoint (HF's model; checkpoint: its config's overrides) and a runner with --cascade-attention (cfg:
    WorkerConfig overrides) whose groups need two members and 64 shared keys (the defaults' 8 members, 32 grouped
    and 256 keys are a server's); planned: each plan's grouped decodes."""
    from workers.attention import triton_backend as tb
    from workers.kernels import paged_attention as pa

    for name, value in (("CASCADE_MIN_PREFIX", 64), ("CASCADE_MIN_MEMBERS", 2), ("CASCADE_MIN_GROUPED", 2)):
        monkeypatch.setattr(pa, name, value)
    planned: list[int] = []
    monkeypatch.setattr(tb.CascadeBuffers, "fill", lambda self, *a, _f=tb.CascadeBuffers.fill, **k: planned.append(
        _f(self, *a, **k)) or planned[-1])
    hf = make_checkpoint(str(tmp_path), "llama", seed=seed, **(checkpoint or {}))
    runner = ModelRunner(WorkerConfig(**{
        "model": str(tmp_path), "device": DEVICE, "dtype": "float32", "kv_cache_memory": "2MiB", "max_model_len": 512,
        "attention_backend": "triton", "decode_attention": "partitioned", "max_num_seqs": 8,
        "cascade_attention": "on", **cfg}))
    return hf, runner, planned


def shared_prefix_run(runner, n_new: int = N_NEW) -> dict[str, list[int]]:
    """Three requests whose prompts start with the same 80 tokens, cached by a first one (the prefix cache's shared
    blocks), decoded together: request id -> (prompt, greedy tokens)."""
    shared = random_prompt(80, seed=7)
    sim = Sim(runner)
    sim.add("first", shared + random_prompt(5, seed=8), greedy(2), keep_blocks=True)
    sim.run()
    cached = sim.done["first"].blocks[:5]
    prompts = {f"r{i}": shared + random_prompt(n, seed=20 + i) for i, n in enumerate((3, 17, 30))}
    for rid, p in prompts.items():
        sim.add(rid, p, greedy(n_new), cached_blocks=cached, num_cached_tokens=80)
    out = sim.run()
    return {rid: (p, out[rid]) for rid, p in prompts.items()}


def test_cascade_attention_gives_hf_greedy_tokens_for_decodes_sharing_a_cached_prefix(tmp_path, monkeypatch):
    """--cascade-attention: three requests whose prompts start with the same 80 tokens, cached by a first one (the
    prefix cache's shared blocks), decode together with their shared 64 keys computed once per group; HF's tokens."""
    hf, runner, planned = cascade_runner(tmp_path, monkeypatch, seed=3)
    for rid, (p, tokens) in shared_prefix_run(runner).items():
        assert tokens == hf_greedy(hf, p, N_NEW), rid
    assert max(planned) == 3  # the three decoded as one group


def test_cascade_attention_on_an_int8_pool_gives_the_plain_kernels_tokens(tmp_path, monkeypatch):
    """--cascade-attention on with --kv-cache-dtype int8: the shared prefix read from the
    int8 pages with their scales gives the greedy tokens of the same int8 pool without cascade (head_dim 32: int8
    dots need it on a GPU)."""
    wide = {"hidden_size": 128}
    _, runner, planned = cascade_runner(tmp_path / "a", monkeypatch, seed=3, checkpoint=wide, kv_cache_dtype="int8")
    _, plain, _ = cascade_runner(tmp_path / "b", monkeypatch, seed=3, checkpoint=wide, kv_cache_dtype="int8",
                                 cascade_attention="off")
    assert shared_prefix_run(runner, n_new=6) == shared_prefix_run(plain, n_new=6)
    assert max(planned) == 3


def test_cascade_attention_with_drafts_gives_hf_greedy_tokens(tmp_path, monkeypatch):
    """Prompt-lookup drafts are verified as a decode row per position: with cascade, one sequence's rows share its
    whole pages and form a group (in a server: eight rows and up, 32 grouped in the step), each row's own keys after
    the shared ones. The batcher drives the runner; HF's greedy tokens."""
    import random

    from tests.test_lanes import engine
    from tests.test_speculative import CHEAP_VERIFY, EagerGraphs
    from workers.attention import triton_backend as tb

    hf, runner, planned = cascade_runner(tmp_path, monkeypatch, seed=4)
    # one partition (a server's large batches): the decode kernel merges the prefix's results itself, no reduce
    # (the test above, at this runner's 8 partitions, takes the reduce)
    monkeypatch.setattr(tb, "num_partitions", lambda *args: 1)
    runner.graphs = EagerGraphs(runner.model, runner.backend, None)  # (the verify rows: the decode graphs' path)
    jobs = {"loop": (random_prompt(6, seed=5) * 14, 20), "b": (random_prompt(70, seed=9), 8)}
    out, s = engine(runner, "mixed", jobs, random.Random(1), cost=CHEAP_VERIFY, speculative="ngram")
    assert out == {rid: hf_greedy(hf, prompt, n) for rid, (prompt, n) in jobs.items()}
    assert s.stats().spec_accepted > 0 and max(planned) >= 2  # (the prompts share nothing: one sequence's rows)


def test_cascade_attention_is_refused_where_it_cannot_run(tmp_path):
    with pytest.raises(ValueError, match="--cascade-attention on is a Triton kernel"):
        ModelRunner(WorkerConfig(model="tiny", device="cpu", attention_backend="torch", cascade_attention="on"))
    with pytest.raises(ValueError, match="needs --decode-attention auto or partitioned"):
        ModelRunner(WorkerConfig(model="tiny", device="cpu", attention_backend="triton", decode_attention="persistent",
                                 cascade_attention="on"))
    with pytest.raises(ValueError, match="--cascade-attention 'yes': choose from auto, on, off"):
        ModelRunner(WorkerConfig(model="tiny", device="cpu", cascade_attention="yes"))
    make_checkpoint(str(tmp_path), "mistral", seed=3)  # (a sliding window)
    with pytest.raises(ValueError, match="--cascade-attention on needs a model without a sliding window"):
        ModelRunner(WorkerConfig(model=str(tmp_path), device=DEVICE, dtype="float32", max_model_len=512,
                                 attention_backend="triton", cascade_attention="on"))


@pytest.mark.parametrize("single_gpu,backend,decode,window,want", [
    (True, "triton", "auto", False, True), (True, "triton", "partitioned", False, True),
    (False, "triton", "auto", False, False),  # a CPU, or tensor parallel: `on` runs there, `auto` does not
    (True, "torch", "auto", False, False), (True, "triton", "persistent", False, False),
    (True, "triton", "auto", True, False)])  # a sliding window
def test_cascade_attention_auto_is_on_only_where_it_can_run(single_gpu, backend, decode, window, want):
    assert cascade_attention_on("auto", single_gpu, backend, decode, window) is want
    assert not cascade_attention_on("off", single_gpu, backend, decode, window)
    if want or not single_gpu:
        assert cascade_attention_on("on", single_gpu, backend, decode, window)
    else:  # the one rule refuses `on` where `auto` stays off on a GPU
        with pytest.raises(ValueError, match="^--cascade-attention on "):
            cascade_attention_on("on", single_gpu, backend, decode, window)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_a_runner_takes_cascade_attention_by_default_where_it_can_run(tmp_path, arch):
    """The default, auto: on for one CUDA device with the partitioned kernel and no sliding window (mistral has one);
    off with no error elsewhere (a CPU worker runs the torch backend)."""
    make_checkpoint(str(tmp_path / arch), arch, seed=3)
    runner = ModelRunner(WorkerConfig(model=str(tmp_path / arch), device=DEVICE, dtype="float32", max_model_len=512,
                                      kv_cache_memory="64MiB"))
    assert getattr(runner.backend, "cascade", False) is (DEVICE == "cuda" and arch == "llama")


def test_persistent_decode_attention_needs_the_triton_backend():
    """auto, the default, picks among the Triton backend's kernels: with the torch backend (a CPU's) there are none."""
    assert ModelRunner(WorkerConfig(model="tiny", device="cpu", decode_attention="auto")).backend.name == "torch"
    with pytest.raises(ValueError, match="needs --attention-backend triton"):
        ModelRunner(WorkerConfig(model="tiny", device="cpu", attention_backend="torch", decode_attention="persistent"))
    with pytest.raises(ValueError, match="choose partitioned, persistent or auto"):
        ModelRunner(WorkerConfig(model="tiny", device="cpu", decode_attention="grid"))


def test_decode_gemv_rows_auto_is_on_only_for_bf16_and_fp16_on_cuda():
    for dtype in ("bfloat16", "float32"):
        runner = ModelRunner(WorkerConfig(model="tiny", device=DEVICE, dtype=dtype, kv_cache_memory="2MiB",
                                          max_model_len=512))
        assert runner.model.gemv_rows == (8 if DEVICE == "cuda" and dtype == "bfloat16" else 0), dtype


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU has the kernels")
def test_decode_gemv_rows_is_checked_before_the_weights_load():
    for rows in (9, -2):
        with pytest.raises(ValueError, match="must be -1 \\(auto\\), 0 \\(off\\) or up to 8"):
            ModelRunner(WorkerConfig(model="tiny", device="cpu", decode_gemv_rows=rows))
    with pytest.raises(ValueError, match="kernels are Triton's and need a GPU; this worker runs on cpu"):
        ModelRunner(WorkerConfig(model="tiny", device="cpu", decode_gemv_rows=1))


def test_decode_gemv_rows_needs_a_head_dim_of_sixteens(tmp_path):
    make_checkpoint(str(tmp_path), "llama")
    edit_config(str(tmp_path), head_dim=8)  # (checked from the config, before any weight is read)
    with pytest.raises(ValueError, match="needs a head_dim that is a multiple of 16 .* this model's is 8"):
        ModelRunner(WorkerConfig(model=str(tmp_path), device=DEVICE, decode_gemv_rows=8))


def test_auto_decode_attention_takes_the_persistent_kernel_for_skewed_batches_only(tmp_path, monkeypatch):
    """--decode-attention auto: the two short prompts decode alone (uniform: partitioned) while the long one's
    prompt is chunked in, then all three together (skewed: persistent); the tokens stay HF's."""
    from workers.attention import triton_backend as tb

    assert tb.skewed([8192] + [128] * 7) and tb.skewed([32768] + [512] * 63)
    assert not tb.skewed([1024] * 32) and not tb.skewed([4000, 100])  # uniform; long but under SKEW_MIN_LEN
    monkeypatch.setattr(tb, "SKEW_MIN_LEN", 64)
    monkeypatch.setattr(tb, "SKEW_RATIO", 2.0)  # (three sequences: the longest is at most 3x the mean)
    calls = dict.fromkeys(("paged_decode", "paged_decode_persistent"), 0)  # the backend's launches of each kernel
    for name in calls:
        def counted(*args, _fn=getattr(tb, name), _name=name, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)
        monkeypatch.setattr(tb, name, counted)
    hf = make_checkpoint(str(tmp_path), "mistral", seed=3)
    runner = ModelRunner(WorkerConfig(model=str(tmp_path), device=DEVICE, dtype="float32", kv_cache_memory="2MiB",
                                      max_model_len=512, attention_backend="triton", decode_attention="auto",
                                      max_num_seqs=8))
    prompts = [random_prompt(n, seed=n) for n in (8, 9, 150)]
    sim = Sim(runner, budget=32)
    for i, p in enumerate(prompts):
        sim.add(f"r{i}", p, greedy(N_NEW))
    out = sim.run()
    for i, p in enumerate(prompts):
        assert out[f"r{i}"] == hf_greedy(hf, p, N_NEW), f"request {i}"
    assert all(calls.values()), calls


@pytest.mark.parametrize("decode,cascade", [("partitioned", False), ("persistent", False), ("auto", False),
                                            ("partitioned", True), ("auto", True)])
def test_the_decode_graphs_replay_a_variant_they_captured(decode, cascade):
    """workers/cuda_graphs.py captures one decode graph per (batch size, variant in graph_variants) and replays
    the one graph_variant picks: with `persistent` alone that is the persistent one (it once asked for the
    partitioned graph, never captured: a KeyError on the GPU); with cascade, the cascade graph only for a batch
    with a group (a batch without one replays the plain graph, which skips the prefix kernel and the reduce)."""
    import numpy as np

    from workers.attention.triton_backend import CascadeBuffers, TritonAttentionBackend
    from workers.cuda_graphs import graph_variant

    backend = TritonAttentionBackend(8, 4, decode=decode, cascade=cascade)
    if cascade:
        backend.graph_cascade = CascadeBuffers(backend.max_batch, 4, "cpu")  # (what the capture allocates)

    def tables(lens, shared):  # each sequence's own pages, or its first 32 pages the same as every other's
        t = np.arange(len(lens) * 2048, dtype=np.int32).reshape(len(lens), 2048)
        t[:, :32] = t[0, :32] if shared else t[:, :32]
        return t

    uniform, skew = [1024] * 32, [32768] + [512] * 63
    picked = {graph_variant(backend.graph_variants, backend, lens, tables(lens, shared), 16)
              for lens in (uniform, skew) for shared in (False, True)}
    assert picked == set(backend.graph_variants)  # auto: each batch its own kernel's graph
    if cascade:
        assert graph_variant(backend.graph_variants, backend, uniform, tables(uniform, False), 16) == "partitioned"
        assert graph_variant(backend.graph_variants, backend, uniform, tables(uniform, True), 16) == "cascade"
