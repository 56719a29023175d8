"""gateway.tool_calls: hermes, mistral and llama3_json tool calls out of generated text, whole and streamed."""

import json
import subprocess
import sys

import pytest

from gateway.tool_calls import PARSERS, ParsedCall, StreamParser, parse

WEATHER = ParsedCall("get_weather", '{"city": "Paris"}')
TIME = ParsedCall("get_time", '{"tz": "Europe/Paris", "n": 2}')


# ---- hermes ----

def test_hermes_single_call_has_no_content():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert parse("hermes", text) == (None, [WEATHER])


def test_hermes_content_before_and_several_calls_in_order():
    text = ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
            '<tool_call>{"name":"get_time","parameters":{"tz":"Europe/Paris","n":2}}</tool_call>')
    assert parse("hermes", text) == ("Let me check.", [WEATHER, TIME])


def test_hermes_text_after_and_between_calls_is_kept():
    text = ('A <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> B '
            '<tool_call>{"name": "get_time", "arguments": {"tz": "Europe/Paris", "n": 2}}</tool_call> C')
    assert parse("hermes", text) == ("A  B  C", [WEATHER, TIME])


def test_hermes_malformed_block_stays_in_content():
    bad = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    assert parse("hermes", bad) == (bad, [])
    text = bad + '\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert parse("hermes", text) == (bad, [WEATHER])


def test_hermes_block_without_name_or_arguments_is_not_a_call():
    for body in ('{"arguments": {}}', '{"name": "f"}', '{"name": "", "arguments": {}}', '["f", {}]', '"f"'):
        text = f"x <tool_call>{body}</tool_call>"
        assert parse("hermes", text) == (text, [])


def test_hermes_no_call_returns_text_unchanged():
    for text in ("", "  Hello there!  \n", "I like <tool> tags and </tool_call> too", "<tool_call>"):
        assert parse("hermes", text) == (text, [])


def test_hermes_unterminated_final_block_parses_when_its_json_is_complete():
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    assert parse("hermes", text) == ("Sure.", [WEATHER])
    cut = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    assert parse("hermes", cut) == (cut, [])


def test_hermes_unterminated_block_before_another_block_is_text():
    first = '<tool_call>{"name": "get_time", "arguments": {"tz": "Europe/Paris", "n": 2}}'
    second = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert parse("hermes", first + second) == (first, [WEATHER])


def test_hermes_arguments_as_json_string_and_non_ascii():
    text = '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\":  \\"Zürich\\"}"}</tool_call>'
    assert parse("hermes", text) == (None, [ParsedCall("get_weather", '{"city":  "Zürich"}')])
    text = '<tool_call>{"name": "f", "arguments": {"city": "Zürich", "emoji": "\\u2603"}}</tool_call>'
    assert parse("hermes", text)[1] == [ParsedCall("f", '{"city": "Zürich", "emoji": "☃"}')]
    text = '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>'
    assert parse("hermes", text)[1] == [ParsedCall("f", '"not json"')]
    text = '<tool_call>{"name": "f", "arguments": "[1, 2]"}</tool_call>'
    assert parse("hermes", text)[1] == [ParsedCall("f", '"[1, 2]"')]


def test_hermes_round_trips_the_builtin_chatml_template():
    from gateway.tokenizer import tiny_tokenizer

    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]
    for content in ("Checking both.", None):
        prompt = tiny_tokenizer().apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content, "tool_calls": calls}],
            add_generation_prompt=False)
        generated = prompt.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
        assert "<tool_call>" in generated
        assert parse("hermes", generated) == (content, [ParsedCall("get_weather", '{"city": "Paris"}'),
                                                        ParsedCall("get_time", '{"tz": "UTC"}')])


# ---- mistral ----

def test_mistral_json_list_single_and_several():
    text = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    assert parse("mistral", text) == (None, [WEATHER])
    text = ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_time", "arguments": {"tz": "Europe/Paris", "n": 2}}]')
    assert parse("mistral", text) == (None, [WEATHER, TIME])


def test_mistral_content_before_marker():
    text = 'I will look it up. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    assert parse("mistral", text) == ("I will look it up.", [WEATHER])


