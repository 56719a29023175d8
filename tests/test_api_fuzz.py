"""Random JSON bodies and parameter values at both generation endpoints of the real stack: only 2xx/4xx,
every 4xx is OpenAI error JSON, a 200 stream carries no error event, and no KV block leaks."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request

from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

# Leaves: a few values of every JSON type, including ones that are out of range for any parameter.
SCALARS = (st.none() | st.booleans() | st.integers(-5, 5) | st.sampled_from([-(2**70), 2**70, 10**6, 2**63])
           | st.floats(allow_nan=False, allow_infinity=False, width=32) | st.text(max_size=6))
ANY = st.recursive(SCALARS, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                   max_leaves=5)


VALID = {
    "model": st.just("tiny"),
    "max_tokens": st.integers(0, 6),  # 0: with echo, the prompt scored and nothing generated (else a 400)
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 400),
    "min_p": st.floats(0, 1),
    "n": st.integers(1, 3),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 319), max_size=3),
    "seed": st.integers(0, 2**40),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.1, 2),
    "logprobs": st.integers(0, 5) | st.booleans(),
    "top_logprobs": st.integers(0, 5),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 2),
    "stream": st.booleans(),
    "echo": st.booleans(),
    "prompt_logprobs": st.integers(0, 5),
    "user": st.text(max_size=5),
}
PROMPT = st.text(min_size=1, max_size=16) | st.lists(st.integers(0, 319), min_size=1, max_size=8) \
    | st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=3)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool"]),
                                 "content": st.text(max_size=12)})
# Half the bodies are well-formed with valid values (they must run: 200), half anything at all.
WELL_FORMED = st.fixed_dictionaries({"prompt": PROMPT, "messages": st.lists(MESSAGE, min_size=1, max_size=3)},
                                    optional=VALID)
# Structured output, tools and the scheduling fields: small schemas (some that llguidance refuses) and values
SCHEMA = st.sampled_from([{"type": "string"}, {"type": "integer", "minimum": 0}, {"enum": ["a", 1]}, {"type": "foo"},
                          {"type": "array", "minItems": -1}, {"$ref": "#/nope"}, {"anyOf": []},
                          {"type": "object", "properties": {"k": {"type": "boolean"}}}])
STRUCTURED = {
    "response_format": st.builds(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}, SCHEMA)
    | st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "yaml"}]),
    "guided_regex": st.sampled_from(["[a-c]+", "((", "\\d{1,3}"]),
    "guided_choice": st.lists(st.text(max_size=3), max_size=3),
    "tools": st.lists(st.builds(lambda n, s: {"type": "function", "function": {"name": n, "parameters": s}},
                                st.sampled_from(["f", "g", ""]), SCHEMA), max_size=2),
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]),
    "logit_bias": st.dictionaries(st.sampled_from(["0", "319", "320", "x"]), st.floats(-150, 150), max_size=2),
    "priority": st.integers(-(2**32), 2**32),
    "slo_ttft_ms": st.floats(-1, 1e7),
    "slo_tpot_ms": st.floats(-1, 1e7),
    "best_of": st.integers(-1, 4),
}
ANYTHING = st.fixed_dictionaries({}, optional={name: v | ANY for name, v in
                                               {**VALID, **STRUCTURED, "prompt": PROMPT,
                                                "messages": st.lists(MESSAGE, max_size=3),
                                                "max_completion_tokens": st.integers(-1, 6),
                                                "stream_options": st.fixed_dictionaries(
                                                    {"include_usage": st.booleans()})}.items()})
BODY = WELL_FORMED | ANYTHING


def _post(url: str, body: bytes) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _check(status: int, raw: bytes, streamed: bool) -> None:
    assert 200 <= status < 500, (status, raw[:300])
    if status >= 400:
        err = json.loads(raw)["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        return
    if streamed:
        events = [ln[len(b"data: "):] for ln in raw.split(b"\n\n") if ln]
        assert events[-1] == b"[DONE]", raw[-200:]
        for ev in events[:-1]:
            assert "error" not in json.loads(ev), ev
    else:
        assert json.loads(raw)["choices"], raw[:300]


def _metric(text: str, name: str) -> float:
    return float(re.search(rf'^{re.escape(name)}{{model_name="tiny"}} ([0-9.e+-]+)$', text, re.M).group(1))


# No shrinking: a failure prints its example at once instead of spending minutes against the live stack.
@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(body=BODY, raw_junk=st.binary(max_size=12))
def test_random_bodies_get_2xx_or_4xx_and_leak_no_kv_blocks(stack, body, raw_junk):
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 3  # keep each example short (the chat default is the whole context)
    data = json.dumps(body).encode()
    streamed = body.get("stream") is True
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, raw = _post(stack.url(path), data)
        event(f"{path} {status}")
        _check(status, raw, streamed)
    status, raw = _post(stack.url("/v1/completions"), raw_junk)
    assert 400 <= status < 500 and "error" in json.loads(raw)


def test_no_kv_block_leaks_after_the_fuzzing(stack):
    deadline = time.monotonic() + 20
    while True:
        with urllib.request.urlopen(stack.url("/metrics")) as resp:
            text = resp.read().decode()
        free, total = _metric(text, "laneserve:kv_cache_blocks_free"), _metric(text, "laneserve:kv_cache_blocks_total")
        if free == total:
            break
        assert time.monotonic() < deadline, f"KV blocks leaked: {free} of {total} free"
        time.sleep(0.05)  # polling a condition with a deadline
    assert total > 0 and _metric(text, "laneserve:num_requests_running") == 0
