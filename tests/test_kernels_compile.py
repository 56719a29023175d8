"""Every Triton kernel a CUDA worker launches compiles for the GPUs we are lent (sm_90), with the arguments and
constexprs the worker gives it there: workers/tools/compile_check.py runs the real runner on the CPU with a
compile-only Triton driver (Triton's own ptxas, no launch). The interpreted kernel tests check what the kernels
compute; this checks what the interpreter accepts and the compiler does not (a variable retyped in a branch, a
shape the layouts reject), which would otherwise surface only on a lent GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "workers.tools.compile_check", "--arch", "90"], env=env,
                          capture_output=True, text=True, timeout=600)
    report = done.stdout + done.stderr[-3000:]
    assert done.returncode == 0, report
    assert "0 of 6 model variants failed; not compiled: none" in done.stdout, report