def test_mistral_newer_name_args_format_repeated():
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz":"Europe/Paris","n":2}'
    assert parse("mistral", text) == (None, [WEATHER, TIME])
    text = 'ok [TOOL_CALLS]get_weather[CALL_ID]abc123XYZ[ARGS]{"city": "Paris"}'
    assert parse("mistral", text) == ("ok", [WEATHER])


def test_mistral_malformed_stays_in_content():
    for text in ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par',
                 '[TOOL_CALLS][]',
                 '[TOOL_CALLS]get_weather{"city": "Paris"}',
                 '[TOOL_CALLS][ARGS]{"city": "Paris"}',
                 'Hi [TOOL_CALLS]get_weather[ARGS]{"city"'):
        assert parse("mistral", text) == (text, [])
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{oops}'
    assert parse("mistral", text) == ("[TOOL_CALLS]get_time[ARGS]{oops}", [WEATHER])


def test_mistral_no_call():
    for text in ("Plain answer [TOOL] here.", "", "[{\"name\": \"get_weather\", \"arguments\": {}}]"):
        assert parse("mistral", text) == (text, [])


# ---- llama3_json ----

def test_llama3_single_call_with_parameters_or_arguments():
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert parse("llama3_json", text) == (None, [WEATHER])
    text = '\n <|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}} \n'
    assert parse("llama3_json", text) == (None, [WEATHER])


def test_llama3_several_calls_separated_by_semicolons():
    text = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "get_time", "parameters": {"tz": "Europe/Paris", "n": 2}};')
    assert parse("llama3_json", text) == (None, [WEATHER, TIME])


def test_llama3_content_before_json_is_plain_content():
    text = 'Here you go: {"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert parse("llama3_json", text) == (text, [])


def test_llama3_malformed_or_non_call_json_is_content():
    for text in ('{"name": "get_weather", "parameters": {"city": ',
                 '{"name": "get_weather", "parameters": {}} and more',
                 '{"name": "get_weather", "parameters": {}}; {"city": "Paris"}',
                 '{"name": "get_weather", "parameters": {}}, {"name": "get_time", "parameters": {}}',
                 '{"answer": 42}',
                 '<|python_tag|>brave_search.call(query="weather")',
                 '<|python_tag|>'):
        assert parse("llama3_json", text) == (text, [])


def test_llama3_no_call():
    for text in ("The weather is fine.", "", "   ", "<b>bold</b>"):
        assert parse("llama3_json", text) == (text, [])


@pytest.mark.parametrize("parser, head", [("hermes", "<tool_call>"), ("mistral", "[TOOL_CALLS]"),
                                          ("llama3_json", "{\"name\": \"f\", \"arguments\": ")])
def test_json_nested_past_the_recursion_limit_is_text_not_an_error(parser, head):
    text = head + "[" * 5000 + "]" * 5000 + "}" * head.count("{")  # a model can write this; Python's json can't read it
    assert parse(parser, text) == (text, [])
    stream = StreamParser(parser)
    streamed = stream.feed(text)
    rest, calls = stream.finish()
    assert streamed + rest == text and calls == []


def test_unknown_parser_is_a_value_error():
    with pytest.raises(ValueError, match="pythonic"):
        parse("pythonic", "x")
    with pytest.raises(ValueError):
        StreamParser("hermes2")


