"""Structured output and tool calls at the edge (docs/structured_output.md).

- `constraint(req, parser)`: what a request asks of its output, from OpenAI's response_format, vLLM's guided_json
  / guided_regex / guided_choice / guided_grammar / structured_outputs, and a chat request's tools with
  tool_choice: an llguidance grammar (P.AddRequest.grammar), checked here so that a bad schema, regex or grammar
  is a 400 naming its field. The batcher compiles it and masks each step's tokens (batcher/grammar.py).
- `ToolOutput`: one chat choice's generated text as OpenAI tool calls, streamed or whole: the arguments of a
  named function (tool_choice {"type": "function", ...}), the JSON list of calls that tool_choice "required"
  constrains the model to, or, with tool_choice "auto", the calls the --tool-call-parser finds in free text
  (gateway/tool_calls.py).

Must not import torch.
"""

from __future__ import annotations

import json
import random
import string
import uuid
from dataclasses import dataclass
from functools import lru_cache

import llguidance as llg

from gateway import tool_calls
from gateway.errors import bad_request

_FORMATS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
ALPHANUMERIC = string.ascii_letters + string.digits


@dataclass
class Constraint:
    grammar: str  # llguidance's grammar text ("" = none: tool_choice auto parses free text)
    tools: str = ""  # "named" | "required" | "auto" when the output is tool calls
    tool_name: str = ""  # named: the function
    parallel: bool = True  # parallel_tool_calls
    param: str = ""  # the request field the grammar comes from (for a 400)
    source: str = ""  # the text it was made from (choices, regex, grammar, schema): checked for special-token text


def constraint(req, parser: str = "") -> Constraint | None:
    """The output constraint of a completion or chat request (None: free text, and no tool calls to parse). Its
    grammar is not checked yet: check() it off the event loop (a large schema takes a while)."""
    asked = _asked(req)
    tools = _tool_mode(req, parser)
    if tools is not None and tools.tools != "auto":
        asked.append(("tool_choice", tools.grammar, ""))  # (the tools' own text is checked with the messages)
    if len(asked) > 1:
        raise bad_request(f"{' and '.join(p for p, *_ in asked)} both constrain the output; give one.",
                          param=asked[1][0])
    if not asked:
        return tools  # None, or auto: free text parsed for calls
    param, grammar, source = asked[0]
    if tools is None:
        return Constraint(grammar, param=param, source=source)
    if tools.tools == "auto":  # free text held to a grammar, then parsed for calls
        tools.grammar, tools.param, tools.source = grammar, param, source
    return tools  # (required or named: the tools' schemas' grammar, a refusal naming "tools")


def _asked(req) -> list[tuple[str, str, str]]:
    """(param, grammar, the text it is made from) for each structured-output field the request sets."""
    asked = []
    fmt = req.response_format
    if fmt is not None:
        kind = fmt.get("type")
        if kind is None:
            raise bad_request("response_format needs a type: text, json_object or json_schema.",
                              param="response_format")
        if kind == "json_object":
            asked.append(("response_format", _json_grammar({"type": "object"}, "response_format"), ""))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise bad_request("response_format.json_schema must be an object with a 'schema' object.",
                                  param="response_format")
            schema = spec.get("schema") or {}
            asked.append(("response_format", _json_grammar(schema, "response_format"), _schema_text(schema)))
        elif kind != "text":
            raise bad_request(f"response_format type must be text, json_object or json_schema, got {kind!r}.",
                              param="response_format")
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            asked.append((name, *_grammar(kind, value, name)))
    so = req.structured_outputs
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("structured_outputs must be an object.", param="structured_outputs")
        given = {k: v for k, v in so.items() if v is not None and v is not False}
        unknown = sorted(set(given) - {"json", "regex", "choice", "grammar", "json_object"})
        if unknown:
            raise bad_request(f"structured_outputs.{unknown[0]} is not supported; json, regex, choice, grammar and "
                              "json_object are.", param="structured_outputs", code="unsupported_parameter")
        if len(given) != 1:
            raise bad_request("structured_outputs must set exactly one of json, regex, choice, grammar, json_object.",
                              param="structured_outputs")
        (kind, value), = given.items()
        if kind == "json_object" and value is not True:
            raise bad_request("structured_outputs.json_object must be true.", param="structured_outputs")
        grammar, text = (_json_grammar({"type": "object"}, "structured_outputs"), "") if kind == "json_object" else \
            _grammar(kind, value, "structured_outputs")
        asked.append(("structured_outputs", grammar, text))
    return asked


