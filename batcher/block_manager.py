"""One worker's KV block pool: allocation, reference counts, prefix cache, pinning.

Owns which block ids are free, who references each block, and the prefix cache:
every FULL block whose K/V is computed is registered under a chained hash of its
token ids (`chain_hashes()`, vLLM's automatic prefix caching; the router keys
prompts with it too), and a lookup is confirmed by comparing the block's stored
tokens, so a hash collision can never hand out the wrong K/V. A freed block
keeps its hash (and stays findable) until it is reused; free blocks are reused
uncached-first (the most recently freed first), then least recently freed (LRU
eviction). Pinned blocks (the warm prefix pool) hold an extra reference and are
never evicted.

Held blocks (`free_blocks(req, fence)`, `release_held()`): with two lanes of steps running
at once (`--lanes streams`) a freed block that a step still in flight may write must not be
handed out before that step is done, or the other lane's step could write it first and the
late write clobber it. The caller names a fence (its last step number in flight); the freed
blocks without a hash (the ones in flight steps can still write: a hashed block is complete
and never written again) wait on `held` until release_held() says every step up to the fence
is done.

Must not do I/O or know about scheduling policy. Invariant (`check()`): every
block is in exactly one of {free lists, held, referenced}: free + held + used == total, and
a free block is on the cached free list iff it has a hash.

Speed (the simulator frees, registers and evicts millions of blocks): the LRU
list is a queue (`deque`) that blocks join at the back and leave at the front,
one C list operation per block and no node to allocate as an OrderedDict would.
A prefix hit that takes a free block out of the middle leaves a stale entry
there instead, skipped when it reaches the front (`_evict()`).
"""

from __future__ import annotations

from collections import deque

from batcher.request import Request

