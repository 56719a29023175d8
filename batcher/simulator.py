"""`laneserve simulate`: replay a trace through the real Scheduler in simulated time.

Owns the discrete-event loop (arrivals, one step in flight per worker, or with
`pipelined` up to the scheduler's max_inflight_steps run back to back), a
stand-in worker that executes StepInputs exactly as the ModelRunner contract
says (per-request tokens / blocks / num_computed_tokens, sample one token when
a request's tokens are all computed) with a deterministic "model", the step-cost
model `t = a + b*prefill_tokens + c*decode_seqs + d*kv_tokens_read` (ms), and the
latency report. The scheduler, block manager and router are the production code.
No torch, no sockets, no wall clock inside the simulation.

Outputs are forced to the trace's length: max_tokens = output tokens and no stop
tokens (ignore_eos), and the fake model never emits a stop token.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from batcher.config import BatcherConfig
from laneserve.wire.protocol import AddRequest, FinishReason, SamplingParams, StepInput, StepOutput
from batcher.router import pick_worker
from batcher.scheduler import Scheduler

if TYPE_CHECKING:
    from loadtest.traces import TraceRequest

DEFAULT_COST_MODEL = Path(__file__).with_name("cost_model.json")
NEAR_DONE = 8  # outputs left: the smallest default decode bucket


@dataclass(frozen=True)
class CostModel:
    """Step time in ms: a + b*prefill_tokens + c*decode_seqs + d*kv_tokens_read.

    h: host gap in ms between two steps under strict alternation (output send, update + schedule, input
    send); pipelined (async scheduling) hides it behind the step before. 0 = folded into a.
    """

    a: float = 4.0
    b: float = 0.06
    c: float = 0.05
    d: float = 0.0001
    h: float = 0.0

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        data = json.loads(Path(path).read_text())
        return cls(**{k: float(data[k]) for k in ("a", "b", "c", "d", "h") if k in data})

    def step_seconds(self, prefill_tokens: int, decode_seqs: int, kv_tokens_read: int) -> float:
        return (self.a + self.b * prefill_tokens + self.c * decode_seqs + self.d * kv_tokens_read) / 1000.0


@dataclass
class SimRequest:
    arrival: float
    prompt_token_ids: list[int]
    output_tokens: int
    params: SamplingParams | None = None  # default: max_tokens=output_tokens, no stop tokens

    def prompt(self) -> list[int]:
        return self.prompt_token_ids


@dataclass
class TraceSimRequest:
    """A trace row whose prompt is made when it arrives: 100k prompts never all exist at once."""

    arrival: float
    row: TraceRequest
    salt: int  # tells apart rows with equal fields: the row index
    params: SamplingParams | None = None

    @property
    def output_tokens(self) -> int:
        return max(self.row.output_tokens, 1)

    def prompt(self) -> list[int]:
        from loadtest.traces import compact_token_ids  # loaded already: _requests_from_trace read the trace

        return compact_token_ids(self.row, salt=self.salt)


class SimWorker:
    """Executes StepInputs like workers/runner.py would, minus the model; checks the scheduler's promises.

    With check_kv, it also keeps the token id written in every K/V slot and verifies, for every
    prefix-cache hit, that the slots the scheduler claims are computed hold exactly those tokens.
    """

    def __init__(self, num_blocks: int, block_size: int, check_kv: bool = False, vocab: int = 32000,
                 token_fn=None):
        self.block_size = block_size
        self.vocab = vocab
        self.token_fn = token_fn  # (request_id, tokens so far) -> next token; default never a stop token
        self.reqs: dict[str, list] = {}  # id -> [token_ids, block_ids, num_computed]
        self.kv = [-1] * (num_blocks * block_size) if check_kv else None

    def execute(self, step: StepInput) -> tuple[StepOutput, tuple[int, int, int]]:
        bs = self.block_size
        for rid in step.finished_req_ids:
            self.reqs.pop(rid, None)
        for nr in step.new_reqs:
            assert nr.request_id not in self.reqs, f"NewReq for a request the worker holds: {nr.request_id}"
            toks = nr.prompt_token_ids + nr.output_token_ids
            if self.kv is not None:
                for pos in range(nr.num_computed_tokens):
                    slot = nr.block_ids[pos // bs] * bs + pos % bs
                    assert self.kv[slot] == toks[pos], f"prefix hit of {nr.request_id} at {pos}: stale K/V"
            self.reqs[nr.request_id] = [toks, list(nr.block_ids), nr.num_computed_tokens]
        for cr in step.cached_reqs:
            self.reqs[cr.request_id][1].extend(cr.new_block_ids)
        ids, sampled = [], []
        prefill_tokens = decode_seqs = kv_read = 0
        reqs, kv, token_fn, vocab = self.reqs, self.kv, self.token_fn, self.vocab
        for rid, n in step.num_scheduled_tokens.items():
            st = reqs[rid]
            toks, blocks, done = st
            end = done + n
            left = len(toks) - end  # tokens still to compute after this step
            if n <= 0 or left < 0 or end > len(blocks) * bs:
                raise AssertionError(f"bad schedule for {rid}: computed {done} + {n} of {len(toks)} tokens, "
                                     f"{len(blocks)} blocks")
            if kv is not None:
                for pos in range(done, end):
                    kv[blocks[pos // bs] * bs + pos % bs] = toks[pos]
            st[2] = end
            kv_read += end
            if n == 1 and done:
                decode_seqs += 1
            else:
                prefill_tokens += n
            if not left:
                # deterministic, never a stop token: outputs end by length
                tok = token_fn(rid, toks) if token_fn is not None else sim_token(end, rid, vocab)
                toks.append(tok)
                ids.append(rid)
                sampled.append([tok])
        return (StepOutput(step=step.step, worker_id=0, request_ids=ids, sampled_token_ids=sampled),
                (prefill_tokens, decode_seqs, kv_read))


def sim_token(num_tokens: int, request_id: str, vocab: int = 32000) -> int:
    """The token a simulated worker samples after num_tokens tokens: deterministic, never a stop token."""
    return (num_tokens * 31 + len(request_id)) % vocab


def run_in_process(scheduled: list) -> tuple[int, int, int]:
    """What SimWorker.execute() computes for a step, read off the scheduler's own record of it
    (Scheduler.schedule_in_process()) instead of a worker's state: simulate()'s fast path. Returns the cost
    model's inputs; the tokens it samples are sim_token()'s, asked for by Scheduler.update_in_order()."""
    tokens = decode_seqs = kv_read = 0
    for _, n, done, _, _ in scheduled:
        tokens += n
        kv_read += done
        if n == 1 and done != 1:  # a decode: one token onto computed ones (done == 1: a one-token prompt)
            decode_seqs += 1
    return tokens - decode_seqs, decode_seqs, kv_read


@dataclass(slots=True)
class _Progress:
    """What simulate() tracks of an unfinished request."""

    arrival: float
    near_done_from: float  # outputs that make it nearly done (inf once it is)
    outputs: int = 0
    first_at: float | None = None
    near_done_at: float | None = None


@dataclass
class SimResult:
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    finish: dict[str, int] = field(default_factory=dict)  # finish reason name -> count
    output_tokens: dict[str, int] = field(default_factory=dict)  # request id -> tokens received
    first_chunk_cached: dict[str, int] = field(default_factory=dict)
    duration: float = 0.0
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    block_seconds: float = 0.0  # integral of KV blocks in use over time
    # "time to free": from a request's first token with <= NEAR_DONE outputs left to its final delta
    # (its blocks are freed in that same update); preempting nearly done sequences makes it long
    near_done_to_free: list[float] = field(default_factory=list)
    preemptions: int = 0
    gated_prefills: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    schedulers: list = field(default_factory=list)


def simulate(requests: Sequence[SimRequest | TraceSimRequest], cfg: BatcherConfig, cost: CostModel = CostModel(),
             num_blocks: int = 8192, block_size: int = 16, max_model_len: int = 32768, num_workers: int = 1,
             check_kv: bool = False, aborts: dict[str, float] | None = None,
             warm_prefixes: list[list[int]] | None = None, pipelined: bool = False,
             sim_worker: bool = False) -> SimResult:
    """Run the trace to completion; every request must get exactly one finishing delta (else RuntimeError).

    pipelined: keep up to max_inflight_steps (async scheduling) steps per worker, each starting when the previous
    one ends, so the cost model's host gap `h` is hidden (assumed shorter than a step); strict alternation
    (default) pays it before every step. Also shows the policy effect of scheduling one step ahead
    (admissions and stops seen a step later).
    sim_worker: run every step through a SimWorker (StepInput in, StepOutput out: the batcher's path, with the
    worker checking the scheduler's promises; check_kv implies it) rather than in process
    (Scheduler.schedule_in_process(), run_in_process(), Scheduler.update_in_order()), which is faster and gives
    the same results.
    """
    scheds = {w: Scheduler(cfg, num_blocks, block_size, max_model_len, warm_prefixes) for w in range(num_workers)}
    workers = ({w: SimWorker(num_blocks, block_size, check_kv) for w in range(num_workers)}
               if sim_worker or check_kv else None)
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    res = SimResult(schedulers=list(scheds.values()))
    live: dict[str, _Progress] = {}  # unfinished requests (a small dict: touched for every token)
    owner: dict[str, int] = {}
    # Events (time, kind, seq, payload), earliest first and steps first at equal times: kind 0 = step done (seq: the
    # worker), 1 = arrival (seq: its rank in arrival order, payload: the request's index), 2 = abort. Arrivals are
    # read off `order` one at a time, so the heap only holds the steps in flight and the aborts.
    events: list = [(t, 2, seq, rid) for seq, (rid, t) in enumerate((aborts or {}).items())]
    heapq.heapify(events)

    def arrival(seq: int) -> tuple | None:
        return (requests[order[seq]].arrival, 1, seq, order[seq]) if seq < len(order) else None

    next_arrival = arrival(0)
    busy: dict[int, deque] = {w: deque() for w in scheds}  # outputs of the steps in flight (None: in process)
    free_at = dict.fromkeys(scheds, 0.0)  # when the worker is done with the steps it holds
    now = 0.0

    host_gap = 0.0 if pipelined else cost.h / 1000.0
    step_seconds = cost.step_seconds
    heappush, heappop = heapq.heappush, heapq.heappop
    output_tokens, first_chunk_cached = res.output_tokens, res.first_chunk_cached

    def start(w: int) -> None:
        sched, outs = scheds[w], busy[w]
        depth = sched.max_inflight_steps if pipelined else 1
        while len(outs) < depth:
            if workers is None:
                scheduled = sched.schedule_in_process(now)
                if scheduled is None:
                    return
                out = None  # update_in_order() samples the tokens
                pf, dec, kv = run_in_process(scheduled)
            else:
                step = sched.schedule(now)
                if step is None:
                    return
                out, (pf, dec, kv) = workers[w].execute(step)  # in order: the same state the worker would see
            dt = step_seconds(pf, dec, kv)
            res.steps += 1
            res.prefill_tokens += pf
            res.decode_tokens += dec
            bm = sched.bm
            res.block_seconds += (bm.num_blocks - bm.num_free) * dt
            outs.append(out)
            free_at[w] = done_at = max(now, free_at[w]) + dt + host_gap
            heappush(events, (done_at, 0, w, None))

    def deliver(deltas) -> None:
        for d in deltas:
            rid = d.request_id
            new, reason = d.new_token_ids, d.finish_reason
            p = live.get(rid)
            assert p is not None, f"a delta for {rid} after its finish"
            n = p.outputs
            if (new or reason is not None) and rid not in first_chunk_cached:
                first_chunk_cached[rid] = d.num_cached_tokens
            if new:
                if not n:
                    p.first_at = now
                n += len(new)
                p.outputs = n
                if n >= p.near_done_from:
                    p.near_done_at = now
                    p.near_done_from = math.inf
            if reason is not None:
                name = FinishReason(reason).name
                res.finish[name] = res.finish.get(name, 0) + 1
                del live[rid]
                if n:
                    output_tokens[rid] = n
                if p.first_at is not None and reason in (FinishReason.STOP, FinishReason.LENGTH):
                    res.ttft.append(p.first_at - p.arrival)
                    res.e2e.append(now - p.arrival)
                    if n > 1:
                        res.tpot.append((now - p.first_at) / (n - 1))
                    if p.near_done_at is not None:
                        res.near_done_to_free.append(now - p.near_done_at)

    def deliver_plain(rids: list[str]) -> None:
        """deliver() for deltas of one token that neither start nor end their request (update_in_order())."""
        for rid in rids:
            p = live[rid]
            n = p.outputs = p.outputs + 1
            if n >= p.near_done_from:
                p.near_done_at = now
                p.near_done_from = math.inf

    while next_arrival is not None or events:
        if next_arrival is not None and (not events or next_arrival < events[0]):
            now, kind, seq, payload = next_arrival
            next_arrival = arrival(seq + 1)
        else:
            now, kind, seq, payload = heappop(events)
        if kind == 1:
            r = requests[payload]
            rid = f"r{payload}"
            params = r.params or SamplingParams(max_tokens=max(r.output_tokens, 1))
            msg = AddRequest(request_id=rid, prompt_token_ids=r.prompt(), params=params, arrival_time=now)
            w = pick_worker(scheds, msg.prompt_token_ids) if num_workers > 1 else 0
            owner[rid] = w
            live[rid] = _Progress(now, params.max_tokens - NEAR_DONE)
            scheds[w].add_request(msg)
            start(w)
        elif kind == 2:
            w = owner.get(payload)
            if w is not None and payload in live:
                deliver(scheds[w].abort_requests([payload]))
                start(w)
        else:
            w = seq
            out = busy[w].popleft()
            if workers is None:
                deltas, plain = scheds[w].update_in_order(sim_token, now)
                if deltas:
                    deliver(deltas)
                deliver_plain(plain)
            else:
                deliver(scheds[w].update(out, now))
            start(w)
        if not events and next_arrival is None:  # idle everywhere: anything still unfinished would hang
            for w in scheds:
                start(w)
    if live:
        raise RuntimeError(f"{len(live)} requests never finished, e.g. {next(iter(live))}")
    res.duration = now - (requests[order[0]].arrival if requests else 0.0)
    for s in scheds.values():
        st = s.stats()
        res.preemptions += st.preemptions
        res.gated_prefills += st.gated_prefills
        res.prefix_queries += st.prefix_queries
        res.prefix_hits += st.prefix_hits
    return res


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarize(res: SimResult) -> dict:
    def pcts(xs: list[float]) -> dict:
        return {f"p{p}": round(percentile(xs, p) * 1000, 3) for p in (50, 95, 99)} | {
            "mean": round(sum(xs) / len(xs) * 1000, 3) if xs else float("nan")}

    total_out = sum(res.output_tokens.values())
    return {
        "requests": sum(res.finish.values()), "finish": res.finish,
        "duration_s": round(res.duration, 3), "steps": res.steps,
        "ttft_ms": pcts(res.ttft), "tpot_ms": pcts(res.tpot), "e2e_ms": pcts(res.e2e),
        "output_tokens": total_out,
        "throughput_tok_s": round(total_out / res.duration, 1) if res.duration > 0 else 0.0,
        "requests_per_s": round(sum(res.finish.values()) / res.duration, 3) if res.duration > 0 else 0.0,
        "prefill_tokens": res.prefill_tokens, "preemptions": res.preemptions, "gated_prefills": res.gated_prefills,
        "prefix_hit_rate": round(res.prefix_hits / res.prefix_queries, 4) if res.prefix_queries else 0.0,
        "block_seconds_per_request": round(res.block_seconds / max(1, sum(res.finish.values())), 4),
        "near_done_to_free_ms": pcts(res.near_done_to_free),
    }


# ---------------------------------------------------------------------- command line
def _requests_from_trace(path: str, limit: int | None, speedup: float, block_size: int) -> list[TraceSimRequest]:
    from loadtest import traces  # the shared trace readers (format by file name/contents)

    if path == "synthetic":  # gamma bursts (shape 0.3) of short and >2k prompts, 5 req/s on average
        trace = traces.gamma_bursts(rate=5.0, n=limit or 5000, burstiness=0.3, input_tokens=(64, 4096),
                                    output_tokens=(16, 256))
    else:
        trace = traces.load_trace(path, limit=limit)
    if limit is not None:
        trace = trace[:limit]
    return [TraceSimRequest(t.arrival / speedup, t, i) for i, t in enumerate(trace)]


def _config(text: str | None) -> BatcherConfig:
    """--config: a JSON object of BatcherConfig fields, or a path to one."""
    if not text:
        return BatcherConfig()
    data = json.loads(Path(text).read_text()) if not text.lstrip().startswith("{") else json.loads(text)
    known = {f.name for f in dataclasses.fields(BatcherConfig)}
    unknown = set(data) - known - {"num_blocks", "block_size", "max_model_len", "num_workers"}
    if unknown:
        raise SystemExit(f"unknown config fields: {sorted(unknown)}")
    return BatcherConfig(**{k: v for k, v in data.items() if k in known})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="laneserve simulate", description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="synthetic", help="trace file (CSV/JSONL, see loadtest.traces) or 'synthetic'")
    ap.add_argument("--config", help="BatcherConfig fields as JSON (inline or a file); may also set num_blocks, "
                                     "block_size, max_model_len, num_workers")
    ap.add_argument("--cost-model", default=str(DEFAULT_COST_MODEL), help="JSON with a, b, c, d (ms)")
    ap.add_argument("--json", help="write the summary here")
    ap.add_argument("--limit", type=int, help="first N requests of the trace")
    ap.add_argument("--speedup", type=float, default=1.0, help="divide arrival times by X")
    ap.add_argument("--pipelined", action="store_true", help="keep 2 steps in flight per worker (async scheduling)")
    ap.add_argument("--bench-step", action="store_true", help="time one schedule()+update() with 256 running")
    args = ap.parse_args(argv)
    if args.bench_step:
        print(json.dumps(bench_step(), indent=1))
        return 0
    cfg = _config(args.config)
    extra = json.loads(Path(args.config).read_text() if args.config and not args.config.lstrip().startswith("{")
                       else (args.config or "{}"))
    block_size = int(extra.get("block_size", 16))
    reqs = _requests_from_trace(args.trace, args.limit, args.speedup, block_size)
    t0 = time.perf_counter()
    res = simulate(reqs, cfg, CostModel.load(args.cost_model), num_blocks=int(extra.get("num_blocks", 8192)),
                   block_size=block_size, max_model_len=int(extra.get("max_model_len", 32768)),
                   num_workers=int(extra.get("num_workers", 1)), pipelined=args.pipelined)
    summary = summarize(res) | {"wall_s": round(time.perf_counter() - t0, 2)}
    _print(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


def _print(s: dict) -> None:
    print(f"requests {s['requests']} {s['finish']}  simulated {s['duration_s']} s in {s['steps']} steps "
          f"(wall {s['wall_s']} s)")
    for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
        v = s[name]
        print(f"  {name:8s} p50 {v['p50']:10.2f}  p95 {v['p95']:10.2f}  p99 {v['p99']:10.2f}")
    print(f"  throughput {s['throughput_tok_s']} tok/s, {s['requests_per_s']} req/s; preemptions "
          f"{s['preemptions']}; gated {s['gated_prefills']}; prefix hit rate {s['prefix_hit_rate']:.1%}")


def bench_step(num_running: int = 256, repeats: int = 200) -> dict:
    """CPU cost of one schedule() + update() with num_running decoding sequences (no prefill)."""
    cfg = BatcherConfig()
    sched = Scheduler(cfg, 65536, 16, 32768)
    worker = SimWorker(65536, 16)
    for i in range(num_running):
        sched.add_request(AddRequest(request_id=f"b{i}", prompt_token_ids=[i % 300 + 1] * 7 + list(range(i, i + 500)),
                                     params=SamplingParams(max_tokens=100000), arrival_time=0.0))
    now = 0.0
    while any(not r.is_decoding for r in sched.running.values()) or len(sched.running) < num_running:
        out, _ = worker.execute(sched.schedule(now))
        sched.update(out, now)
        now += 0.01
    sched_s = upd_s = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        step = sched.schedule(now)
        t1 = time.perf_counter()
        out, _ = worker.execute(step)
        t2 = time.perf_counter()
        sched.update(out, now)
        t3 = time.perf_counter()
        sched_s += t1 - t0
        upd_s += t3 - t2
        now += 0.01
    assert len(step.num_scheduled_tokens) == num_running
    return {"running": num_running, "schedule_us": round(sched_s / repeats * 1e6, 1),
            "update_us": round(upd_s / repeats * 1e6, 1),
            "total_us": round((sched_s + upd_s) / repeats * 1e6, 1)}


if __name__ == "__main__":
    sys.exit(main())
