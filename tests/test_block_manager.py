"""BlockManager on its own: refcounts, chained hashes confirmed by tokens, LRU eviction, pinning."""

from __future__ import annotations

from batcher.block_manager import BlockManager
from laneserve.wire.protocol import SamplingParams
from batcher.request import Request

BS = 4


def req(tokens, rid="r", internal=False) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=8), internal=internal)


def prefill(bm: BlockManager, r: Request) -> int:
    """Admit r like the scheduler does: prefix hit, blocks for the rest, compute it, register full blocks."""
    hit = bm.acquire_prefix(r, bm.lookup(r))
    r.num_computed_tokens = hit
    assert bm.allocate(r, r.compute_target - hit)
    r.num_computed_tokens = r.compute_target
    bm.cache_full_blocks(r)
    return hit


def test_allocate_and_free_keep_exact_accounting():
    bm = BlockManager(8, BS)
    a = req(range(10))
    assert bm.allocate(a, 10) and len(a.block_ids) == 3 and bm.num_free == 5
    a.num_computed_tokens = 10
    assert bm.allocate(a, 2) and len(a.block_ids) == 3  # 12 tokens still fit in 3 blocks
    assert bm.allocate(a, 3) and len(a.block_ids) == 4
    b = req(range(100, 120), "b")
    assert not bm.allocate(b, 20) and b.block_ids == [] and bm.num_free == 4  # all or nothing
    bm.check()
    bm.free_blocks(a)
    assert bm.num_free == 8 and a.block_ids == []
    bm.check()


def test_prefix_hit_shares_blocks_and_refcounts():
    bm = BlockManager(16, BS)
    a = req(list(range(10)), "a")
    assert prefill(bm, a) == 0
    b = req(list(range(8)) + [99, 98, 97], "b")  # shares 2 full blocks
    assert prefill(bm, b) == 8
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert [bm.ref[x] for x in a.block_ids[:2]] == [2, 2]
    assert bm.queries == 10 + 11 and bm.hits == 8
    bm.free_blocks(a)
    assert [bm.ref[x] for x in b.block_ids[:2]] == [1, 1]
    bm.free_blocks(b)
    bm.check()
    assert bm.num_free == 16
    # Freed blocks keep their hash: a third request still hits them.
    c = req(list(range(8)) + [5], "c")
    assert prefill(bm, c) == 8
    bm.check()


def test_whole_prompt_cached_still_leaves_one_token_to_compute():
    bm = BlockManager(16, BS)
    a = req(range(8), "a")
    prefill(bm, a)
    b = req(range(8), "b")
    assert bm.lookup(b) == 1  # not 2: the worker must compute at least one token to sample


