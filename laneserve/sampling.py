"""The bounds of the sampling and scheduling parameters of a request, in one place.

The gateway checks a request's fields with them (a 400 naming the field) and the batcher checks every
AddRequest's SamplingParams again (a peer may skip the gateway): a value out of these bounds would fail or
stall a worker's step, and every request in it. Torch-free, no I/O.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's bound: each in [-100, 100])
# distinct stop_token_ids with the model's EOS ids (the gateway adds those). Each AddRequest carries them and, while
# min_tokens holds, the worker masks them row by row each step, as it adds logit_bias's: the same bound (unbounded, a
# vocabulary's ids x 256 choices stalled the gateway's loop and every step)
MAX_STOP_TOKEN_IDS = MAX_LOGIT_BIAS
MAX_PRIORITY = 2**31  # |priority|: lower goes first (vLLM's rule)
MAX_SLO_MS = 3_600_000.0  # an SLO target of more than an hour is a typo, not a target
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1

# float parameters: name -> (low, high, low excluded)
FLOAT_RANGES = {
    "temperature": (0.0, 1e6, False),  # 0 = greedy
    "top_p": (0.0, 1.0, True),
    "min_p": (0.0, 1.0, False),
    "presence_penalty": (-2.0, 2.0, False),
    "frequency_penalty": (-2.0, 2.0, False),
    "repetition_penalty": (0.0, 1e3, True),
}
# integer parameters: name -> (low, high)
INT_RANGES = {
    "max_tokens": (0, 2**62),  # 0: score the prompt only (the gateway allows it with echo alone, as vLLM)
    "min_tokens": (0, 2**62),
    "top_k": (-1, 2**62),  # -1 and 0: off
    "logprobs": (0, MAX_LOGPROBS),
    "prompt_logprobs": (0, MAX_LOGPROBS),
    "seed": (SEED_MIN, SEED_MAX),
}


def check_sampling(values: Mapping[str, Any], vocab_size: int = 0) -> tuple[str, str] | None:
    """The first value out of bounds as (parameter, message), or None. Absent and None values pass;
    stop_token_ids must be token ids of the model when vocab_size is known (> 0)."""
    for name, (lo, hi, lo_open) in FLOAT_RANGES.items():
        v = values.get(name)
        if v is not None and not (math.isfinite(v) and lo <= v <= hi and not (lo_open and v == lo)):
            return name, f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}."
    for name, (lo, hi) in INT_RANGES.items():
        v = values.get(name)
        if v is not None and not lo <= v <= hi:
            return name, f"{name} must be in [{lo}, {hi}], got {v}."
    stop_ids = values.get("stop_token_ids") or ()
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        return "stop_token_ids", (f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} distinct ids, the model's "
                                  f"EOS ids among them, got {len(stop_ids)}.")
    for t in stop_ids:
        if t < 0 or (vocab_size and t >= vocab_size):
            return "stop_token_ids", f"stop_token_ids: {t} is not a token id of this model (vocab {vocab_size})."
    bias = values.get("logit_bias") or ()
    if len(bias) > MAX_LOGIT_BIAS:
        return "logit_bias", f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}."
    for t, b in bias:
        if t < 0 or (vocab_size and t >= vocab_size):
            return "logit_bias", f"logit_bias: {t} is not a token id of this model (vocab {vocab_size})."
        if not (math.isfinite(b) and -100 <= b <= 100):
            return "logit_bias", f"logit_bias values must be in [-100, 100], got {b} for token {t}."
    return None


def check_slo_target(name: str, value: Any) -> str | None:
    """Why `value` can't be an SLO target in ms (None: it can; 0 means none)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return f"{name} must be a finite number of milliseconds"
    if not 0 <= value <= MAX_SLO_MS:
        return f"{name} must be between 0 (no target) and {MAX_SLO_MS:.0f} ms, got {value}"
    return None
