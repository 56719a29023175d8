"""The batcher's one typed config object (flags and LANESERVE_* env vars via laneserve.config)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from laneserve.config import flag, shared


@dataclass
class BatcherConfig:
    batcher_address: str = shared("batcher_address")
    worker_address: str = shared("worker_address")
    # scheduling policy (batcher/scheduler.py)
    max_num_batched_tokens: int = shared("max_num_batched_tokens")
    max_num_seqs: int = shared("max_num_seqs")
    decode_buckets: str = field(default="8,16,32", metadata=flag(
        "decode buckets by tokens remaining (max_tokens - generated), comma-separated upper bounds; a last "
        "'rest' bucket is implied; '' = one bucket. A priority: when the step's budget or seat cap runs out the "
        "lowest buckets decode first, and preemption takes the newest request of the highest bucket first"))
    enable_prefix_caching: bool = field(default=True, metadata=flag("reuse the K/V of full 16-token blocks shared "
                                                                  "by prompts (chained token hash)"))
    warm_prefix: str = field(default="", metadata=flag(
        "JSON/JSONL file of token-id lists (RAG system prompts) prefilled at start and pinned in every worker's "
        "prefix cache; the batcher has no tokenizer, so token ids, not text. Read once at start; one longer than "
        "the context is cut to it, one with ids outside a worker's vocabulary skipped there"))
    watermark: float = field(default=0.01, metadata=flag(
        "admit a new request only if this fraction of the KV pool stays free after its prompt's blocks"))
    max_active_blocks: int = field(default=0, metadata=flag(
        "per-request KV block cap (0 = off): a prompt over it is rejected (ERROR), generation stops at it (LENGTH)"))
    burst_gating: bool = field(default=True, metadata=flag("hold back long prompts while a burst is detected"))
    burst_window_s: float = field(default=2.0, metadata=flag("sliding window of the burst detector's arrival rate"))
    burst_arrival_rate: float = field(default=8.0, metadata=flag(
        "burst when more than this many requests/s arrived over the window (0 = rate test off)"))
    burst_queue_depth: int = field(default=32, metadata=flag(
        "burst when at least this many requests wait for admission (0 = depth test off)"))
    long_prefill_threshold: int = field(default=2048, metadata=flag(
        "a prompt with more uncached tokens than this is 'long' for burst gating"))
    min_active_decodes: int = field(default=8, metadata=flag(
        "during a burst a long prompt waits while at least this many decodes are running (and at least one: with "
        "none running nothing would end the wait)"))
    max_gated_wait_s: float = field(default=2.0, metadata=flag(
        "longest a long prompt is held back by gating; then it is admitted in arrival order"))
    affinity_max_load_gap: int = field(default=64, metadata=flag(
        "prefix affinity yields to least-load when the prefix holder has this many more unfinished requests"))
    async_scheduling: bool = field(default=True, metadata=flag(
        "schedule step N+1 while the worker runs step N (2 steps in flight per worker), hiding the batcher's "
        "update/schedule and the socket round trip from the GPU"))
    schedule_lead_ms: float = field(default=0.0, metadata=flag(
        "with --async-scheduling: compose a step that would queue behind the one in flight only this many ms before "
        "that one is predicted to end, not at once, so requests arriving meanwhile join it (0 = at once); a step "
        "that ends sooner than predicted by more than this leaves the GPU waiting (laneserve:pipeline_bubble_ms_total "
        "against a run at 0 shows the cost); mixed lanes only (docs/scheduling.md)"))
    lanes: str = field(default="mixed", metadata=flag(
        "mixed | streams | auto: mixed runs each step's decodes and prefill chunks as one forward; streams sends "
        "them as two lanes of steps that a CUDA worker runs at once, decodes on a high-priority stream, so decodes "
        "stop waiting for long prefills; auto: streams for a worker that runs lanes on their own streams (CUDA, "
        "tensor parallel 1), else mixed (docs/lanes.md)"))
    # speculative decoding (batcher/spec.py, docs/speculative.md)
    speculative: str = field(default="off", metadata=flag(
        "off | ngram: prompt-lookup drafts | draft: drafts of the workers' --draft-model; verified in one forward "
        "(greedy and seeded outputs unchanged, sampled ones keep the model's distribution); how many per step (0 to "
        "--num-speculative-tokens) follows from the step-cost model and the measured acceptance, 0 while prompts "
        "wait or prefill"))
    num_speculative_tokens: int = field(default=4, metadata=flag("the most draft tokens a step verifies per request"))
    prompt_lookup_min: int = field(default=2, metadata=flag("ngram: the shortest suffix n-gram looked up"))
    prompt_lookup_max: int = field(default=4, metadata=flag("ngram: the longest suffix n-gram looked up"))
    # SLO scheduling (batcher/slo.py, docs/scheduling.md "SLO scheduling"); 0 = no target
    slo_ttft_ms: float = field(default=0.0, metadata=flag(
        "p95 time-to-first-token target in ms (0 = none): waiting prompts are served by deadline slack and the "
        "long-prompt gate also closes when the queue would miss its deadlines; a request may set its own "
        "(slo_ttft_ms in the body)"))
    slo_tpot_ms: float = field(default=0.0, metadata=flag(
        "time-per-output-token target in ms (0 = none): each step's prefill budget is the time the running "
        "requests' TPOT budgets leave (up to --max-num-batched-tokens); a request may set its own (slo_tpot_ms)"))
    slo_pause_decodes: bool = field(default=True, metadata=flag(
        "with TTFT and TPOT targets: while waiting prompts would miss their TTFT deadlines, decoding requests far "
        "enough inside their TPOT budgets sit steps out so the prompts get them (at least --min-active-decodes "
        "keep decoding)"))
    slo_admission: str = field(default="off", metadata=flag(
        "off | reject: with reject, a request whose predicted TTFT exceeds 1.25x its target is refused at once "
        "(429 + Retry-After) so the others keep theirs"))
    cost_model: str = field(default="", metadata=flag(
        "step-cost model JSON (a, b, c, d and optionally e, g: ms terms, batcher/cost_model.py) the scheduler "
        "starts from ('' = the shipped H200 fit); "
        "refitted online from the workers' step times"))
    cost_model_out: str = field(default="", metadata=flag(
        "write worker 0's online-fitted step-cost model here every 10 s and at exit (for `laneserve simulate "
        "--cost-model`); '' = don't"))
    step_trace: str = field(default="", metadata=flag(
        "write a JSONL timeline here: each request's arrival and first token, each step's composition and output "
        "(the worker's device, launch and idle times); `python -m batcher.trace FILE` splits the time to first "
        "token into queueing, waiting behind other steps and the step itself, and its `--fit-cost-model OUT` fits "
        "the step-cost model over every step (for `laneserve simulate --cost-model`; batcher/trace.py); '' = "
        "don't"))
    # reliability (docs/reliability.md)
    on_worker_loss: str = field(default="fail", metadata=flag(
        "what happens to a lost worker's requests: fail (an ERROR finish, the client sees an error) | requeue "
        "(recomputed once on another live worker, the client sees no break; with none alive they wait for one to "
        "register, until the gateway's --request-timeout)"))
    worker_timeout: float = field(default=30.0, metadata=flag(
        "a worker silent this long (no heartbeat or step output) is declared lost (0 = off); a dead process "
        "or a closed connection is noticed at once from the socket's disconnect event"))
    max_waiting_requests: int = field(default=2048, metadata=flag(
        "requests waiting for admission per worker; over it new requests are rejected as retryable "
        "(the gateway answers 429 + Retry-After); 0 = no cap"))
    curve_server_secret_key: str = field(default="", metadata=flag(
        "tcp across hosts: the batcher's CURVE certificate (zmq.auth secret file); its clients need the public "
        "file. '' = no encryption or authentication (ipc:// or loopback only)"))
    curve_client_keys_dir: str = field(default="", metadata=flag(
        "with CURVE: directory of the public certificates of the gateways and workers allowed to connect "
        "('' = any client that knows the server's public key)"))

    def validate(self) -> None:
        """Start-up checks beyond the numbers' ranges (laneserve.config.from_args calls it): a bad list or file is
        a clear error before anything starts, not a failure each time a worker registers."""
        try:
            buckets = parse_buckets(self.decode_buckets)
        except ValueError:
            raise ValueError(f"--decode-buckets {self.decode_buckets!r}: must be comma-separated whole "
                             "numbers") from None
        if any(b < 1 for b in buckets):
            raise ValueError(f"--decode-buckets {self.decode_buckets!r}: each bound must be at least 1")
        if self.warm_prefix and not self.enable_prefix_caching:
            raise ValueError(f"--warm-prefix {self.warm_prefix}: warm prefixes are prefix-cache entries; without "
                             "prefix caching (--no-enable-prefix-caching) their blocks would be held for nothing")
        if self.warm_prefix:
            try:
                load_warm_prefixes(self.warm_prefix)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"--warm-prefix {self.warm_prefix}: {exc}") from None
        for flag_name, path in (("--cost-model-out", self.cost_model_out), ("--step-trace", self.step_trace)):
            if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
                raise ValueError(f"{flag_name} {path}: its directory does not exist")


def parse_buckets(spec: str) -> list[int]:
    """--decode-buckets: the bounds, ascending (a ValueError for one that is not a whole number)."""
    return sorted({int(x) for x in spec.replace(" ", "").split(",") if x})


def load_warm_prefixes(path: str) -> list[list[int]]:
    """Token-id lists from a JSON file (a list of lists, or {"prefixes": [...]}) or JSONL (one list per line).

    Lines/items may also be objects with a "token_ids" key. The only file read of the batcher's policy code,
    done once when a Scheduler is built.
    """
    import json

    with open(path) as f:
        text = f.read()
    try:
        data = json.loads(text)
        items = data["prefixes"] if isinstance(data, dict) else data
    except json.JSONDecodeError:
        items = [json.loads(line) for line in text.splitlines() if line.strip()]
    out = []
    for item in items:
        ids = item["token_ids"] if isinstance(item, dict) else item
        if not (isinstance(ids, list) and all(isinstance(t, int) for t in ids)):
            raise ValueError(f"{path}: a warm prefix must be a list of token ids, got {str(ids)[:80]}")
        out.append(ids)
    return out
