"""The step-cost model: what one step costs on a worker, predicted from what it holds, and learned online.

Owns `CostModel` (step ms = a + g*mixed + b*prefill_tokens + e*attention_pairs +
c*decode_seqs + m*mixed*decode_seqs + d*kv_tokens_read) and `OnlineCostFit`, which refits it per worker while the
batcher serves, from the step times the worker reports (StepOutput.execute_time). The scheduler's SLO
controller (batcher/slo.py) and the simulator (batcher/sim/) both predict with it.
Pure: no I/O but CostModel.load()/save().

The terms of a step (batcher/scheduler.py's `step_features`):
- prefill_tokens: tokens computed by rows that are not one-token decodes;
- attention_pairs: for those rows, the token pairs their attention computes: tokens x context before the chunk
  (its cached prefix or earlier chunks) + tokens^2 / 2 (causal, within the chunk). Until stop 42 the term left the
  chunk's own half out and b absorbed it at the chunk sizes a window held: on the H100's Azure conv trace a 4k-token
  chunk's step then took 9 ms more than the fit predicted (docs/perf.md);
- decode_seqs: one-token rows;
- kv_tokens_read: sum over rows of their context after the step (K/V the attention reads);
- mixed: 1 if the step has any prefill row. On the GPU a decode-only step replays a CUDA graph
  and a step with a prefill runs eagerly: measured on the H200 (7B shape, 2026-12-04), a step
  with 6-21 prefill tokens and ~155 decodes took 26 ms against 12.6 ms for the same decodes
  alone. Without this term the fit spreads that cost over a and b, and mispredicts both kinds.
- mixed x decode_seqs (no trace field of its own: the product of two): a decode row in a step with a prefill chunk.
  A decode-only step is bound by reading the weights (a) and a decode row adds little (c); with a prefill chunk
  the GEMMs are bound by compute, where a decode row costs about what a prompt token does and the weights' read
  hides behind it. Fitted over stop 49's seven H100 traces (docs/perf.md), m came out 0.008-0.019 ms a row (b:
  ~0.02 ms a token) and g -1.2 to -1.9 ms; without the term the fit priced the mixed steps of a burst, many decodes
  beside a chunk, ~0.5 ms low each, and the simulator's worst-seed TTFT p95 ran up to 22% low there. So g may be
  negative: a + g, a mixed step's own fixed cost, is kept >= 0.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path

DEFAULT_COST_MODEL = Path(__file__).with_name("cost_model.json")
STREAMS_COST_MODEL = Path(__file__).with_name("cost_model_streams.json")  # learned with --lanes streams


def default_cost_model(lanes: str) -> Path:
    """The shipped prior for a scheduler with these lanes: a streams server's steps run beside the other
    lane's, and its model is learned that way (docs/lanes.md)."""
    return STREAMS_COST_MODEL if lanes == "streams" else DEFAULT_COST_MODEL

Features = tuple[int, int, int, int, int]  # prefill_tokens, attention_pairs, decode_seqs, kv_tokens_read, mixed


MAX_STEP_MS = 60_000.0  # a step time reported above this is not learned from (a stall, or a bogus figure)


def learned_ms(execute_ms: float, draft_ms: float = 0.0) -> float | None:
    """What the fit learns from a step that took execute_ms, draft_ms of it the draft model's (the model prices the
    target's work; the draft's is priced apart): None for a time not to learn from (not in (0, MAX_STEP_MS): a NaN,
    a stall, a bogus figure), else execute_ms less the draft's part where that is a share of it. The scheduler's
    live fit and `python -m batcher.trace --fit-cost-model` both take this."""
    if not 0.0 < execute_ms < MAX_STEP_MS:
        return None
    return execute_ms - draft_ms if 0.0 < draft_ms < execute_ms else execute_ms


def attention_pairs(tokens: int, context: int) -> int:
    """The attention_pairs term of a chunk of `tokens` after `context` computed ones: each token over the context
    and, causally, the chunk's tokens before it."""
    return tokens * context + tokens * tokens // 2


