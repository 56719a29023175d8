"""Triton kernels for the GPU path (paged decode attention, KV writes). Imported only when Triton is present."""
