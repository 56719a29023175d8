"""gateway/tokenizer.py and gateway/detokenizer.py without a server: the tiny tokenizer's spec, HF
directories (chat template rendered as transformers does), incremental detokenization and stop strings."""

from __future__ import annotations

import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gateway.detokenizer import MAX_HELD, IncrementalDetokenizer, StopStrings, TextStream
from gateway.tokenizer import CHATML_TEMPLATE, build_tiny_tokenizer, load_tokenizer
from laneserve import modelspec

TINY = load_tokenizer("tiny")


def test_tiny_tokenizer_is_byte_level_with_four_specials():
    text = "Hello, lanes € ✓"
    assert TINY.encode(text) == list(text.encode())
    assert TINY.encode("<s><|im_start|>x<|im_end|></s>") == [256, 258, ord("x"), 259, 257]
    assert TINY.decode(list(text.encode())) == text
    assert TINY.decode([256, 104, 257]) == "h"
    assert TINY.decode([256, 104, 257], skip_special_tokens=False) == "<s>h</s>"
    assert TINY.eos_token_ids == (257, 259)
    assert TINY.bos_token_id == 256 and TINY.model_id == "tiny"
    assert TINY.vocab_size >= 260 and TINY.max_model_len == 8192


def test_tiny_chat_template_is_chatml():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert TINY.apply_chat_template(msgs) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert TINY.apply_chat_template(msgs, add_generation_prompt=False).endswith("hi<|im_end|>\n")
    ids = TINY.encode(TINY.apply_chat_template(msgs), add_special_tokens=False)
    assert ids[0] == 258 and ids.count(259) == 2


LLAMA_LIKE_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] | trim + ' [/INST]' }}"
    "{% else %}{{ message['content'] | tojson + eos_token }}{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf_model")
    build_tiny_tokenizer().save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True}, "eos_token": "</s>", "chat_template": LLAMA_LIKE_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 259, 7]}))
    (d / "config.json").write_text(json.dumps({"max_position_embeddings": 1024, "vocab_size": 300}))
    return d


def test_hf_dir_reads_template_bos_eos_generation_config_and_limits(hf_dir):
    tok = load_tokenizer(str(hf_dir))
    assert tok.model_id == hf_dir.name
    assert tok.eos_token_ids == (257, 259, 7)
    assert tok.max_model_len == 1024 and tok.vocab_size == 300
    assert tok.encode("ab") == [256, 97, 98]  # add_bos_token, as HF's LlamaTokenizerFast
    assert tok.encode("ab", add_special_tokens=False) == [97, 98]
    assert load_tokenizer(str(hf_dir), served_model_name="m", max_model_len=64).max_model_len == 64


