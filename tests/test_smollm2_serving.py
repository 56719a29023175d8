"""A real trained model end to end: SmolLM2-135M-Instruct (GGUF, Q4_1) served over HTTP on CPU, checked against
`transformers` loading the same file, and for answers that make sense."""

from __future__ import annotations

import asyncio
import json
import os

import aiohttp
import pytest

from tests.stack import Stack

gguf_file = pytest.importorskip("laneserve.gguf_file")
pytest.importorskip("gguf")
try:
    PATH = gguf_file.resolve_model(gguf_file.SMOLLM2)
except gguf_file.GGUFError as e:  # the package is not installed: the Makefile installs it
    pytest.skip(str(e), allow_module_level=True)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]


@pytest.fixture(scope="module")
def stack():
    s = Stack("--model", gguf_file.SMOLLM2, timeout=180.0)
    yield s
    s.stop()


async def test_greedy_text_equals_transformers(stack, smollm2_reference, smollm2_greedy):
    """The prompts at once (decoded in one batch), each against transformers alone: its 32 greedy tokens with
    nothing banned (as ignore_eos: an EOS may come out, and is not text)."""
    async def complete(s, prompt: str) -> dict:
        body = {"model": gguf_file.SMOLLM2, "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
        async with s.post(stack.url("/v1/completions"), json=body) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()

    async with aiohttp.ClientSession() as s:
        outs = await asyncio.gather(*(complete(s, prompt) for prompt in PROMPTS))
    for prompt, out in zip(PROMPTS, outs):
        assert out["usage"]["completion_tokens"] == 32
        want = smollm2_reference[0].decode(smollm2_greedy(prompt, 32), skip_special_tokens=True)
        assert out["choices"][0]["text"] == want, prompt


async def test_chat_answers_paris_and_stops_on_eos(stack):
    body = {"model": gguf_file.SMOLLM2, "temperature": 0, "max_tokens": 64,
            "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}]}
    async with aiohttp.ClientSession() as s:
        async with s.post(stack.url("/v1/chat/completions"), json=body) as resp:
            assert resp.status == 200, await resp.text()
            out = await resp.json()
    choice = out["choices"][0]
    assert "Paris" in choice["message"]["content"]
    assert choice["finish_reason"] == "stop"  # the model's <|im_end|> (its EOS), well before max_tokens
    assert out["usage"]["completion_tokens"] < 64


async def test_structured_output_and_a_required_tool_call_make_sense(stack):
    """A JSON schema answer and a forced tool call from a trained model: valid, and about the question."""
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
              "properties": {"city": {"type": "string"}, "country": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                               "parameters": {"type": "object", "additionalProperties": False,
                                                              "required": ["city"],
                                                              "properties": {"city": {"type": "string"}}}}}]
    chat = f"{stack.base_url}/v1/chat/completions"
    async with aiohttp.ClientSession() as s:
        body = {"model": gguf_file.SMOLLM2, "temperature": 0, "max_tokens": 60,
                "messages": [{"role": "user", "content": "What is the capital of France? Answer in JSON with the city "
                                                         "and its country."}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}}}
        async with s.post(chat, json=body) as r:
            assert r.status == 200, await r.text()
            choice = (await r.json())["choices"][0]
        body = {"model": gguf_file.SMOLLM2, "temperature": 0, "max_tokens": 60, "tools": tools,
                "tool_choice": "required", "messages": [{"role": "user", "content": "What's the weather in Paris?"}]}
        async with s.post(chat, json=body) as r:
            assert r.status == 200, await r.text()
            called = (await r.json())["choices"][0]
    answer = json.loads(choice["message"]["content"])
    assert choice["finish_reason"] == "stop" and answer["city"] == "Paris" and "fr" in answer["country"].lower()
    (call,) = called["message"]["tool_calls"]
    assert called["finish_reason"] == "tool_calls" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
