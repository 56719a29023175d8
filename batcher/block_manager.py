"""One worker's KV block pool: allocation, reference counts, prefix cache, pinning.

Owns which block ids are free, who references each block, and the prefix cache:
every FULL block whose K/V is computed is registered under a chained hash of its
token ids (`hash((parent_hash, tokens))`, vLLM's automatic prefix caching), and a
lookup is confirmed by comparing the block's stored tokens, so a hash collision
can never hand out the wrong K/V. A freed block keeps its hash (and stays
findable) until it is reused; free blocks are reused uncached-first, then least
recently freed (LRU eviction). Pinned blocks (the warm prefix pool) hold an
extra reference and are never evicted.

Must not do I/O or know about scheduling policy. Invariant (`check()`): every
block is in exactly one of {free list, referenced}: free + used == total.
"""

from __future__ import annotations

from collections import OrderedDict

from batcher.request import Request

NO_HASH = None


def chain_hashes(token_ids: list[int], block_size: int, start: int = 0, parent: int | None = None,
                 out: list[int] | None = None, end: int | None = None) -> list[int]:
    """Chained hashes of full blocks [start, end) of token_ids (parent: the hash of block start-1)."""
    out = [] if out is None else out
    h = parent if parent is not None else 0
    end = len(token_ids) // block_size if end is None else end
    for i in range(start, end):
        h = hash((h, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        out.append(h)
    return out


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref = [0] * num_blocks
        self.hash: list[int | None] = [NO_HASH] * num_blocks
        self.tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.pinned: set[int] = set()
        self.cached: dict[int, int] = {}  # hash -> block id
        # Free blocks in reuse order: uncached ones at the front, cached ones by age (LRU first).
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.queries = 0  # tokens looked up in the prefix cache
        self.hits = 0  # of which were found

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_usable(self) -> int:
        """Blocks a request could ever get: all but the pinned ones."""
        return self.num_blocks - len(self.pinned)

    def num_cached_blocks(self, hashes: list[int], token_ids: list[int]) -> int:
        """Length of the longest chain of leading blocks found in the cache (tokens confirmed)."""
        bs = self.block_size
        n = 0
        for i, h in enumerate(hashes):
            bid = self.cached.get(h)
            if bid is None or self.tokens[bid] != tuple(token_ids[i * bs:(i + 1) * bs]):
                break
            n += 1
        return n

    # ------------------------------------------------------------------ allocation
    def lookup(self, req: Request) -> int:
        """How many leading blocks of the request are cached (no state change besides its hash list).

        At least one token is always left to compute, since the worker samples only after computing one.
        """
        if not self.enable_prefix_caching:
            return 0
        tokens = req.token_ids
        bs = self.block_size
        usable = (req.compute_target - 1) // bs  # full blocks that leave >= 1 token to compute
        hashes = req.block_hashes
        if len(hashes) < usable:
            chain_hashes(tokens, bs, len(hashes), hashes[-1] if hashes else None, hashes, usable)
        cached = self.cached
        n = 0
        for i in range(usable):
            bid = cached.get(hashes[i])
            if bid is None or self.tokens[bid] != tuple(tokens[i * bs:(i + 1) * bs]):
                break
            n += 1
        return n

    def num_free_hits(self, req: Request, num_hit_blocks: int) -> int:
        """Of the first num_hit_blocks cached blocks of req, those now free (acquiring takes them off the list)."""
        ref, cached = self.ref, self.cached
        return sum(1 for h in req.block_hashes[:num_hit_blocks] if ref[cached[h]] == 0)

    def acquire_prefix(self, req: Request, num_hit_blocks: int) -> int:
        """Give a request with no blocks its first num_hit_blocks cached blocks (from lookup()); returns tokens."""
        assert not req.block_ids
        for h in req.block_hashes[:num_hit_blocks]:
            bid = self.cached[h]
            if self.ref[bid] == 0:
                del self.free[bid]
            self.ref[bid] += 1
            req.block_ids.append(bid)
        req.num_registered_blocks = num_hit_blocks
        if self.enable_prefix_caching:
            self.queries += req.compute_target
            self.hits += num_hit_blocks * self.block_size
        return num_hit_blocks * self.block_size

    def blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        have = len(req.block_ids)
        need = -(-(req.num_computed_tokens + num_new_tokens) // self.block_size)
        return need - have if need > have else 0

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Append the blocks for num_new_tokens more tokens of K/V; False (nothing taken) if short."""
        n = self.blocks_needed(req, num_new_tokens)
        if n > len(self.free):
            return False
        for _ in range(n):
            bid, _ = self.free.popitem(last=False)
            h = self.hash[bid]
            if h is not NO_HASH:  # evict: this cached block is reused for new K/V
                del self.cached[h]
                self.hash[bid] = NO_HASH
                self.tokens[bid] = None
            self.ref[bid] = 1
            req.block_ids.append(bid)
            req.new_block_ids.append(bid)
        return True

    def cache_full_blocks(self, req: Request, num_tokens: int | None = None) -> None:
        """Register the request's newly full blocks among its first num_tokens [all computed] in the prefix cache.

        With steps in flight, num_tokens is what the step just done computed: later K/V is still being written.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = (req.num_computed_tokens if num_tokens is None else num_tokens) // bs
        hashes = req.block_hashes
        if len(hashes) < full:
            chain_hashes(req.token_ids, bs, len(hashes), hashes[-1] if hashes else None, hashes, full)
        for i in range(req.num_registered_blocks, full):
            h = hashes[i]
            if h not in self.cached:  # else another block holds the same tokens; keep that one
                bid = req.block_ids[i]
                self.hash[bid] = h
                self.tokens[bid] = tuple(req.token_ids[i * bs:(i + 1) * bs])
                self.cached[h] = bid
        req.num_registered_blocks = full

    def free_blocks(self, req: Request) -> None:
        """Drop the request's references; tail blocks first so they are evicted first (vLLM)."""
        for bid in reversed(req.block_ids):
            self.ref[bid] -= 1
            if self.ref[bid] == 0:
                self.free[bid] = None  # appended: most recently freed, evicted last
                if self.hash[bid] is NO_HASH:
                    self.free.move_to_end(bid, last=False)
        req.block_ids = []
        req.new_block_ids = []
        req.num_registered_blocks = 0

    # ------------------------------------------------------------------ warm pool
    def pin(self, block_ids: list[int]) -> None:
        for bid in block_ids:
            if bid not in self.pinned:
                self.pinned.add(bid)
                self.ref[bid] += 1

    def check(self) -> None:
        """Recount everything (tests): free + used == total, refs consistent, cache index sound."""
        used = sum(1 for r in self.ref if r > 0)
        assert all(r >= 0 for r in self.ref), "negative refcount"
        assert used + len(self.free) == self.num_blocks, (used, len(self.free), self.num_blocks)
        assert all(self.ref[b] == 0 for b in self.free), "a free block is referenced"
        assert all(self.ref[b] >= 1 for b in self.pinned)
        for h, bid in self.cached.items():
            assert self.hash[bid] == h and self.tokens[bid] is not None