def test_hf_dir_chat_template_renders_like_transformers(hf_dir):
    from transformers import PreTrainedTokenizerFast

    ours = load_tokenizer(str(hf_dir))
    theirs = PreTrainedTokenizerFast.from_pretrained(str(hf_dir))
    msgs = [{"role": "user", "content": " hi \n"}, {"role": "assistant", "content": "yo \"€\""},
            {"role": "user", "content": "more"}]
    assert ours.apply_chat_template(msgs) == theirs.apply_chat_template(msgs, tokenize=False)
    bad = [{"role": "assistant", "content": "x"}]
    with pytest.raises(ValueError, match="alternate"):
        ours.apply_chat_template(bad)


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=40))
def test_incremental_detokenization_reassembles_text_and_never_splits_a_character(text):
    # A special token's text ("<s>") encodes to that token, which detokenization skips (as HF and vLLM do).
    assume(not any(t in text for t in modelspec.TINY_SPECIAL_TOKENS))
    ids = TINY.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(TINY, prompt_ids=TINY.encode("ctx: "))
    pieces = [detok.step(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == text
    if "\ufffd" not in text:
        assert not any("\ufffd" in p for p in pieces)


def test_an_incomplete_character_is_held_then_flushed_as_replacement():
    detok = IncrementalDetokenizer(TINY)
    assert [detok.step(t) for t in "€".encode()] == ["", "", "€"]
    assert detok.step(0xE2) == ""  # first byte of a 3-byte character, never completed
    assert detok.flush() == "\ufffd"


def test_tokens_that_never_decode_are_emitted_as_they_come_in_a_bounded_window():
    # lone continuation bytes (a model can sample them forever) and skipped special tokens: each step decodes a
    # window of at most 2 x MAX_HELD tokens, and the text comes out as the tokens do, not all at the end
    for token, text in ((0x80, "\ufffd"), (258, "")):
        detok = IncrementalDetokenizer(TINY, prompt_ids=TINY.encode("ctx: "))
        pieces = []
        for _ in range(1000):
            pieces.append(detok.step(token))
            assert len(detok.ids) - detok.prefix_offset <= 2 * MAX_HELD + 1
        pieces.append(detok.flush())
        assert "".join(pieces) == text * 1000
        streamed = "".join(pieces[:-1])
        assert streamed == text * len(streamed) and (not text or len(streamed) >= 1000 - MAX_HELD)
    # a character that completes after such a run still comes out whole
    detok = IncrementalDetokenizer(TINY)
    ids = [0x80] * (MAX_HELD + 5) + list("€ok".encode())
    assert "".join([detok.step(t) for t in ids] + [detok.flush()]) == "\ufffd" * (MAX_HELD + 5) + "€ok"
    # skipped special tokens inside a character add no text and hold nothing back: it still comes out whole, as a
    # full decode gives it (they once counted toward MAX_HELD, flushing the character's first bytes as U+FFFD)
    ids = list("Hi ".encode()) + list("😀".encode()[:2]) + [258] * (MAX_HELD + 2) + list("😀".encode()[2:])
    detok = IncrementalDetokenizer(TINY)
    assert "".join([detok.step(t) for t in ids] + [detok.flush()]) == TINY.decode(ids) == "Hi 😀"


def _reference_stop(text: str, stops: list[str]) -> str:
    """Char-by-char: cut at the first stop string to be completed (the longest of those ending together)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if s and text[:end].endswith(s)]
        if done:
            return text[:end - max(map(len, done))]
    return text


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet="abc€", max_size=30), stops=st.lists(st.text(alphabet="abc€", min_size=1, max_size=4),
                                                               max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=8))
def test_stop_strings_never_leak_across_chunk_boundaries(text, stops, cuts):
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    s = StopStrings(stops)
    out = "".join(s.push(c) for c in chunks) + s.flush()
    assert text.startswith(out)
    if s.matched is None:
        assert out == text and not any(x in text for x in stops)
    else:
        assert text[len(out):].startswith(s.matched)
        assert not any(x in out for x in stops)
    single = StopStrings(stops)
    out_by_char = "".join(single.push(ch) for ch in text) + single.flush()
    assert out_by_char == _reference_stop(text, stops)


def test_stop_string_inside_one_chunk_and_include_stop_str():
    s = StopStrings(["STOP", "xx"], include_stop_str=True)
    assert s.push("abcST") == "ab"  # 'cST' (longest stop - 1 chars) held: 'ST' could begin 'STOP'
    assert s.push("OPmore") == "cSTOP" and s.matched == "STOP"
    assert s.push("later") == "" and s.flush() == ""


def test_text_stream_hides_the_stop_token_but_counts_it_and_cuts_at_stop_strings():
    ts = TextStream(TINY, TINY.encode("q"), stops=["lo w"])
    out = ts.add(TINY.encode("hel")) + ts.add(TINY.encode("lo wor"))
    assert out == "hel" and ts.stop_str == "lo w" and ts.num_tokens == 7  # stops consuming at the match
    ts = TextStream(TINY, None)
    assert ts.add([104, 105, 257], hide_last=True) == "hi" and ts.num_tokens == 3
    assert ts.finish() == ""


def test_stop_strings_wait_for_min_tokens_as_vllm():
    """vLLM checks stop strings only once more than min_tokens tokens were generated; one that begins within them
    and ends after is still found (the held-back tail)."""
    ts = TextStream(TINY, None, stops=["a", "xyz"], min_tokens=3)
    assert ts.add(TINY.encode("aaa")) == "a" and ts.stop_str is None  # 'aa' held back ('xyz' is 3 long)
    assert ts.add(TINY.encode("ba")) == "aab" and ts.stop_str == "a"  # the fifth token's 'a' ends it
    ts = TextStream(TINY, None, stops=["xyz"], min_tokens=2)
    assert ts.add(TINY.encode("xy")) == "" and ts.add(TINY.encode("z")) == "" and ts.stop_str == "xyz"


@pytest.mark.parametrize("mode", ["auto", "vllm"])
def test_the_models_generation_config_sets_a_requests_sampling_defaults_as_vllm(hf_dir, tmp_path, mode):
    """vLLM's --generation-config auto (its default): a model dir's sampling values are the defaults of a request
    that leaves them out (a review found them ignored: Qwen2.5 sampled at temperature 1 where vLLM uses 0.7)."""
    import shutil

    from gateway import schemas as S
    from gateway.app import API_KEY, create_app
    from gateway.config import GatewayConfig

    d = tmp_path / "m"
    shutil.copytree(hf_dir, d)
    (d / "generation_config.json").write_text(json.dumps({
        "eos_token_id": 257, "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
        "repetition_penalty": 1.05, "max_new_tokens": 10}))
    app = create_app(GatewayConfig(model=str(d), generation_config=mode, batcher_address=f"ipc://{tmp_path}/b"))
    tok = app[API_KEY].tok
    params = [S.sampling_params(S.parse(json.dumps(body).encode(), S.CompletionRequest), tok, 4, None)
              for body in ({"prompt": "x"}, {"prompt": "x", "temperature": 0, "top_k": -1, "top_p": 1})]
    penalty = 1.05 if mode == "auto" else 1.0  # (the second request leaves it out too)
    assert [(p.temperature, p.top_p, p.top_k, p.repetition_penalty) for p in params] == [
        (0.7, 0.8, 20, 1.05) if mode == "auto" else (1.0, 1.0, 0, 1.0), (0.0, 1.0, 0, penalty)]
    (d / "generation_config.json").write_text(json.dumps({"top_p": 2.0}))
    with pytest.raises(SystemExit, match=r"generation_config\.json: top_p must be in \(0\.0, 1\.0\], got 2\.0"):
        create_app(GatewayConfig(model=str(d), batcher_address=f"ipc://{tmp_path}/b"))


def test_a_request_may_name_the_model_by_the_model_flag_as_vllm_serves_it(hf_dir, tmp_path):
    """vLLM serves `--model PATH` as PATH; ours as the dir's name, and a request giving PATH got a 404 (a review)."""
    from gateway.app import API_KEY, create_app
    from gateway.config import GatewayConfig
    from gateway.errors import ApiError

    path = str(hf_dir)
    api = create_app(GatewayConfig(model=path + "/", batcher_address=f"ipc://{tmp_path}/b"))[API_KEY]
    for name in (path + "/", path, hf_dir.name, None):  # (as given, without its trailing slash, the dir's name)
        api._check_model(name)
    named = create_app(GatewayConfig(model=path, served_model_name="m", batcher_address=f"ipc://{tmp_path}/b"))
    for name in (path, hf_dir.name):  # --served-model-name: that name alone, as vLLM
        with pytest.raises(ApiError, match="does not exist"):
            named[API_KEY]._check_model(name)
    named[API_KEY]._check_model("m")
