"""Compile every Triton kernel a CUDA worker would launch, for a GPU this machine does not have.

`python -m workers.tools.compile_check [--arch 90]` runs the real model runner on the CPU with a 2-layer model of
the Mistral-7B shape (and 1-layer ones of the Qwen2-7B shape: qkv bias, 28 heads over 4 K/V heads; and of
SmolLM2-135M's: head_dim 64, tied embeddings) through the Triton attention backend, the fused kernels and the
small-batch GEMV path, in each variant a GPU run takes (partitioned, persistent and auto decode attention, bf16 and
int8 K/V, prefill chunks, decode steps of 1, 8 and 9 sequences; `--dtypes` adds fp16 / fp32 models), with
Triton's active driver replaced by one that compiles each kernel for the target (Triton's own ptxas, to a cubin),
checks its shared memory against the target's and launches nothing. So a kernel the GPU's compiler or shared memory
would reject, with the arguments and constexprs the worker gives it there, fails here first, on a CPU machine,
before a lent GPU's minutes go on it (a launch refused for its registers per thread is not checked). It also lists
the variants that spill registers to the stack (Triton's cuobjdump): slower on the device, not an error.
Nothing is computed: the weights, the kernels' outputs and the torch GEMMs' are left as allocated, so the tokens are
meaningless.

Limits: the Triton installed compiles (CI's is the newest 3.x; to check the lent GPU's, `pip install --no-deps
--target DIR triton==3.6.0` and run this with PYTHONPATH=DIR), and what compiles can still be wrong or slow on the
device: the GPU tests (`workers/tools/gpu_bench.sh`) remain the check that counts.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

# compute capability -> the most shared memory a block may opt into (bytes): A100, RTX 30xx, L40 / RTX 40xx, H100 / H200
SHARED_MEMORY = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
ARCHS = tuple(SHARED_MEMORY)


class _CompileOnlyDriver:
    """Triton's driver interface as far as compiling needs it: the target, and a launcher that does nothing."""

    backend = "cuda"

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.arch = arch
        self.target = GPUTarget("cuda", arch, 32)
        self.utils = self
        self.launcher_cls = lambda src, metadata: (lambda *args, **kwargs: None)

    @staticmethod
    def is_active() -> bool:
        return True

    def get_current_target(self):
        return self.target

    @staticmethod
    def get_current_device() -> int:
        return 0

    @staticmethod
    def get_current_stream(device=None) -> int:
        return 0

    @staticmethod
    def load_binary(name, kernel, shared, device):  # (module, function, registers, spills, max threads)
        return 0, 0, 0, 0, 1024

    def get_device_properties(self, device) -> dict:  # Triton checks each kernel's shared memory against it
        return {"max_shared_mem": SHARED_MEMORY[self.arch], "multiprocessor_count": 132, "max_num_regs": 65536,
                "warpSize": 32, "sm_clock_rate": 1980000, "mem_clock_rate": 2619000, "mem_bus_width": 5120}


def install(arch: int) -> None:
    """Make Triton compile for `arch` and launch nothing."""
    from triton.runtime.driver import driver

    from workers.kernels.fused import INTERPRETED

    if INTERPRETED:
        raise SystemExit("compile_check: TRITON_INTERPRET is set (the interpreter compiles nothing): unset it")

    driver.set_active(_CompileOnlyDriver(arch))


def compiled(arch: int) -> dict[str, list]:
    """Each of the workers' launched Triton kernels -> its compiled variants that fit `arch` (its JIT cache, less
    those Triton refused for their shared memory: the GEMV then ran with fewer stages)."""
    from triton.runtime.jit import JITFunction

    from workers.kernels import fused, gemv, paged_attention

    out = {}
    for module in (fused, gemv, paged_attention):
        for name, fn in vars(module).items():
            if isinstance(fn, JITFunction) and (name.endswith("_kernel") or name in ("_gemv", "_qkv_rope")):
                caches = getattr(fn, "device_caches", {})
                out[f"{module.__name__.rsplit('.', 1)[1]}.{name}"] = [
                    k for c in caches.values() for k in c[0].values() if k.metadata.shared <= SHARED_MEMORY[arch]]
    return out


def compiled_variants(arch: int) -> dict[str, int]:
    return {name: len(kernels) for name, kernels in compiled(arch).items()}


def resource_usage(kernel) -> tuple[int, int] | None:
    """A compiled kernel's registers per thread and stack bytes (spills), from Triton's cuobjdump; None if unknown."""
    import re
    import subprocess

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    cubin = getattr(kernel, "asm", {}).get("cubin")
    if not cubin or not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+)", text), re.search(r"STACK:(\d+)", text)
    return (int(regs.group(1)), int(stack.group(1))) if regs and stack else None


