"""Structured output and tool calling (docs/structured_output.md): the request's constraint as a grammar (gateway),
its matcher and per-step token masks (batcher, in simulated time), the masks applied in sampling (worker), and the
whole stack through the openai SDK and LangChain, on the tiny random-weight model: whatever the weights, the output
follows the grammar.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import llguidance as llg
import msgspec
import pytest
import torch

from batcher.config import BatcherConfig
from batcher.grammar import Grammars
from batcher.scheduler import Scheduler
from gateway import schemas as S
from gateway import structured
from gateway.errors import ApiError
from gateway.tokenizer import load_tokenizer
from laneserve.wire.protocol import AddRequest, FinishReason, SamplingParams, Vocabulary
from tests.stack import Stack
from tests.test_async_scheduling import AsyncDriver
from tests.test_scheduler import Driver
from workers.sampling import SampleRow, sample

BS = 16
TOK = load_tokenizer("tiny")
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "ok", "n"],
          "properties": {"answer": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search the documents.", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["q"],
    "properties": {"q": {"type": "string", "maxLength": 6}}}}},
    {"type": "function", "function": {"name": "now", "parameters": {
        "type": "object", "additionalProperties": False, "properties": {}}}}]
HERMES_CALL = '<tool_call>{"name": "search", "arguments": {"q": "Bingley"}}</tool_call>'


def chat(**kw) -> S.ChatRequest:
    return S.parse(json.dumps({"messages": [{"role": "user", "content": "hi"}], **kw}).encode(), S.ChatRequest)


def completion(**kw) -> S.CompletionRequest:
    return S.parse(json.dumps({"prompt": "hi", **kw}).encode(), S.CompletionRequest)


def matcher(grammar: str) -> llg.LLMatcher:
    lt = llg.LLTokenizer(TOK.tokenizer.to_str(), n_vocab=TOK.vocab_size, eos_token=list(TOK.eos_token_ids))
    return llg.LLMatcher(lt, grammar)


def accepts(grammar: str, text: str) -> bool:
    m = matcher(grammar)
    return m.consume_tokens(TOK.encode(text, add_special_tokens=False)) and m.is_accepting()


# ---------------------------------------------------------------- gateway: the request's grammar
@pytest.mark.parametrize("req, good, bad", [
    (chat(response_format={"type": "json_object"}), '{"a": [1, 2]}', "[1]"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}),
     '{"answer": "yes", "ok": true, "n": 7}', '{"answer": "yes", "ok": true, "n": 700}'),
    (completion(guided_json=SCHEMA), '{"answer": "", "ok": false, "n": 0}', '{"ok": false, "n": 0}'),
    (completion(guided_json=json.dumps({"type": "array", "items": {"type": "integer"}})), "[1, 2]", '["1"]'),
    (completion(guided_regex=r"[0-9]{3}-[a-c]+"), "123-ab", "12-ab"),
    (completion(guided_choice=["yes", "no way"]), "no way", "no"),
    (completion(guided_grammar='root ::= "a" ("," "a")*'), "a,a,a", "a,"),
    (completion(guided_grammar='start: "x" NUM\nNUM: /[0-9]+/'), "x42", "x"),
    (completion(structured_outputs={"choice": ["red", "blue"]}), "blue", "green"),
    (completion(structured_outputs={"json_object": True}), "{}", "1"),
    (chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "search"}}), '{"q": "abc"}',
     '{"q": "abcdefgh"}'),
    (chat(tools=TOOLS, tool_choice="required"), '[{"name": "now", "parameters": {}}]', "[]"),
    (chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), '[{"name": "now", "parameters": {}}]',
     '[{"name": "now", "parameters": {}}, {"name": "now", "parameters": {}}]'),
])
def test_each_kind_of_constraint_becomes_a_grammar_that_holds_the_output_to_it(req, good, bad):
    c = structured.constraint(req)
    structured.check(c)
    assert accepts(c.grammar, good) and not accepts(c.grammar, bad)


BAD_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "array", "minItems": -1}}}]


@pytest.mark.parametrize("req, param", [
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}),
     "response_format"),
    (chat(response_format={"type": "json_schema"}), "response_format"),
    (chat(response_format={"type": "yaml"}), "response_format"),
    (completion(guided_json="{not json"), "guided_json"),
    (completion(guided_regex="(("), "guided_regex"),
    (completion(guided_regex=""), "guided_regex"),
    (completion(guided_choice=[]), "guided_choice"),
    (completion(guided_choice=["a", 1]), "guided_choice"),
    (completion(guided_grammar="root ::= ("), "guided_grammar"),
    (completion(guided_regex="a", guided_choice=["a"]), "guided_choice"),
    (completion(structured_outputs={"structural_tag": "x"}), "structured_outputs"),
    (completion(structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs"),
    (chat(tools=TOOLS), "tool_choice"),  # auto needs --tool-call-parser
    (chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (chat(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (chat(tool_choice="required"), "tool_choice"),
    (chat(tools=TOOLS, tool_choice="required", guided_regex="a"), "tool_choice"),
    (chat(tools=TOOLS, tool_choice={"type": "function", "function": "search"}), "tool_choice"),
    (chat(tools=BAD_TOOLS, tool_choice="required"), "tools"),  # (a schema llguidance refuses: the tools' fault)
    (chat(tools=BAD_TOOLS, tool_choice={"type": "function", "function": {"name": "f"}}), "tools"),
    (completion(guided_json="[" * 50000), "guided_json"),
])
def test_a_bad_or_conflicting_constraint_is_a_400_naming_its_field(req, param):
    with pytest.raises(ApiError) as e:
        S.chat_tools(getattr(req, "tools", None))
        structured.check(structured.constraint(req))
    assert e.value.status == 400 and e.value.param == param


# ---------------------------------------------------------------- worker: masks in sampling
def test_sampling_takes_only_tokens_the_mask_allows():
    logits = torch.randn(4, 70)
    mask = torch.zeros(3, dtype=torch.int32)
    for t in (5, 40, 66):
        mask[t // 32] |= 1 << (t % 32)
    m = mask.numpy().tobytes()
    rows = [SampleRow(SamplingParams(temperature=0.0), [1], 1, allowed=m),
            SampleRow(SamplingParams(temperature=1.0, top_k=2), [1], 1, allowed=m),
            SampleRow(SamplingParams(temperature=0.0), [1], 1),
            SampleRow(SamplingParams(temperature=1.0, seed=3), [1], 1, allowed=m)]
    for _ in range(20):
        tokens, _ = sample(logits, rows)
        assert tokens[0] == max((5, 40, 66), key=lambda t: logits[0, t])
        assert tokens[1] in (5, 40, 66) and tokens[3] in (5, 40, 66)
        assert tokens[2] == int(logits[2].argmax())


def test_a_masked_rows_logprobs_are_of_the_tokens_the_grammar_allows():
    """vLLM masks the logits before its sampler, so its raw logprobs are the allowed tokens' (a review found
    ours listing forbidden tokens as the top ones)."""
    logits = torch.tensor([[5.0, 1.0, 0.0, 3.0], [5.0, 1.0, 0.0, 3.0]])
    m = torch.tensor([0b0110], dtype=torch.int32).numpy().tobytes()  # tokens 1 and 2
    rows = [SampleRow(SamplingParams(temperature=0.0, logprobs=2), [1], 1, allowed=m),
            SampleRow(SamplingParams(temperature=0.0, logprobs=1), [1], 1)]
    tokens, lps = sample(logits.clone(), rows)
    allowed = torch.tensor([1.0, 0.0]).log_softmax(-1)
    assert tokens == [1, 0] and lps[0].top_ids == [1, 2] and lps[0].logprob == pytest.approx(allowed[0].item())
    assert lps[0].top_logprobs == pytest.approx(allowed.tolist())
    assert lps[1].top_ids == [0] and lps[1].logprob == pytest.approx(logits[1].log_softmax(-1)[0].item())


# ---------------------------------------------------------------- batcher: matchers and masks, simulated time
def grammars() -> Grammars:
    g = Grammars()
    g.set_vocabulary(Vocabulary(tokenizer_json=TOK.tokenizer.to_str(), vocab_size=TOK.vocab_size,
                                eos_token_ids=list(TOK.eos_token_ids)))
    return g


JSON_GRAMMAR = structured.constraint(completion(guided_json=SCHEMA)).grammar


def run_mixed(driver_cls, pool: int, **config) -> tuple[Driver, list[str]]:
    """8 plain requests and 4 that follow SCHEMA, stop token = the tiny model's eos."""
    g = grammars()
    s = Scheduler(dataclasses.replace(BatcherConfig(), **config), pool, BS, 4096, grammars=g)
    d = driver_cls(s)
    constrained = []
    for i in range(12):
        rid = f"r{i}"
        params = SamplingParams(max_tokens=120 if i % 3 == 0 else 30, stop_token_ids=TOK.eos_token_ids)
        grammar = g.compile(JSON_GRAMMAR) if i % 3 == 0 else None
        if grammar is not None:
            constrained.append(rid)
        s.add_request(AddRequest(request_id=rid, prompt_token_ids=[(7 * i + j) % 250 for j in range(40 + 9 * i)],
                                 params=params, arrival_time=0.0), grammar=grammar)
    d.run()
    assert s.num_constrained == 0
    return d, constrained


