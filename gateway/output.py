"""One choice's output state and its OpenAI JSON shapes (completion and chat, streamed or not).

Choice.feed() turns the batcher's TokenDeltas into text (via detokenizer.TextStream), finish
reasons and logprobs; CompletionShape / ChatShape render choices and chunks exactly as the
OpenAI API (and vLLM) do. Pure: no sockets, no aiohttp.
"""

from __future__ import annotations

from gateway.detokenizer import TextStream
from gateway.tokenizer import ModelTokenizer
from laneserve.wire.protocol import FinishReason, PromptLogprobs, TokenDelta, TokenLogprobs

FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}
MIN_LOGPROB = -9999.0  # what -inf is shown as (JSON has no infinity; vLLM's and OpenAI's value)


class EngineError(Exception):
    """A request ended with FinishReason.ERROR (worker failure): a 500, not the user's fault."""


class InvalidRequest(Exception):
    """A request ended with FinishReason.INVALID (its own input failed while it ran, e.g. its grammar): a 400."""


class ScoredPrompt:
    """A choice's prompt logprobs, assembled from the deltas' chunks (PromptLogprobs) by position: a chunk scored
    again (its request was preempted and recomputed) overwrites with the same values, positions past the prompt (a
    request requeued with its outputs appended to its prompt) are dropped. Entry j scores prompt token j; entry 0
    (no context) stays None. field_k / echo_k: the top-k shown by the `prompt_logprobs` field / by echo's logprobs
    (None: not shown there)."""

    __slots__ = ("ids", "entries", "missing", "field_k", "echo_k")

    def __init__(self, prompt_ids: list[int], field_k: int | None, echo_k: int | None):
        self.ids = prompt_ids
        self.entries: list[tuple | None] = [None] * len(prompt_ids)  # (logprob, rank, top ids, top logprobs)
        self.missing = len(prompt_ids) - 1
        self.field_k, self.echo_k = field_k, echo_k

    def add(self, chunk: PromptLogprobs) -> None:
        entries = self.entries
        for j, e in enumerate(zip(chunk.token_logprobs, chunk.ranks, chunk.top_ids, chunk.top_logprobs), chunk.start):
            if j >= len(entries):
                break
            if j >= 1:
                self.missing -= entries[j] is None
                entries[j] = e

    @property
    def complete(self) -> bool:
        return self.missing <= 0

    def echo_entries(self) -> list[TokenLogprobs | None]:
        """Echo's view: per prompt token its logprob and the top echo_k (None for the first)."""
        k = self.echo_k or 0
        return [None if e is None else TokenLogprobs(e[0], e[2][:k], e[3][:k]) for e in self.entries]


class Choice:
    __slots__ = ("index", "request_id", "text", "eos", "finish_reason", "stop_reason", "parts", "want_logprobs",
                 "lp_tokens", "lp_entries", "needs_abort", "first_token_at", "num_cached", "prefix", "stop_ids",
                 "tools", "lp_ids", "last_token_at", "lp_offset", "prompt", "echoed", "keep_logprobs")

    def __init__(self, index: int, request_id: str, tok: ModelTokenizer, prompt_ids: list[int], stops: list[str],
                 include_stop_str: bool, skip_special_tokens: bool, want_logprobs: bool, prefix: str = "",
                 stop_ids: tuple[int, ...] = (), tools=None, lp_ids: bool = False,
                 scoring: tuple[int | None, int | None] = (None, None), min_tokens: int = 0,
                 keep_logprobs: bool = True):
        self.index = index
        self.request_id = request_id
        self.text = TextStream(tok, prompt_ids, stops, include_stop_str, skip_special_tokens, min_tokens)
        self.eos = tok.eos_token_ids
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.parts: list[str] = [prefix] if prefix else []  # the whole text, for non-streaming answers
        self.prefix = prefix  # echo: the prompt text, sent before the first generated text
        self.want_logprobs = want_logprobs
        self.lp_tokens: list[int] = []
        self.lp_entries: list = []
        self.keep_logprobs = keep_logprobs  # False when streamed: each chunk sends its own, none are held
        self.needs_abort = False  # a stop string ended it before the batcher did
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.num_cached = 0
        # the request's stop token ids (eos included unless ignore_eos): a STOP delta ending in one does not show it;
        # one ending otherwise (its grammar was complete: docs/structured_output.md) shows all its tokens
        self.stop_ids = frozenset(stop_ids)
        self.tools = tools  # chat with tool calling: its gateway.structured.ToolOutput
        self.lp_ids = lp_ids  # return_tokens_as_token_ids: logprobs name tokens "token_id:N"
        self.lp_offset = len(prefix)  # streamed completion logprobs: text_offset of the next chunk's first token
        # prompt logprobs (schemas.prompt_scoring's (field k, echo k)), None when neither shows them
        self.prompt = ScoredPrompt(prompt_ids, *scoring) if scoring != (None, None) else None
        self.echoed = False  # streamed: the echo chunk (the prompt's text) was sent

    @property
    def num_tokens(self) -> int:
        return self.text.num_tokens

    def feed(self, d: TokenDelta) -> tuple[str, list[int], list]:
        """-> (new text, token ids consumed, their logprobs); sets finish_reason when the choice ends."""
        if d.finish_reason == FinishReason.ERROR:
            raise EngineError(d.error or "engine error")
        if d.finish_reason == FinishReason.INVALID:
            raise InvalidRequest(d.error or "invalid request")
        if d.num_cached_tokens:
            self.num_cached = d.num_cached_tokens
        if d.prompt_logprobs is not None and self.prompt is not None:
            self.prompt.add(d.prompt_logprobs)
        ids = d.new_token_ids
        before = self.text.num_tokens
        stop_token = d.finish_reason == FinishReason.STOP and bool(ids) and ids[-1] in self.stop_ids
        piece = self.text.add(ids, hide_last=stop_token and not self.text.stops.include_stop_str)
        consumed = ids[:self.text.num_tokens - before]
        lps = d.logprobs[:len(consumed)] if (self.want_logprobs and d.logprobs) else []
        if self.text.stop_str is not None:
            self.finish_reason, self.stop_reason = "stop", self.text.stop_str
            self.needs_abort = d.finish_reason is None
        elif d.finish_reason is not None:
            piece += self.text.finish()
            if self.text.stop_str is not None:
                self.finish_reason, self.stop_reason = "stop", self.text.stop_str
            else:
                self.finish_reason = FINISH[d.finish_reason]
                if stop_token and ids[-1] not in self.eos:
                    self.stop_reason = ids[-1]
        if piece:
            self.parts.append(piece)
        if lps and self.keep_logprobs:
            self.lp_tokens += consumed
            self.lp_entries += lps
        return piece, consumed, lps


