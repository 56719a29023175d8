"""Weight-streaming linear for small batches (issue 25): y = x @ w.T for x [M, K] with M <= 8.

At batch 1-8 a decode step's GEMMs read every weight once and do almost no math, so their time is the weights'
bytes over the bandwidth the kernel reaches: cuBLAS reads the 7B's weights at 3.2-4.1 TB/s on the H200.
This kernel gives each program BLOCK_N rows of w (contiguous along K, so each row streams in wide loads) and
multiplies them with the M input rows padded to 16 on the tensor cores (the math is free here; the padding keeps
registers for the loads), accumulating in fp32; SPLIT_K > 1 splits K over programs (fp32 atomics into a zeroed
buffer, then one cast) for shapes with too few row blocks to fill the GPU. Measured on the H200 (2026-12-05,
`python -m workers.tools.kernel_bench --gemv`, docs/perf.md): with each shape's best config 8% faster than cuBLAS
over a batch-1 step's weights (3.9-4.2 TB/s), no faster at batch 4-8, slower with one config for all shapes. Not
wired into the model: a per-shape table tuned on one model would be needed for ~7% at batch 1. On CPU tensors it
runs under Triton's interpreter (tests).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

MAX_M = 8
# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages); the bench sweeps GEMV_GRID and prints the best per shape
GEMV_CONFIG = {"BLOCK_N": 32, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 4, "num_stages": 4}
GEMV_GRID = {"BLOCK_N": [16, 32, 64], "BLOCK_K": [128, 256, 512], "SPLIT_K": [1, 2, 4], "num_warps": [4],
             "num_stages": [3, 5]}

if triton is not None:
    @triton.jit
    def _gemv(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, k_per_split,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr, UPCAST: tl.constexpr,
              PRECISION: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ms = tl.arange(0, 16)
        k_lo = tl.program_id(1) * k_per_split
        acc = tl.zeros((16, BLOCK_N), tl.float32)
        for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            w = tl.load(w_ptr + rows[:, None] * stride_wn + ks[None, :], mask=(rows[:, None] < N) & k_ok[None, :],
                        other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptr + ms[:, None] * stride_xm + ks[None, :], mask=(ms[:, None] < M) & k_ok[None, :],
                        other=0.0)
            if UPCAST:  # (Triton's interpreter: its bf16 dot is wrong)
                x, w = x.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        offs = ms[:, None] * stride_ym + rows[None, :]
        mask = (ms[:, None] < M) & (rows[None, :] < N)
        if ATOMIC:
            tl.atomic_add(y_ptr + offs, acc, mask=mask)
        else:
            tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def gemv(x: torch.Tensor, w: torch.Tensor, config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (M <= 8, rows contiguous along K) @ w.T for w [N, K] contiguous: [M, N] in x's dtype."""
    M, K = x.shape
    N = w.shape[0]
    if M > MAX_M or w.shape[1] != K or w.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"gemv takes x [M <= {MAX_M}, K] and w [N, K] contiguous along K, got {tuple(x.shape)} "
                         f"and {tuple(w.shape)}")
    c = {**GEMV_CONFIG, **(config or {})}
    split = c["SPLIT_K"]
    k_per_split = -(-K // (split * c["BLOCK_K"])) * c["BLOCK_K"]
    split = -(-K // k_per_split)
    y = out if out is not None else torch.empty(M, N, dtype=x.dtype, device=x.device)
    acc = torch.zeros(M, N, dtype=torch.float32, device=x.device) if split > 1 else y
    grid = (triton.cdiv(N, c["BLOCK_N"]), split)
    _gemv[grid](x, w, acc, M, N, K, x.stride(0), w.stride(0), acc.stride(0), k_per_split,
                BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], ATOMIC=split > 1, UPCAST=not x.is_cuda,
                PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=c["num_warps"],
                num_stages=c["num_stages"])
    if split > 1:
        y.copy_(acc)
    return y
