"""One choice's output state and its OpenAI JSON shapes (completion and chat, streamed or not).

Choice.feed() turns the batcher's TokenDeltas into text (via detokenizer.TextStream), finish
reasons and logprobs; CompletionShape / ChatShape render choices and chunks exactly as the
OpenAI API (and vLLM) do. Pure: no sockets, no aiohttp.
"""

from __future__ import annotations

from gateway.detokenizer import TextStream
from gateway.tokenizer import ModelTokenizer
from laneserve.wire.protocol import FinishReason, TokenDelta

FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}


class EngineError(Exception):
    """A request ended with FinishReason.ERROR (worker failure): a 500, not the user's fault."""


class InvalidRequest(Exception):
    """A request ended with FinishReason.INVALID (its own input failed while it ran, e.g. its grammar): a 400."""


class Choice:
    __slots__ = ("index", "request_id", "text", "eos", "finish_reason", "stop_reason", "parts", "want_logprobs",
                 "lp_tokens", "lp_entries", "needs_abort", "first_token_at", "num_cached", "prefix", "stop_ids", "tools",
                 "lp_ids", "last_token_at", "lp_offset")

    def __init__(self, index: int, request_id: str, tok: ModelTokenizer, prompt_ids: list[int], stops: list[str],
                 include_stop_str: bool, skip_special_tokens: bool, want_logprobs: bool, prefix: str = "",
                 stop_ids: tuple[int, ...] = (), tools=None, lp_ids: bool = False):
        self.index = index
        self.request_id = request_id
        self.text = TextStream(tok, prompt_ids, stops, include_stop_str, skip_special_tokens)
        self.eos = tok.eos_token_ids
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.parts: list[str] = [prefix] if prefix else []  # the whole text, for non-streaming answers
        self.prefix = prefix  # echo: the prompt text, sent before the first generated text
        self.want_logprobs = want_logprobs
        self.lp_tokens: list[int] = []
        self.lp_entries: list = []
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
        ids = d.new_token_ids
        before = self.text.num_tokens
        hide_stop_token = d.finish_reason == FinishReason.STOP and bool(ids) and ids[-1] in self.stop_ids
        piece = self.text.add(ids, hide_last=hide_stop_token)
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
                if hide_stop_token and ids[-1] not in self.eos:
                    self.stop_reason = ids[-1]
        if piece:
            self.parts.append(piece)
        if lps:
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


class CompletionShape(_Shape):
    object = "text_completion"
    chunk_object = "text_completion"

    def logprobs(self, ids: list[int], lps: list, offset: int = 0, as_id: bool = False) -> dict | None:
        if not lps:
            return None
        texts = [self.token_text(t) for t in ids]
        offsets, pos = [], offset
        for t in texts:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": [self.token_text(t, True) for t in ids] if as_id else texts,
                "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [self._top(lp, as_id) for lp in lps], "text_offset": offsets}

    def _top(self, lp, as_id: bool) -> dict[str, float]:
        """token -> logprob of the top ones; tokens that decode alike ("\ufffd" pieces) keep an entry each, the
        later ones named "token_id:N"."""
        out: dict[str, float] = {}
        for i, v in zip(lp.top_ids, lp.top_logprobs):
            key = self.token_text(i, as_id)
            out[key if key not in out else self.token_text(i, True)] = v
        return out

    def choice(self, ch: Choice) -> dict:
        return {"index": ch.index, "text": "".join(ch.parts),
                "logprobs": self.logprobs(ch.lp_tokens, ch.lp_entries, len(ch.prefix), ch.lp_ids)
                if ch.want_logprobs else None,
                "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason}

    def chunk_choice(self, ch: Choice, text: str, ids: list[int], lps: list, finished: bool) -> dict:
        logprobs = None
        if lps:  # text_offset counts from the start of the choice's text (the echoed prompt included), as whole
            logprobs = self.logprobs(ids, lps, ch.lp_offset, ch.lp_ids)
            ch.lp_offset += sum(len(self.token_text(t)) for t in ids)
        return {"index": ch.index, "text": text, "logprobs": logprobs,
                "finish_reason": ch.finish_reason if finished else None,
                "stop_reason": ch.stop_reason if finished else None}

    def first_chunk_choice(self, ch: Choice) -> dict | None:
        return {"index": ch.index, "text": ch.prefix, "logprobs": None, "finish_reason": None,
                "stop_reason": None} if ch.prefix else None


class ChatShape(_Shape):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def _entry(self, token_id: int, logprob: float, as_id: bool) -> dict:
        """OpenAI's entry: the token's text (or "token_id:N"), its logprob, and its own bytes (a piece of a UTF-8
        character is that piece, not the U+FFFD its text shows)."""
        return {"token": self.token_text(token_id, as_id), "logprob": logprob,
                "bytes": list(self.tok.token_bytes(token_id))}

    def logprobs(self, ids: list[int], lps: list, as_id: bool = False) -> dict | None:
        if not lps:
            return None
        return {"content": [{**self._entry(t, lp.logprob, as_id),
                             "top_logprobs": [self._entry(i, v, as_id) for i, v in zip(lp.top_ids, lp.top_logprobs)]}
                            for t, lp in zip(ids, lps)]}

    def choice(self, ch: Choice) -> dict:
        message = {"role": "assistant", "content": "".join(ch.parts)}
        finish_reason = ch.finish_reason
        if ch.tools is not None:
            message["content"], calls = ch.tools.calls(message["content"])
            if calls:
                message["tool_calls"] = calls
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
