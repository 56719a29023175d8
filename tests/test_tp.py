"""Tensor parallelism on CPU with gloo (issue 11): TP=2 gives the same greedy tokens as TP=1.

In process: this test process is rank 0 (workers.tp_group.TPGroup starts rank 1 as a spawned
child that runs its follower loop) and the Sim batcher drives rank 0's ModelRunner, forwarding
each StepInput as workers/main.py does. Over HTTP: the real stack with --tensor-parallel-size 2
against the TP=1 stack. Plus the start-up error when the heads don't divide.
"""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import time

import aiohttp
import pytest
import torch
import torch.distributed as dist

from laneserve.modelspec import TINY_CONFIG, load_model_config
from laneserve.wire import protocol as P
from tests.helpers_models import DEVICE, Sim, greedy, hf_greedy, make_checkpoint, random_prompt
from tests.stack import alive, cmdline, descendants
from workers.config import WorkerConfig
from workers.loader import load_model
from workers.model.layers import check_shardable
from workers.model.llama import LlamaForCausalLM
from workers.runner import ModelRunner
from workers.tp_group import TPGroup

# WORKER_TEST_DEVICE=cuda reruns the in-process checks with NCCL on 2 GPUs (Triton, CUDA graphs with the all-reduce)
CFG = dict(device=DEVICE, dtype="float32", kv_cache_memory="2MiB", max_model_len=256, num_threads=1)
# (prompt length, new tokens, prefill chunk): long prompts are chunked and share steps with decodes
BATCH = [(37, 24, 16), (5, 20, None), (60, 12, 20), (17, 16, None)]


@pytest.fixture(autouse=True)
def _restore_threads():
    """num_threads=1 (two ranks share the CPU) sets torch's global pool: give later tests theirs back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


class Leader:
    """Rank 0 as workers/main.py runs it: forward the step to the other ranks, then execute."""

    def __init__(self, group: TPGroup, runner: ModelRunner):
        self.group, self.runner = group, runner
        self.num_blocks = runner.num_blocks

    def execute(self, step):
        self.group.send(step)
        return self.runner.execute(step)


def run_batch(runner) -> dict[str, list[int]]:
    sim = Sim(runner, budget=40)
    for i, (n, new, chunk) in enumerate(BATCH):
        sim.add(f"r{i}", random_prompt(n, seed=20 + i), greedy(new), chunk=chunk)
    # seeded sampling: rank 0's sampler state decides, the other rank appends what it broadcasts
    sim.add("seeded", random_prompt(23, seed=30), P.SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95,
                                                                    seed=7))
    return sim.run()


def prompt_scores(runner) -> list[P.PromptLogprobs]:
    """The prompt logprobs of a 60-token prompt scored in chunks of 16 next to a generating request."""
    sim = Sim(runner, budget=40)
    sim.add("scored", random_prompt(60, seed=40), greedy(0, prompt_logprobs=2), chunk=16)
    sim.add("gen", random_prompt(9, seed=41), greedy(12))
    sim.run()
    return sim.done["scored"].scored


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # biases: column-parallel q/k/v/gate/up biases are sharded, row-parallel o/down biases added once
    # after the all-reduce; tied: lm_head is the replicated embedding
    path = tmp_path_factory.mktemp("tp")
    hf = make_checkpoint(str(path), "llama", seed=3, attention_bias=True, mlp_bias=True,
                         tie_word_embeddings=True)  # 4 heads, 2 KV heads, intermediate 160
    return path, hf


@pytest.mark.parametrize("model", ["checkpoint", "tiny"])
def test_rank_shards_reassemble_the_whole_model(ckpt, model):
    """Each rank loads only its slice (get_slice for safetensors, sliced seeded weights for tiny):
    the two ranks' shards, put back together along their shard dims, are the TP=1 weights."""
    path = str(ckpt[0]) if model == "checkpoint" else "tiny"
    mc = load_model_config(path)
    whole = load_model(path, mc, torch.float32, torch.device("cpu"))
    shards = [load_model(path, mc, torch.float32, torch.device("cpu"), tp_rank=r, tp_size=2) for r in (0, 1)]
    with torch.device("meta"):
        dims = LlamaForCausalLM(mc, 2).shard_dims()  # the loading layout, before the projections are merged
    layer = "model.layers.0."
    assert dims[layer + "self_attn.k_proj.weight"] == 0 and dims[layer + "mlp.down_proj.weight"] == 1
    assert dims["model.embed_tokens.weight"] is None
    if model == "checkpoint":
        assert dims[layer + "self_attn.q_proj.bias"] == 0 and dims[layer + "self_attn.o_proj.bias"] is None
    # a rank's merged qkv / gate_up rows are its q, k, v / gate, up shards: split back, they reassemble
    parts = [s.checkpoint_state_dict() for s in shards]
    for name, full in whole.checkpoint_state_dict().items():
        if dims[name] is None:
            assert torch.equal(parts[0][name], full) and torch.equal(parts[1][name], full), name
        else:
            assert parts[0][name].shape[dims[name]] * 2 == full.shape[dims[name]], name
            assert torch.equal(torch.cat([parts[0][name], parts[1][name]], dims[name]), full), name