class _Shape:
    def __init__(self, tok: ModelTokenizer):
        self.tok = tok
        self._token_text: dict[int, str] = {}

    def token_text(self, token_id: int, as_id: bool = False) -> str:
        if as_id:
            return f"token_id:{token_id}"
        s = self._token_text.get(token_id)
        if s is None:
            s = self._token_text[token_id] = self.tok.decode([token_id], skip_special_tokens=False)
        return s

    def prompt_logprobs(self, ch: Choice) -> list[dict | None] | None:
        """vLLM's `prompt_logprobs`: None for the first prompt token, then per token {token id (a string): {logprob,
        rank, decoded_token}} for the prompt's own token (its rank among the vocabulary) and the top-k (ranks 1..k)."""
        scores = ch.prompt
        if scores is None or scores.field_k is None:
            return None
        k = scores.field_k
        out: list[dict | None] = []
        for t, e in zip(scores.ids, scores.entries):
            if e is None:
                out.append(None)
                continue
            entry = {str(t): self._scored(t, e[0], e[1])}
            for rank, (i, v) in enumerate(zip(e[2][:k], e[3][:k]), 1):
                entry[str(i)] = self._scored(i, v, rank)
            out.append(entry)
        return out

    def _scored(self, token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": max(logprob, MIN_LOGPROB), "rank": rank, "decoded_token": self.token_text(token_id)}


class CompletionShape(_Shape):
    object = "text_completion"
    chunk_object = "text_completion"

    def logprobs(self, ids: list[int], lps: list, offset: int = 0, as_id: bool = False) -> dict | None:
        """lps: a TokenLogprobs per token, or None for a token with none (the first of an echoed prompt)."""
        if not lps:
            return None
        texts = [self.token_text(t) for t in ids]
        offsets, pos = [], offset
        for t in texts:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": [self.token_text(t, True) for t in ids] if as_id else texts,
                "token_logprobs": [None if lp is None else max(lp.logprob, MIN_LOGPROB) for lp in lps],
                "top_logprobs": [None if lp is None else self._top(t, lp, as_id) for t, lp in zip(ids, lps)],
                "text_offset": offsets}

    def _echo_logprobs(self, ch: Choice) -> tuple[list[int], list]:
        """Echo with logprobs: the prompt's tokens and their logprobs, which the answer's logprobs start with."""
        if not ch.prefix or ch.prompt is None or ch.prompt.echo_k is None:
            return [], []
        return ch.prompt.ids, ch.prompt.echo_entries()

    def _top(self, token_id: int, lp, as_id: bool) -> dict[str, float]:
        """token -> logprob of the top ones, then of the token itself where it is not among them (OpenAI's and vLLM's
        up to k + 1 entries); tokens that decode alike ("\ufffd" pieces) keep an entry each, the later ones named
        "token_id:N"."""
        out: dict[str, float] = {}
        top = list(zip(lp.top_ids, lp.top_logprobs))
        for i, v in top + ([(token_id, lp.logprob)] if token_id not in lp.top_ids else []):
            key = self.token_text(i, as_id)
            out[key if key not in out else self.token_text(i, True)] = max(v, MIN_LOGPROB)
        return out

    def choice(self, ch: Choice) -> dict:
        logprobs = None
        if ch.want_logprobs:
            ids, lps = self._echo_logprobs(ch)
            # text_offset counts from the start of the choice's text: from the echoed prompt's first token when its
            # logprobs come first (vLLM's sum of the tokens' texts), else from the end of the echoed text
            logprobs = self.logprobs(ids + ch.lp_tokens, lps + ch.lp_entries, 0 if ids else len(ch.prefix), ch.lp_ids)
        return {"index": ch.index, "text": "".join(ch.parts), "logprobs": logprobs,
                "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason,
                "prompt_logprobs": self.prompt_logprobs(ch)}

    def response_fields(self, choices: list[Choice]) -> dict:
        return {}

    def chunk_choice(self, ch: Choice, text: str, ids: list[int], lps: list, finished: bool) -> dict:
        logprobs = None
        if lps:  # text_offset counts from the start of the choice's text (the echoed prompt included), as whole
            logprobs = self.logprobs(ids, lps, ch.lp_offset, ch.lp_ids)
            ch.lp_offset += sum(len(self.token_text(t)) for t in ids)
        return {"index": ch.index, "text": text, "logprobs": logprobs,
                "finish_reason": ch.finish_reason if finished else None,
                "stop_reason": ch.stop_reason if finished else None}

    def first_chunk_choice(self, ch: Choice) -> dict | None:
        """The echo chunk (the prompt's text), once: with echo scoring it carries the prompt's logprobs, so it waits
        for them (None until they are all in; they come with the first token at the latest)."""
        if not ch.prefix or ch.echoed:
            return None
        ids, lps = self._echo_logprobs(ch) if ch.want_logprobs else ([], [])
        logprobs = None
        if ids:
            if not ch.prompt.complete:
                return None
            logprobs = self.logprobs(ids, lps, 0, ch.lp_ids)
            ch.lp_offset = sum(len(self.token_text(t)) for t in ids)
        ch.echoed = True
        return {"index": ch.index, "text": ch.prefix, "logprobs": logprobs, "finish_reason": None,
                "stop_reason": None}