def _variants(tmp: str, dtypes: tuple[str, ...]) -> list[tuple[str, dict, str]]:
    from workers.tools.bench import MISTRAL_7B, write_dummy_model_dir

    mistral = write_dummy_model_dir(os.path.join(tmp, "mistral"), {**MISTRAL_7B, "num_hidden_layers": 2})
    qwen2 = write_dummy_model_dir(os.path.join(tmp, "qwen2"), {
        **MISTRAL_7B, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 1, "num_attention_heads": 28, "num_key_value_heads": 4,
        "vocab_size": 32000, "tie_word_embeddings": False})
    smollm2 = write_dummy_model_dir(os.path.join(tmp, "smollm2"), {
        **MISTRAL_7B, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 1, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True})
    gemv = {"decode_gemv_rows": 8}
    return [("mistral, bf16 K/V, partitioned decode, GEMV path", {"decode_attention": "partitioned", **gemv}, mistral),
            ("mistral, bf16 K/V, persistent decode", {"decode_attention": "persistent"}, mistral),
            ("mistral, bf16 K/V, auto decode, cascade", {"decode_attention": "auto", "cascade_attention": "on"},
             mistral),
            # (auto compiles the partitioned kernel and the persistent one, here with the cascade's)
            ("mistral, int8 K/V, auto decode, cascade", {"kv_cache_dtype": "int8", "decode_attention": "auto",
                                                        "cascade_attention": "on"}, mistral),
            ("qwen2, bf16 K/V, GEMV path (qkv bias), cascade", {"decode_attention": "partitioned",
                                                                 "cascade_attention": "on", **gemv}, qwen2),
            ("SmolLM2-135M shape (head_dim 64), GEMV path, auto decode", {"decode_attention": "auto", **gemv},
             smollm2),
            *((f"mistral, {dtype}, GEMV path", {"dtype": dtype, "decode_attention": "partitioned", **gemv}, mistral)
              for dtype in dtypes if dtype != "bfloat16")]


def _allocated_linear(linear):
    """F.linear that allocates its output and computes nothing: its shape, dtype and checks are F.linear's own (run
    on the meta device). The 7B shapes' GEMMs on the CPU took ~2/3 of a run, and what compiles is not in their values
    (the weights are uninitialised already)."""
    def allocated(x, weight, bias=None):
        out = linear(x.to("meta"), weight.to("meta"), None if bias is None else bias.to("meta"))
        return x.new_empty(out.shape, dtype=out.dtype)
    return allocated


def run(arch: int, dtypes: tuple[str, ...] = ("bfloat16",)) -> int:
    install(arch)
    import torch

    from workers import loader
    from workers.config import WorkerConfig
    from workers.kernels import fused
    from workers.runner import ModelRunner
    from workers.tools.driver import EngineDriver

    fused.USE_TRITON = True  # the fused kernels on CPU tensors (compiled, not run)
    loader.init_random_ = lambda model, generator: None  # nothing is computed: the weights stay as allocated
    torch.nn.functional.linear = _allocated_linear(torch.nn.functional.linear)  # (the model's GEMMs alike)
    torch.manual_seed(0)
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        variants = _variants(tmp, dtypes)
        for name, settings, model in variants:
            t0, before = time.perf_counter(), sum(compiled_variants(arch).values())
            try:  # (a 160 MiB pool: the 7B shape's 640 float32 blocks hold the driver's ~600, and the kernels take
                # its strides, not its size; 320 MiB took up to ~0.6 s to zero in each variant)
                runner = ModelRunner(WorkerConfig(**{"dtype": "bfloat16", **settings}, model=model,
                                                  load_format="dummy", device="cpu", attention_backend="triton",
                                                  kv_cache_memory="160MiB", max_model_len=2048, max_num_seqs=16))
                runner.model.compile_attention(any_device=True)  # what a GPU worker compiles at start (the
                # cascade's prefix kernel among them: the steps below form no group)
                vocab = runner.model_config.vocab_size
                for batch in (1, 8, 9):  # the GEMV path's M == 1 and M > 1 specialisations, then past it
                    driver = EngineDriver(runner, context=16, long_context=160 if batch > 1 else 0)
                    driver.prefill(batch, vocab, chunk=64)
                    for _ in range(2):
                        driver.decode_step()
                    runner.flush()
                    driver.finish()
            except Exception as exc:  # noqa: BLE001  (reported per variant: the others still run)
                failed += 1
                print(f"FAILED  {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}", flush=True)
                continue
            print(f"ok      {name}: {sum(compiled_variants(arch).values()) - before} new kernel variants compiled in "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
    counts = compiled_variants(arch)
    for kernel, n in counts.items():
        print(f"  {kernel}: {n}")
    for name, kernels in compiled(arch).items():  # register spills: slower on the device (not an error)
        for k in kernels:
            usage = resource_usage(k)
            if usage and usage[1]:
                print(f"  spills: {name} ({k.metadata.num_warps} warps, {k.metadata.num_stages} stages, "
                      f"{k.metadata.shared} B shared): {usage[0]} registers, {usage[1]} B of stack")
    print(f"sm_{arch}: {sum(counts.values())} kernel variants compiled; {failed} of {len(variants)} model variants "
          f"failed; not compiled: {', '.join(k for k, n in counts.items() if not n) or 'none'}")
    return 1 if failed or not all(counts.values()) else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workers.tools.compile_check", description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, choices=ARCHS, default=90, help="compute capability x 10 (90: H100/H200)")
    ap.add_argument("--dtypes", default="bfloat16", help="model dtypes, comma-separated: bfloat16 (every variant), "
                    "float16, float32 (the 7B shape's GEMV path each; float32 takes ~1 min)")
    args = ap.parse_args(argv)
    dtypes = tuple(dict.fromkeys(args.dtypes.split(",")))
    if not set(dtypes) <= {"bfloat16", "float16", "float32"}:
        ap.error(f"--dtypes {args.dtypes!r}: choose from bfloat16, float16, float32")
    return run(args.arch, dtypes)


if __name__ == "__main__":
    sys.exit(main())