@pytest.mark.parametrize("driver_cls, pool", [(Driver, 512), (AsyncDriver, 512), (AsyncDriver, 24)])
def test_constrained_requests_follow_the_grammar_beside_plain_ones_even_when_preempted(driver_cls, pool):
    d, constrained = run_mixed(driver_cls, pool, max_num_batched_tokens=256)
    for rid in constrained:
        assert d.finish[rid] == FinishReason.STOP, rid  # the grammar ended it (the schema is short)
        jsonschema.validate(json.loads(TOK.decode(d.tokens[rid])), SCHEMA)
    for rid in set(d.tokens) - set(constrained):
        assert len(d.tokens[rid]) == 30 and d.finish[rid] == FinishReason.LENGTH
    # a constrained request never has a mask while a token of its is still being sampled (its mask follows from
    # that token), and only rows that sample carry one (SimWorker checks that)
    masked = [set(st.allowed_token_ids) for st in d.steps]
    assert sum(map(len, masked)) == sum(len(d.tokens[rid]) for rid in constrained)
    if driver_cls is AsyncDriver and pool == 512:
        assert d.max_depth == 2
        assert not any(a & b for a, b in zip(masked, masked[1:]))  # two steps in flight: never in both


def test_an_aborted_constrained_request_is_forgotten():
    g = grammars()
    s = Scheduler(BatcherConfig(), 64, BS, 4096, grammars=g)
    for rid in ("a", "b"):
        s.add_request(AddRequest(request_id=rid, prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=50),
                                 arrival_time=0.0), grammar=g.compile(JSON_GRAMMAR))
    d = Driver(s)
    d.step()
    assert s.num_constrained == 2
    d.take(s.abort_requests(["a", "b"]))
    assert s.num_constrained == 0 and d.finish == {"a": FinishReason.ABORT, "b": FinishReason.ABORT}
    d.run()