class ChatShape(_Shape):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def _entry(self, token_id: int, logprob: float, as_id: bool) -> dict:
        """OpenAI's entry: the token's text (or "token_id:N"), its logprob, and its own bytes (a piece of a UTF-8
        character is that piece, not the U+FFFD its text shows)."""
        return {"token": self.token_text(token_id, as_id), "logprob": max(logprob, MIN_LOGPROB),  # (a grammar's -inf)
                "bytes": list(self.tok.token_bytes(token_id))}

    def logprobs(self, ids: list[int], lps: list, as_id: bool = False) -> dict | None:
        if not lps:
            return None
        return {"content": [{**self._entry(t, lp.logprob, as_id),
                             "top_logprobs": [self._entry(i, v, as_id) for i, v in zip(lp.top_ids, lp.top_logprobs)]}
                            for t, lp in zip(ids, lps)]}

    def response_fields(self, choices: list[Choice]) -> dict:
        """vLLM's chat answer carries the prompt's logprobs once, beside the choices (they share the prompt)."""
        return {"prompt_logprobs": self.prompt_logprobs(choices[0]) if choices else None}

    def choice(self, ch: Choice) -> dict:
        message = {"role": "assistant", "content": "".join(ch.parts)}
        finish_reason = ch.finish_reason
        if ch.tools is not None:
            message["content"], calls = ch.tools.calls(message["content"])
            if calls:  # (without "index": OpenAI's and vLLM's whole message; it belongs to stream deltas)
                message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in calls]
            finish_reason = ch.tools.finish_reason(finish_reason)
        return {"index": ch.index, "message": message,
                "logprobs": (self.logprobs(ch.lp_tokens, ch.lp_entries, ch.lp_ids) or {"content": []})
                if ch.want_logprobs
                else None,
                "finish_reason": finish_reason, "stop_reason": ch.stop_reason}

    def chunk_choice(self, ch: Choice, text: str, ids: list[int], lps: list, finished: bool,
                     calls: list[dict] | None = None) -> dict:
        delta = {"content": text} if text else {}
        if calls:
            delta["tool_calls"] = calls
        finish_reason = ch.finish_reason if finished else None
        if finished and ch.tools is not None:
            finish_reason = ch.tools.finish_reason(finish_reason)
        return {"index": ch.index, "delta": delta, "logprobs": self.logprobs(ids, lps, ch.lp_ids) if lps else None,
                "finish_reason": finish_reason, "stop_reason": ch.stop_reason if finished else None}

    def first_chunk_choice(self, ch: Choice) -> dict:
        return {"index": ch.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}