def _grammar(kind: str, value, param: str) -> tuple[str, str]:
    """(the grammar, the text it holds) of a guided_* / structured_outputs value. The text is for the special-token
    check: choices, a schema's JSON, a regex or grammar with its backslashes dropped (`<\\|im_end\\|>`; a character
    class or a hex escape still hides a special token's text)."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except (ValueError, RecursionError):
                raise bad_request(f"{param} must be a JSON schema (an object, or its JSON text).",
                                  param=param) from None
        if not isinstance(value, dict):
            raise bad_request(f"{param} must be a JSON schema object.", param=param)
        return _json_grammar(value, param), _schema_text(value)
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise bad_request(f"{param} must be a non-empty list of non-empty strings.", param=param)
        return llg.grammar_from("choice", json.dumps(value)), "\n".join(value)
    if not (isinstance(value, str) and value):
        raise bad_request(f"{param} must be a non-empty string.", param=param)
    try:
        return llg.grammar_from(_FORMATS[kind], value), value.replace("\\", "")
    except ValueError as exc:  # a GBNF grammar that does not convert
        raise bad_request(f"{param}: {exc}", param=param) from None


def _schema_text(schema: dict) -> str:
    return json.dumps(schema, ensure_ascii=False)  # (non-ASCII as itself: a special token's text may be)


# JSON as json.dumps writes it: whitespace anywhere else lets a model pad its output (a small one loops on it)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _json_grammar(schema: dict, param: str) -> str:
    try:
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise bad_request(f"{param}: not a usable JSON schema: {exc}", param=param) from None


def check(c: Constraint) -> None:
    """400 naming the field when llguidance refuses the grammar."""
    why = _refusal(c.grammar) if c.grammar else ""
    if why:
        raise bad_request(f"{c.param}: {why}", param=c.param)


@lru_cache(maxsize=256)
def _refusal(grammar: str) -> str:
    """Why llguidance refuses the grammar ('' = it compiles); cached, since clients resend the same schemas."""
    return llg.LLMatcher.validate_grammar(grammar)


# ---------------------------------------------------------------- tools
def _tool_mode(req, parser: str) -> Constraint | None:
    """A chat request's tool calling: None when it may not call tools (no tools, or tool_choice none)."""
    tools = getattr(req, "tools", None)
    choice = getattr(req, "tool_choice", None)
    if not tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools.", param="tool_choice")
        return None
    parallel = req.parallel_tool_calls is not False
    if choice is None or choice == "auto":
        if not parser:
            raise bad_request("tool_choice auto (the default with tools) needs the server's --tool-call-parser; send "
                              "tool_choice 'required', a named function or 'none'.", param="tool_choice",
                              code="unsupported_parameter")
        return Constraint("", "auto", parallel=parallel)
    if choice == "none":
        return None
    functions = {t["function"]["name"]: t["function"] for t in tools}
    if choice == "required":
        try:
            calls = _required_calls(functions)
        except RecursionError:
            raise bad_request("a tool's parameters schema nests too deeply.", param="tools") from None
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not parallel:
            schema["maxItems"] = 1
        return Constraint(_json_grammar(schema, "tools"), "required", parallel=parallel, param="tools")
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or (isinstance(choice, dict) and choice.get("type", "function") != "function"):
        raise bad_request("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                          "{'name': str}}.", param="tool_choice")
    if name not in functions:
        raise bad_request(f"tool_choice names {name!r}, which is not among the tools.", param="tool_choice")
    schema = functions[name].get("parameters") or {"type": "object"}
    return Constraint(_json_grammar(schema, "tools"), "named", name, parallel, "tools")