# ---------------------------------------------------------------- the stack, through real clients
@pytest.fixture(scope="module")
def tool_stack():
    s = Stack("--tool-call-parser", "hermes")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(tool_stack):
    import openai

    return openai.OpenAI(base_url=tool_stack.base_url + "/v1", api_key="none", max_retries=0)


def test_json_schema_through_the_openai_sdk_streamed_or_not(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    msg = [{"role": "user", "content": "Answer in JSON."}]
    r = client.chat.completions.create(model="tiny", messages=msg, response_format=fmt, max_tokens=100, n=3, seed=1)
    for ch in r.choices:
        assert ch.finish_reason == "stop"
        jsonschema.validate(json.loads(ch.message.content), SCHEMA)
    parts = client.chat.completions.create(model="tiny", messages=msg, response_format=fmt, max_tokens=100, seed=1,
                                           stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    assert text == r.choices[0].message.content  # seed 1, choice 0: the same tokens streamed


def test_choice_regex_and_grammar_on_completions(client):
    r = client.completions.create(model="tiny", prompt="Is it?", max_tokens=10, n=6,
                                  extra_body={"guided_choice": ["yes", "no", "maybe not"]})
    assert all(c.text in ("yes", "no", "maybe not") and c.finish_reason == "stop" for c in r.choices)
    stream = client.completions.create(model="tiny", prompt="Code:", max_tokens=20, stream=True,
                                       extra_body={"guided_regex": "[0-9]{3}-[a-c]{2,4}"})
    assert re.fullmatch("[0-9]{3}-[a-c]{2,4}", "".join(c.choices[0].text for c in stream))
    r = client.completions.create(model="tiny", prompt="List:", max_tokens=40,
                                  extra_body={"structured_outputs": {"grammar": 'root ::= "a" (", a")* "."'}})
    assert re.fullmatch(r"a(, a)*\.", r.choices[0].text) or r.choices[0].finish_reason == "length"


def test_a_named_tool_and_required_tools(client):
    msg = [{"role": "user", "content": "Find Bingley."}]
    named = {"type": "function", "function": {"name": "search"}}
    r = client.chat.completions.create(model="tiny", messages=msg, tools=TOOLS, tool_choice=named, max_tokens=60)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "search" and r.choices[0].finish_reason == "stop" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])
    chunks = list(client.chat.completions.create(model="tiny", messages=msg, tools=TOOLS, tool_choice=named,
                                                 max_tokens=60, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert deltas[0].function.name == "search" and deltas[0].id and all(d.index == 0 for d in deltas)
    json.loads("".join(d.function.arguments for d in deltas))
    r = client.chat.completions.create(model="tiny", messages=msg, tools=TOOLS, tool_choice="required",
                                       max_tokens=120, parallel_tool_calls=False)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None and len(ch.message.tool_calls) == 1
    assert ch.message.tool_calls[0].function.name in ("search", "now")
    chunks = list(client.chat.completions.create(model="tiny", messages=msg, tools=TOOLS, tool_choice="required",
                                                 max_tokens=120, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert deltas and [d.index for d in deltas] == list(range(len(deltas)))  # a stream's deltas carry their index


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_the_models_calls(client, stream):
    """The hermes parser finds a call in what the model wrote (the model is held to one here by a regex)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Find Bingley."}], "tools": TOOLS,
            "max_tokens": 120, "stream": stream,
            "extra_body": {"guided_regex": re.escape("Let me look. " + HERMES_CALL)}}
    r = client.chat.completions.create(**body)
    if not stream:
        msg, reason = r.choices[0].message, r.choices[0].finish_reason
        content, calls = msg.content, msg.tool_calls
    else:
        chunks = [c.choices[0] for c in r if c.choices]
        content = "".join(c.delta.content or "" for c in chunks)
        calls = [tc for c in chunks for tc in c.delta.tool_calls or ()]
        reason = chunks[-1].finish_reason
    assert reason == "tool_calls" and content.strip() == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("search", {"q": "Bingley"})]


def test_langchain_structured_output_and_bound_tools(tool_stack):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, ConfigDict, Field

    class Answer(BaseModel):
        model_config = ConfigDict(extra="forbid")
        answer: str = Field(max_length=8)
        confident: bool

    llm = ChatOpenAI(model="tiny", base_url=tool_stack.base_url + "/v1", api_key="none", max_tokens=100,
                     temperature=0, max_retries=0)
    out = llm.with_structured_output(Answer, method="json_schema").invoke("Who took Netherfield?")
    assert isinstance(out, Answer) and len(out.answer) <= 8

    msg = llm.bind_tools([TOOLS[0]], tool_choice="search").invoke("Find Bingley.")
    assert [c["name"] for c in msg.tool_calls] == ["search"] and len(msg.tool_calls[0]["args"]["q"]) <= 6


NESTED = {"type": "object", "additionalProperties": False, "required": ["title", "kind", "tags", "source"],
          "properties": {
              "title": {"type": "string", "maxLength": 10},
              "kind": {"enum": ["quote", "summary", "answer"]},
              "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 5}},
              "source": {"type": "object", "additionalProperties": False, "required": ["page"],
                         "properties": {"page": {"type": "integer", "minimum": 1, "maximum": 999},
                                        "quote": {"type": ["string", "null"], "maxLength": 12}}}}}


def test_a_nested_schema_holds_for_20_seeds(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Cite a source."}],
                                       max_tokens=400, n=20, seed=0, response_format={
                                           "type": "json_schema", "json_schema": {"name": "cite", "schema": NESTED}})
    assert len(r.choices) == 20
    for ch in r.choices:  # choice i samples with seed i
        assert ch.finish_reason == "stop"
        jsonschema.validate(json.loads(ch.message.content), NESTED)


def test_the_openai_sdk_parses_into_a_pydantic_model(client):
    from pydantic import BaseModel, ConfigDict, Field

    class Citation(BaseModel):
        model_config = ConfigDict(extra="forbid")
        page: int = Field(ge=1, le=99)
        quote: str = Field(max_length=10)

    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    r = parse(model="tiny", messages=[{"role": "user", "content": "Cite."}], response_format=Citation, max_tokens=80)
    out = r.choices[0].message.parsed
    assert isinstance(out, Citation) and 1 <= out.page <= 99


@pytest.mark.parametrize("stream", [False, True])
def test_a_langchain_agent_round_trip(tool_stack, stream):
    """bind_tools: the model calls the tool, the tool's result goes back, then a final answer in text."""
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="tiny", base_url=tool_stack.base_url + "/v1", api_key="none", max_tokens=60,
                     temperature=0, max_retries=0)

    def ask(model, messages):
        if not stream:
            return model.invoke(messages)
        chunks = list(model.stream(messages))
        return sum(chunks[1:], chunks[0])

    history = [HumanMessage("Who took Netherfield Park?")]
    ai = ask(llm.bind_tools([TOOLS[0]], tool_choice="search"), history)
    (call,) = ai.tool_calls
    assert call["name"] == "search" and call["id"] and len(call["args"]["q"]) <= 6
    history += [ai, ToolMessage("Mr. Bingley, a young man of large fortune.", tool_call_id=call["id"])]
    final = ask(llm.bind_tools([TOOLS[0]], tool_choice="none"), history)
    assert not final.tool_calls and isinstance(final.content, str) and final.content


def test_litellm_structured_output_and_a_tool_call(tool_stack, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list
    litellm = pytest.importorskip("litellm")
    common = {"model": "hosted_vllm/tiny", "api_base": tool_stack.base_url + "/v1", "api_key": "none",
              "max_tokens": 100, "temperature": 0}
    r = litellm.completion(messages=[{"role": "user", "content": "JSON please."}], **common, response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    # litellm drops additionalProperties from tool parameters; maxProperties keeps the random model to "q"
    search = {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "required": ["q"], "maxProperties": 1,
        "properties": {"q": {"type": "string", "maxLength": 6}}}}}
    r = litellm.completion(messages=[{"role": "user", "content": "Search."}], tools=[search], tool_choice="required",
                           parallel_tool_calls=False, **common)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "search"
    assert list(json.loads(call.function.arguments)) == ["q"]


def test_a_grammar_that_fails_while_running_is_a_400_and_one_completed_by_the_last_token_a_stop(client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:  # compiles, then hits llguidance's parser limits
        client.completions.create(model="tiny", prompt="hi", max_tokens=5,
                                  extra_body={"guided_grammar": 'root ::= a\na ::= "x" a'})
    assert "grammar" in e.value.body["message"] and len(e.value.body["message"]) < 400  # (no parser state dump)
    r = client.completions.create(model="tiny", prompt="hi", max_tokens=3, extra_body={"guided_choice": ["yes"]})
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("yes", "stop")


def test_required_tools_whose_parameters_refer_to_their_own_defs(client):
    """pydantic (and openai.pydantic_function_tool) writes nested models as $defs with "#/$defs/..." pointers."""
    params = {"type": "object", "additionalProperties": False, "required": ["loc"],
              "$defs": {"Loc": {"type": "object", "additionalProperties": False, "required": ["city"],
                                "properties": {"city": {"type": "string", "maxLength": 5}}}},
              "properties": {"loc": {"$ref": "#/$defs/Loc"}}}
    tools = [{"type": "function", "function": {"name": "weather", "parameters": params}}]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=100,
                                       tools=tools, tool_choice="required", parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), params)
    assert "index" not in call.model_extra  # OpenAI's and vLLM's whole message: index belongs to stream deltas


@pytest.mark.parametrize("params", [
    # recursive: "#" is the tool's own parameters (it once pointed at the whole list of calls)
    {"type": "object", "additionalProperties": False, "required": ["v"],
     "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9}, "kid": {"$ref": "#"}}},
    # an $id of its own: its pointers resolve against it (they were rebased, and refused)
    {"$id": "https://example.com/tool.json", "type": "object", "additionalProperties": False, "required": ["o"],
     "properties": {"o": {"$ref": "#/$defs/O"}}, "$defs": {"O": {"type": "integer", "minimum": 0, "maximum": 9}}},
])
def test_required_tools_with_recursive_or_identified_parameters_follow_their_schema(client, params):
    tools = [{"type": "function", "function": {"name": "tree", "parameters": params}}]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=120,
                                       tools=tools, tool_choice="required", n=4, seed=1)
    for ch in r.choices:
        if ch.finish_reason == "tool_calls":  # (max_tokens may cut a deep tree: length, and text)
            for call in ch.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), params)
    assert any(ch.finish_reason == "tool_calls" for ch in r.choices)