@dataclass(frozen=True)
class CostModel:
    """Step time in ms: a + g*mixed + b*prefill_tokens + e*attention_pairs + c*decode_seqs + m*mixed*decode_seqs
    + d*kv_tokens_read (module docstring; g may be negative, a + g >= 0).

    h: host gap in ms: how long the worker waits for a step composed on the output of the one before, with none
    in flight (output send, update + schedule, input send); async scheduling hides it behind the step in flight.
    Learned online from the workers' idle times (OnlineCostFit.observe_gap). The scheduler adds it to the
    predicted start of a mixed-lane step with none in flight, speculation prices it (a step with drafts is alone
    in flight: batcher/spec.py), and the simulator charges it to every such step (two lanes hide it).
    """

    a: float = 4.0
    b: float = 0.06
    c: float = 0.05
    d: float = 0.0001
    e: float = 0.0
    g: float = 0.0
    h: float = 0.0
    m: float = 0.0

    @classmethod
    def load(cls, path: str | Path = DEFAULT_COST_MODEL) -> CostModel:
        """A model from JSON: a, b, c, d required, e, g, h, m optional, each a finite number >= 0 but g, which may
        be negative down to -a (ValueError naming the file otherwise; OSError if it can't be read)."""
        try:
            data = json.loads(Path(path).read_text())
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            missing = [k for k in "abcd" if k not in data]
            if missing:
                raise ValueError(f"missing {', '.join(missing)}")
            values = {k: data[k] for k in ("a", "b", "c", "d", "e", "g", "h", "m") if k in data}
            for k, v in values.items():
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise ValueError(f"{k} must be a finite number, got {v!r}")
                if v < 0 and k != "g":
                    raise ValueError(f"{k} must be >= 0, got {v!r}")
            if values["a"] + values.get("g", 0.0) < 0:
                raise ValueError(f"a + g (a mixed step's fixed cost) must be >= 0, got {values['a']} + {values['g']}")
        except ValueError as exc:  # json.JSONDecodeError is one
            raise ValueError(f"{path}: not a usable cost model (a, b, c, d, and optionally e, g, h, m: "
                             f"ms terms): {exc}") from None
        return cls(**{k: float(v) for k, v in values.items()})

    def save(self, path: str | Path, **extra) -> None:
        Path(path).write_text(json.dumps(asdict(self) | extra, indent=1) + "\n")

    def step_ms(self, prefill_tokens: int, attention_pairs: int, decode_seqs: int, kv_tokens_read: int,
                mixed: int = 0) -> float:
        return (self.a + self.g * mixed + self.b * prefill_tokens + self.e * attention_pairs
                + (self.c + self.m * mixed) * decode_seqs + self.d * kv_tokens_read)

    def mixed_ms(self, decode_seqs: int) -> float:
        """What a prefill chunk's presence adds to a step of decode_seqs decodes, once, beside the chunk's own cost
        (chunk_ms): g + m * decode_seqs."""
        return self.g + self.m * decode_seqs

    def chunk_ms(self, tokens: int, context: int) -> float:
        """What `tokens` prefill tokens after `context` computed ones add to a step (mixed_ms apart: once a step)."""
        return (self.b + self.d) * tokens + self.e * attention_pairs(tokens, context) + self.d * context

    def tpot_ceiling(self, tpot_ms: float, work_ms: float, decode_rows: float, mixed_share: float) -> float:
        """The most requests a second any schedule serves with steps averaging tpot_ms (at most one token a step
        per request, so a TPOT target needs that), each request bringing work_ms of its own work (its prefill
        tokens, attention pairs, decode rows and K/V reads: step_ms less a, g and m) and decode_rows rows, with
        mixed_share of the steps carrying a prompt chunk: 1000 ms = S (a + f (g + m B)) + r work_ms, S = 1000 /
        tpot_ms steps a second of B = r decode_rows / S rows each. docs/scheduling.md, "A ceiling no schedule
        passes"."""
        steps = 1000.0 / tpot_ms
        left = 1000.0 - steps * (self.a + mixed_share * self.g)
        return max(0.0, left / (work_ms + mixed_share * self.m * decode_rows))

    def affordable(self, ms: float, context: int) -> int:
        """The most prefill tokens after `context` that fit in ms (0 if none): chunk_ms(t, context) <= ms, a
        quadratic in t (e / 2 t^2 + (b + d + e context) t + d context)."""
        per_token = self.b + self.d + self.e * context
        room = ms - self.d * context
        if room <= 0:
            return 0
        if self.e > 0:
            return int(2 * room / (per_token + math.sqrt(per_token * per_token + 2 * self.e * room)))
        return int(room / per_token) if per_token > 0 else 1 << 30