def _required_calls(functions: dict) -> list[dict]:
    """tool_choice required: the schema of one call of each function, its parameters' $refs rebased."""
    return [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
             "properties": {"name": {"type": "string", "enum": [name]},
                            "parameters": _rebase(fn.get("parameters") or {"type": "object"},
                                                  f"/items/anyOf/{i}/properties/parameters")}}
            for i, (name, fn) in enumerate(functions.items())]


def _rebase(schema, prefix: str):
    """A tool's parameters schema moved under `prefix` of a bigger one: its local "$ref" pointers, "#/..." (to its
    own $defs, as pydantic writes them) and "#" (itself, a recursive schema), rewritten to point there. A subschema
    with an "$id" of its own is kept as it is: its pointers resolve against that $id, wherever it sits."""
    if isinstance(schema, dict):
        if "$id" in schema:
            return schema
        return {k: (("#" + prefix + v[1:]) if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/"))
                    else _rebase(v, prefix)) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebase(v, prefix) for v in schema]
    return schema


class ToolOutput:
    """One chat choice's text as tool calls. Streaming: feed() each text piece -> (content to send, tool-call
    deltas to send); finish() -> the same for what was held back. Whole: calls(text) -> (content, calls)."""

    def __init__(self, c: Constraint, parser: str):
        self.c = c
        self.parser = parser
        self.stream = tool_calls.StreamParser(parser) if c.tools == "auto" else None
        self.named_sent = False
        self.held: list[str] = []  # required: the JSON list, parsed at the end
        self.called = False  # calls were found (finish_reason tool_calls, but for a named function: stop)

    def _call(self, name: str, arguments: str, index: int) -> dict:
        # Mistral's chat templates take back only 9-character alphanumeric call ids (vLLM's mistral parser makes
        # such ones): a client sending the calls back with their results would get a 400 from the template
        call_id = "".join(random.choices(ALPHANUMERIC, k=9)) if self.parser == "mistral" else \
            f"call_{uuid.uuid4().hex[:24]}"
        return {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: tool_calls when the model stopped after calling tools (a named function's call: stop)."""
        return "tool_calls" if self.called and reason == "stop" and self.c.tools != "named" else reason

    def calls(self, text: str) -> tuple[str | None, list[dict]]:
        """-> (content, tool calls) of a whole text, each call with its stream delta's "index" (a whole message
        leaves it out: ChatShape.choice)."""
        content, calls = self._calls(text)
        self.called = bool(calls)
        return content, calls

    def _calls(self, text: str) -> tuple[str | None, list[dict]]:
        if self.c.tools == "named":
            return None, [self._call(self.c.tool_name, text, 0)]
        if self.c.tools == "required":
            try:  # the grammar's list of calls, unless max_tokens cut it or it nests past Python's recursion limit
                return None, [self._call(it["name"], json.dumps(it["parameters"], ensure_ascii=False), i)
                              for i, it in enumerate(json.loads(text))]
            except (ValueError, RecursionError):
                return text, []
        content, found = tool_calls.parse(self.parser, text)
        return content, self._parsed(found)

    def _parsed(self, found: list[tool_calls.ParsedCall]) -> list[dict]:
        """The calls a parser found, as OpenAI's (the first only, with parallel_tool_calls false)."""
        return [self._call(f.name, f.arguments, i) for i, f in enumerate(found if self.c.parallel else found[:1])]

    def feed(self, piece: str) -> tuple[str, list[dict]]:
        if self.c.tools == "named":  # the arguments stream as they come
            if not self.named_sent:
                self.named_sent = True
                return "", [self._call(self.c.tool_name, piece, 0)]
            return "", [{"index": 0, "function": {"arguments": piece}}] if piece else []
        if self.c.tools == "required":
            self.held.append(piece)
            return "", []
        return self.stream.feed(piece), []

    def finish(self) -> tuple[str, list[dict]]:
        if self.c.tools == "named":
            return "", [] if self.named_sent else [self._call(self.c.tool_name, "", 0)]
        if self.c.tools == "required":
            content, calls = self.calls("".join(self.held))
            return content or "", calls
        content, found = self.stream.finish()
        calls = self._parsed(found)
        self.called = bool(calls)
        return content, calls
