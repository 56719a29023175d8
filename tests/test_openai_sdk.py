"""The gateway through the real `openai` SDK against the real stack (tiny model): what users' code does."""

from __future__ import annotations

import re
import time

import aiohttp
import openai
import pytest

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.api, api_key="unused", max_retries=0, timeout=60)


def _async_client(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.api, api_key="unused", max_retries=0, timeout=60)


def test_sync_completion_and_models(client):
    out = client.completions.create(model="tiny", prompt="The lanes", max_tokens=12, **GREEDY)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.choices[0].finish_reason == "length" and out.choices[0].index == 0
    assert out.usage.prompt_tokens == len(b"The lanes") and out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    assert [m.id for m in client.models.list().data] == ["tiny"]


async def test_async_streaming_completion_matches_non_streaming_and_reports_usage_last(stack):
    async with _async_client(stack) as aclient:
        full = await aclient.completions.create(model="tiny", prompt="abc", max_tokens=20, **GREEDY)
        chunks = [c async for c in await aclient.completions.create(
            model="tiny", prompt="abc", max_tokens=20, stream=True, stream_options={"include_usage": True}, **GREEDY)]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
        assert all(c.usage is None for c in chunks[:-1])
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


async def test_streaming_without_include_usage_sends_no_usage(stack):
    async with _async_client(stack) as aclient:
        chunks = [c async for c in await aclient.completions.create(model="tiny", prompt="x", max_tokens=3, stream=True,
                                                                     **GREEDY)]
        assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)


async def test_chat_streaming_and_non_streaming_agree(stack):
    async with _async_client(stack) as aclient:
        msgs = [{"role": "system", "content": "terse"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
        full = await aclient.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, **GREEDY)
        assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
        rendered = "<|im_start|>system\nterse<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        assert full.usage.prompt_tokens == len(rendered) - 3 * (len("<|im_start|>") - 1) - 2 * (len("<|im_end|>") - 1)
        stream = await aclient.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=10,
                                                       stream=True, stream_options={"include_usage": True}, **GREEDY)
        chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == full.choices[0].message.content
        assert chunks[-1].usage.completion_tokens == 10


def test_chat_over_the_context_is_a_400_with_vllms_wording(client):
    msgs = [{"role": "user", "content": "x" * 8150}]
    with pytest.raises(openai.BadRequestError, match=r"maximum context length is 8192 tokens\. However, you "
                                                     r"requested 8269 tokens \(8169 in the messages, 100 in the "
                                                     r"completion\)"):
        client.chat.completions.create(model="tiny", messages=msgs, max_tokens=100)


