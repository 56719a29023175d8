"""Issue 3's "done when": `laneserve serve --model DIR` serves a local HF checkpoint over HTTP with
greedy output identical to transformers."""

from __future__ import annotations

import json
import os

import aiohttp

from tests.helpers_models import hf_greedy, make_checkpoint, random_prompt

SPECIAL = 3  # ids 0..2 are <unk>, <s>, </s>: not shown in text


def write_word_tokenizer(path: str, vocab_size: int) -> None:
    """A word-level tokenizer whose text maps back to ids one to one ("w17 w3 ...")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(SPECIAL, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False}, f)


async def test_served_checkpoint_greedy_equals_transformers(tmp_path, make_stack):
    path = str(tmp_path / "llama-tiny")
    hf = make_checkpoint(path, "llama", seed=5)
    write_word_tokenizer(path, hf.config.vocab_size)
    st = make_stack("--model", path)
    prompts = [random_prompt(n, seed=n, vocab=hf.config.vocab_size) for n in (7, 30)]
    async with aiohttp.ClientSession() as s:
        async with s.get(st.url("/v1/models")) as resp:
            assert [m["id"] for m in (await resp.json())["data"]] == ["llama-tiny"]
        for prompt in prompts:
            body = {"model": "llama-tiny", "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
            async with s.post(st.url("/v1/completions"), json=body) as resp:
                assert resp.status == 200, await resp.text()
                out = await resp.json()
            expected = [f"w{t}" for t in hf_greedy(hf, prompt, 32) if t >= SPECIAL]
            assert out["choices"][0]["text"].split() == expected
            assert out["usage"]["completion_tokens"] == 32
