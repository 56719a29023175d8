"""What vLLM users rely on (docs/from-vllm.md): API details through the openai SDK and aiohttp on the real stack,
and `laneserve serve` taking vLLM's command line."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest

from gateway.errors import ApiError
from laneserve import cli
from laneserve.config import from_args


@pytest.fixture(scope="module")
def client(request):
    import openai

    stack = request.getfixturevalue("stack")
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="none", max_retries=0)


def test_models_retrieve(client):
    import openai

    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_logit_bias_forces_or_bans_a_token(client):
    forced = client.completions.create(model="tiny", prompt="hi", max_tokens=6, temperature=1.0, seed=3,
                                       logit_bias={"65": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == "A" * 6  # token 65 is "A" in the tiny byte-level vocabulary
    greedy = {"model": "tiny", "prompt": "hi", "max_tokens": 1, "temperature": 0, "logprobs": 0}
    ids = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    top = client.completions.create(**greedy, extra_body=ids).choices[0].logprobs.tokens[0]  # "token_id:N"
    banned = client.completions.create(**greedy, logit_bias={top.split(":")[1]: -100}, extra_body=ids)
    assert banned.choices[0].logprobs.tokens[0] != top


def test_stop_strings_wait_for_min_tokens(client):
    """vLLM's rule: a stop string ends the text only after min_tokens tokens (the stop token ids likewise)."""
    out = client.completions.create(model="tiny", prompt="hi", max_tokens=10, stop=["A"], logit_bias={"65": 100},
                                    extra_body={"ignore_eos": True, "min_tokens": 4})
    choice = out.choices[0]
    assert (choice.text, choice.finish_reason, out.usage.completion_tokens) == ("AAAA", "stop", 5)


@pytest.mark.parametrize("bias, why", [({"x": 1}, "token ids"), ({"5": 101}, "[-100, 100]"),
                                       ({"99999": 1}, "not a token id"), ({"65": 100, "065": 100}, "twice")])
def test_bad_logit_bias_is_a_400(client, bias, why):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=1, logit_bias=bias)
    assert e.value.body["param"] == "logit_bias" and why in e.value.body["message"]


def test_top_logprobs_hold_the_top_k_and_the_sampled_token_and_chat_bytes_are_the_tokens_own(client):
    """Completion top_logprobs: the k most likely tokens and the sampled one where it is not among them (OpenAI's
    and vLLM's up to k + 1 entries), each key once (tokens that decode alike named token_id:N)."""
    r = client.completions.create(model="tiny", prompt="\u00e9t\u00e9 \u2713", max_tokens=12, logprobs=5,
                                  temperature=1.0, seed=0, extra_body={"ignore_eos": True})
    assert all(len(top) in (5, 6) for top in r.choices[0].logprobs.top_logprobs)
    ids = client.completions.create(model="tiny", prompt="hi", max_tokens=24, logprobs=3, temperature=1.0, seed=3,
                                    extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    lp = ids.choices[0].logprobs
    assert all(t.startswith("token_id:") for t in lp.tokens)
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert all(k.startswith("token_id:") for k in top) and top[tok] == value
        others = [v for k, v in top.items() if k != tok]
        assert len(top) == 3 or len(top) == 4 and value <= min(others), (tok, top)
    assert any(len(top) == 4 for top in lp.top_logprobs)  # sampled at temperature 1: not always a top-3 token
    zero = client.completions.create(model="tiny", prompt="hi", max_tokens=3, logprobs=0,
                                     extra_body={"ignore_eos": True})
    assert [list(top) for top in zero.choices[0].logprobs.top_logprobs] == [[t] for t in zero.choices[0].logprobs.tokens]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "\u2713"}],
                                          max_tokens=16, logprobs=True, top_logprobs=2, temperature=1.0, seed=1,
                                          extra_body={"ignore_eos": True, "skip_special_tokens": False})
    entries = chat.choices[0].logprobs.content
    raw = b"".join(bytes(e.bytes) for e in entries)
    assert raw.decode("utf-8", "replace") == chat.choices[0].message.content  # pieces of characters join up
    pieces = [e for e in entries if e.token == "\ufffd"]  # a byte of a character, shown as U+FFFD
    assert pieces and all(len(e.bytes) == 1 and e.bytes != [239, 191, 189] for e in pieces)


