"""Burst detection and the long-prompt gate it drives.

Owns the decision "is this scheduler in a burst right now?" and "may this long
prompt be admitted now?". Pure: time is passed in (the scheduler's clock, i.e.
the `now` of `schedule()`), no I/O.

Detector: arrivals are stamped with the `now` of the first `schedule()` that
sees them (the gateway's `arrival_time` is another process's clock, so it is
not compared with ours). A burst is on while EITHER
  - more than `burst_arrival_rate` requests/s arrived over the last
    `burst_window_s` seconds (count in window / window), OR
  - at least `burst_queue_depth` requests wait for admission.
Either test is off when its threshold is 0.

Gate (only while a burst is on, or with SLO targets while the waiting queue
served in order would miss a deadline, and only when `burst_gating`; with SLO
targets the scheduler also lets a prompt through once holding it would make it
miss its own deadline, batcher/slo.py `may_hold`): a prompt with
more than `long_prefill_threshold` uncached tokens is held back while at least
`min_active_decodes` requests are active (running with at most the threshold
left to compute: decoding, or finishing a short prefill). Its prefill chunks
would fill every step's spare budget and slow each of those decodes (the step
time grows with the prefill tokens), so during a burst short requests pass it
and it goes when the decode lane thins out. Held requests keep their queue
position. A request is never held longer than `max_gated_wait_s` from the
first time it was seen: then it is admitted like any other (no starvation).
"""

from __future__ import annotations

from collections import deque

from batcher.config import BatcherConfig


class BurstDetector:
    def __init__(self, cfg: BatcherConfig):
        self.window = cfg.burst_window_s
        self.rate = cfg.burst_arrival_rate
        self.depth = cfg.burst_queue_depth
        self.arrivals: deque[float] = deque()
        self.active = False

    def arrived(self, now: float, n: int) -> None:
        """n requests arrived (seen by the schedule() at now)."""
        self.arrivals.extend([now] * n)

    def observe(self, now: float, queue_depth: int) -> bool:
        """Is a burst on at now? Sets `active`, which the gate reads."""
        arrivals = self.arrivals
        horizon = now - self.window
        while arrivals and arrivals[0] < horizon:
            arrivals.popleft()
        by_rate = self.rate > 0 and self.window > 0 and len(arrivals) / self.window > self.rate
        by_depth = self.depth > 0 and queue_depth >= self.depth
        self.active = by_rate or by_depth
        return self.active


class LongPromptGate:
    def __init__(self, cfg: BatcherConfig):
        self.enabled = cfg.burst_gating
        self.threshold = cfg.long_prefill_threshold
        self.min_active = cfg.min_active_decodes
        self.max_wait = cfg.max_gated_wait_s
        self.detector = BurstDetector(cfg)
        self.pressure = False  # SLO scheduling: served in order, a waiting request would miss its deadline

    def holds(self, now: float, uncached_tokens: int, first_seen: float, active_decodes: int) -> bool:
        """True: keep this prompt waiting for now. Never while nothing decodes (with --min-active-decodes 0 an idle
        server held every long prompt: nothing was running to end the hold, and the batcher schedules on events)."""
        return (self.enabled and (self.detector.active or self.pressure) and uncached_tokens > self.threshold
                and active_decodes >= max(self.min_active, 1) and now - first_seen < self.max_wait)
