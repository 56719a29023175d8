"""The worker's one typed config object (flags and LANESERVE_* env vars via laneserve.config)."""

from __future__ import annotations

from dataclasses import dataclass, field

from laneserve.config import flag


@dataclass
class WorkerConfig:
    worker_address: str = field(default="ipc:///tmp/laneserve/workers.sock",
                                metadata=flag("ZeroMQ address of the batcher's worker socket"))
    worker_id: int = field(default=0, metadata=flag("this worker's id (one per GPU)"))
    model: str = field(default="tiny", metadata=flag("'tiny' (embedded random model) or an HF checkpoint dir"))
    device: str = field(default="auto", metadata=flag("auto | cpu | cuda | cuda:N"))
    dtype: str = field(default="auto", metadata=flag("auto | float32 | bfloat16 | float16"))
    load_format: str = field(default="auto", metadata=flag("auto | safetensors | dummy (random weights)"))
    seed: int = field(default=0, metadata=flag("seed of the tiny/dummy weights"))
    max_model_len: int = field(default=0, metadata=flag("context length; 0 = the model's"))
    max_num_seqs: int = field(default=256, metadata=flag("most sequences in one step"))
    max_num_batched_tokens: int = field(default=2048, metadata=flag("token budget of one step"))
    kv_cache_memory: str = field(default="", metadata=flag(
        "KV pool size, e.g. 256MiB or 4GiB; empty = 256MiB on CPU, --gpu-memory-utilization on CUDA"))
    gpu_memory_utilization: float = field(default=0.9, metadata=flag(
        "share of GPU memory for weights + activations + KV pool (measured after a warm-up forward)"))
    kv_cache_dtype: str = field(default="auto", metadata=flag(
        "auto (the model's dtype) | int8 (per-layer, per-KV-head scales: half the bytes, twice the blocks)"))
    kv_scales: str = field(default="", metadata=flag(
        "int8 KV scales JSON from `laneserve calibrate-kv`; empty = kv_scales.json in the model dir if present, "
        "else set once from the first prefill chunk (docs/kv_int8.md)"))
    attention_backend: str = field(default="auto", metadata=flag(
        "auto (triton on CUDA, torch elsewhere) | torch (reference: gather + SDPA) | triton (paged decode/prefill kernels)"))
    enforce_eager: bool = field(default=False, metadata=flag("CUDA: run decode eagerly instead of CUDA graphs"))
    overlap_steps: str = field(default="auto", metadata=flag(
        "auto (on for CUDA at tensor-parallel size 1) | on | off: launch a decode-only step's forward before the "
        "previous step's sampled tokens reach the host (they are read on the device), so host work hides "
        "behind the GPU"))
    num_threads: int = field(default=0, metadata=flag("CPU: torch intra-op threads; 0 = torch's default"))
    tensor_parallel_size: int = field(default=1, metadata=flag(
        "ranks (GPUs) per worker: this process is rank 0 and starts ranks 1..T-1; heads and MLP are split "
        "over them (NCCL on CUDA, gloo on CPU; docs/tensor_parallel.md). The batcher sees one worker"))
    dist_init_address: str = field(default="", metadata=flag(
        "rendezvous of the tensor-parallel group, e.g. tcp://127.0.0.1:29500; empty = a free local port"))
    curve_server_public_key: str = field(default="", metadata=flag(
        "tcp across hosts: the batcher's public CURVE certificate (zmq.auth file); set = connect with CURVE"))
    curve_client_secret_key: str = field(default="", metadata=flag(
        "with CURVE: this client's certificate (zmq.auth secret file); '' = a fresh key pair per start"))