def test_module_imports_no_heavy_dependencies():
    code = ("import sys, gateway.tool_calls; bad = [m for m in ('torch', 'aiohttp', 'zmq', 'batcher', 'workers') "
            "if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---- streaming ----

TEXTS = {
    "hermes": [
        ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
         '<tool_call>{"name":"get_time","parameters":{"tz":"Europe/Paris","n":2}}</tool_call>'),
        ('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call> B <tool_call>'
         '{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> end <tool'),
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',
        "I like <tool> tags, <tool_cal and <<tool_call",
    ],
    "mistral": [
        'I will look it up. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{oops}',
        "Plain [TOOL answer [TOOL_CALL",
    ],
    "llama3_json": [
        (' <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
         '{"name": "get_time", "parameters": {"tz": "Europe/Paris", "n": 2}}'),
        '\n{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '{"name": "get_weather", "parameters": {"city": ',
        " <|python The weather is {fine}.",
    ],
}
CASES = [(p, t) for p, texts in TEXTS.items() for t in texts]


def _stream(parser: str, deltas: list[str]) -> tuple[str, list[ParsedCall], list[str]]:
    sp = StreamParser(parser)
    pieces = [sp.feed(d) for d in deltas]
    rest, calls = sp.finish()
    return "".join(pieces) + rest, calls, pieces


def _check_against_parse(parser: str, text: str, streamed: str, calls: list[ParsedCall]):
    content, expected = parse(parser, text)
    assert calls == expected
    if expected:
        assert (streamed.strip() or None) == content
    else:
        assert streamed == text == content


def test_every_parser_has_stream_cases():
    assert set(TEXTS) == set(PARSERS) and all(len(texts) >= 2 for texts in TEXTS.values())


@pytest.mark.parametrize("parser,text", CASES)
def test_stream_matches_parse_at_every_split_point(parser, text):
    for i in range(len(text) + 1):
        streamed, calls, _ = _stream(parser, [text[:i], text[i:]])
        _check_against_parse(parser, text, streamed, calls)


@pytest.mark.parametrize("parser,text", CASES)
def test_stream_matches_parse_at_every_pair_of_split_points(parser, text):
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 3):
            streamed, calls, _ = _stream(parser, [text[:i], text[i:j], text[j:]])
            _check_against_parse(parser, text, streamed, calls)


@pytest.mark.parametrize("parser,text", CASES)
def test_stream_char_by_char_matches_parse_and_never_streams_a_marker(parser, text):
    streamed, calls, pieces = _stream(parser, list(text))
    _check_against_parse(parser, text, streamed, calls)
    if calls:
        assert not any(m in "".join(pieces) for m in ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "{"))


def test_stream_content_before_a_call_is_streamed_before_finish():
    text = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    _, calls, pieces = _stream("hermes", list(text))
    assert "".join(pieces) == "Let me check. " and calls == [WEATHER]
    # the held-back "<tool_cal" prefix never reached the client
    assert all("<" not in p for p in pieces)


def test_marker_prefix_that_turns_out_to_be_text_streams_as_content():
    sp = StreamParser("hermes")
    assert sp.feed("Hello <tool") == "Hello "
    assert sp.feed("s are fun") == "<tools are fun"
    assert sp.finish() == ("", [])
    sp = StreamParser("mistral")
    assert sp.feed("see [TOOL") == "see "
    assert sp.feed("S] list") == "[TOOLS] list"
    assert sp.finish() == ("", [])


def test_held_back_prefix_is_returned_by_finish():
    sp = StreamParser("hermes")
    assert sp.feed("ends with <tool_c") == "ends with "
    assert sp.finish() == ("<tool_c", [])


def test_llama3_stream_holds_leading_whitespace_until_decided():
    sp = StreamParser("llama3_json")
    assert sp.feed("  ") == ""
    assert sp.feed("<|pyt") == ""
    assert sp.feed("hon is great") == "  <|python is great"
    assert sp.feed(" {x}") == " {x}"
    assert sp.finish() == ("", [])
    sp = StreamParser("llama3_json")
    assert sp.feed(' {"name": "get_weather", ') == ""
    assert sp.feed('"parameters": {"city": "Paris"}}') == ""
    assert sp.finish() == ("", [WEATHER])


def test_stream_malformed_buffered_block_comes_back_as_content():
    text = 'Hi <tool_call>{"name": "get_weather", "arguments": {"city": '
    sp = StreamParser("hermes")
    assert sp.feed(text) == "Hi "
    assert sp.finish() == (text[3:], [])


def test_stream_arguments_are_valid_json():
    for parser, text in CASES:
        for call in _stream(parser, list(text))[1]:
            assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize("parser, text", [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"x": -Infinity}'),
    ("llama3_json", '{"name": "f", "parameters": {"x": NaN}}'),
])
def test_python_json_constants_are_not_arguments(parser, text):
    """NaN and Infinity are Python's JSON extensions, not JSON: a client's parser would refuse such arguments, so
    the block stays content (no call)."""
    assert parse(parser, text) == (text, [])
