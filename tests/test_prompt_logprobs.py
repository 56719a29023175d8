"""Log-likelihood scoring (issue 24): vLLM's `prompt_logprobs` and OpenAI's `echo` + `logprobs` (with `max_tokens`
0) equal transformers' log_softmax on a tiny Llama checkpoint: in the worker chunk by chunk and after a resume, and
over HTTP through the openai SDK for a prompt of many prefill chunks, one sharing a cached prefix, a batch scored
as lm-eval-harness does, chat, a stream and a pool so small that requests are preempted. The batcher ends a
max_tokens 0 request after its prefill with one LENGTH delta and frees its blocks; bad values are 400s."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest
import torch

from batcher.scheduler import Scheduler
from gateway.output import ScoredPrompt
from laneserve.wire import protocol as P
from tests.helpers_models import DEVICE, Sim, greedy, hf_greedy, make_checkpoint, random_prompt
from tests.test_async_scheduling import AsyncDriver
from tests.test_checkpoint_serving import SPECIAL, write_word_tokenizer
from tests.test_scheduler import Driver, add, cfg
from workers.config import WorkerConfig
from workers.runner import ModelRunner

TOL = 2e-4  # fp32 on CPU: chunked attention sums in another order than transformers' one pass
CHUNK = 16  # --max-num-batched-tokens of the served stack: a prompt of 100 tokens is 7 prefill chunks
K = 3


@torch.no_grad()
def reference(hf, ids: list[int], k: int = K) -> list[tuple | None]:
    """transformers' scores of each prompt token: (logprob, rank, top-k ids, top-k logprobs); None for the first."""
    lp = hf(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)
    out: list[tuple | None] = [None]
    for j in range(1, len(ids)):
        row = lp[j - 1]
        values, top = row.topk(k)
        out.append((row[ids[j]].item(), int((row >= row[ids[j]]).sum()), top.tolist(), values.tolist()))
    return out


def assert_scores(got: list, ref: list, k: int = K) -> None:
    """got: per prompt token None or (logprob, rank or None when not shown, top ids, top logprobs), as reference()
    gives them."""
    assert len(got) == len(ref) and got[0] is None
    for j, (g, r) in enumerate(zip(got[1:], ref[1:]), 1):
        assert g[0] == pytest.approx(r[0], abs=TOL), j
        assert g[1] in (None, r[1]) and list(g[2]) == r[2][:k], j
        assert list(g[3]) == pytest.approx(r[3][:k], abs=TOL), j


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("scoring") / "llama-tiny")  # the served model's id is the folder's name
    hf = make_checkpoint(path, "llama", seed=11)
    write_word_tokenizer(path, hf.config.vocab_size)
    return path, hf


# ------------------------------------------------------------------ the worker
def scores_of(chunks: list[P.PromptLogprobs], num_prompt_tokens: int) -> list:
    """The chunks' entries by position (each position exactly once), None for the first token."""
    got: list = [None] * num_prompt_tokens
    for c in chunks:
        for j, e in enumerate(zip(c.token_logprobs, c.ranks, c.top_ids, c.top_logprobs), c.start):
            assert 1 <= j < num_prompt_tokens and got[j] is None, j
            got[j] = e
    return got


def test_worker_scores_every_chunk_and_again_after_a_resume(checkpoint):
    path, hf = checkpoint
    runner = ModelRunner(WorkerConfig(model=path, device=DEVICE, dtype="float32", kv_cache_memory="4MiB",
                                      max_model_len=512))
    prompt = random_prompt(70, seed=21)
    ref = reference(hf, prompt)
    sim = Sim(runner, budget=40)
    sim.add("score", prompt, greedy(0, prompt_logprobs=K), chunk=CHUNK)  # 5 chunks, nothing sampled
    sim.add("gen", prompt, greedy(6, prompt_logprobs=K), chunk=23)  # chunks that do not end on block boundaries
    sim.add("plain", random_prompt(30, seed=22), greedy(6))
    sim.run()
    assert sim.done["score"].out == [] and len(sim.done["score"].scored) == 5
    assert_scores(scores_of(sim.done["score"].scored, 70), ref)
    assert_scores(scores_of(sim.done["gen"].scored, 70), ref)
    assert sim.done["gen"].out == hf_greedy(hf, prompt, 6) and sim.done["plain"].scored == []
    # preempted and recomputed: a NewReq with its outputs; the prompt is scored again, the outputs are not
    sim = Sim(runner)
    sim.add("gen", prompt, greedy(6, prompt_logprobs=K), output_token_ids=hf_greedy(hf, prompt, 3), chunk=CHUNK)
    sim.run()
    assert_scores(scores_of(sim.done["gen"].scored, 70), ref)