NO_HASH = None


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
        # Free blocks, reused in this order: the uncached ones (a stack: the most recently freed is on top, at
        # the end; block 0 first at start), then the cached ones by age (LRU first, evicted when reused).
        self.free_uncached: list[int] = list(range(num_blocks - 1, -1, -1))
        # The cached ones: a queue, least recently freed first. A prefix hit on a free block leaves its entry
        # there, stale, rather than cutting it out of the middle; `stale` counts them by block (a block's stale
        # entries all come before its live one, if it has one: that one is added when it is freed again).
        self.free_cached: deque[int] = deque()
        self.stale: dict[int, int] = {}
        self.num_stale = 0
        self.held: deque[tuple[int, list[int]]] = deque()  # (fence, blocks) in fence order: free_blocks(fence=)
        self.num_held = 0
        self.queries = 0  # tokens looked up in the prefix cache
        self.hits = 0  # of which were found

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        return len(self.free_uncached) + len(self.free_cached) - self.num_stale

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

    # ------------------------------------------------------------------ block keys
    def chain_hashes(self, token_ids: list[int], end: int, hashes: list[int], start: int = 0,
                     register: list[int] | None = None) -> list[int]:
        """The keys of a sequence's full blocks [start, end), appended to `hashes` (its keys so far: at least
        those before start); with `register` (its block ids), each block is also registered under its key.

        A block's key is hash((the key of the block before it, 0 for the first; its token ids)): the one place
        this rule is written. Keying and registering share one loop: the simulator registers every block it
        computes, and a call per block or a second loop cost it ~1.5% (measured). A block whose key is cached
        already is not registered: another block holds the same tokens; that one stays.
        """
        bs = self.block_size
        known = len(hashes)
        h = hashes[start - 1] if start else 0
        cached, hash_of, tokens_of = self.cached, self.hash, self.tokens
        blocks = zip(*[iter(token_ids[start * bs:end * bs])] * bs)  # the full blocks as tuples, cut in C
        for i, block in enumerate(blocks, start):
            if i < known:
                h = hashes[i]
            else:
                h = hash((h, block))
                hashes.append(h)
            if register is not None and h not in cached:
                bid = register[i]
                hash_of[bid] = h
                tokens_of[bid] = block
                cached[h] = bid
        return hashes

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
        cached, stored = self.cached, self.tokens
        n = 0
        while n < usable:
            if n == len(hashes):  # keyed up to the first miss only: cache_full_blocks() keys the rest
                self.chain_hashes(tokens, n + 1, hashes, n)
            bid = cached.get(hashes[n])
            # The tokens are compared on a hash hit only: a request waiting in line looks up every step.
            if bid is None or stored[bid] != tuple(tokens[n * bs:(n + 1) * bs]):
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
            if self.ref[bid] == 0:  # a free cached block: its entry in free_cached goes stale
                self.stale[bid] = self.stale.get(bid, 0) + 1
                self.num_stale += 1
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
        if n == 0:
            return True
        uncached = self.free_uncached
        k = len(uncached)
        if n > k + len(self.free_cached) - self.num_stale:
            return False
        if n <= k:
            taken = uncached[-n:]
            del uncached[-n:]
            taken.reverse()  # top of the stack first
        else:  # all the uncached ones, then evict: least recently freed cached blocks are reused for new K/V
            taken = uncached[::-1]
            uncached.clear()
            taken += self._evict(n - k)
        ref = self.ref
        for bid in taken:
            ref[bid] = 1
        req.block_ids += taken
        return True

    def _evict(self, n: int) -> list[int]:
        """Take the n least recently freed cached blocks off the free list and out of the prefix cache."""
        pop, stale = self.free_cached.popleft, self.stale
        cached, hash_of, tokens_of = self.cached, self.hash, self.tokens
        victims: list[int] = []
        for _ in range(n):
            bid = pop()
            while bid in stale:  # taken by a prefix hit since it was freed (and maybe back, further on)
                self._drop_stale(bid)
                bid = pop()
            victims.append(bid)
            del cached[hash_of[bid]]
            hash_of[bid] = NO_HASH
            tokens_of[bid] = None
        return victims

    def _drop_stale(self, bid: int) -> None:
        """One stale entry of bid has left free_cached."""
        left = self.stale.pop(bid) - 1
        if left:
            self.stale[bid] = left
        self.num_stale -= 1

    def cache_full_blocks(self, req: Request, num_tokens: int | None = None) -> None:
        """Register the request's newly full blocks among its first num_tokens [all computed] in the prefix cache.

        With steps in flight, num_tokens is what the step just done computed: later K/V is still being written.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        start = req.num_registered_blocks
        # (not past its known tokens: a speculative step computes K/V for drafts that are not its tokens yet)
        full = min(req.num_computed_tokens if num_tokens is None else num_tokens, len(req.token_ids)) // bs
        if full > start:  # lookup() keyed them up to its first miss (and at least up to start)
            self.chain_hashes(req.token_ids, full, req.block_hashes, start, register=req.block_ids)
        req.num_registered_blocks = full

    def free_blocks(self, req: Request, fence: int | None = None) -> None:
        """Drop the request's references; tail blocks first so they are evicted first (vLLM): cached ones join
        the LRU end, uncached ones the top of the stack (so its head block is reused first). With a fence the
        uncached ones are held instead, until release_held() passes the fence (module docstring)."""
        ref, hashes = self.ref, self.hash
        lru = self.free_cached
        uncached = self.free_uncached if fence is None else []
        for bid in reversed(req.block_ids):
            r = ref[bid] - 1
            ref[bid] = r
            if not r:
                if hashes[bid] is NO_HASH:
                    uncached.append(bid)
                else:
                    lru.append(bid)  # most recently freed, evicted last
        if fence is not None and uncached:
            self.held.append((fence, uncached))
            self.num_held += len(uncached)
        if self.num_stale > self.num_blocks:  # hits on free blocks, and few evictions to pass their entries
            self._compact_lru()
        req.block_ids = []
        req.num_registered_blocks = 0

    def release_held(self, fence: float) -> None:
        """Free the held blocks whose fence is below `fence` (the caller's oldest step still in flight)."""
        held = self.held
        while held and held[0][0] < fence:
            blocks = held.popleft()[1]
            self.free_uncached += blocks
            self.num_held -= len(blocks)

    def _compact_lru(self) -> None:
        """Drop the stale entries of free_cached; the others keep their order."""
        stale = self.stale
        keep = deque()
        for bid in self.free_cached:
            if bid in stale:
                self._drop_stale(bid)
            else:
                keep.append(bid)
        self.free_cached = keep

    # ------------------------------------------------------------------ warm pool
    def pin(self, block_ids: list[int]) -> None:
        for bid in block_ids:
            if bid not in self.pinned:
                self.pinned.add(bid)
                self.ref[bid] += 1

    def check(self) -> None:
        """Recount everything (tests): free + used == total, refs consistent, cache index sound."""
        used = sum(1 for r in self.ref if r > 0)
        stale = dict(self.stale)
        assert sum(stale.values()) == self.num_stale and all(n > 0 for n in stale.values())
        free_cached = []  # the entries that count: a block's stale ones come first
        for bid in self.free_cached:
            if stale.get(bid):
                stale[bid] -= 1
            else:
                free_cached.append(bid)
        assert not any(stale.values()), "a stale entry counted for a block not in free_cached"
        free = self.free_uncached + free_cached
        held = [bid for _, blocks in self.held for bid in blocks]
        assert len(held) == self.num_held and all(self.ref[b] == 0 and self.hash[b] is NO_HASH for b in held)
        assert all(r >= 0 for r in self.ref), "negative refcount"
        assert used + len(free) + len(held) == self.num_blocks, (used, len(free), len(held), self.num_blocks)
        assert len(set(free + held)) == len(free) + len(held), "a block is free twice"
        assert all(self.ref[b] == 0 for b in free), "a free block is referenced"
        assert all(self.hash[b] is NO_HASH for b in self.free_uncached), "a cached block on the uncached list"
        assert all(self.hash[b] is not NO_HASH for b in free_cached), "an uncached block on the cached list"
        assert all(self.ref[b] >= 1 for b in self.pinned)
        for h, bid in self.cached.items():
            assert self.hash[bid] == h and self.tokens[bid] is not None
