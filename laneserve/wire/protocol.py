"""Every message that crosses a process boundary, and nothing else.

Owns the msgspec Structs spoken between gateway, batcher and workers,
their msgpack encoders/decoders and PROTOCOL_VERSION. Must import nothing but
msgspec and the standard library: gateway, batcher and workers all depend on it.

Rules (docs/architecture.md, "The wire"): every top-level message is a tagged
Struct so one Decoder(Union[...]) per receiving socket rejects anything
malformed; new fields go last with a default; the per-token struct is
array_like.
"""

from __future__ import annotations

import enum

import msgspec

PROTOCOL_VERSION = 3  # 3: max_tokens 0 and prompt_logprobs (an older peer would ignore them)


class FinishReason(enum.IntEnum):
    STOP = 0  # stop token (eos or a stop_token_id)
    LENGTH = 1  # max_tokens or the context length reached
    ABORT = 2  # cancelled by the client (disconnect, timeout)
    ERROR = 3  # engine failure; the delta's `error` says what
    INVALID = 4  # the request's own input failed while it ran (its grammar hit a parser limit): a 400, `error` says


class Msg(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True, gc=False):
    pass


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Per-request sampling, already validated by the gateway."""

    max_tokens: int = 16  # 0: the prompt is only computed (scored: prompt_logprobs), nothing sampled; ends LENGTH
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # includes the model's eos unless ignore_eos
    min_tokens: int = 0  # stop tokens are ignored before this many outputs
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: none; k >= 0: sampled token's logprob + top-k
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), before anything else
    # None: none; k >= 0: each prompt token's logprob and rank and the top-k at its position (vLLM's prompt_logprobs),
    # computed by the worker as it prefills (StepOutput.prompt_logprobs); such a request skips the prefix cache
    prompt_logprobs: int | None = None


# ---------------------------------------------------------------- gateway -> batcher
class AddRequest(Msg):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0  # lower goes first (vLLM's rule)
    slo_ttft_ms: float = 0.0  # this request's targets; 0 = the batcher's --slo-ttft-ms / --slo-tpot-ms
    slo_tpot_ms: float = 0.0
    # structured output (docs/structured_output.md): an llguidance grammar (JSON text, built and checked by the
    # gateway) that every sampled token must follow; "" = none
    grammar: str = ""
    speculative: bool = True  # False: never verify drafts for it (--speculative), the request's opt-out


class Vocabulary(Msg):
    """The served tokenizer, which the batcher's grammar matchers need (it has no tokenizer of its own): sent by a
    gateway once per connection, before its first request on it."""

    tokenizer_json: str  # the HF tokenizers JSON
    vocab_size: int  # the model's embedding rows: a token mask covers [0, vocab_size)
    eos_token_ids: list[int]


class AbortRequests(Msg):
    request_ids: list[str]


class Ping(Msg):
    """Liveness probe; answered with Pong outside the request queue."""

    nonce: int


# ---------------------------------------------------------------- batcher -> gateway
class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    logprob: float  # of the sampled token
    top_ids: list[int]
    top_logprobs: list[float]


class PromptLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Prompt tokens start, start + 1, ... scored by one prefill chunk (SamplingParams.prompt_logprobs): each one's
    logprob given the tokens before it, its rank in that distribution (1 = the most likely) and the top-k there.
    Token 0 has no context: start >= 1. A prompt recomputed after a preemption is scored again (same values)."""

    start: int
    token_logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


class TokenDelta(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first delta)
    prompt_logprobs: PromptLogprobs | None = None  # a prefill chunk's, for requests that ask (maybe without tokens)
    # first delta: ms from the batcher's receipt of the request to its first scheduled step (None: not the first
    # delta, or an older batcher). A duration, not a time: the gateway's host has another clock
    queued_ms: float | None = None


class TokenBatch(Msg):
    step: int
    deltas: list[TokenDelta]
    timestamp: float


class Rejected(Msg):
    request_id: str
    reason: str
    retryable: bool