# ------------------------------------------------------------------ the batcher
@pytest.mark.parametrize("driver", [Driver, AsyncDriver])  # one step in flight, two
@pytest.mark.parametrize("num_blocks", [64, 9])  # 9: the scored prompt is preempted at its last chunk, then redone
def test_max_tokens_0_ends_after_its_prefill_with_one_length_delta_and_frees_its_blocks(driver, num_blocks):
    s = Scheduler(cfg(max_num_batched_tokens=32, async_scheduling=driver is AsyncDriver), num_blocks, 16, 4096)
    d = driver(s)
    add(s, "gen", 30, base=500, max_tokens=40)
    d.step()
    add(s, "score", 100, max_tokens=0, prompt_logprobs=2)
    d.run()  # (no delta after a finish; every block free at the end)
    assert [(x.new_token_ids, x.finish_reason) for x in d.deltas if x.request_id == "score"] == [
        ([], P.FinishReason.LENGTH)]
    assert d.finish["gen"] == P.FinishReason.LENGTH and len(d.tokens["gen"]) == 40
    computed = sum(st.num_scheduled_tokens.get("score", 0) for st in d.steps)
    if num_blocks == 64:
        assert (computed, s.stats().preemptions) == (100, 0)
    else:  # preempted once, then computed again from its first token
        assert s.stats().preemptions == 1 and computed > 100


@pytest.mark.parametrize("driver", [Driver, AsyncDriver])
@pytest.mark.parametrize("length", [17, 33])
def test_max_tokens_0_whose_last_chunk_is_one_token_ends_with_length_not_an_error(driver, length):
    """A last prefill chunk of one token is scheduled as a decode: it must not expect a sampled token either."""
    s = Scheduler(cfg(max_num_batched_tokens=16, async_scheduling=driver is AsyncDriver), 64, 16, 4096)
    d = driver(s)
    add(s, "score", length, max_tokens=0, prompt_logprobs=1)
    d.run()
    (only,) = [x for x in d.deltas if x.request_id == "score"]
    assert (only.new_token_ids, only.finish_reason, only.error) == ([], P.FinishReason.LENGTH, None)
    assert only.queued_ms is not None and only.num_cached_tokens == 0  # what a first token's delta carries
    assert s.stats().kv_blocks_free == 64


def test_a_request_scoring_its_prompt_skips_the_prefix_cache():
    s = Scheduler(cfg(), 64, 16, 4096)
    d = Driver(s)
    add(s, "first", 64, max_tokens=2)
    d.run()
    add(s, "scored", 64, max_tokens=2, prompt_logprobs=0)
    add(s, "plain", 64, max_tokens=2)
    d.run()
    computed = {nr.request_id: nr.num_computed_tokens for st in d.steps for nr in st.new_reqs}
    assert computed == {"first": 0, "scored": 0, "plain": 48}


# ------------------------------------------------------------------ the gateway
def test_the_gateway_keeps_the_latest_score_per_position_and_drops_what_is_past_the_prompt():
    scores = ScoredPrompt([5, 6, 7, 8], field_k=1, echo_k=None)

    def chunk(start, lps):
        return P.PromptLogprobs(start, lps, [1] * len(lps), [[9]] * len(lps), [-0.5] * len(lps))

    scores.add(chunk(1, [-1.0, -2.0]))
    assert not scores.complete
    scores.add(chunk(1, [-1.5, -2.5, -3.5, -4.5, -5.5]))  # rescored after a preemption; a requeue's longer prompt
    assert scores.complete and [e and e[0] for e in scores.entries] == [None, -1.5, -2.5, -3.5]