def test_n_and_several_prompts_merge_into_one_response_by_index(client):
    out = client.completions.create(model="tiny", prompt=["one", "two"], n=3, max_tokens=4, seed=7, temperature=1.0,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == list(range(6))
    assert out.usage.completion_tokens == 24 and out.usage.prompt_tokens == 6
    # choices of one prompt got seeds 7, 8, 9: the same request again gives the same texts
    again = client.completions.create(model="tiny", prompt=["one", "two"], n=3, max_tokens=4, seed=7, temperature=1.0,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in out.choices]


def test_token_id_prompts(client):
    by_text = client.completions.create(model="tiny", prompt="hey", max_tokens=5, **GREEDY)
    by_ids = client.completions.create(model="tiny", prompt=list(b"hey"), max_tokens=5, **GREEDY)
    many = client.completions.create(model="tiny", prompt=[list(b"hey"), list(b"hey")], max_tokens=5, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert [c.text for c in many.choices] == [by_text.choices[0].text] * 2


def test_seed_reproducibility(client):
    def sample(seed):
        return client.completions.create(model="tiny", prompt="seeded", max_tokens=16, temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text

    assert sample(1234) == sample(1234)
    assert len({sample(1), sample(2), sample(3)}) > 1


def _greedy_text(client, prompt, n_tokens=40):
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=n_tokens, **GREEDY).choices[0].text


def _pick_stop(text: str) -> str:
    for start in range(len(text) // 3, len(text) - 2):
        cand = text[start:start + 2]
        if "\ufffd" not in cand:
            return cand
    pytest.skip("no 2-character substring without U+FFFD in the greedy output")


def test_stop_strings_cut_the_output_streaming_and_not(client):
    text = _greedy_text(client, "stop here")
    stop = _pick_stop(text)
    expected = text[:text.index(stop)]
    out = client.completions.create(model="tiny", prompt="stop here", max_tokens=40, stop=[stop, "\x00never"],
                                    **GREEDY)
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 40
    chunks = list(client.completions.create(model="tiny", prompt="stop here", max_tokens=40, stop=stop, stream=True,
                                            **GREEDY))
    pieces = [c.choices[0].text for c in chunks]
    assert "".join(pieces) == expected and chunks[-1].choices[0].finish_reason == "stop"
    assert not any(stop in p for p in pieces)


def test_stop_token_ids_finish_with_stop_and_hide_the_token(client):
    text = _greedy_text(client, "tok", 20)
    raw = text.encode("utf-8", "replace")
    target = next((b for b in raw[3:] if 32 < b < 127), None)
    if target is None:
        pytest.skip("no ascii byte in the greedy output")
    out = client.completions.create(model="tiny", prompt="tok", max_tokens=20, temperature=0,
                                    extra_body={"stop_token_ids": [target], "ignore_eos": True})
    assert out.choices[0].finish_reason == "stop" and chr(target) not in out.choices[0].text
    assert out.model_extra.get("choices") is None  # nothing odd leaked into the top level
    assert out.choices[0].model_extra["stop_reason"] == target


def test_logprobs_and_echo(client):
    out = client.completions.create(model="tiny", prompt="echo me", max_tokens=4, logprobs=2, echo=True, **GREEDY)
    ch = out.choices[0]
    assert ch.text.startswith("echo me")
    # echo with logprobs scores the prompt too (vLLM, OpenAI): its 7 tokens first, the first one without a logprob
    assert len(ch.logprobs.tokens) == 7 + 4 and len(ch.logprobs.token_logprobs) == 7 + 4
    assert ch.logprobs.token_logprobs[0] is None and ch.logprobs.top_logprobs[0] is None
    # the top 2, and the token itself where it is not among them (a prompt's token; greedy ones are the top 1)
    tokens, tops = ch.logprobs.tokens, ch.logprobs.top_logprobs
    assert all(len(top) == 2 or len(top) == 3 and tok in top for tok, top in zip(tokens[1:7], tops[1:7]))
    assert all(len(top) == 2 and max(top, key=top.get) == tok for tok, top in zip(tokens[7:], tops[7:]))
    assert all(lp <= 0 for lp in ch.logprobs.token_logprobs[1:])
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "q"}], max_tokens=3,
                                          logprobs=True, top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 3 for c in content)


async def test_tokenize_detokenize_roundtrip(stack):
    async with aiohttp.ClientSession() as s:
        async with s.post(stack.url("/tokenize"), json={"model": "tiny", "prompt": "héllo"}) as r:
            tok = await r.json()
        assert tok["tokens"] == list("héllo".encode()) and tok["count"] == 6 and tok["max_model_len"] == 8192
        async with s.post(stack.url("/detokenize"), json={"model": "tiny", "tokens": tok["tokens"]}) as r:
            assert (await r.json())["prompt"] == "héllo"
        async with s.post(stack.url("/tokenize"), json={"messages": [{"role": "user", "content": "a"}]}) as r:
            assert (await r.json())["tokens"][:2] == [258, ord("u")]


def _metric(text: str, name: str) -> float:
    m = re.search(rf'^{re.escape(name)}{{model_name="tiny"}} ([0-9.e+-]+)$', text, re.M)
    assert m, name
    return float(m.group(1))


async def _kv_settles(s, stack) -> str:
    """/metrics once every KV block is free again (bounded wait: aborts free blocks within a step)."""
    deadline = time.monotonic() + 20
    while True:
        async with s.get(stack.url("/metrics")) as r:
            text = await r.text()
        if _metric(text, "laneserve:kv_cache_blocks_free") == _metric(text, "laneserve:kv_cache_blocks_total"):
            return text
        assert time.monotonic() < deadline, "KV blocks leaked"
        await __import__("asyncio").sleep(0.05)


async def test_client_disconnect_aborts_and_frees_kv_blocks(stack):
    body = {"model": "tiny", "prompt": "long " * 40, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(stack.url("/v1/completions"), json=body) as resp:
            assert resp.status == 200
            got = 0
            async for line in resp.content:
                got += line.startswith(b"data: ")
                if got >= 3:
                    break
            resp.close()  # drop the connection mid-stream
        text = await _kv_settles(s, stack)
    assert _metric(text, "laneserve:num_requests_running") == 0
    assert _metric(text, "laneserve:kv_cache_blocks_total") > 0
    for name in ("laneserve:time_to_first_token_seconds_count", "laneserve:e2e_request_latency_seconds_count",
                 "laneserve:generation_tokens_total", "laneserve:prompt_tokens_total"):
        assert _metric(text, name) > 0