def test_bad_constraints_over_http_are_400s_and_min_tokens_is_refused(client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": {"type": "foo"}}})
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=5,
                                  extra_body={"guided_choice": ["a"], "min_tokens": 2})
    assert e.value.body["param"] == "min_tokens"
    with pytest.raises(openai.BadRequestError) as e:  # EOS ends a grammar's output: it cannot be ignored
        client.completions.create(model="tiny", prompt="x", max_tokens=5,
                                  extra_body={"guided_regex": "[0-9]{1,3}", "ignore_eos": True})
    assert e.value.body["param"] == "ignore_eos"
    with pytest.raises(openai.BadRequestError):  # a grammar with no output at all: refused, not an empty 200
        client.completions.create(model="tiny", prompt="x", max_tokens=5,
                                  extra_body={"guided_grammar": "root ::= root"})
    # special-token text cannot be generated as text (the output would end at the end-of-turn token, or break)
    for extra in ({"guided_choice": ["yes<|im_start|>"]}, {"guided_regex": "x<\\|im_end\\|>y"},
                  {"guided_json": {"type": "string", "enum": ["<|im_end|>"]}}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt="x", max_tokens=5, extra_body=extra)
        assert e.value.body["param"] == next(iter(extra)) and "special-token text" in e.value.body["message"]