# ------------------------------------------------------------------ over HTTP
@pytest.fixture(scope="module")
def served(checkpoint):
    from tests.stack import Stack

    path, hf = checkpoint
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    st = Stack("--model", path, "--max-num-batched-tokens", str(CHUNK), "--chat-template", template)
    yield st, hf
    st.stop()


@pytest.fixture(scope="module")
def client(served):
    import openai

    return openai.OpenAI(base_url=served[0].api, api_key="none", max_retries=0, timeout=120)


def prompt_ids(n: int, seed: int) -> list[int]:
    """A random prompt of plain words (no special token, which text leaves out)."""
    return [SPECIAL + t % (128 - SPECIAL) for t in random_prompt(n, seed)]


def words(ids: list[int]) -> list[str]:
    return [f"w{t}" for t in ids]


def echo_scores(lp, k: int = K) -> list:
    """Echo's logprobs as reference() tuples (OpenAI's shape has no rank); checks that a token outside the top k
    follows them in its top_logprobs (OpenAI's and vLLM's k + 1 entries), with its own logprob."""
    out = []
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        if v is None:
            out.append(None)
            continue
        items = list(top.items())
        assert len(items) == k or len(items) == k + 1 and items[-1] == (tok, v), (tok, v, items)
        out.append((v, None, [token_id(t) for t, _ in items[:k]], [x for _, x in items[:k]]))
    return out


def token_id(text: str) -> int:
    """The word tokenizer's id of a token's text."""
    return {"<unk>": 0, "<s>": 1, "</s>": 2}.get(text) or int(text[1:])


def field_scores(entries: list, prompt: list[int], k: int = K) -> list:
    """vLLM's prompt_logprobs as reference() tuples; checks each entry's shape: the prompt's own token first (its
    rank), then the top-k with ranks 1..k (the own token's entry is theirs when it is among them), each with its
    decoded_token."""
    out: list = [None]
    assert entries[0] is None
    for t, e in zip(prompt[1:], entries[1:]):
        own = e[str(t)]
        top = sorted(((int(i), v) for i, v in e.items() if v["rank"] <= k), key=lambda x: x[1]["rank"])
        assert list(e)[0] == str(t) and len(e) == k + (own["rank"] > k) and len(top) == k
        assert [v["rank"] for _, v in top] == list(range(1, k + 1))
        assert all(v["decoded_token"] == f"w{i}" for i, v in e.items() if int(i) >= SPECIAL)
        out.append((own["logprob"], own["rank"], [i for i, _ in top], [v["logprob"] for _, v in top]))
    return out


