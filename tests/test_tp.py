"""Tensor parallelism on CPU with gloo (issue 11): TP=2 gives the same greedy tokens as TP=1.

In process: this test process is rank 0 (workers.parallel.TPGroup starts rank 1 as a spawned
child that runs its follower loop) and the Sim sidecar drives rank 0's ModelRunner, forwarding
each StepInput as workers/main.py does. Over HTTP: the real stack with --tensor-parallel-size 2
against the TP=1 stack. Plus the start-up error when the heads don't divide.
"""

from __future__ import annotations

import asyncio
import os

import aiohttp
import pytest
import torch
import torch.distributed as dist

from tests.helpers_models import Sim, greedy, hf_greedy, make_checkpoint, random_prompt
from workers.config import WorkerConfig
from workers.model.tiny import TINY_CONFIG
from workers.parallel import TPGroup, check_shardable
from workers.runner import ModelRunner

CFG = dict(device="cpu", dtype="float32", kv_cache_memory="2MiB", max_model_len=256, num_threads=1)
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
    return sim.run()


def test_tp2_greedy_matches_tp1_and_transformers(tmp_path):
    # biases: column-parallel q/k/v/gate/up biases are sharded, row-parallel o/down biases added once
    # after the all-reduce; tied: lm_head is the replicated embedding
    hf = make_checkpoint(str(tmp_path), "llama", seed=3, attention_bias=True, mlp_bias=True,
                         tie_word_embeddings=True)  # 4 heads, 2 KV heads, intermediate 160
    tp1 = ModelRunner(WorkerConfig(model=str(tmp_path), **CFG))
    ref = run_batch(tp1)
    for i, (n, new, _) in enumerate(BATCH):
        assert ref[f"r{i}"] == hf_greedy(hf, random_prompt(n, seed=20 + i), new)
    cfg = WorkerConfig(model=str(tmp_path), tensor_parallel_size=2, **CFG)
    group = TPGroup(cfg)
    try:
        assert dist.get_backend() == "gloo" and dist.get_world_size() == 2
        assert os.environ["NCCL_NVLS_ENABLE"] == "0" and os.environ["NVSHMEM_DISABLE_NVLS"] == "1"
        runner = ModelRunner(cfg)
        # each rank pools 1 of the 2 KV heads: the same per-rank budget holds twice the blocks
        assert runner.kv_cache.pool.shape[-2] == 1 and runner.num_blocks == 2 * tp1.num_blocks
        assert runner.model.lm_head is None  # tied: config.json said so
        attn = runner.model.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads, attn.q_proj.weight.shape[0]) == (2, 1, 32)
        assert run_batch(Leader(group, runner)) == ref
        # the follower's state follows the diffs too: a second batch on the same group still matches
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


async def _greedy_texts(base: str) -> list[str]:
    prompts = ["Hello, lanes", "tensor parallel " * 6, "a", "The quick brown fox jumps over"]

    async def one(session, prompt):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True}
        async with session.post(f"{base}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return (await resp.json())["choices"][0]["text"]

    async with aiohttp.ClientSession() as s:
        return await asyncio.gather(*(one(s, p) for p in prompts))


def test_stack_with_tp2_answers_like_tp1(stack, make_stack):
    tp2 = make_stack("--tensor-parallel-size", "2", "--num-threads", "1")
    assert len(tp2.children) >= 4  # batcher, gateway, worker (rank 0) and its rank 1
    assert asyncio.run(_greedy_texts(tp2.base_url)) == asyncio.run(_greedy_texts(stack.base_url))
    assert tp2.stop() == 0
    alive = [pid for pid in tp2.children if os.path.exists(f"/proc/{pid}") and
             open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
    assert not alive, f"processes left after shutdown: {alive}"
