"""Token ids -> text, incrementally, for one choice: no broken UTF-8, no leaked stop strings.

IncrementalDetokenizer follows vLLM's prefix/read offsets: text is emitted only when decoding
the new tokens in the context of a few previous ones grows the text and does not end in U+FFFD
(a partial multi-byte character waits for its remaining bytes). StopStrings holds back the last
len(longest stop) - 1 characters so a stop string split across chunks is still caught and never
reaches the client. TextStream joins the two per choice. Pure: no I/O, no zmq, no aiohttp.
"""

from __future__ import annotations

from gateway.tokenizer import ModelTokenizer

PROMPT_CONTEXT = 5  # prompt tokens decoded with the first outputs (leading-space rules of SentencePiece)
REPLACEMENT = "\ufffd"
# Tokens held without text before the held ones are emitted anyway (as U+FFFD, or nothing for skipped special tokens),
# but the last CHAR_TOKENS (a UTF-8 character's bytes but one: a character still to complete). Without it a run of
# tokens that never decodes (lone continuation bytes, skipped special tokens) is decoded again at every step over a
# growing window: quadratic, on the gateway's event loop (4k such tokens: 0.6 s; 256 choices of 8k: minutes).
MAX_HELD = 8
CHAR_TOKENS = 3


class IncrementalDetokenizer:
    def __init__(self, tok: ModelTokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True):
        self.tok = tok
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list((prompt_ids or [])[-PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def step(self, token_id: int) -> str:
        """Append one token; return the text it completes (often '' for a partial character). A special token that
        decoding skips is not kept: it adds no text, and held it would count toward MAX_HELD, flushing a character
        still to complete as U+FFFD."""
        if self.skip_special_tokens and self.tok.is_special(token_id):
            return ""
        self.ids.append(token_id)
        decode = self.tok.decode
        prefix_text = decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        new_text = decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            # Keep the context window short: decoding cost stays per-token, not per-sequence.
            return new_text[len(prefix_text):]
        if len(self.ids) - self.read_offset > MAX_HELD:
            upto = len(self.ids) - CHAR_TOKENS
            text = decode(self.ids[self.prefix_offset:upto], self.skip_special_tokens)
            self.prefix_offset, self.read_offset = self.read_offset, upto
            return text[len(prefix_text):] if text.startswith(prefix_text) else ""
        return ""

    def flush(self) -> str:
        """At the end: whatever is still held (an incomplete character decodes to U+FFFD)."""
        if self.read_offset >= len(self.ids):
            return ""
        prefix_text = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        new_text = self.tok.decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text):] if new_text.startswith(prefix_text) else new_text


class StopStrings:
    """Cuts the output at the first stop string; holds back just enough text to see split ones."""

    def __init__(self, stops: list[str], include_stop_str: bool = False):
        self.stops = [s for s in stops if s]
        self.include_stop_str = include_stop_str
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.fresh = 0  # a match must end past pending[:fresh] (text pushed with match False)
        self.matched: str | None = None

    def push(self, text: str, match: bool = True) -> str:
        """Feed text; return what is safe to emit. After a match, `matched` is set and nothing more is emitted.
        match False (the first min_tokens tokens' text): nothing matches yet, and later only a stop string that ends
        in later text (vLLM's rule: one that begins in the held-back tail is still found)."""
        if self.matched is not None or not text:
            return ""
        if not self.stops:
            return text
        self.pending += text
        if not match:
            self.fresh = len(self.pending)
        # pending = held tail (< longest stop) + new text: a match can start anywhere in it.
        best, best_stop = -1, None
        for s in self.stops if match else ():
            i = self.pending.find(s, max(0, self.fresh - len(s) + 1))
            if i != -1 and (best == -1 or i < best):
                best, best_stop = i, s
        if best_stop is not None:
            self.matched = best_stop
            out = self.pending[:best + (len(best_stop) if self.include_stop_str else 0)]
            self.pending = ""
            return out
        cut = len(self.pending) - self.hold
        if cut <= 0:
            return ""
        out, self.pending = self.pending[:cut], self.pending[cut:]
        self.fresh = max(0, self.fresh - cut)
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.matched is not None else self.pending), ""
        return out


class TextStream:
    """One choice's text: tokens in, safe text out; `stop_str` is set when a stop string ended it."""

    def __init__(self, tok: ModelTokenizer, prompt_ids: list[int] | None, stops: list[str] | None = None,
                 include_stop_str: bool = False, skip_special_tokens: bool = True, min_tokens: int = 0):
        self.detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens)
        self.stops = StopStrings(stops or [], include_stop_str)
        self.min_tokens = min_tokens  # stop strings end the text only once more tokens than this were generated
        self.num_tokens = 0  # tokens consumed (counted in usage), including a hidden stop token

    @property
    def stop_str(self) -> str | None:
        return self.stops.matched

    def add(self, token_ids: list[int], hide_last: bool = False) -> str:
        """Consume tokens until a stop string matches; hide_last: the last one is a stop token (no text)."""
        out = []
        last = len(token_ids) - 1
        for i, t in enumerate(token_ids):
            self.num_tokens += 1
            if hide_last and i == last:
                break
            piece = self.detok.step(t)
            if piece:
                out.append(self.stops.push(piece, self.num_tokens > self.min_tokens))
                if self.stops.matched is not None:
                    break
        return "".join(out)

    def finish(self) -> str:
        """The held-back tail once the choice is over (empty if a stop string cut it)."""
        if self.stops.matched is not None:
            return ""
        return self.stops.push(self.detok.flush()) + self.stops.flush()
