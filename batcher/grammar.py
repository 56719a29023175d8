"""Structured output in the batcher (docs/structured_output.md): the grammar matchers of constrained requests and
the token masks of their steps, on llguidance's numpy API.

A request's matcher lives here, beside its tokens, not in a worker: the batcher sees every token a request
samples, in order, and keeps them across preemption (which recomputes K/V, not tokens) and a requeue to another
worker, so the matcher stays in step with the request wherever it runs. A worker gets only the bitmask of each
step (StepInput.allowed_token_ids) and applies it to the logits on its device (workers/sampling.py). The gateway
turns the request's response_format / guided_* / tool_choice into an llguidance grammar and checks it
(gateway/structured.py); it also sends the tokenizer (Vocabulary), which the batcher has no other way to know.

Compiling is off the event loop (a thread) and cached by grammar text: a cached grammar's matcher is a copy.
Must not import torch.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict

import llguidance as llg
import llguidance.numpy as llnp
import numpy as np

from laneserve.wire.protocol import Vocabulary

CACHE_SIZE = 128  # compiled grammars kept, by text (least recently used out first)
MASK_THREADS = 2  # llguidance's pool for the masks of one step


class GrammarError(ValueError):
    """A grammar this batcher cannot run (no tokenizer yet, or llguidance refuses it): the request is rejected."""


class Grammars:
    """The tokenizer (from the gateways' Vocabulary), the compiled grammars, and the masks of a step."""

    def __init__(self):
        self.vocab: Vocabulary | None = None
        self.tokenizer: llg.LLTokenizer | None = None  # built from vocab in a compile thread, when first needed
        self.words = 0  # int32 words of one mask
        self._lock = threading.Lock()
        self.cache: OrderedDict[str, llg.LLMatcher] = OrderedDict()  # grammar text -> a matcher at its start
        self.building: dict[str, asyncio.Future] = {}
        self._executor: llg.LLExecutor | None = None

    def set_vocabulary(self, msg: Vocabulary) -> None:
        """A gateway's tokenizer; a different one (another model) drops what was compiled for the old one."""
        old = self.vocab
        if old is not None and (old.vocab_size, old.eos_token_ids, old.tokenizer_json) == (
                msg.vocab_size, msg.eos_token_ids, msg.tokenizer_json):
            return
        with self._lock:
            self.vocab, self.tokenizer = msg, None
            self.words = (msg.vocab_size + 31) // 32
            self.cache.clear()

    # ------------------------------------------------------------------ compiling
    def compile(self, grammar: str) -> llg.LLMatcher:
        """A matcher at the start of `grammar`, compiled now, not cached (blocking: matcher() runs it in a thread).
        Touches nothing but the tokenizer, under the lock, so threads may run it beside the event loop."""
        with self._lock:
            if self.vocab is None:
                raise GrammarError("no gateway has sent the tokenizer yet")
            if self.tokenizer is None:  # ~1 s for a 128k vocabulary: once, in the first compile's thread
                v = self.vocab
                self.tokenizer = llg.LLTokenizer(v.tokenizer_json, n_vocab=v.vocab_size, eos_token=v.eos_token_ids)
            tokenizer = self.tokenizer
        m = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if not m.is_error():  # a grammar with no output at all (`root ::= root`) fails at its first mask
            llnp.fill_next_token_bitmask(m, np.empty((1, self.words), dtype=np.int32))
        if m.is_error():
            raise GrammarError(_brief(m.get_error()) or "the grammar failed")
        return m

    def cached(self, grammar: str) -> llg.LLMatcher | None:
        """A fresh matcher for `grammar` if it is compiled already, else None."""
        template = self.cache.get(grammar)
        if template is None:
            return None
        self.cache.move_to_end(grammar)
        return template.deep_copy()

    async def matcher(self, grammar: str) -> llg.LLMatcher:
        """A fresh matcher for `grammar`: a copy of the cached one, else compiled in a thread (requests with the same
        grammar that arrive meanwhile wait for that one compile). Raises GrammarError."""
        m = self.cached(grammar)
        if m is not None:
            return m
        fut = self.building.get(grammar)
        if fut is None:
            fut = self.building[grammar] = asyncio.ensure_future(asyncio.to_thread(self.compile, grammar))
            fut.add_done_callback(lambda f: self._built(grammar, f))
        return (await asyncio.shield(fut)).deep_copy()

    def _built(self, grammar: str, fut: asyncio.Future) -> None:
        self.building.pop(grammar, None)
        if fut.cancelled() or fut.exception() is not None:
            return
        self.cache[grammar] = fut.result()
        while len(self.cache) > CACHE_SIZE:
            self.cache.popitem(last=False)

    # ------------------------------------------------------------------ steps
    def masks(self, matchers: list[llg.LLMatcher]) -> list[bytes]:
        """Each matcher's next-token bitmask (P.StepInput.allowed_token_ids), computed on llguidance's threads."""
        out = np.empty((len(matchers), self.words), dtype=np.int32)
        if len(matchers) == 1:
            llnp.fill_next_token_bitmask(matchers[0], out)
        else:
            if self._executor is None:
                self._executor = llg.LLExecutor(MASK_THREADS)
            llnp.fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], out)
        return [row.tobytes() for row in out]


def follow(matcher: llg.LLMatcher, token: int) -> bool:
    """Advance the matcher by a sampled token; True once the grammar is complete (nothing but EOS may follow).
    Raises GrammarError when the matcher fails: a token it does not allow, or a parser limit its grammar hits."""
    if not matcher.consume_token(token):
        raise GrammarError(_brief(matcher.get_error()) or f"token {token} is not allowed by the grammar")
    return matcher.is_stopped()


def _brief(error: str) -> str:
    """llguidance's error, its first line (not the parser's state dump that may follow), at most 200 characters."""
    return (error.strip().splitlines() or [""])[0][:200]
