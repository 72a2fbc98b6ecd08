"""Timing on the device, shared by the benchmarks: wall time with CUDA synchronised around the
timed loop; MFU's yardstick, the datasheet's dense bf16 peak, and beside it the bf16 matmul rate
measured in the same run (which moves with clocks and the other tenants of the GPU)."""

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


# Dense (no sparsity) bf16 tensor-core peaks, TFLOP/s, from NVIDIA's datasheets: H200 SXM and H100 SXM
# 989.4 ("1,979 TFLOPS with sparsity"), H100 PCIe 756, A100 312. Matched against the device name,
# longest first; None for other devices (MFU is then against the measured rate, and says so).
DATASHEET_BF16_TFLOPS = {"H200": 989.4, "H100 80GB HBM3": 989.4, "H100 PCIe": 756.0, "H100": 989.4, "A100": 312.0}


def datasheet_tflops(device) -> float | None:
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next(
        (DATASHEET_BF16_TFLOPS[k] for k in sorted(DATASHEET_BF16_TFLOPS, key=len, reverse=True) if k in name), None
    )


def matmul_peak_tflops(device, n: int = 8192, repeats: int = 20) -> float:
    import torch

    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = n if device.type == "cuda" else 512
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / timed(lambda: a @ b, repeats, warmup=3) / 1e12