def test_hash_collision_is_caught_by_comparing_tokens():
    bm = BlockManager(16, BS)
    a = req(range(8), "a")
    prefill(bm, a)
    # Forge a collision: make block 1's hash also the registered key for different tokens.
    forged = req([0, 1, 2, 3, 40, 41, 42, 43, 44], "f")
    h = bm.chain_hashes(forged.token_ids, len(forged.token_ids) // BS, [])
    bm.cached[h[1]] = a.block_ids[1]
    assert bm.lookup(forged) == 1  # block 0 is real, block 1's tokens differ -> no hit


def test_lru_eviction_reuses_uncached_first_then_oldest_cached():
    bm = BlockManager(6, BS)
    old = req(range(0, 8), "old")
    prefill(bm, old)
    new = req(range(100, 108), "new")
    prefill(bm, new)
    bm.free_blocks(old)  # freed first: least recently used
    bm.free_blocks(new)
    assert len(bm.cached) == 4
    x = req(range(200, 208), "x")
    assert bm.allocate(x, 8)  # takes the 2 never-cached blocks: nothing evicted
    assert len(bm.cached) == 4
    y = req(range(300, 308), "y")
    assert bm.allocate(y, 8)  # now evicts: the older request's blocks go first
    assert bm.lookup(req(range(0, 9), "o2")) == 0
    assert bm.lookup(req(range(100, 109), "n2")) == 2
    bm.check()


def test_eviction_order_takes_tail_blocks_before_head_blocks():
    bm = BlockManager(4, BS)
    a = req(list(range(16)) + [0], "a", internal=True)  # 16 computed tokens, 4 full blocks
    prefill(bm, a)
    bm.free_blocks(a)
    z = req(range(500, 504), "z")
    assert bm.allocate(z, 4)  # evicts one block: the last of the chain, so the prefix stays useful
    assert bm.lookup(req(list(range(16)) + [1], "p")) == 3


def test_pinned_blocks_survive_eviction_pressure():
    bm = BlockManager(4, BS)
    w = req(list(range(8)) + [0], "warm", internal=True)  # the sentinel token is never computed
    prefill(bm, w)
    bm.pin(w.block_ids)
    bm.free_blocks(w)
    assert bm.num_free == 2 and bm.num_usable == 2
    hog = req(range(900, 908), "hog")
    assert bm.allocate(hog, 8) and not bm.allocate(req(range(5), "more"), 4)
    bm.free_blocks(hog)
    assert bm.lookup(req(list(range(8)) + [7], "user")) == 2
    bm.check()
    assert bm.num_free + len(bm.pinned) == bm.num_blocks


def test_duplicate_content_is_registered_once():
    bm = BlockManager(8, BS)
    a, b = req(range(9), "a"), req(range(9), "b")
    for r in (a, b):  # both computed before either was registered (same step)
        assert bm.allocate(r, 9)
        r.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    bm.cache_full_blocks(b)
    assert len(bm.cached) == 2 and all(bm.hash[x] is None for x in b.block_ids)
    bm.free_blocks(a)
    bm.free_blocks(b)
    bm.check()


def test_free_blocks_are_reused_in_the_documented_order():
    """Against a one-list model of the policy: uncached blocks first (the most recently freed first), then the
    cached ones least recently freed first; a prefix hit takes a free cached block off the list."""
    import random
    from collections import OrderedDict

    rng = random.Random(7)
    bm = BlockManager(24, BS)
    model = OrderedDict.fromkeys(range(24))  # the reuse order, front first
    docs = [[rng.randrange(50) for _ in range(8)] for _ in range(3)]  # shared prefixes: hits on free blocks
    live: list[Request] = []
    for i in range(400):
        if live and (rng.random() < 0.45 or bm.num_free < 6):
            r = live.pop(rng.randrange(len(live)))
            freed = [b for b in reversed(r.block_ids) if bm.ref[b] == 1]
            bm.free_blocks(r)
            for b in freed:
                model[b] = None
                if bm.hash[b] is None:
                    model.move_to_end(b, last=False)
            continue
        r = req(rng.choice(docs) + [rng.randrange(50) for _ in range(rng.randrange(1, 10))], f"r{i}")
        hit = bm.lookup(r)
        for h in r.block_hashes[:hit]:
            model.pop(bm.cached[h], None)
        r.num_computed_tokens = bm.acquire_prefix(r, hit)
        before = len(r.block_ids)
        assert bm.allocate(r, r.compute_target - r.num_computed_tokens)
        assert r.block_ids[before:] == [model.popitem(last=False)[0] for _ in r.block_ids[before:]]
        r.num_computed_tokens = r.compute_target
        bm.cache_full_blocks(r)
        live.append(r)
        bm.check()
    assert bm.num_free == len(model)


def test_prefix_hits_on_free_blocks_leave_stale_lru_entries_that_are_skipped_and_compacted():
    """A hit on a free cached block leaves its LRU entry behind, stale: eviction skips it and takes the block at
    its new place (freed again: most recently used); many of them (hits, no eviction) are compacted away."""
    bm = BlockManager(8, BS)
    a = req(range(8), "a")  # 2 full blocks, cached
    prefill(bm, a)
    head = a.block_ids
    bm.free_blocks(a)
    b = req(range(100, 108), "b")  # 2 more cached blocks, freed after a's
    prefill(bm, b)
    b_blocks = b.block_ids
    bm.free_blocks(b)
    for i in range(3 * bm.num_blocks):  # hit a's blocks and free them again: 2 stale entries each time
        r = req(list(range(8)) + [i], f"h{i}")
        assert prefill(bm, r) == 8 and r.block_ids[:2] == head
        bm.free_blocks(r)
        bm.check()
        assert len(bm.free_cached) <= 3 * bm.num_blocks  # compacted now and then
    # LRU order now: 4 uncached blocks, b's 2 blocks (tail first), a's 2 blocks (freed last).
    x = req(range(200, 224), "x")
    assert bm.allocate(x, 24) and x.block_ids[4:] == b_blocks[::-1]
    assert bm.lookup(req(list(range(8)) + [1], "again")) == 2  # a's blocks survived
    y = req(range(300, 304), "y")
    assert bm.allocate(y, 4) and y.block_ids == head[::-1][:1]
    assert bm.lookup(req(list(range(8)) + [1], "again2")) == 1
    bm.check()
