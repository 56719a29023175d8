"""Prometheus metrics of one gateway: request latencies and token counts it measures itself, plus
the engine's state from the batcher's latest Pong (EngineStats). Names follow vLLM's with the
prefix `laneserve:`. One CollectorRegistry per app, so several apps can live in one process.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from laneserve.wire.protocol import EngineStats

P = "laneserve:"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class EngineCollector:
    """Exposes the latest EngineStats at scrape time (counters are the batcher's running totals)."""

    def __init__(self, stats: Callable[[], tuple[EngineStats, int]]):
        self.stats = stats

    def collect(self):
        s, workers = self.stats()
        used = s.kv_blocks_total - s.kv_blocks_free
        gauges = [
            ("num_requests_running", "Requests in model execution batches.", s.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("kv_cache_blocks_total", "KV cache blocks in all workers' pools.", s.kv_blocks_total),
            ("kv_cache_blocks_free", "Free KV cache blocks.", s.kv_blocks_free),
            ("kv_cache_blocks_used", "KV cache blocks in use.", used),
            ("kv_cache_usage_perc", "KV cache usage; 1 means 100 percent.",
             used / s.kv_blocks_total if s.kv_blocks_total else 0.0),
            ("prefix_cache_hit_rate", "Prefix cache hits / queries (prompt tokens), since start.",
             s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0),
            ("workers_alive", "Workers the batcher counts as ready.", workers),
        ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(P + name, doc)
            g.add_metric([], float(value))
            yield g
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
            ("spec_decode_num_steps", "Steps that verified draft tokens (speculative decoding; over engine_steps: "
             "the share of steps that speculated).", s.spec_steps),
            ("spec_decode_num_drafts", "Drafts verified (one per request per such step).", s.spec_sequences),
            ("spec_decode_num_draft_tokens", "Draft tokens verified.", s.spec_drafted),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted (over num_draft_tokens: the acceptance rate; "
             "over num_drafts: the mean accepted length).", s.spec_accepted),
        ]
        for name, doc, value in counters:
            c = CounterMetricFamily(P + name, doc)
            c.add_metric([], float(value))
            yield c


class Metrics:
    def __init__(self, engine_stats: Callable[[], tuple[EngineStats, int]]):
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token (gateway arrival to first "
                              "token delta).", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(P + "time_per_output_token_seconds", "Mean time per output token after the first.",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "End-to-end request latency.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram(P + "request_queue_time_seconds", "Gateway arrival to the request being handed to "
                               "the batcher (validation, tokenization, admission).", buckets=LATENCY_BUCKETS,
                               registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens.", registry=r)
        self.request_success = Counter(P + "request_success", "Finished requests by finish reason.",
                                       ["finished_reason"], registry=r)
        self.request_errors = Counter(P + "request_errors", "Requests answered with an error, by status.",
                                      ["status"], registry=r)
        self.in_flight = Gauge(P + "gateway_requests_in_flight", "HTTP generation requests this gateway is "
                               "serving.", registry=r)
        r.register(EngineCollector(engine_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