def test_tp2_greedy_matches_tp1_and_transformers(ckpt):
    tmp_path, hf = ckpt
    tp1 = ModelRunner(WorkerConfig(model=str(tmp_path), **CFG))
    ref = run_batch(tp1)
    for i, (n, new, _) in enumerate(BATCH):
        assert ref[f"r{i}"] == hf_greedy(hf, random_prompt(n, seed=20 + i), new)
    cfg = WorkerConfig(model=str(tmp_path), tensor_parallel_size=2, **CFG)
    group = TPGroup(cfg)
    try:
        assert dist.get_backend() == ("nccl" if DEVICE.startswith("cuda") else "gloo") and dist.get_world_size() == 2
        assert os.environ["NCCL_NVLS_ENABLE"] == "0" and os.environ["NVSHMEM_DISABLE_NVLS"] == "1"
        runner = ModelRunner(cfg)
        # each rank pools 1 of the 2 KV heads: the same per-rank budget holds twice the blocks
        assert runner.kv_cache.pool.shape[-2] == 1 and runner.num_blocks == 2 * tp1.num_blocks
        assert runner.model.lm_head is None  # tied: config.json said so
        attn = runner.model.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads, attn.qkv_proj.weight.shape[0]) == (2, 1, 32 + 16 + 16)
        assert run_batch(Leader(group, runner)) == ref
        # prompt logprobs: rank 0 alone scores the chunks (it answers the batcher); a request with max_tokens 0
        # samples on no rank, so the ranks' token broadcasts stay in step
        scored = [prompt_scores(r) for r in (tp1, Leader(group, runner))]
        assert [c.start for c in scored[0]] == [c.start for c in scored[1]] == [1, 17, 33, 49]
        for a, b in zip(*scored):
            assert a.top_ids == b.top_ids and a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-4)
        # a step that fails alike on every rank (unknown request) fails there too and both reset:
        # the group stays in step and a second batch still matches
        bad = P.StepInput(step=99, cached_reqs=[P.CachedReq("nope", [1])], num_scheduled_tokens={"nope": 1})
        with pytest.raises(KeyError):
            Leader(group, runner).execute(bad)
        runner.reset()
        assert run_batch(Leader(group, runner)) == ref
    finally:
        group.close()
    assert not group.procs and not dist.is_initialized()


def test_heads_that_do_not_divide_fail_at_start():
    with pytest.raises(ValueError, match=r"tensor-parallel-size 3: the model's num_attention_heads 4 and "
                                         r"num_key_value_heads 2 must be divisible by 3"):
        TPGroup(WorkerConfig(device="cpu", tensor_parallel_size=3))  # tiny: 4 heads, 2 KV heads
    with pytest.raises(ValueError, match=r"num_key_value_heads 2 must be divisible by 4"):
        check_shardable(TINY_CONFIG, 4)
    with pytest.raises(ValueError, match="no process group of that size"):
        ModelRunner(WorkerConfig(device="cpu", tensor_parallel_size=2))  # not started through TPGroup
    check_shardable(TINY_CONFIG, 2)


async def _greedy_texts(base: str, patience: float = 0.0) -> list[str]:
    """Greedy completions of a few prompts, concurrently. patience > 0: a polite client that retries
    429/503 (no worker ready yet) after their Retry-After, for up to that many seconds."""
    prompts = ["Hello, lanes", "tensor parallel " * 6, "a", "The quick brown fox jumps over"]
    deadline = time.monotonic() + patience

    async def one(session, prompt):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True}
        while True:
            async with session.post(f"{base}/v1/completions", json=body) as resp:
                if resp.status in (429, 503) and time.monotonic() < deadline:
                    await asyncio.sleep(float(resp.headers.get("Retry-After", 1)))  # backoff, not a sync
                    continue
                assert resp.status == 200, await resp.text()
                return (await resp.json())["choices"][0]["text"]

    async with aiohttp.ClientSession() as s:
        return await asyncio.gather(*(one(s, p) for p in prompts))


def test_stack_with_tp2_answers_like_tp1_and_recovers_from_a_lost_rank(stack, make_stack):
    tp2 = make_stack("--tensor-parallel-size", "2", "--num-threads", "1")
    followers = [pid for pid in tp2.children if b"spawn_main" in cmdline(pid)]
    assert len(followers) == 1, [cmdline(p) for p in tp2.children]  # rank 1, started by the worker (rank 0)
    expected = asyncio.run(_greedy_texts(stack.base_url))
    assert asyncio.run(_greedy_texts(tp2.base_url)) == expected
    # rank 1 dies: rank 0 exits at once (it could only hang in the next collective), the launcher
    # restarts the worker, which starts a new rank 1, and the stack answers as before
    os.kill(followers[0], signal.SIGKILL)
    line = ""
    while "worker 0 exited" not in line:
        try:
            line = tp2._q.get(timeout=30)
        except queue.Empty:
            raise AssertionError("worker not restarted:\n" + "".join(tp2.lines[-30:])) from None
        assert line is not None, "".join(tp2.lines[-30:])
    assert "restarting it" in line
    assert asyncio.run(_greedy_texts(tp2.base_url, patience=60)) == expected
    started = set(tp2.children) | set(descendants(tp2.proc.pid))  # the new worker and its rank 1 too
    assert tp2.stop() == 0
    left = [pid for pid in started if alive(pid)]
    assert not left, f"processes left after shutdown: {[cmdline(p) for p in left]}"
