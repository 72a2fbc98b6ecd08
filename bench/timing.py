"""Timing on the device, shared by the benchmarks: wall time with CUDA synchronised around the
timed loop, and the bf16 matmul rate measured in the same run (the MFU yardstick)."""

from __future__ import annotations

import time


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, iters: int = 1, warmup: int = 0) -> float:
    """Seconds per call of fn, averaged over `iters` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters


def matmul_peak_tflops(device, n: int = 8192, repeats: int = 20) -> float:
    import torch

    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = n if device.type == "cuda" else 512
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / timed(lambda: a @ b, repeats, warmup=3) / 1e12