# Upper bounds of the tokens-per-step histogram (vLLM's iteration_tokens_total, its bounds without CUDA graphs);
# EngineStats.iteration_tokens counts the steps in each bucket, the last one past the last bound.
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class EngineStats(msgspec.Struct, kw_only=True, omit_defaults=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of which were served from it
    gated_prefills: int = 0  # admissions deferred by burst gating
    preemptions: int = 0
    steps: int = 0
    steps_timed: int = 0  # steps whose execute_time came back, and the sums over them of
    step_ms_predicted: float = 0.0  # the cost model's prediction (before it learned from that step)
    step_ms_measured: float = 0.0  # and the worker's measure
    slo_shed: int = 0  # requests refused by predictive SLO admission
    slo_paused_decodes: int = 0  # decode rows that sat a step out for waiting prompts (SLO decode pausing)
    spec_steps: int = 0  # steps that verified drafts (speculative decoding)
    spec_sequences: int = 0  # drafts they verified (one per request per step)
    spec_drafted: int = 0  # the draft tokens they verified
    spec_accepted: int = 0  # of which were accepted
    # steps by tokens scheduled (prefill chunks, decodes and drafts; steps of none not counted): a count per bucket
    # of ITERATION_TOKENS_BUCKETS (not cumulative; empty: no step yet), and the tokens summed over those steps
    iteration_tokens: list[int] = []
    iteration_tokens_sum: int = 0
    pipeline_bubble_ms: float = 0.0  # StepOutput.idle_time summed over steps scheduled behind one in flight
    eager_steps: int = 0  # timed steps with a prompt chunk (run eagerly), and the sums over them of
    eager_launch_ms: float = 0.0  # StepOutput.launch_time
    eager_step_ms: float = 0.0  # and execute_time


class Pong(Msg):
    nonce: int
    workers_alive: int
    protocol_version: int = PROTOCOL_VERSION
    stats: EngineStats = msgspec.field(default_factory=EngineStats)


# ---------------------------------------------------------------- batcher -> worker
class NewReq(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """A request the worker has no state for (first schedule, or resumed after preemption)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int = 0  # tokens whose KV is already in block_ids (prefix cache)
    output_token_ids: list[int] = []  # tokens generated before a preemption (recomputed)


class CachedReq(msgspec.Struct, array_like=True, gc=False):
    """A running request that got new blocks this step."""

    request_id: str
    new_block_ids: list[int]


LANE_MIXED, LANE_DECODE, LANE_PREFILL = 0, 1, 2  # StepInput.lane


class DraftJob(msgspec.Struct, array_like=True, gc=False):
    """Draft-model work for one request in a step (`--speculative draft`, docs/speculative.md). The worker's draft
    model computes its K/V of the request's positions [start, stop) (every token there is known to the worker),
    then, when k > 0, proposes k drafts: its argmax after position stop - 1, which is then the request's input
    position this step (its num_scheduled_tokens is 1 + k), and after each draft in turn. k = 0: the K/V only."""

    start: int
    stop: int
    k: int


class StepInput(Msg):
    """One forward: new requests in full, running ones as a diff.

    The worker keeps per-request state (tokens, blocks, num_computed_tokens);
    num_scheduled_tokens[r] tokens of r are computed this step, starting at its
    num_computed_tokens. When they reach the end of r's tokens the worker
    samples one token and appends it. finished_req_ids (finished, aborted or
    preempted since the last step) are dropped before anything else.

    lane (`--lanes`, docs/lanes.md): LANE_MIXED, one forward after the other (every step before);
    with `--lanes streams` the batcher sends LANE_DECODE steps (decodes only) and LANE_PREFILL steps
    (prefill chunks only), which a CUDA worker runs on a high- and a low-priority stream at once:
    steps of one lane run in order, and their outputs come back in order within each lane.
    """

    step: int
    lane: int = 0
    # speculative decoding (docs/speculative.md): request id -> draft tokens; such a request's
    # num_scheduled_tokens is 1 + len(drafts), its input its last token then the drafts, and its
    # output row the accepted drafts then one token sampled after them (greedy verification)
    spec_token_ids: dict[str, list[int]] = {}
    new_reqs: list[NewReq] = []
    cached_reqs: list[CachedReq] = []
    num_scheduled_tokens: dict[str, int] = {}
    finished_req_ids: list[str] = []
    # structured output: request id -> the tokens it may sample in this step, a little-endian bitmask of
    # ceil(vocab_size / 32) int32 words (bit t of word t // 32: token t allowed); only for requests that sample
    allowed_token_ids: dict[str, bytes] = {}
    # speculative decoding with a draft model: request id -> its DraftJob, as spec_token_ids but the worker's draft
    # model proposes the drafts
    draft_jobs: dict[str, DraftJob] = {}


class Shutdown(Msg):
    pass


class Reannounce(Msg):
    """The batcher does not know the worker that sent a Heartbeat/StepOutput (it restarted, or it
    declared the worker lost): the worker drops all request state and sends WorkerReady again."""

    reason: str = ""


# ---------------------------------------------------------------- worker -> batcher
class WorkerReady(Msg):
    worker_id: int
    num_blocks: int
    block_size: int
    max_model_len: int
    protocol_version: int
    model: str = ""
    vocab_size: int = 0  # 0 = unknown; else the batcher rejects token ids outside [0, vocab_size)
    concurrent_lanes: bool = False  # it runs LANE_DECODE and LANE_PREFILL steps at once (--lanes auto: streams)
    speculative: bool = False  # it verifies StepInput.spec_token_ids (tensor parallel 1)
    draft_model: str = ""  # its draft model (--draft-model): it runs StepInput.draft_jobs
    draft_size: float = 0.0  # the draft model's parameters over the model's (the batcher's first guess of its cost)


class StepOutput(Msg):
    step: int
    worker_id: int
    request_ids: list[str] = []  # requests that sampled a token this step
    sampled_token_ids: list[list[int]] = []
    logprobs: list[list[TokenLogprobs]] | None = None  # parallel to request_ids when asked
    error: str | None = None
    execute_time: float = 0.0  # seconds the worker spent on this step alone (from its start, or the end of the
    # step before when they overlap, to its tokens on the host; on CUDA, launched behind the step before: on the
    # device, from where the GPU reaches it to its end): what the batcher's cost model learns from
    prompt_logprobs: dict[str, PromptLogprobs] = {}  # request id -> the prompt tokens this step's chunk scored
    draft_time: float = 0.0  # seconds of execute_time its draft model took (StepInput.draft_jobs)
    idle_time: float = 0.0  # seconds the worker had nothing of this lane to run before this step came (0: it came
    # while the step before ran)
    launch_time: float = 0.0  # seconds its host took to build the forward's inputs and launch it (a CUDA graph
    # replay: one launch; an eager step: every kernel), waits for other steps' tokens not counted


class Heartbeat(Msg):
    worker_id: int


GatewayToBatcher = AddRequest | AbortRequests | Ping | Vocabulary
BatcherToGateway = TokenBatch | Rejected | Pong
BatcherToWorker = StepInput | Shutdown | Reannounce
WorkerToBatcher = WorkerReady | StepOutput | Heartbeat

_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode


def decoder(union) -> msgspec.msgpack.Decoder:
    """One decoder per receiving socket, over the union of what it may receive."""
    return msgspec.msgpack.Decoder(union)
