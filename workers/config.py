"""The worker's one typed config object (flags and LANESERVE_* env vars via laneserve.config)."""

from __future__ import annotations

from dataclasses import dataclass, field

from laneserve.config import flag, shared


@dataclass
class WorkerConfig:
    worker_address: str = shared("worker_address")
    worker_id: int = field(default=0, metadata=flag("this worker's id (one per GPU)"))
    model: str = shared("model")
    device: str = field(default="auto", metadata=flag("auto | cpu | cuda | cuda:N"))
    dtype: str = field(default="auto", metadata=flag("auto | float32 | bfloat16 | float16 (vLLM's float and half "
                                                      "are float32 and float16)"))
    load_format: str = field(default="auto", metadata=flag("auto | safetensors | gguf | dummy (random weights)"))
    seed: int = field(default=0, metadata=flag("seed of the tiny/dummy weights"))
    max_model_len: int = shared("max_model_len")
    max_num_seqs: int = shared("max_num_seqs")
    max_num_batched_tokens: int = shared("max_num_batched_tokens")
    draft_model: str = field(default="", metadata=flag(
        "a smaller model sharing the model's tokenizer ('tiny', an HF checkpoint dir, a .gguf) for the batcher's "
        "--speculative draft: loaded beside the model, with its own K/V in every KV block, in the model's dtype "
        "(random weights when --load-format dummy); '' = none"))
    kv_cache_memory: str = field(default="", metadata=flag(
        "KV pool size, e.g. 256MiB or 4GiB; empty or 0 = on CPU 256MiB or room for two --max-model-len sequences, "
        "whichever is more; on CUDA --gpu-memory-utilization"))
    gpu_memory_utilization: float = field(default=0.9, metadata=flag(
        "share of GPU memory for weights + activations + KV pool (measured after a warm-up forward)"))
    kv_cache_dtype: str = field(default="auto", metadata=flag(
        "auto (the model's dtype) | int8 (per-layer, per-KV-head scales: half the bytes, twice the blocks)"))
    kv_scales: str = field(default="", metadata=flag(
        "int8 KV scales JSON from `laneserve calibrate-kv`; empty = kv_scales.json in the model dir if present, "
        "else set once from the first prefill chunk (docs/kv_int8.md)"))
    attention_backend: str = field(default="auto", metadata=flag(
        "auto (triton on CUDA, torch elsewhere) | torch (reference: gather + SDPA) | triton (paged decode/prefill "
        "kernels)"))
    decode_attention: str = field(default="auto", metadata=flag(
        "the Triton decode-attention kernel: auto (persistent for a batch whose longest context is >= 4x its mean "
        "and >= 4096 tokens, partitioned otherwise; the decode CUDA graphs are captured with both; docs/perf.md) | "
        "partitioned (a grid of sequence x KV head x partition, the partition count per step from the batch size) | "
        "persistent (a fixed grid taking chunks of one length from a work plan built on the device: long and short "
        "contexts in one batch are balanced; needs the Triton backend). The torch backend (the CPU default) has "
        "neither: auto and partitioned mean its own"))
    cascade_attention: str = field(default="auto", metadata=flag(
        "auto | on | off: decodes whose contexts start with the same K/V pages (the prefix cache's: a shared "
        "document or system prompt) read those pages once per 64 query heads of the group instead of once per "
        "sequence, where that pays: groups of 8 decodes and up, 32 decodes in groups a step (docs/architecture.md). "
        "Needs the Triton backend's partitioned kernel (--decode-attention auto or partitioned) and a model without "
        "a sliding window: on refuses to start without them; auto is on where they hold on CUDA at tensor-parallel "
        "size 1, whatever the K/V cache dtype (int8 included)"))
    decode_gemv_rows: int = field(default=-1, metadata=flag(
        "CUDA, tensor-parallel size 1: steps of at most this many tokens (1-8) run the model's linear layers as "
        "weight-streaming GEMV kernels with SiLU * up, the residual adds and (Triton attention, a pool that is not "
        "int8) RoPE and the K/V write fused into them, and the RMSNorms too at one token: four launches per layer "
        "besides attention at one token, six at 2-8, instead of eight (issue 25); 0 = cuBLAS and the separate "
        "kernels; -1 (auto) = 8 on CUDA at tensor-parallel size 1 with a bf16 or fp16 model whose head_dim is a "
        "multiple of 16 (whole decode steps 1.04-1.08x faster at batch 1-8 on an H100 and an H200), else 0"))
    enforce_eager: bool = field(default=False, metadata=flag(
        "CUDA: run every step eagerly instead of CUDA graphs (decode graphs and piecewise graphs)"))
    piecewise_graph_tokens: int = field(default=2048, metadata=flag(
        "CUDA: steps with a prompt chunk of up to this many tokens (at most --max-num-batched-tokens) replay the "
        "model's pieces between attentions as CUDA graphs, attention eager between them (docs/architecture.md); "
        "larger steps run eagerly; 0 = all of them eagerly"))
    overlap_steps: str = field(default="auto", metadata=flag(
        "auto (on for CUDA at tensor-parallel size 1) | on | decode | off: launch a step's forward before the "
        "previous step's sampled tokens reach the host (they are read on the device), so host work hides behind "
        "the GPU (a step with drafts waits for them); decode: decode-only steps only (a step with a prompt chunk "
        "waits, as before 2026-12-05: for comparison); on and decode are refused under tensor parallel"))
    num_threads: int = field(default=0, metadata=flag(
        "CPU: torch intra-op threads; 0 = the machine's cores divided among the CPU workers `laneserve serve` "
        "starts (two workers with torch's default each oversubscribe the cores)"))
    tensor_parallel_size: int = field(default=1, metadata=flag(
        "ranks (GPUs) per worker: this process is rank 0 and starts ranks 1..T-1; heads and MLP are split "
        "over them (NCCL on CUDA, gloo on CPU; docs/tensor_parallel.md). The batcher sees one worker"))
    dist_init_address: str = field(default="", metadata=flag(
        "rendezvous of the tensor-parallel group, e.g. tcp://127.0.0.1:29500; empty = a free local port"))
    liveness_file: str = field(default="", metadata=flag(
        "a file whose modification time the worker's loop sets about every 0.5 s (between steps, and while idle); "
        "created once the model is loaded. `laneserve serve` kills and restarts a worker whose file has not changed "
        "for the batcher's --worker-timeout (a hung process, or one step longer than that), and a Kubernetes "
        "liveness probe can do the same; '' = none"))
    curve_server_public_key: str = shared("curve_server_public_key")
    curve_client_secret_key: str = shared("curve_client_secret_key")