# The fit runs on features in these units (ms per step, per 1k prefill tokens, per 1M token pairs, per 100
# sequences, per 100k K/V tokens, per mixed step, per 100 decode rows of a mixed step), where every coefficient is
# of order 1: the prior's pull is then even.
_SCALE = (1.0, 1e3, 1e6, 1e2, 1e5, 1.0, 1e2)
_FIELDS = ("a", "b", "e", "c", "d", "g", "m")
_SIGNED = _FIELDS.index("g")  # the one coefficient the fit lets go below 0 (a + g >= 0 instead)


def regressors(features: Features) -> tuple[float, ...]:
    """A step's row of the fit, in _FIELDS' order and _SCALE's units."""
    p, pairs, decodes, kv, mixed = features
    return 1.0, *(f / s for f, s in zip((p, pairs, decodes, kv, mixed, mixed * decodes), _SCALE[1:]))


GAP_WINDOW = 64  # host gaps: h follows about this many latest ones


class OnlineCostFit:
    """Least squares over the last `window` timed steps, pulled toward the prior (ridge, `prior_weight`
    pseudo-steps per term), refitted every `every` steps; coefficients are kept >= 0. A term the window
    never varies (no prefills at all, say) keeps the prior's value."""

    def __init__(self, prior: CostModel, window: int = 512, every: int = 32, prior_weight: float = 4.0):
        self.prior = self.model = prior
        self.rows: deque[tuple[tuple[float, ...], float]] = deque(maxlen=window)
        self.every = every
        self.prior_weight = prior_weight
        self.steps = 0
        self.gaps = 0  # host gaps observed (observe_gap)
        self.predicted_ms = 0.0  # running totals over every timed step (the /metrics counters)
        self.measured_ms = 0.0

    def observe(self, features: Features, measured_ms: float) -> None:
        self.steps += 1
        self.predicted_ms += self.model.step_ms(*features)
        self.measured_ms += measured_ms
        self.rows.append((features, measured_ms))
        if self.steps % self.every == 0:
            self.model = self.fit()

    def observe_gap(self, ms: float) -> None:
        """A host gap: how long the worker waited for a step composed on the output of the one before, with none
        in flight (StepOutput.idle_time). The model's h is their running mean (the last GAP_WINDOW weigh most)."""
        self.gaps += 1
        h = self.model.h
        self.model = replace(self.model, h=h + (ms - h) / min(self.gaps, GAP_WINDOW))

    def samples(self) -> list[list[float]]:
        """The window as [prefill_tokens, attention_pairs, decode_seqs, kv_tokens_read, mixed, measured ms]."""
        return [[*f, round(ms, 4)] for f, ms in self.rows]

    def fit(self) -> CostModel:
        """Ridge least squares with every coefficient but g >= 0: solve (X'X + wI) beta = X'y + w beta_prior over
        the window; a coefficient that comes out negative is held at 0 and the rest solved again (an active set:
        decode rows and K/V read move together, so one of them can swing below 0); g is kept >= -a."""
        k = len(_FIELDS)
        w = self.prior_weight
        beta0 = [getattr(self.prior, f) * s for f, s in zip(_FIELDS, _SCALE)]
        xtx = [[w if i == j else 0.0 for j in range(k)] for i in range(k)]
        xty = [w * b for b in beta0]
        for features, y in self.rows:
            x = regressors(features)
            for i in range(k):
                xi = x[i]
                if xi:
                    row = xtx[i]
                    for j in range(k):
                        row[j] += xi * x[j]
                    xty[i] += xi * y
        free = list(range(k))
        beta = [0.0] * k
        while free:
            sol = _solve([[xtx[i][j] for j in free] for i in free], [xty[i] for i in free])
            beta = [0.0] * k
            for i, b in zip(free, sol):
                beta[i] = b
            negative = [i for i in free if beta[i] < 0 and i != _SIGNED]
            if not negative:
                break
            free.remove(min(negative, key=lambda i: beta[i]))
        fitted = {f: (b if i == _SIGNED else max(0.0, b)) / s for i, (f, b, s) in enumerate(zip(_FIELDS, beta, _SCALE))}
        fitted["g"] = max(fitted["g"], -fitted["a"])
        return replace(self.prior, h=self.model.h, **fitted)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b (a small, symmetric positive definite: Gauss-Jordan with partial pivoting)."""
    n = len(b)
    m = [row[:] + [bi] for row, bi in zip(a, b)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[piv] = m[piv], m[col]
        p = m[col][col]
        for r in range(n):
            if r != col and m[r][col]:
                f = m[r][col] / p
                m[r] = [x - f * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]
