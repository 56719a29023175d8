"""Router: prefix affinity to the worker that holds the longest cached prefix, then least load."""

from __future__ import annotations

import dataclasses

from batcher.config import BatcherConfig
from laneserve.wire.protocol import AddRequest, SamplingParams
from batcher.router import pick_worker
from batcher.scheduler import Scheduler
from batcher.sim.engine import CostModel, SimRequest, SimWorker, simulate


def run_to_completion(s: Scheduler, rid: str, prompt: list[int]) -> None:
    s.add_request(AddRequest(request_id=rid, prompt_token_ids=prompt, params=SamplingParams(max_tokens=1),
                             arrival_time=0.0))
    w = SimWorker(s.num_blocks, s.block_size)
    while (st := s.schedule(0.0)) is not None:
        s.update(w.execute(st)[0], 0.0)


def schedulers(n: int, **kw) -> dict[int, Scheduler]:
    cfg = dataclasses.replace(BatcherConfig(), **kw)
    return {w: Scheduler(cfg, 256, 16, 4096) for w in range(n)}


def add_load(s: Scheduler, n: int) -> None:
    for _ in range(n):
        s.add_request(AddRequest(request_id=f"load{s.num_unfinished}", prompt_token_ids=[5] * 10, params=SamplingParams(),
                                 arrival_time=0.0))


def test_least_load_without_any_cached_prefix():
    ss = schedulers(3)
    add_load(ss[0], 2)
    add_load(ss[1], 1)
    add_load(ss[2], 3)
    assert pick_worker(ss, list(range(100))) == 1


def test_longest_cached_prefix_wins_over_load():
    ss = schedulers(3)
    system = list(range(1000, 1200))
    run_to_completion(ss[1], "a", system[:64] + [1, 2, 3])  # 4 blocks of it
    run_to_completion(ss[2], "b", system + [4, 5, 6])  # 12 blocks of it
    add_load(ss[2], 5)
    assert pick_worker(ss, system + [7, 8]) == 2
    assert pick_worker(ss, system[:70] + [9]) == 1  # both hold its 4 full blocks: the less loaded one
    assert pick_worker(ss, [7] * 50) == 0  # no prefix anywhere: least loaded


def test_affinity_yields_to_load_when_the_holder_is_swamped():
    ss = schedulers(2, affinity_max_load_gap=4)
    system = list(range(1000, 1200))
    run_to_completion(ss[1], "a", system + [1])
    add_load(ss[1], 4)
    assert pick_worker(ss, system + [2]) == 1
    add_load(ss[1], 1)
    assert pick_worker(ss, system + [2]) == 0


def test_two_workers_with_shared_prefixes_keep_hits_high():
    prefixes = [list(range(k * 1000, k * 1000 + 512)) for k in range(4)]
    reqs = [SimRequest(0.05 * i, prefixes[i % 4] + [i, i + 1, i + 2], 4) for i in range(80)]
    cfg = dataclasses.replace(BatcherConfig(), affinity_max_load_gap=64)
    res = simulate(reqs, cfg, CostModel(), num_blocks=1024, num_workers=2, check_kv=True)
    assert res.finish == {"LENGTH": 80}
    # Each prefix is computed on one worker only: 4 misses of 512 tokens out of 80 x 515 queried.
    assert res.prefix_hits == 76 * 512 - 0 and res.prefix_queries == 80 * 515
    for s in res.schedulers:
        s.bm.check()
        assert s.num_unfinished == 0