def test_top_logprobs_without_logprobs_is_a_400(client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                       top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"


def test_best_of_answers_the_sequences_with_the_highest_cumulative_logprob(client):
    common = {"model": "tiny", "prompt": "Once", "max_tokens": 6, "temperature": 1.0, "seed": 5,
              "extra_body": {"ignore_eos": True}}
    every = client.completions.create(n=4, logprobs=0, **common)
    score = {c.text: sum(c.logprobs.token_logprobs) for c in every.choices}
    best = client.completions.create(n=2, best_of=4, **common)
    assert [c.text for c in best.choices] == sorted(score, key=score.get, reverse=True)[:2]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert client.completions.create(best_of=1, **common).choices[0].logprobs is None  # best_of == n: no logprobs
    assert best.usage.completion_tokens == 24  # every sequence generated is counted
    import openai

    with pytest.raises(openai.BadRequestError):
        client.completions.create(n=2, best_of=1, **common)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(best_of=3, stream=True, **common)


async def test_continuous_usage_stats_put_usage_in_every_chunk(stack):
    # 32 tokens: on a busy 2-core machine the gateway may merge 5 tokens' deltas into one chunk (seen once)
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 32, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    usages = []
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{stack.base_url}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if line.startswith(b"data: {"):
                    usages.append(json.loads(line[6:])["usage"])
    assert all(u is not None for u in usages) and usages[-1]["completion_tokens"] == 32, usages
    counts = [u["completion_tokens"] for u in usages]
    assert counts == sorted(counts) and counts[0] < 32, usages
    # vLLM's include_usage defaults to true once stream_options is given; false turns usage off, continuous too
    for options, every, last in (({"continuous_usage_stats": True}, True, True), ({}, False, True),
                                 ({"include_usage": False, "continuous_usage_stats": True}, False, False)):
        body["stream_options"] = options
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{stack.base_url}/v1/completions", json=body) as r:
                chunks = [json.loads(line[6:]) async for line in r.content if line.startswith(b"data: {")]
        with_usage = [c for c in chunks if c.get("usage")]
        assert (len(with_usage) == len(chunks) if every else len(with_usage) == last), (options, chunks[-2:])
        assert not last or with_usage[-1]["usage"]["completion_tokens"] == 32


def test_retry_after_is_jittered_and_given_in_ms_too():
    delays = set()
    for _ in range(50):
        headers = ApiError(429, "busy", retry_after=2.0).response().headers
        ms = int(headers["retry-after-ms"])
        assert 1000 <= ms <= 3000 and int(headers["Retry-After"]) == max(1, round(ms / 1000))
        delays.add(ms)
    assert len(delays) > 10


# ---------------------------------------------------------------- the command line
def _configs(argv: list[str]):
    args = cli.parse_args(argv)
    return [from_args(cls, args, env={}) for cls in cli._configs()]


def test_vllm_flags_parse_to_the_same_config():
    vllm = ["serve", "tiny", "--tensor-parallel-size", "1", "--max-model-len", "512", "--gpu-memory-utilization",
            "0.8", "--max-num-seqs", "64", "--max-num-batched-tokens", "1024", "--no-enable-prefix-caching",
            "--kv-cache-dtype", "int8", "--served-model-name", "m", "--api-key", "k", "--enforce-eager",
            "--seed", "3", "--dtype", "float32", "--chat-template", "{{ 1 }}"]
    gateway, batcher, worker = _configs(vllm)
    assert (gateway.model, gateway.max_model_len, gateway.served_model_name, gateway.api_key, gateway.chat_template) \
        == ("tiny", 512, "m", "k", "{{ 1 }}")
    assert (batcher.max_num_seqs, batcher.max_num_batched_tokens, batcher.enable_prefix_caching) == (64, 1024, False)
    assert (worker.model, worker.tensor_parallel_size, worker.gpu_memory_utilization, worker.kv_cache_dtype,
            worker.enforce_eager, worker.seed, worker.dtype) == ("tiny", 1, 0.8, "int8", True, 3, "float32")
    assert _configs(["serve", "--model", "tiny"])[0].model == "tiny"


@pytest.mark.parametrize("argv, says", [
    (["serve", "--block-size", "32"], "KV blocks are 16 tokens"),
    (["serve", "--data-parallel-size", "2"], "--num-workers N"),
    (["serve", "--max-num-sequences", "4"], "nearest laneserve setting is --max-num-seqs"),
    (["serve", "tiny", "-tp", "2"], "-tp (vLLM's) is not a laneserve flag: write --tensor-parallel-size"),
    (["serve", "--revision", "main"], "--revision (vLLM's) is not a laneserve flag: models load from local"),
    (["serve", "--uvicorn-log-level", "warning"], "--uvicorn-log-level (vLLM's) is not a laneserve flag"),
    (["serve", "tiny", "--model", "other"], "given twice"),
    # values out of range are refused before anything starts (each once started a server that hung or failed)
    (["serve", "--max-num-seqs", "0"], "--max-num-seqs 0: must be >= 1"),
    (["serve", "--port", "70000"], "--port 70000: must be >= 1 and <= 65535"),
    (["serve", "--request-timeout", "nan"], "--request-timeout nan: must be a finite number"),
    (["serve", "--max-waiting-requests", "-1"], "--max-waiting-requests -1: must be >= 0"),
    (["serve", "--decode-gemv-rows", "9"], "--decode-gemv-rows 9: must be >= -1 and <= 8"),  # (-1, auto, passes)
    (["serve", "--seed", "99999999999999999999999"], "--seed 1e+23: must be >= 0 and <= 1.84467e+19"),
    (["serve", "--gpu-memory-utilization", "5"], "must be > 0 and <= 1"),
    (["serve", "--decode-buckets", "a,b"], "--decode-buckets 'a,b': must be comma-separated whole numbers"),
    (["serve", "--warm-prefix", "/nonexistent.json"], "--warm-prefix /nonexistent.json"),
    (["serve", "--warm-prefix", "w.json", "--no-enable-prefix-caching"], "without prefix caching"),
    (["serve", "--cost-model-out", "/nonexistent/dir/cm.json"], "its directory does not exist"),
    (["serve", "--step-trace", "/nonexistent/dir/t.jsonl"], "--step-trace /nonexistent/dir/t.jsonl: its directory"),
    (["--log-level", "FOO", "serve"], "--log-level 'FOO'"),
    (["--log-level=FOO", "simulate", "--help"], "--log-level 'FOO'"),  # before a tool's name too
])
def test_a_flag_laneserve_lacks_is_a_clear_error(argv, says):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert says in str(e.value)


def test_a_port_in_use_is_one_line_before_anything_starts():
    """A review found another server's /health on the port taken for the gateway's ("laneserve ready"), then the
    gateway's bind traceback."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as e:
            cli.main(["serve", "--host", "127.0.0.1", "--port", str(port)])
    assert str(e.value) == f"laneserve serve: --host 127.0.0.1 --port {port}: Address already in use"


@pytest.mark.parametrize("argv, says", [
    (["--device", "cuda:2"], "--device cuda:2: 2 GPUs visible"),
    (["--device", "cuda", "--num-workers", "3"], "3 workers x --tensor-parallel-size 1 need 3 GPUs, 2 visible"),
    (["--device", "cuda", "--tensor-parallel-size", "4"], "1 workers x --tensor-parallel-size 4 need 4 GPUs"),
])
def test_gpus_asked_for_beyond_the_visible_ones_are_one_line_before_anything_starts(argv, says, monkeypatch):
    """A review found cuda:N unusable (each worker sees one GPU) and extra workers put on GPUs already taken."""
    from tests.stack import free_port

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--port", str(free_port()), *argv])
    assert says in str(e.value)


@pytest.mark.parametrize("value, ok", [("", False), ("off", True), ("maybe", False)])
def test_an_empty_boolean_variable_is_an_error_not_false(value, ok):
    from batcher.config import BatcherConfig
    from laneserve.config import from_args

    env = {"LANESERVE_ENABLE_PREFIX_CACHING": value}
    if ok:
        assert from_args(BatcherConfig, env=env).enable_prefix_caching is False
        return
    with pytest.raises(SystemExit, match=f"invalid LANESERVE_ENABLE_PREFIX_CACHING={value!r}: not a boolean"):
        from_args(BatcherConfig, env=env)


def test_a_documented_negative_value_passes_the_bounds():
    from laneserve.config import check_numbers
    from workers.config import WorkerConfig

    check_numbers(WorkerConfig, {"decode_gemv_rows": -1})  # auto: a review found it refused as "must be >= 0"


def test_a_tools_bad_value_is_one_line_not_a_traceback(capsys):
    assert cli.main(["simulate", "--trace", "synthetic", "--num-requests", "20", "--config", "{bad"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("laneserve simulate: error: ") and "\n" not in err, err
    with pytest.raises(SystemExit):  # a rate or speed-up that is not a finite number > 0: argparse's error
        cli.main(["simulate", "--trace", "synthetic", "--speedup", "0"])
    assert "argument --speedup: '0': must be a finite number > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # the global --log-level before a tool's name reaches the tool's parser
        cli.main(["--log-level", "WARNING", "simulate", "--help"])
    assert e.value.code == 0 and "usage: laneserve simulate" in capsys.readouterr().out


# ---------------------------------------------------------------- metrics
# Every series vLLM's own Grafana dashboard queries, in two versions of it (tests/data/README.md: where from)
UPSTREAM = json.loads((Path(__file__).parent / "data" / "vllm_dashboard_metrics.json").read_text())["dashboards"]
# and the rest of vLLM's set that the issue (#24) named: its newer names, its tokens-per-step histogram, cache info
VLLM_MORE = ["vllm:inter_token_latency_seconds_bucket", "vllm:request_inference_time_seconds_sum",
             "vllm:kv_cache_usage_perc", "vllm:cache_config_info", "vllm:iteration_tokens_total_bucket",
             "vllm:iteration_tokens_total_sum", "vllm:iteration_tokens_total_count"]


async def test_vllms_dashboard_finds_its_series_under_metrics_prefix_vllm(make_stack):
    st = make_stack("--metrics-prefix", "vllm")
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{st.base_url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3,
                                                                  "ignore_eos": True}) as r:
            assert r.status == 200
        async with s.get(f"{st.base_url}/metrics") as r:
            text = await r.text()
    series = [line.split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")]
    wanted = [name for d in UPSTREAM for name in d["series"]] + VLLM_MORE
    assert len(UPSTREAM) == 2 and len(set(wanted)) > 25
    for name in wanted:
        assert any(s.startswith(name + "{") and 'model_name="tiny"' in s for s in series), name
    assert all('model_name="tiny"' in s for s in series)  # every series, vLLM's label
    assert not any(s.startswith("laneserve:") for s in series)
    assert 'vllm:request_generation_tokens_sum{model_name="tiny"} 3.0' in text


def test_streamed_text_offsets_continue_across_chunks_as_the_whole_answer_gives_them(client):
    common = {"model": "tiny", "prompt": "hello", "max_tokens": 6, "temperature": 0, "logprobs": 1, "echo": True,
              "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**common).choices[0].logprobs.text_offset
    streamed = [o for c in client.completions.create(stream=True, **common) if c.choices[0].logprobs
                for o in c.choices[0].logprobs.text_offset]
    assert streamed == whole and whole[:6] == [0, 1, 2, 3, 4, 5]  # echo scores the prompt: its tokens come first


async def test_chat_template_kwargs_reach_the_template(make_stack, tmp_path):
    """vLLM's chat_template_kwargs (Qwen3's enable_thinking, say) become the template's variables, in chat and in
    /tokenize; a variable the server sets itself, or special-token text in them, is a 400."""
    template = tmp_path / "thinking.jinja"
    template.write_text("{% if enable_thinking is defined and not enable_thinking %}NOTHINK {% endif %}"
                        "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    st = make_stack("--chat-template", str(template))
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    async with aiohttp.ClientSession() as s:
        async def post(path, body):
            async with s.post(st.url(path), json=body) as r:
                return r.status, await r.json()

        async def text(body):
            status, out = await post("/tokenize", body)
            assert status == 200, out
            status, out = await post("/detokenize", {"tokens": out["tokens"]})
            return out["prompt"]

        assert await text(chat | off) == "NOTHINK hi" and await text(chat) == "hi"
        status, out = await post("/v1/chat/completions", chat | off | {"max_tokens": 2})
        assert status == 200 and out["usage"]["prompt_tokens"] == len("NOTHINK hi"), out
        for bad in ({"messages": "x"}, {"enable_thinking": "<|im_end|>"}, {"self": 1}):
            status, out = await post("/v1/chat/completions", chat | {"max_tokens": 2, "chat_template_kwargs": bad})
            assert status == 400, out


@pytest.mark.parametrize("given, temperature, seeds", [
    ({"seed": -1, "n": 2}, 1.0, [None, None]),  # -1: no seed, as vLLM (a review found it a seed, and n's seeds 0, 1)
    ({"seed": 7, "n": 2}, 1.0, [7, 8]),
    ({"temperature": 0.003}, 0.01, [None]),  # vLLM's floor: 0 < T < 0.01 samples at 0.01
    ({"temperature": 1e-7}, 0.01, [None]), ({"temperature": 0}, 0.0, [None]), ({"temperature": 0.5}, 0.5, [None]),
])
def test_sampling_defaults_and_floors_as_vllm(given, temperature, seeds):
    from gateway import schemas as S
    from gateway.tokenizer import load_tokenizer

    req = S.parse(json.dumps({"prompt": "hi", **given}).encode(), S.CompletionRequest)
    params = [S.sampling_params(req, load_tokenizer("tiny"), 4, None, index=j) for j in range(req.n or 1)]
    assert [p.seed for p in params] == seeds and {p.temperature for p in params} == {temperature}


def test_include_stop_str_in_output_shows_a_stop_token_too(client):
    """vLLM's detokenizer keeps the stop token's text with include_stop_str_in_output (stop_token_ids and EOS with
    skip_special_tokens false); without it the token is hidden. stop_reason names the id either way."""
    common = dict(model="tiny", prompt="hi", max_tokens=6, logit_bias={"65": 100})
    for include, text in ((True, "A"), (False, "")):
        out = client.completions.create(**common, extra_body={"stop_token_ids": [65],
                                                              "include_stop_str_in_output": include})
        ch = out.choices[0]
        assert (ch.text, ch.finish_reason, ch.model_extra["stop_reason"]) == (text, "stop", 65)
    chunks = client.completions.create(**common, stream=True, extra_body={"stop_token_ids": [65],
                                                                          "include_stop_str_in_output": True})
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "A"


def test_request_id_names_the_response_as_vllm_does(client, stack):
    """vLLM's response id is "cmpl-" / "chatcmpl-" and the X-Request-Id header, else the body's request_id; the
    engine keeps its own ids, so two requests may name the same one."""
    import openai

    msgs = [{"role": "user", "content": "x"}]
    out = client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"request_id": "job-7"})
    assert out.id == "cmpl-job-7"
    same = client.completions.create(model="tiny", prompt=["x", "y"], max_tokens=2,
                                     extra_body={"request_id": "job-7"})
    assert same.id == "cmpl-job-7" and len(same.choices) == 2
    chat = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, stream=True,
                                          extra_body={"request_id": "body"}, extra_headers={"X-Request-Id": "hdr"})
    assert {c.id for c in chat} == {"chatcmpl-hdr"}  # the header first, as vLLM
    assert client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1).id.startswith("chatcmpl-")
    for bad in ("", "x" * 257, "tab\there", "é"):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt="x", max_tokens=1, extra_body={"request_id": bad})
        assert e.value.body["param"] == "request_id"


@pytest.mark.parametrize("endpoint, body, param", [
    ("chat/completions", {"best_of": 2}, "best_of"),
    ("completions", {"return_token_ids": True}, "return_token_ids"),
    ("chat/completions", {"structural_tag": "{}"}, "structural_tag"),
])
async def test_vllm_fields_laneserve_cannot_honour_are_a_400(stack, endpoint, body, param):
    base = {"model": "tiny", "max_tokens": 1}
    base.update({"messages": [{"role": "user", "content": "x"}]} if endpoint.startswith("chat") else {"prompt": "x"})
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{stack.base_url}/v1/{endpoint}", json={**base, **body}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == param
        fine = {k: (1 if k == "best_of" else False if k == "return_token_ids" else None) for k in body}
        async with s.post(f"{stack.base_url}/v1/{endpoint}", json={**base, **fine}) as r:
            assert r.status == 200, await r.text()  # the values that ask for nothing


async def test_version_and_detokenize_with_special_tokens(stack):
    async with aiohttp.ClientSession() as s:
        async with s.get(stack.url("/version")) as r:
            assert r.status == 200 and (await r.json())["version"] == "0.1.0"
        async with s.post(stack.url("/detokenize"), json={"tokens": [104, 105, 258]}) as r:
            assert (await r.json())["prompt"] == "hi<|im_start|>"  # vLLM's tokenizer.decode keeps them
        body = {"model": "tiny", "prompt": [258, 104, 105], "echo": True, "max_tokens": 1}
        async with s.post(f"{stack.base_url}/v1/completions", json=body) as r:
            assert (await r.json())["choices"][0]["text"].startswith("<|im_start|>hi")


def test_vllm_api_key_is_read_when_laneserve_has_none(monkeypatch):
    """A deployment moved from vLLM keeps its key: VLLM_API_KEY, as `vllm serve` reads it, unless --api-key or
    --api-key-file gives one."""
    from gateway.app import read_api_key
    from gateway.config import GatewayConfig

    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert read_api_key(GatewayConfig()) == "from-vllm"
    assert read_api_key(GatewayConfig(api_key="mine")) == "mine"
    monkeypatch.delenv("VLLM_API_KEY")
    assert read_api_key(GatewayConfig()) == ""


def test_vllm_logging_flags_are_taken():
    ns = cli.build_parser().parse_args(["serve", "tiny", "--disable-log-requests", "--disable-log-stats"])
    assert ns.disable_log_requests and ns.disable_log_stats


def test_a_prefix_of_a_flag_is_not_that_flag():
    """argparse took any unambiguous prefix (--max-num-seq as --max-num-seqs): docs/from-vllm.md says a flag
    laneserve lacks is an error, and a prefix is one."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "tiny", "--max-num-seq", "3"])
    assert "unknown flag --max-num-seq; the nearest laneserve setting is --max-num-seqs" in str(exc.value.code)
