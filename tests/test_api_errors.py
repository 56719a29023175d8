"""Every error status of the gateway, over raw HTTP, as OpenAI error JSON; plus auth, limits, timeouts,
the batcher being absent, and graceful drain on shutdown."""

from __future__ import annotations

import asyncio
import json
import re
import signal

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.schemas import resolve_max_tokens
from laneserve.sampling import MAX_STOP_TOKEN_IDS

CTX_RE = re.compile(r"This model's maximum context length is (\d+) tokens\. However, you requested (\d+) tokens "
                    r"\((\d+) in the messages, (\d+) in the completion\)\. Please reduce the length of the messages "
                    r"or completion\.")


async def _call(session, method, url, expect, **kw):
    async with session.request(method, url, **kw) as resp:
        body = await resp.read()
        assert resp.status == expect, (resp.status, body[:300])
        if expect >= 400:
            err = json.loads(body)["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]
            return err, resp.headers
        return json.loads(body) if body else None, resp.headers


async def test_bad_requests_are_400_with_openai_error_json(stack):
    url = stack.url("/v1/completions")
    async with aiohttp.ClientSession() as s:
        err, _ = await _call(s, "POST", url, 400, data=b"{not json")
        assert err["type"] == "invalid_request_error"
        err, _ = await _call(s, "POST", url, 400, json={"model": "tiny", "prompt": "x", "max_tokens": "ten"})
        assert err["param"] == "max_tokens"
        err, _ = await _call(s, "POST", url, 400, json={"prompt": "x", "temperature": True})
        assert err["param"] == "temperature"
        await _call(s, "POST", url, 400, json=["a", "list"])
        await _call(s, "POST", url, 400, json={"prompt": ""})
        await _call(s, "POST", url, 400, json={"prompt": []})
        await _call(s, "POST", url, 400, json={"prompt": [1, "a"]})
        await _call(s, "POST", url, 400, json={"prompt": [1, 99999]})
        await _call(s, "POST", url, 400, json={"prompt": "x", "n": 0})
        await _call(s, "POST", url, 400, json={"prompt": "x", "top_p": 0})
        await _call(s, "POST", url, 400, json={"prompt": "x", "logprobs": 21})
        await _call(s, "POST", url, 400, json={"prompt": "x", "stream_options": {"include_usage": True}})
        await _call(s, "POST", stack.url("/v1/chat/completions"), 400, json={"messages": []})
        await _call(s, "POST", stack.url("/v1/chat/completions"), 400,
                    json={"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
        # stop_token_ids: at most MAX_STOP_TOKEN_IDS with the model's EOS ids (tiny's: 257 and 259)
        ids = [t for t in range(320) if t not in (257, 259)][:MAX_STOP_TOKEN_IDS]
        err, _ = await _call(s, "POST", url, 400, json={"prompt": "x", "stop_token_ids": ids})
        assert err["param"] == "stop_token_ids" and str(MAX_STOP_TOKEN_IDS) in err["message"]
        await _call(s, "POST", url, 200, json={"prompt": "x", "max_tokens": 1, "stop_token_ids": ids,
                                               "ignore_eos": True})
        # a whole answer's logprobs past MAX_SAMPLED_SCORES entries (n x max_tokens x (k + 1))
        err, _ = await _call(s, "POST", url, 400, json={"prompt": "x", "n": 32, "max_tokens": 8000, "logprobs": 20})
        assert err["param"] == "logprobs"
        chat = stack.url("/v1/chat/completions")
        msgs = [{"role": "user", "content": "x"}]
        await _call(s, "POST", chat, 200, json={"messages": msgs, "max_tokens": 0, "max_completion_tokens": 1})
        err, _ = await _call(s, "POST", chat, 400, json={"messages": msgs, "max_tokens": 0})
        assert err["param"] == "max_tokens" and "echo" not in err["message"]
        err, _ = await _call(s, "POST", chat, 400, json={"messages": msgs, "structured_outputs": {"json_object": 0}})
        assert err["param"] == "structured_outputs"
        # unknown fields are ignored, as vLLM does
        ok, _ = await _call(s, "POST", url, 200, json={"prompt": "x", "max_tokens": 2, "frobnicate": {"a": 1}})
        assert ok["usage"]["completion_tokens"] <= 2


UNHONOURED = [("/v1/completions", {"suffix": "END"}), ("/v1/completions", {"use_beam_search": True}),
              ("/v1/completions", {"allowed_token_ids": [5]}), ("/v1/completions", {"bad_words": ["a"]}),
              ("/v1/completions", {"truncate_prompt_tokens": 1}), ("/v1/completions", {"detokenize": False}),
              ("/v1/chat/completions", {"echo": True}),
              ("/v1/chat/completions", {"continue_final_message": True}),
              ("/v1/chat/completions", {"functions": [{"name": "f", "parameters": {}}]}),
              ("/v1/chat/completions", {"modalities": ["text", "audio"]}),
              ("/v1/completions", {"response_format": {}})]


async def test_parameters_the_server_cannot_honour_are_400_and_their_off_values_are_accepted(stack):
    """Known OpenAI / vLLM fields that would change the output are refused by name, never ignored with a 200; the
    values that ask for nothing pass."""
    body = {"completions": {"prompt": "x", "max_tokens": 2}, "chat": {"messages": [{"role": "user", "content": "x"}],
                                                                     "max_tokens": 2}}
    async with aiohttp.ClientSession() as s:
        for route, extra in UNHONOURED:
            base = body["chat" if "chat" in route else "completions"]
            err, _ = await _call(s, "POST", stack.url(route), 400, json=base | extra)
            assert err["param"] == next(iter(extra)), err
        err, _ = await _call(s, "POST", stack.url("/v1/completions"), 400,  # a key spelled with a JSON escape
                             data=b'{"prompt": "x", "\\u0073uffix": "END"}',
                             headers={"Content-Type": "application/json"})
        assert err["param"] == "suffix"
        for route, extra in [("/v1/completions", {"suffix": None, "use_beam_search": False, "detokenize": True,
                                                  "length_penalty": 0.5}),
                             ("/v1/chat/completions", {"echo": False, "modalities": ["text"], "functions": [],
                                                       "function_call": "none"})]:
            base = body["chat" if "chat" in route else "completions"]
            await _call(s, "POST", stack.url(route), 200, json=base | extra)
        err, _ = await _call(s, "POST", stack.url("/tokenize"), 400,  # (/tokenize: the chat template's fields)
                             json={"messages": body["chat"]["messages"], "chat_template": "{{ messages }}"})
        assert err["param"] == "chat_template"
        out, _ = await _call(s, "POST", stack.url("/tokenize"), 200, json={"prompt": "hi", "return_token_strs": True})
        assert out["token_strs"] == ["h", "i"], out


async def test_context_length_error_keeps_vllms_wording(stack):
    async with aiohttp.ClientSession() as s:
        err, _ = await _call(s, "POST", stack.url("/v1/completions"), 400,
                             json={"prompt": list(range(100)) * 80, "max_tokens": 500})
    m = CTX_RE.fullmatch(err["message"])
    assert m and m.groups() == ("8192", "8500", "8000", "500")


def test_default_max_tokens_completion_16_chat_the_remaining_context():
    assert resolve_max_tokens(None, 16, 100, 8192) == 16
    assert resolve_max_tokens(None, 16, 8185, 8192) == 7
    assert resolve_max_tokens(None, None, 100, 8192) == 8092
    assert resolve_max_tokens(50, None, 100, 8192) == 50


async def test_404_405_and_unknown_model(stack):
    async with aiohttp.ClientSession() as s:
        err, _ = await _call(s, "POST", stack.url("/v1/completions"), 404, json={"model": "gpt-9", "prompt": "x"})
        assert err["code"] == "model_not_found" and err["param"] == "model"
        await _call(s, "GET", stack.url("/v1/nothing"), 404)
        await _call(s, "GET", stack.url("/v1/completions"), 405)


@pytest.fixture(scope="module")
def guarded(request):
    """A stack with an API key (from the env var), a small body limit, a queue cap of 2 and a 3 s timeout."""
    from tests.stack import Stack

    st = Stack("--max-body-bytes", "4096", "--max-queued-requests", "2", "--request-timeout", "3",
               env={"LANESERVE_API_KEY": "sekret"})
    yield st
    st.stop()


AUTH = {"Authorization": "Bearer sekret"}


async def test_api_key_guards_everything_but_health_metrics_and_version(guarded):
    body = {"prompt": "x", "max_tokens": 2}
    async with aiohttp.ClientSession() as s:
        err, _ = await _call(s, "POST", guarded.url("/v1/completions"), 401, json=body)
        assert err["type"] == "authentication_error"
        await _call(s, "POST", guarded.url("/v1/completions"), 401, json=body, headers={"Authorization": "Bearer no"})
        await _call(s, "GET", guarded.url("/v1/models"), 401)
        await _call(s, "GET", guarded.url("/nowhere"), 401)
        await _call(s, "POST", guarded.url("/v1/completions"), 200, json=body, headers=AUTH)
        await _call(s, "GET", guarded.url("/health"), 200)
        await _call(s, "GET", guarded.url("/version"), 200)
        async with s.get(guarded.url("/metrics")) as r:
            assert r.status == 200 and "laneserve:kv_cache_blocks_free" in await r.text()


async def test_browser_clients_get_cors_as_from_vllm(guarded):
    """A review found no CORS: a browser's preflight got the API key's 401 (vLLM allows every origin by default)."""
    page = {"Origin": "https://app.example"}
    async with aiohttp.ClientSession() as s:
        async with s.options(guarded.url("/v1/chat/completions"), headers={
                **page, "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type"}) as r:
            assert r.status == 200  # before the API key's check: a preflight carries none
            assert r.headers["Access-Control-Allow-Origin"] == "*"
            assert "POST" in r.headers["Access-Control-Allow-Methods"]
            assert r.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        body = {"prompt": "x", "max_tokens": 2, "stream": True}
        async with s.post(guarded.url("/v1/completions"), json=body, headers={**AUTH, **page}) as r:
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == "*"  # a stream's headers too
            await r.read()
        async with s.post(guarded.url("/v1/completions"), json=body, headers=page) as r:
            assert r.status == 401 and r.headers["Access-Control-Allow-Origin"] == "*"  # (so the page reads why)
        async with s.get(guarded.url("/health")) as r:
            assert "Access-Control-Allow-Origin" not in r.headers  # no Origin, no CORS headers


def test_an_origin_list_allows_those_origins_alone():
    from gateway.cors import _allowed, parse_origins

    origins = parse_origins(" https://a.example, https://b.example ")
    assert [_allowed(origins, o) for o in ("https://a.example", "https://c.example", None)] == [
        "https://a.example", None, None]
    assert _allowed(parse_origins(""), "https://a.example") is None  # --allowed-origins '': off


async def test_body_over_max_body_bytes_is_413(guarded):
    async with aiohttp.ClientSession() as s:
        err, _ = await _call(s, "POST", guarded.url("/v1/completions"), 413, json={"prompt": "x" * 5000},
                             headers=AUTH)


async def test_over_max_queued_requests_is_429_with_retry_after(guarded):
    hold = {"prompt": "hold", "n": 2, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(guarded.url("/v1/completions"), json=hold, headers=AUTH) as held:
            assert held.status == 200
            await held.content.readline()  # the two sequences are in flight now
            err, headers = await _call(s, "POST", guarded.url("/v1/completions"), 429,
                                       json={"prompt": "x", "max_tokens": 1}, headers=AUTH)
            assert int(headers["Retry-After"]) >= 1 and err["type"] == "rate_limit_error"
            held.close()
        # more sequences than the cap can ever hold: a 400, not a "retry later" that never succeeds
        err, _ = await _call(s, "POST", guarded.url("/v1/completions"), 400, json={"prompt": "x", "n": 3},
                             headers=AUTH)
        assert err["param"] == "n"


async def test_request_timeout_is_504_or_an_error_event_in_a_stream(guarded):
    long = {"prompt": "slow", "max_tokens": 8000, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        err, _ = await _call(s, "POST", guarded.url("/v1/completions"), 504, json=long, headers=AUTH)
        assert "timed out" in err["message"]
    client = openai.OpenAI(base_url=guarded.api, api_key="sekret", max_retries=0)
    with pytest.raises(openai.APIError, match="timed out"):
        for _ in client.completions.create(model="tiny", prompt="slow", max_tokens=8000, stream=True,
                                           extra_body={"ignore_eos": True}):
            pass


async def test_no_batcher_is_503_with_retry_after(tmp_path):
    cfg = GatewayConfig(batcher_address=f"ipc://{tmp_path}/nobody.sock", batcher_timeout=0.2, retry_after=2)
    async with TestClient(TestServer(create_app(cfg))) as c:
        resp = await c.post("/v1/completions", json={"prompt": "x"})
        # --retry-after 2, jittered by up to half (tests/test_vllm_compat.py)
        assert resp.status == 503 and 1 <= int(resp.headers["Retry-After"]) <= 3
        assert 1000 <= int(resp.headers["retry-after-ms"]) <= 3000
        assert (await resp.json())["error"]["type"] == "service_unavailable_error"
        resp = await c.get("/health")
        assert resp.status == 503
        resp = await c.get("/metrics")  # still answers, with stale engine gauges
        assert resp.status == 200


def test_sigint_drains_an_in_flight_stream(make_stack):
    st = make_stack()
    body = {"prompt": "drain", "max_tokens": 64, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}

    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(st.url("/v1/completions"), json=body) as resp:
                assert resp.status == 200
                lines = [await resp.content.readline()]
                st.proc.send_signal(signal.SIGINT)
                lines += [line async for line in resp.content]
        return [ln.decode().strip() for ln in lines if ln.strip()]

    lines = asyncio.run(go())
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][len("data: "):])["usage"]["completion_tokens"] == 64
    assert st.proc.wait(30) == 0


async def test_an_unexpected_exception_is_a_logged_500_in_openai_shape(tmp_path, caplog):
    cfg = GatewayConfig(batcher_address=f"ipc://{tmp_path}/nobody.sock")
    app = create_app(cfg)

    async def broken(request):
        raise RuntimeError("bug")

    app.router.add_get("/broken", broken)  # a handler with a bug, to exercise the last-resort middleware
    async with TestClient(TestServer(app)) as c:
        resp = await c.get("/broken")
        assert resp.status == 500
        assert (await resp.json())["error"]["type"] == "server_error"
    assert "unexpected error in GET /broken" in caplog.text
