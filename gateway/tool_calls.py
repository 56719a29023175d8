"""Tool calls out of a chat model's generated text, like vLLM's ``--tool-call-parser`` (hermes, mistral, llama3_json).

``parse(parser, text)`` splits a finished text into content and calls; ``StreamParser`` does the same incrementally,
streaming content until a tool-call marker may have begun and buffering from there to ``finish()``.

Content rule: the kept text (everything outside well-formed call blocks, in order) is joined as is. With no call
found, ``parse`` returns the text unchanged; with calls, it returns the kept text ``.strip()``-ed, or None if empty.
A stream's feed() returns plus finish()'s content concatenate to exactly the unstripped kept text, so
``streamed == text`` when no call was found, else ``(streamed.strip() or None) == content``.
"""

import json
import re
from dataclasses import dataclass

PARSERS = ("hermes", "mistral", "llama3_json")

_HERMES_START = "<tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|(?=<tool_call>)|\Z)", re.DOTALL)
_MISTRAL_START = "[TOOL_CALLS]"
_PYTHON_TAG = "<|python_tag|>"


@dataclass
class ParsedCall:
    """One tool call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


def _arguments(value) -> str:
    """JSON text of the arguments: a string that is JSON object text is kept as is, anything else is dumped."""
    if isinstance(value, str):
        try:
            if isinstance(_json(value), dict):
                return value
        except ValueError:
            pass
    return json.dumps(value, ensure_ascii=False)


def _call(obj) -> ParsedCall | None:
    """A call from a decoded {"name", "arguments"|"parameters"} object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = "arguments" if "arguments" in obj else "parameters" if "parameters" in obj else None
    return None if key is None else ParsedCall(obj["name"], _arguments(obj[key]))


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


# Every parser's JSON: without Python's NaN and Infinity extensions, which are not JSON (a client's parser would
# refuse arguments holding them, so such text stays content): ValueError
_DECODER = json.JSONDecoder(parse_constant=_no_constant)
_json = _DECODER.decode


def _loads(text: str):
    """The JSON value of text, or None."""
    try:
        return _json(text)
    except ValueError:
        return None


def _split_hermes(text: str) -> tuple[list[str], list[ParsedCall]]:
    kept, calls, pos = [], [], 0
    for m in _HERMES_BLOCK.finditer(text):
        # a block must be closed, or be the unterminated last one (generation cut after its JSON)
        call = _call(_loads(m.group(1))) if m.group(2) or m.end() == len(text) else None
        if call is not None:
            kept.append(text[pos:m.start()])
            calls.append(call)
            pos = m.end()
    kept.append(text[pos:])
    return kept, calls


def _mistral_block(block: str) -> list[ParsedCall] | None:
    """Calls of the text after one [TOOL_CALLS]: a JSON list (or object), or ``name[ARGS]{json}``."""
    block = block.strip()
    if block[:1] in ("[", "{"):
        objs = _loads(block)
        calls = [_call(o) for o in (objs if isinstance(objs, list) else [objs])]
        return calls if calls and None not in calls else None
    name, _, args = block.partition("[ARGS]")  # no [ARGS]: args is "", not JSON
    name = name.split("[CALL_ID]")[0].strip()  # newer tokenizers put a call id between name and [ARGS]
    try:
        return [ParsedCall(name, _arguments(_json(args)))]
    except ValueError:
        return None


def _split_mistral(text: str) -> tuple[list[str], list[ParsedCall]]:
    head, *blocks = text.split(_MISTRAL_START)
    kept, calls = [head], []
    for block in blocks:
        got = _mistral_block(block)
        if got is None:
            kept.append(_MISTRAL_START + block)
        else:
            calls.extend(got)
    return kept, calls


def _split_llama3_json(text: str) -> tuple[list[str], list[ParsedCall]]:
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].lstrip()
    elif not body.startswith("{"):
        return [text], []
    calls, pos = [], 0
    while pos < len(body):  # one object, or several separated by ';' (a trailing ';' is allowed)
        try:
            obj, pos = _DECODER.raw_decode(body, pos)
        except ValueError:
            return [text], []
        call = _call(obj)
        rest = body[pos:].lstrip()
        if call is None or (rest and rest[0] != ";"):
            return [text], []
        calls.append(call)
        pos = len(body) - len(rest[1:].lstrip())
    return ([], calls) if calls else ([text], [])


_SPLIT = {"hermes": _split_hermes, "mistral": _split_mistral, "llama3_json": _split_llama3_json}


def _splitter(parser: str):
    if parser not in _SPLIT:
        raise ValueError(f"unknown tool-call parser {parser!r}; supported: {', '.join(PARSERS)}")
    return _SPLIT[parser]


def _split_safely(split, text: str) -> tuple[list[str], list[ParsedCall]]:
    """split(text), with JSON nested past Python's recursion limit (a model can write `[[[[...`) as no call."""
    try:
        return split(text)
    except RecursionError:
        return [text], []


def parse(parser: str, text: str) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a finished generation; ``(text, [])`` when it holds no well-formed call."""
    kept, calls = _split_safely(_splitter(parser), text)
    if not calls:
        return text, []
    return "".join(kept).strip() or None, calls


class StreamParser:
    """Incremental ``parse``: feed() returns the content safe to stream now, finish() the rest and the calls."""

    def __init__(self, parser: str):
        self._split = _splitter(parser)
        self._parser = parser
        self._pending = ""  # content held back: it may be the start of a marker
        self._buffer: str | None = None  # everything from the first marker on, once one has started
        self._plain = False  # llama3_json: the text is known not to be a call, stream everything

    def feed(self, delta: str) -> str:
        """Add generated text; return the content that can be streamed now."""
        if self._buffer is not None:
            self._buffer += delta
            return ""
        if self._plain:
            return delta
        text = self._pending + delta
        if self._parser == "llama3_json":  # a call only when the whole (stripped) text starts like one
            head = text.lstrip()
            if head.startswith(("{", _PYTHON_TAG)):
                self._buffer, self._pending = text, ""
            elif _PYTHON_TAG.startswith(head):
                self._pending = text
            else:
                self._plain, self._pending = True, ""
                return text
            return ""
        marker = _HERMES_START if self._parser == "hermes" else _MISTRAL_START
        at = text.find(marker)
        if at >= 0:
            self._buffer, self._pending = text[at:], ""
            return text[:at]
        hold = next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-k:])), 0)
        self._pending = text[len(text) - hold:]
        return text[:len(text) - hold]

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """End of generation: (content not yet streamed, all calls found)."""
        if self._buffer is None:
            rest, self._pending = self._pending, ""
            return rest, []
        kept, calls = _split_safely(self._split, self._buffer)
        self._buffer = None
        return "".join(kept), calls
