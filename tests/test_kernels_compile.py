"""Every Triton kernel a CUDA worker launches compiles for the GPUs we are lent (sm_90, H100 / H200) and the A100s of
the users' fleet (sm_80, less shared memory: the GEMV's H200-tuned pipelines are cut to fit), with the arguments and
constexprs the worker gives it there: workers/tools/compile_check.py runs the real runner on the CPU with a
compile-only Triton driver (Triton's own ptxas, no launch). The interpreted kernel tests check what the kernels
compute; this checks what the interpreter accepts and the compiler or the GPU's resources do not (a variable
retyped in a branch, a config past the shared memory), which would otherwise surface only on a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_every_kernel_compiles_for_sm90_and_sm80():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    runs = {arch: subprocess.Popen([sys.executable, "-m", "workers.tools.compile_check", "--arch", arch], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for arch in ("90", "80")}  # (at once: each is mostly one core's compiling)
    try:
        for arch, proc in runs.items():
            out, err = proc.communicate(timeout=600)
            report = out + err[-3000:]
            assert proc.returncode == 0, report
            assert f"sm_{arch}: " in out and "0 of 6 model variants failed; not compiled: none" in out, report
    finally:
        for proc in runs.values():
            proc.kill()
            proc.wait()
