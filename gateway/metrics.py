"""Prometheus metrics of one gateway: request latencies and token counts it measures itself, plus
the engine's state from the batcher's latest Pong (EngineStats). Names are vLLM's with the prefix
`laneserve:` (`--metrics-prefix vllm`: `vllm:`, for dashboards that cannot be edited), every series with
the `model_name` label. One CollectorRegistry per app, so several apps can live in one process.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from laneserve.wire.protocol import ITERATION_TOKENS_BUCKETS, EngineStats

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000)
LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
LOOP_LAG_TICK_S = 0.01  # watch_loop_lag's timer
PREFIXES = ("laneserve", "vllm")  # --metrics-prefix: the series' names start with it and a colon
BLOCK_SIZE = 16  # tokens per KV block (the batcher's, fixed), for cache_config_info


class EngineCollector:
    """Exposes the latest EngineStats at scrape time (counters are the batcher's running totals)."""

    def __init__(self, stats: Callable[[], tuple[EngineStats, int]], prefix: str, model: str):
        self.stats, self.prefix, self.model = stats, prefix, model

    def collect(self):
        s, workers = self.stats()
        used = s.kv_blocks_total - s.kv_blocks_free
        usage = used / s.kv_blocks_total if s.kv_blocks_total else 0.0
        gauges = [
            ("num_requests_running", "Requests in model execution batches.", s.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("num_requests_swapped", "Requests swapped to CPU: always 0 (preemption recomputes).", 0),
            ("kv_cache_blocks_total", "KV cache blocks in all workers' pools.", s.kv_blocks_total),
            ("kv_cache_blocks_free", "Free KV cache blocks.", s.kv_blocks_free),
            ("kv_cache_blocks_used", "KV cache blocks in use.", used),
            ("kv_cache_usage_perc", "KV cache usage; 1 means 100 percent.", usage),
            ("gpu_cache_usage_perc", "KV cache usage; 1 means 100 percent (kv_cache_usage_perc's older name).", usage),
            ("cpu_cache_usage_perc", "CPU KV cache usage: always 0 (no CPU swap).", 0),
            ("prefix_cache_hit_rate", "Prefix cache hits / queries (prompt tokens), since start.",
             s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0),
            ("workers_alive", "Workers the batcher counts as ready.", workers),
        ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(self.prefix + name, doc, labels=["model_name"])
            g.add_metric([self.model], float(value))
            yield g
        info = GaugeMetricFamily(self.prefix + "cache_config_info", "The KV cache's configuration (value 1).",
                                 labels=["model_name", "block_size", "num_gpu_blocks", "enable_prefix_caching"])
        info.add_metric([self.model, str(BLOCK_SIZE), str(s.kv_blocks_total), "True"], 1.0)
        yield info
        counters = [
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_queries),
            ("prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.prefix_hits),
            ("num_gated_prefills", "Admissions deferred by burst gating.", s.gated_prefills),
            ("num_preemptions", "Requests preempted to free KV blocks.", s.preemptions),
            ("engine_steps", "Scheduler steps run.", s.steps),
            ("step_time_timed", "Steps whose time the workers reported.", s.steps_timed),
            ("step_time_predicted_ms", "Step time the batcher's cost model predicted, summed over the timed "
             "steps (divide by step_time_timed for the mean).", s.step_ms_predicted),
            ("step_time_measured_ms", "Step time the workers measured, summed over the timed steps.",
             s.step_ms_measured),
            ("num_slo_shed", "Requests refused by predictive SLO admission (429).", s.slo_shed),
            ("num_slo_paused_decodes", "Decode rows that sat a step out so waiting prompts could make their TTFT "
             "deadlines (SLO decode pausing).", s.slo_paused_decodes),
            ("spec_decode_num_steps", "Steps that verified draft tokens (speculative decoding; over engine_steps: "
             "the share of steps that speculated).", s.spec_steps),
            ("spec_decode_num_drafts", "Drafts verified (one per request per such step).", s.spec_sequences),
            ("spec_decode_num_draft_tokens", "Draft tokens verified.", s.spec_drafted),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted (over num_draft_tokens: the acceptance rate; "
             "over num_drafts: the mean accepted length).", s.spec_accepted),
            ("pipeline_bubble_ms", "Time workers waited for steps the batcher had scheduled to queue behind the "
             "one in flight (ms): --schedule-lead-ms shorter than the host's share of a step, or the cost model "
             "predicting steps too long.", s.pipeline_bubble_ms),
            ("eager_steps", "Timed steps with a prompt chunk: run eagerly (the others replay CUDA graphs).",
             s.eager_steps),
            ("eager_step_launch_ms", "Host time the workers took to build those steps' inputs and launch their "
             "kernels (ms; over eager_steps: the mean). With steps back to back, near eager_step_time_measured_ms: "
             "the host's launches, not the GPU, set the pace.", s.eager_launch_ms),
            ("eager_step_time_measured_ms", "Step time the workers measured for those steps (ms).", s.eager_step_ms),
        ]
        for name, doc, value in counters:
            c = CounterMetricFamily(self.prefix + name, doc, labels=["model_name"])
            c.add_metric([self.model], float(value))
            yield c
        yield self._iteration_tokens(s)

    def _iteration_tokens(self, s: EngineStats) -> HistogramMetricFamily:
        """vLLM's iteration_tokens_total: steps by tokens scheduled, from the batcher's bucket counts."""
        h = HistogramMetricFamily(self.prefix + "iteration_tokens_total", "Tokens per engine step (prefill chunks, "
                                  "decodes and draft tokens scheduled; steps of none not counted).",
                                  labels=["model_name"])
        counts = s.iteration_tokens or [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        bounds = [str(float(b)) for b in ITERATION_TOKENS_BUCKETS] + ["+Inf"]
        running, buckets = 0, []
        for bound, n in zip(bounds, counts):
            running += n
            buckets.append((bound, float(running)))
        h.add_metric([self.model], buckets, float(s.iteration_tokens_sum))
        return h


class Metrics:
    """The gateway's series, each with the model_name label (vLLM's dashboards filter on it); names are vLLM's under
    `prefix:` (--metrics-prefix)."""

    def __init__(self, engine_stats: Callable[[], tuple[EngineStats, int]], model: str = "",
                 prefix: str = "laneserve"):
        r = self.registry = CollectorRegistry()
        P = prefix + ":"
        self.model = model

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(P + name, doc, ["model_name"], buckets=buckets, registry=r).labels(model)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token (gateway arrival to first token "
                         "delta).", LATENCY_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds", "Mean time per output token after the first.", TPOT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between two token deltas of a request (a delta of "
                        "speculative decoding may hold several tokens).", TPOT_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS)
        # vLLM's phases: queue = arrival -> first scheduled, prefill = scheduled -> first token, decode = first
        # token -> last, inference = scheduled -> last. "Scheduled" is the gateway's hand-off plus the batcher's
        # wait (TokenDelta.queued_ms, a duration: the two hosts' clocks differ).
        self.queue = hist("request_queue_time_seconds", "Gateway arrival to the first step that scheduled the "
                          "request (validation, tokenization and the batcher's wait for admission).", LATENCY_BUCKETS)
        self.prefill_time = hist("request_prefill_time_seconds", "First scheduled to the first token.",
                                 LATENCY_BUCKETS)
        self.decode_time = hist("request_decode_time_seconds", "First token to the last.", LATENCY_BUCKETS)
        self.inference_time = hist("request_inference_time_seconds", "First scheduled to the last token.",
                                   LATENCY_BUCKETS)
        self.request_prompt_tokens = hist("request_prompt_tokens", "Prompt tokens of a finished request.",
                                          TOKEN_BUCKETS)
        self.request_generation_tokens = hist("request_generation_tokens", "Tokens a finished request generated.",
                                              TOKEN_BUCKETS)
        self.request_max_tokens = hist("request_max_num_generation_tokens", "max_tokens of a finished request.",
                                       TOKEN_BUCKETS)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens processed.", ["model_name"],
                                     registry=r).labels(model)
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens.", ["model_name"],
                                         registry=r).labels(model)
        self._success = Counter(P + "request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self._errors = Counter(P + "request_errors", "Requests answered with an error, by status (/health and "
                               "/metrics are not counted).", ["model_name", "status"], registry=r)
        self.loop_lag = hist("gateway_event_loop_lag_seconds", "How late the gateway's event loop ran a timer due "
                             f"every {LOOP_LAG_TICK_S * 1000:g} ms: a stalled loop delays every stream it serves.",
                             LOOP_LAG_BUCKETS)
        self.in_flight = Gauge(P + "gateway_requests_in_flight", "HTTP generation requests this gateway is "
                               "serving.", ["model_name"], registry=r).labels(model)
        r.register(EngineCollector(engine_stats, P, model))

    def success(self, reason: str) -> None:
        self._success.labels(self.model, reason).inc()

    def error(self, status: int) -> None:
        self._errors.labels(self.model, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def watch_loop_lag(observe: Callable[[float], None], tick: float = LOOP_LAG_TICK_S) -> None:
    """Observes, every `tick` s, how much later than due the event loop woke this task: the time its callbacks held
    it (the first sign of a gateway stall; the load tester's TTFT less the batcher's says only that time went
    somewhere outside the batcher)."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + tick
        await asyncio.sleep(tick)  # a timer, not synchronisation
        observe(max(0.0, loop.time() - due))
