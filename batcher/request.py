"""One request's scheduling state and its block arithmetic (nano-vllm's `Sequence`).

Owns the per-request bookkeeping the scheduler and the block manager share: the
token ids (prompt + outputs), how many of them have KV in the cache
(`num_computed_tokens`), the blocks that hold that KV, the chained hashes of its
full blocks, and its lifecycle status. Pure data plus arithmetic: no I/O, no
policy (which request runs when is batcher/scheduler.py's business).
"""

from __future__ import annotations

import enum

from laneserve.wire.protocol import SamplingParams


class Status(enum.IntEnum):
    WAITING = 0  # queued (new, or preempted and waiting to be recomputed)
    RUNNING = 1  # holds blocks; prefilling or decoding
    FINISHED = 2


class Request:
    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "params", "arrival_time", "status",
                 "num_computed_tokens", "block_ids", "block_hashes", "num_cached_tokens", "max_len",
                 "internal", "on_worker", "first_delta_sent", "num_sent_blocks", "admit_seq", "seen_at",
                 "gated_since", "num_preemptions", "epoch", "num_registered_blocks", "num_output_placeholders",
                 "max_num_tokens", "length_limit", "stop_check_from", "priority", "deadline", "tpot",
                 "first_token_at", "uncached_estimate", "admission_uncached", "arrived_at", "prefill_step", "ngrams",
                 "grammar", "speculative", "received_at", "scheduled_at", "samples", "draft_done")

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float = 0.0, max_len: int = 1 << 62, internal: bool = False):
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt, then outputs
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.arrival_time = arrival_time
        self.status = Status.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V is in block_ids once the steps in flight are done
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # chained hash of each full block, computed lazily
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.max_len = max_len  # context limit: min(max_model_len, max_active_blocks * block_size)
        # Derived once for the hot paths: prompt + max_tokens outputs, the number of tokens at which
        # generation ends by LENGTH (max_tokens reached, or the context limit), and the number from which a
        # token appended may end it (so it is checked): one below that, or any with stop tokens.
        self.max_num_tokens = self.num_prompt_tokens + params.max_tokens
        self.length_limit = min(self.max_num_tokens, max_len)
        self.stop_check_from = 0 if params.stop_token_ids else self.length_limit - 1
        # A warm-prefix request: its last token is a sentinel that is never computed, so the
        # worker never samples for it; its full blocks are pinned when the prefill is done.
        self.internal = internal
        # the worker samples for it once its prompt is computed: not a warm prefix, not a scored prompt (max_tokens
        # 0, which ends when its prompt is computed: Scheduler._apply)
        self.samples = not internal and params.max_tokens > 0
        self.on_worker = False  # the worker holds state for it (else the next step sends a NewReq)
        self.first_delta_sent = False
        self.num_sent_blocks = 0  # of block_ids, those a StepInput gave the worker (schedule() sends the rest)
        self.admit_seq = 0  # admission order: preemption takes the newest
        self.seen_at: float | None = None  # first schedule() that saw it (the scheduler's clock)
        self.gated_since: float | None = None
        self.num_preemptions = 0
        self.epoch = 0  # bumped when its steps in flight become void: it is preempted or finished
        self.num_registered_blocks = 0  # leading full blocks already offered to the prefix cache
        # Tokens that steps in flight will sample for it (async scheduling, vLLM's name): the worker already
        # has them when it runs the next step, so the scheduler counts them as known tokens of unknown value.
        self.num_output_placeholders = 0
        # SLO scheduling (batcher/slo.py): lower priority values go first (vLLM's rule); the time its first
        # token is due (the scheduler's clock; None: no TTFT target); its TPOT budget in seconds (0: none);
        # when its first token came back (its update()); its uncached prompt tokens when last looked up.
        self.priority = 0
        self.arrived_at: float | None = None  # the scheduler's clock when added (None: not stamped yet)
        self.deadline: float | None = None
        self.tpot = 0.0
        self.first_token_at: float | None = None
        self.uncached_estimate = len(prompt_token_ids)
        # as predictive admission prices it: after the prefix cache's hits when it came (SLO admission) or when
        # last looked up. The SLO policy's order prices a waiting prompt by uncached_estimate, its whole prompt
        # until it is looked up at the head of the queue, which starts decode pausing sooner on cached prefixes.
        self.admission_uncached = len(prompt_token_ids)
        self.prefill_step = 0  # two lanes: the prefill step in flight that computes some of it (0: none)
        self.ngrams = None  # speculative decoding: its batcher.spec.NgramIndex, made when first drafted for
        self.grammar = None  # structured output: its llguidance matcher (batcher/grammar.py), at its last token
        self.speculative = True  # it may get drafts (--speculative; a request can opt out)
        self.draft_done = 0  # --speculative draft: its leading positions whose draft-model K/V the worker has
        # Its queue time, sent with its first token (vLLM's request_queue_time_seconds ends at the first schedule):
        # when the batcher received it (None: arrived_at; earlier when a grammar compiled first) and when a step
        # first scheduled it (the scheduler's clock both).
        self.received_at: float | None = None
        self.scheduled_at: float | None = None

    # ------------------------------------------------------------------ sizes
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def compute_target(self) -> int:
        """How many tokens must have K/V before the worker samples (warm prefixes never sample).

        Counts the placeholders of tokens still being sampled by steps in flight.
        """
        return len(self.token_ids) + self.num_output_placeholders - self.internal

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.compute_target - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Exactly one token (the last sampled one) is left to compute: a decode step."""
        return self.compute_target - self.num_computed_tokens == 1 and self.num_output_tokens > 0

    @property
    def tokens_remaining(self) -> int:
        """Outputs still allowed (max_tokens - generated, in-flight samples included): the decode bucket key."""
        return self.params.max_tokens - self.num_output_tokens - self.num_output_placeholders

    @property
    def queued_ms(self) -> float | None:
        """Its wait from the batcher's receipt to the first step that scheduled it, in ms (None: not scheduled)."""
        if self.scheduled_at is None:
            return None
        start = self.received_at if self.received_at is not None else self.arrived_at
        return max(0.0, (self.scheduled_at - start) * 1000.0)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}"
                f"+{self.num_output_placeholders}, computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
