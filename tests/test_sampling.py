"""workers/sampling.py on small hand-checked tensors: masks, penalty formulas, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from laneserve.wire.protocol import SamplingParams
from workers.sampling import SampleRow, apply_penalties, min_p_mask, sample, seed_for, top_k_top_p_mask


def row(tokens=(1, 2), prompt=1, **kw) -> SampleRow:
    return SampleRow(SamplingParams(**kw), list(tokens), prompt)


def test_top_k_mask_keeps_the_k_largest_per_row():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [1.0, 4.0, 3.0, 2.0], [1.0, 4.0, 3.0, 2.0]])
    drop = top_k_top_p_mask(logits, torch.tensor([2, 0, 10]), torch.tensor([1.0, 1.0, 1.0]))
    assert drop.tolist() == [[True, False, False, True], [False] * 4, [False] * 4]


def test_top_k_keeps_tokens_tied_with_the_kth_as_vllm():
    logits = torch.tensor([[2.0, 2.0, 1.0, 0.0], [3.0, 1.0, 1.0, 1.0]])
    drop = top_k_top_p_mask(logits, torch.tensor([1, 2]), torch.tensor([1.0, 1.0]))
    assert drop.tolist() == [[False, False, True, True], [False] * 4]


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    drop = top_k_top_p_mask(logits, torch.tensor([0]), torch.tensor([0.75]))
    assert drop.tolist() == [[True, False, True, False]]  # 0.5 + 0.3 >= 0.75
    drop = top_k_top_p_mask(logits, torch.tensor([0]), torch.tensor([0.4]))
    assert drop.tolist() == [[True, False, True, True]]  # the top token alone reaches 0.4


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    logits = torch.tensor([[0.05, 0.5, 0.15, 0.3]]).log()
    # top-2 renormalised: 0.625, 0.375 -> top_p 0.6 keeps only the first
    drop = top_k_top_p_mask(logits, torch.tensor([2]), torch.tensor([0.6]))
    assert drop.tolist() == [[True, False, True, True]]


def test_min_p_drops_tokens_below_fraction_of_top_prob():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]])
    drop = min_p_mask(probs, torch.tensor([0.2, 0.5]))
    assert drop.tolist() == [[False, False, False, True], [False, False, True, True]]


def test_penalties_follow_vllm_formulas():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0]])
    # prompt [0, 1]; output [2, 2, 3]
    r = row(tokens=[0, 1, 2, 2, 3], prompt=2, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    apply_penalties(logits, [r])
    expected = [2.0 / 2, -2.0 * 2, 2.0 / 2 - 0.5 * 2 - 0.25, -2.0 * 2 - 0.5 - 0.25, 1.0]
    assert logits[0].tolist() == pytest.approx(expected)


def test_frequency_and_presence_ignore_prompt_tokens():
    logits = torch.zeros(1, 3)
    apply_penalties(logits, [row(tokens=[0, 0, 1], prompt=2, frequency_penalty=1.0, presence_penalty=1.0)])
    assert logits[0].tolist() == [0.0, -2.0, 0.0]


def test_greedy_and_penalised_greedy():
    logits = torch.tensor([[0.0, 3.0, 2.9], [0.0, 3.0, 2.9]])
    rows = [row(tokens=[5, 1], prompt=1, temperature=0.0),
            row(tokens=[5, 1], prompt=1, temperature=0.0, presence_penalty=0.5)]
    tokens, logprobs = sample(logits, rows)
    assert tokens == [1, 2] and logprobs is None


def test_min_tokens_masks_stop_tokens_until_reached():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    rows = [row(tokens=[0, 2], prompt=1, temperature=0.0, min_tokens=2, stop_token_ids=(1,)),
            row(tokens=[0, 2, 2], prompt=1, temperature=0.0, min_tokens=2, stop_token_ids=(1,))]
    assert sample(logits, rows)[0] == [2, 1]


def test_top_k_one_is_greedy_at_any_temperature():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0))
    tokens, _ = sample(logits, [row(temperature=5.0, top_k=1)] * 16)
    assert tokens == logits.argmax(-1).tolist()


def test_sampling_frequencies_follow_softmax_with_temperature():
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5])
    n = 4000
    torch.manual_seed(0)
    tokens, _ = sample(logits.expand(n, 4), [row(temperature=2.0)] * n)
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / n
    expected = (logits / 2.0).softmax(-1)
    assert (freq - expected).abs().max() < 0.03, (freq, expected)


def test_seeded_rows_ignore_batch_mates_and_depend_on_output_index():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(1))
    seeded = row(tokens=[1, 2, 3], prompt=1, temperature=1.0, seed=42)
    alone = [sample(logits, [seeded])[0][0] for _ in range(3)]
    assert len(set(alone)) == 1
    noise = torch.randn(4, 100)
    batch = torch.cat([noise[:2], logits, noise[2:]])
    mates = [row(temperature=1.0), row(temperature=0.0), seeded, row(temperature=0.7, seed=1), row(top_p=0.5)]
    assert sample(batch, mates)[0][2] == alone[0]
    # the noise is keyed on (seed, output index): different index, different draw (almost surely over 20)
    draws = {sample(logits, [row(tokens=[1] * (2 + i), prompt=1, temperature=1.0, seed=42)])[0][0] for i in range(20)}
    assert len(draws) > 1
    assert seed_for(42, 0) != seed_for(42, 1) != seed_for(43, 0)


def test_seeded_rows_with_filters_on_tied_bf16_logits_ignore_their_batch_on_the_device():
    """A seeded row's token is the same alone, in a batch of other filters, in a slice of it and again, where bf16
    logits tie often at the top-k / top-p cutoff (WORKER_TEST_DEVICE=cuda runs it on a GPU: its sort and cumsum
    must not depend on the batch's shape)."""
    from tests.helpers_models import DEVICE

    torch.manual_seed(0)
    logits = (torch.randn(6, 3000) * 4).bfloat16().to(DEVICE)
    kinds = [dict(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05), dict(temperature=1.0, top_k=20),
             dict(temperature=1.3, top_p=0.95), dict(temperature=0.0), dict(temperature=1.0, min_p=0.1)]
    for i in range(6):
        seeded = row(tokens=[1] * 5, prompt=5, seed=1000 + i, **kinds[i % len(kinds)])
        mates = [row(tokens=[1] * 5, prompt=5, temperature=1.0, top_k=j % 7, top_p=0.5 + 0.05 * j,
                     presence_penalty=0.1 * (j % 3)) for j in range(6)]
        mates[i] = seeded
        alone = sample(logits[i:i + 1], [seeded])[0][0]
        assert alone == sample(logits, mates)[0][i] == sample(logits[:i + 1], mates[:i + 1])[0][-1], i
        assert sample(logits[i:i + 1], [seeded])[0][0] == alone


def test_logprobs_are_raw_model_logprobs_with_top_n():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [1.0, 3.0, 2.0, 0.0]])
    rows = [row(temperature=0.0, logprobs=2, presence_penalty=10.0, tokens=[0, 1]), row(temperature=0.0)]
    tokens, logprobs = sample(logits, rows)
    raw = logits[0].log_softmax(-1)
    assert tokens[0] == 2  # the penalty moved the choice ...
    assert logprobs[0].logprob == pytest.approx(raw[2].item())  # ... but logprobs are the raw model's
    assert logprobs[0].top_ids == [1, 2]
    assert logprobs[0].top_logprobs == pytest.approx([raw[1].item(), raw[2].item()])
    assert logprobs[1] is None
    assert math.isclose(sum(math.exp(v) for v in raw.tolist()), 1.0, rel_tol=1e-6)
