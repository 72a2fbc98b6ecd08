"""The bf16 matmul rate of this GPU, measured in the same run as a benchmark (the MFU yardstick)."""
from __future__ import annotations

import time


def matmul_peak_tflops(device, n: int = 8192, repeats: int = 20) -> float:
    import torch
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = n if device.type == "cuda" else 512
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync()
    return 2 * n ** 3 / ((time.perf_counter() - start) / repeats) / 1e12