def test_wire_vocabulary_round_trips():
    v = Vocabulary(tokenizer_json="{}", vocab_size=3, eos_token_ids=[2])
    from laneserve.wire import protocol as P

    assert msgspec.msgpack.decode(P.encode(v), type=P.GatewayToBatcher) == v


# ---------------------------------------------------------------- the batcher process: vocabulary, compile, requeue
async def test_a_constrained_request_survives_a_worker_loss_and_a_grammar_needs_the_vocabulary(tmp_path):
    """The real batcher on real sockets (tests/test_reliability.py's harness): a grammar before any gateway sent
    the tokenizer is rejected; then a constrained request requeued to another worker mid-way follows its grammar
    across the two workers (its matcher is rebuilt from the tokens streamed)."""
    from batcher.sim.engine import SimWorker
    from laneserve.wire import protocol as P
    from tests.test_reliability import GW, WK, batcher, recv

    async with batcher(tmp_path, on_worker_loss="requeue") as side:
        wa = await side.worker(0)
        wb = await side.worker(1)
        add = P.AddRequest(request_id="j", prompt_token_ids=[7] * 20, arrival_time=0.0, grammar=JSON_GRAMMAR,
                           params=SamplingParams(max_tokens=200, stop_token_ids=TOK.eos_token_ids))
        await side.gw.send(P.encode(msgspec.structs.replace(add, request_id="early")))
        (rej,) = (await side.deltas_until_finished({"early"}))["early"]
        assert isinstance(rej, P.Rejected) and not rej.retryable and "tokenizer" in rej.reason
        await side.gw.send(P.encode(Vocabulary(tokenizer_json=TOK.tokenizer.to_str(), vocab_size=TOK.vocab_size,
                                               eos_token_ids=list(TOK.eos_token_ids))))
        await side.gw.send(P.encode(add))
        sim_a, first = SimWorker(64, BS), []
        for _ in range(4):  # four steps on worker 0 (least load, lowest id): some tokens reach the gateway
            step = await recv(wa, WK)
            assert set(step.allowed_token_ids) <= set(step.num_scheduled_tokens)
            await wa.send(P.encode(sim_a.execute(step)[0]))
        while sum(len(d.new_token_ids) for d in first) < 4:  # one token a step (one step in flight for it)
            first += (await recv(side.gw, GW)).deltas
        await side.roundtrip()
        wa.close()
        rest = (await side.served_until_finished(wb, {"j"}, wid=1))["j"]
    ds = first + rest
    assert [d.finish_reason for d in ds if d.finish_reason is not None] == [FinishReason.STOP]
    jsonschema.validate(json.loads(TOK.decode([t for d in ds for t in d.new_token_ids])), SCHEMA)