def test_echo_scoring_with_max_tokens_0_equals_transformers_over_many_chunks(served, client):
    _, hf = served
    prompt = prompt_ids(100, seed=31)
    ref = reference(hf, prompt)
    out = client.completions.create(model="llama-tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=K)
    ch = out.choices[0]
    assert ch.finish_reason == "length" and ch.text.split() == words(prompt) and out.usage.completion_tokens == 0
    lp = ch.logprobs
    assert lp.tokens == words(prompt) and lp.top_logprobs[0] is None
    assert_scores(echo_scores(lp), ref)
    assert lp.text_offset == [sum(len(w) for w in words(prompt[:i])) for i in range(100)]  # vLLM's: token texts
    assert_scores(field_scores(ch.model_extra["prompt_logprobs"], prompt), ref)  # vLLM fills it with echo too


def test_prompt_logprobs_field_is_vllms_and_equals_transformers_while_generating(served, client):
    _, hf = served
    prompt = prompt_ids(45, seed=32)
    out = client.completions.create(model="llama-tiny", prompt=prompt, max_tokens=8, temperature=0,
                                    extra_body={"prompt_logprobs": 2, "ignore_eos": True})
    ch = out.choices[0]
    assert ch.text.split() == words(t for t in hf_greedy(hf, prompt, 8) if t >= SPECIAL) and ch.logprobs is None
    assert_scores(field_scores(ch.model_extra["prompt_logprobs"], prompt, 2), reference(hf, prompt), 2)
    zero = client.completions.create(model="llama-tiny", prompt=prompt[:5], max_tokens=1,
                                     extra_body={"prompt_logprobs": 0})
    assert [e and list(e) for e in zero.choices[0].model_extra["prompt_logprobs"]] == [None] + [
        [str(t)] for t in prompt[1:5]]  # k = 0: the prompt's own token alone


def _metric(st, name: str) -> float:
    with urllib.request.urlopen(st.url("/metrics")) as resp:
        text = resp.read().decode()
    return float(re.search(rf'^laneserve:{name}{{model_name="llama-tiny"}} ([0-9.e+-]+)$', text, re.M).group(1))


def test_a_prompt_sharing_a_cached_prefix_is_scored_in_full(served, client):
    st, hf = served
    shared = prompt_ids(64, seed=33)
    client.completions.create(model="llama-tiny", prompt=shared + [7, 8], max_tokens=1)  # its blocks are cached now
    prompt = shared + prompt_ids(20, seed=34)
    hits = _metric(st, "prefix_cache_hits_total")
    out = client.completions.create(model="llama-tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=K)
    assert _metric(st, "prefix_cache_hits_total") == hits  # not looked up: every position computed
    ref = reference(hf, prompt)
    assert_scores(field_scores(out.choices[0].model_extra["prompt_logprobs"], prompt), ref)
    client.completions.create(model="llama-tiny", prompt=prompt, max_tokens=1)
    assert _metric(st, "prefix_cache_hits_total") >= hits + 64  # the same prompt without scoring: served from it


def test_a_batch_scored_as_lm_eval_harness_does(served, client):
    """lm-eval-harness's loglikelihood over the completions API: echo, logprobs 1, temperature 0, the prompt as token
    ids (context + continuation); the continuation's logprob is the sum past the context, is_greedy when each of
    its tokens is the top one. Its older form asks max_tokens 0, its newer one max_tokens 1 and drops the last."""
    _, hf = served
    pairs = [(prompt_ids(n, seed=40 + n), prompt_ids(m, seed=50 + m)) for n, m in ((5, 3), (37, 1), (20, 12))]
    pairs.append((pairs[0][0], hf_greedy(hf, pairs[0][0], 4)))  # a greedy continuation
    refs = [reference(hf, ctx + cont, 1)[len(ctx):] for ctx, cont in pairs]
    expected = [(sum(r[0] for r in ref), all(r[1] == 1 for r in ref)) for ref in refs]  # (loglikelihood, is_greedy)
    assert expected[-1][1]  # the last continuation is the model's own
    for max_tokens, cut in ((0, None), (1, -1)):
        out = client.completions.create(model="llama-tiny", prompt=[c + x for c, x in pairs], max_tokens=max_tokens,
                                        echo=True, logprobs=1, temperature=0)
        assert [ch.index for ch in out.choices] == list(range(len(pairs)))
        for ch, (ctx, _), (loglikelihood, is_greedy) in zip(out.choices, pairs, expected):
            lp = ch.logprobs
            assert sum(lp.token_logprobs[len(ctx):cut]) == pytest.approx(loglikelihood, abs=TOL)
            assert all(t == max(top, key=top.get) for t, top in
                       zip(lp.tokens[len(ctx):cut], lp.top_logprobs[len(ctx):cut])) == is_greedy


def test_chat_prompt_logprobs_beside_the_choices(served, client):
    st, hf = served
    messages = [{"role": "user", "content": " ".join(words(prompt_ids(30, seed=35)))}]
    body = json.dumps({"model": "llama-tiny", "messages": messages}).encode()
    req = urllib.request.Request(st.url("/tokenize"), data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as resp:
        ids = json.loads(resp.read())["tokens"]
    out = client.chat.completions.create(model="llama-tiny", messages=messages, max_tokens=2, n=2,
                                         extra_body={"prompt_logprobs": K})
    assert "prompt_logprobs" not in out.choices[0].model_extra
    assert_scores(field_scores(out.model_extra["prompt_logprobs"], ids), reference(hf, ids))


def test_streamed_echo_carries_the_prompt_scores_before_the_text(served, client):
    _, hf = served
    prompt = prompt_ids(50, seed=36)
    whole = client.completions.create(model="llama-tiny", prompt=prompt, max_tokens=3, echo=True, logprobs=2,
                                      temperature=0, extra_body={"ignore_eos": True}).choices[0].logprobs
    chunks = list(client.completions.create(model="llama-tiny", prompt=prompt, max_tokens=3, echo=True, logprobs=2,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    first = chunks[0].choices[0]
    assert first.text.split() == words(prompt) and len(first.logprobs.tokens) == 50
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    joined = {f: [v for lp in streamed for v in getattr(lp, f)] for f in ("tokens", "text_offset", "token_logprobs")}
    assert joined["tokens"] == whole.tokens and joined["text_offset"] == whole.text_offset
    lps = joined["token_logprobs"]
    assert lps[0] is None and lps[1:] == pytest.approx(whole.token_logprobs[1:], abs=TOL)
    scored = list(client.completions.create(model="llama-tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=2,
                                            stream=True))
    assert [c.choices[0].finish_reason for c in scored] == [None, "length"]  # echo chunk, then its one end
    assert scored[0].choices[0].logprobs.token_logprobs[1:] == pytest.approx(whole.token_logprobs[1:50])


def test_preempted_requests_keep_their_prompt_scores(checkpoint, make_stack):
    """A pool of 12 blocks for two requests of 8 blocks each: one is preempted and recomputed (its prompt scored
    twice); each answer still has its prompt's scores once, equal to transformers', and its greedy tokens."""
    import openai

    path, hf = checkpoint
    st = make_stack("--model", path, "--max-num-batched-tokens", str(CHUNK), "--max-model-len", "128",
                    "--kv-cache-memory", str(12 * 2 * 2 * 2 * 16 * 16 * 4))
    client = openai.OpenAI(base_url=st.api, api_key="none", max_retries=0, timeout=120)
    prompts = [prompt_ids(40, seed=60 + i) for i in range(2)]
    out = client.completions.create(model="llama-tiny", prompt=prompts, max_tokens=80, echo=True, logprobs=K,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert _metric(st, "num_preemptions_total") > 0
    for ch in sorted(out.choices, key=lambda c: c.index):
        prompt = prompts[ch.index]
        ref = reference(hf, prompt)
        assert_scores(field_scores(ch.model_extra["prompt_logprobs"], prompt), ref)
        assert len(ch.logprobs.tokens) == 40 + 80 and ch.logprobs.token_logprobs[0] is None
        assert ch.text.split() == words(prompt) + words(t for t in hf_greedy(hf, prompt, 80) if t >= SPECIAL)


def post(st, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(st.url(path), data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read()) if not body.get("stream") else {}
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("body, param", [
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),  # vLLM's --max-logprobs default
    ({"prompt_logprobs": "2"}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # vLLM: not available in a stream
    ({"echo": True, "logprobs": 21}, "logprobs"),
    ({"max_tokens": 0}, "max_tokens"),  # 0 only with echo (vLLM's rule)
    ({"max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
    ({"max_tokens": -1, "echo": True}, "max_tokens"),
    ({"prompt": [[5] * 300] * 10, "n": 20, "prompt_logprobs": 20}, "prompt_logprobs"),  # 1.26M scores to hold
])
def test_bad_scoring_values_are_400s(served, body, param):
    st, _ = served
    status, err = post(st, "/v1/completions", {"model": "llama-tiny", "prompt": [5, 6, 7], "max_tokens": 1, **body})
    assert status == 400 and err["error"]["param"] == param, err


def test_chat_has_no_max_tokens_0_and_a_stream_accepts_prompt_logprobs_0(served):
    st, _ = served
    chat = {"model": "llama-tiny", "messages": [{"role": "user", "content": "w5"}]}
    for body in ({"max_tokens": 0}, {"max_tokens": 0, "echo": True}, {"prompt_logprobs": 2, "stream": True}):
        status, err = post(st, "/v1/chat/completions", {**chat, **body})
        assert status == 400 and err["error"]["param"] in ("max_tokens", "prompt_logprobs", "echo"), err  # (chat has
        # no echo either)
    for path, body in (("/v1/completions", {"prompt": [5, 6, 7]}), ("/v1/chat/completions", chat)):
        status, _ = post(st, path, {"model": "llama-tiny", "max_tokens": 1, "stream": True, "prompt_logprobs": 0,
                                    **body})
        assert status == 200  # vLLM accepts 0 in a stream, and shows none
