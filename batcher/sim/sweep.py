"""`laneserve simulate sweep`'s runs: `laneserve loadtest sweep` in simulated time (simulator against GPU).

Owns turning a simulated run into the load client's records (the command line is batcher/sim/cli.py's). The
traces are the ones `laneserve loadtest sweep` replays for the same flags (loadtest.cli.plan_sweep: the warm-up,
and per rate and seed its trace, each rag run with documents of its own). Each run is one simulate() of the warm-up
followed, WARMUP_GAP_S after its last arrival, by the run's trace, on a fresh scheduler with async
scheduling (`--pipelined`); the run's requests become RequestRecords, so loadtest.report.summarize and
loadtest.sweep.build compute every figure as they do for a served sweep, and `laneserve loadtest compare`
sets a measured sweep.json beside a simulated one. Rows longer than --config's max_model_len are shortened to fit
as the load client shortens them to the server's (`fit_rows`). ITL is the gaps between a request's deltas with
tokens (one a step: the gateway streams each as one chunk). Not simulated: the HTTP
path (the gateway's tokenizing and streaming time), and the load client's --no-ignore-eos and --endpoint chat
(every request here gets exactly its trace's output tokens, or its shortened row's). Set `num_blocks` in --config to
the server's KV pool (its `cache_config_info` on /metrics): too small a pool makes requests wait for K/V space.
"""

from __future__ import annotations

from batcher.cost_model import CostModel
from batcher.sim.engine import SimResult, TraceSimRequest, simulate
from laneserve.wire.protocol import FinishReason

WARMUP_GAP_S = 60.0  # from the warm-up's last arrival to the run's first: its requests have finished by then


def fit_rows(rows: list, max_model_len: int) -> tuple[list, int]:
    """The rows shortened to fit max_model_len as the load client shortens them (loadtest.client.fit_to_context),
    and how many were."""
    from loadtest.client import fit_to_context

    fitted = [fit_to_context(r, max_model_len) for r in rows]
    return [r for r, _ in fitted], sum(c for _, c in fitted)


def records(res: SimResult, rows: list, fitted: list, first: int, frontend_s: float = 0.0) -> list:
    """The load client's RequestRecords of rows (the run's trace rows, simulated as requests r{first}, ... as `fitted`:
    each row shortened to fit max_model_len as the client would, fit_rows); frontend_s (--frontend-ms) added to each
    TTFT and end-to-end latency."""
    from loadtest.client import RequestRecord

    out = []
    for i, (row, sent) in enumerate(zip(rows, fitted)):
        rid = f"r{first + i}"
        rec = RequestRecord(index=i, scheduled=row.arrival, input_tokens=sent.input_tokens,
                            max_tokens=max(sent.output_tokens, 1), trace_input_tokens=row.input_tokens,
                            trace_output_tokens=row.output_tokens, sent=row.arrival, prompt_tokens=sent.input_tokens,
                            clamped=sent != row)
        if rid in res.shed:
            rec.status, rec.error = 429, "shed by predictive SLO admission"
        else:
            arrival, first_at, end, n, reason = res.ends[rid]
            rec.status = 200
            rec.e2e, rec.output_tokens = end - arrival + frontend_s, n
            rec.ttft = None if first_at is None else first_at - arrival + frontend_s
            rec.itl = res.itl.get(rid, [])
            if reason not in (FinishReason.STOP, FinishReason.LENGTH):
                rec.error = FinishReason(reason).name
        out.append(rec)
    return out


def run_one(warmup: list, rows: list, cfg, cost: CostModel, step_noise: float, seed: int, max_model_len: int,
            frontend_s: float = 0.0, **kw) -> tuple[list, SimResult]:
    """Simulate the warm-up, then rows WARMUP_GAP_S after it (both shortened to fit max_model_len: fit_rows); the
    rows' RequestRecords, and the whole simulation's result (the warm-up's requests too)."""
    shift = warmup[-1].arrival + WARMUP_GAP_S if warmup else 0.0
    reqs = [TraceSimRequest(r.arrival, r, i) for i, r in enumerate(fit_rows(warmup, max_model_len)[0])]
    fitted = fit_rows(rows, max_model_len)[0]
    reqs += [TraceSimRequest(r.arrival + shift, r, len(warmup) + i) for i, r in enumerate(fitted)]
    res = simulate(reqs, cfg, cost, pipelined=True, step_noise=step_noise, noise_seed=seed,
                   max_model_len=max_model_len, **kw)
    late = [i for i in range(len(warmup)) if f"r{i}" in res.ends and res.ends[f"r{i}"][2] >= shift]
    if late:
        raise SystemExit(f"error: warm-up request {late[0]} was still running when the run began; the server is "
                         "overloaded at the warm-up's rate")
    return records(res, rows, fitted, len(warmup), frontend_s), res