@pytest.mark.parametrize("parser, pattern", [("mistral", r"[A-Za-z0-9]{9}"), ("hermes", r"call_[0-9a-f]{24}")])
def test_tool_call_ids_are_the_form_the_parsers_chat_templates_take_back(parser, pattern):
    """Mistral's templates refuse any call id but 9 alphanumeric characters (a review found ours refused with a 400
    when a client sent the calls back with their results); vLLM's mistral parser makes such ids."""
    import re

    out = structured.ToolOutput(structured.Constraint("", "named", "f"), parser)
    _, calls = out.calls("{}")
    assert re.fullmatch(pattern, calls[0]["id"]) and calls[0]["function"] == {"name": "f", "arguments": "{}"}


def test_a_chat_logprob_of_minus_infinity_is_shown_as_vllm_shows_it():
    """A grammar's mask makes forbidden tokens' logprobs -inf, which JSON writes as null; vLLM shows -9999.0."""
    from gateway.output import MIN_LOGPROB, ChatShape
    from laneserve.wire.protocol import TokenLogprobs

    shown = ChatShape(TOK).logprobs([65], [TokenLogprobs(-0.5, [65, 66], [-0.5, float("-inf")])])["content"][0]
    assert shown["logprob"] == -0.5 and [e["logprob"] for e in shown["top_logprobs"]] == [-0.5, MIN_LOGPROB]
