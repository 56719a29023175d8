"""Which worker gets a new request: prefix affinity first, then least load. Pure.

One Scheduler per worker owns that worker's KV pool (see docs/scheduling.md), so
a request can only reuse K/V cached on the worker it is sent to. The router asks
each worker's block manager how many leading full blocks of the prompt it holds
(chained hash, tokens confirmed) and prefers the longest; ties, and prompts with
no cached prefix anywhere, go to the worker with the fewest unfinished requests.
Affinity yields to load when the prefix holder has `affinity_max_load_gap` more
unfinished requests than the least loaded worker (a hot prefix must not pin all
traffic to one GPU). Must not do I/O or change any scheduler's state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from batcher.scheduler import Scheduler


def pick_worker(schedulers: Mapping[int, "Scheduler"], prompt_token_ids: list[int]) -> int:
    if not schedulers:
        raise ValueError("no worker to pick")
    loads = {wid: s.num_unfinished for wid, s in schedulers.items()}
    least = min(loads, key=lambda w: (loads[w], w))
    if len(schedulers) == 1:
        return least
    hashes_by_bs: dict[int, list[int]] = {}
    best, best_blocks = least, 0
    for wid in sorted(schedulers):
        s = schedulers[wid]
        if not s.cfg.enable_prefix_caching or loads[wid] - loads[least] > s.cfg.affinity_max_load_gap:
            continue
        bs = s.block_size
        if bs not in hashes_by_bs:
            hashes_by_bs[bs] = s.bm.chain_hashes(prompt_token_ids, (len(prompt_token_ids) - 1) // bs, [])
        n = s.bm.num_cached_blocks(hashes_by_bs[bs], prompt_token_ids) * bs
        if n > best_blocks or (n == best_blocks and n > 0 and loads[wid] < loads[best]):
            best, best_blocks = wid, n
    return best
