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


def fp8_matmul_tflops(device, layout: str, n: int = 8192, repeats: int = 20) -> float | None:
    """The FP8 GEMM rate of an n x n x n product, timed as matmul_peak_tflops times bf16's: operands
    quantized beforehand (no activation quantization in the time), bf16 output, through the GEMM
    FP8Linear runs for `layout`: "rowwise" (torch._scaled_mm, one scale per row) or "block" (the
    dflash::fp8_block_mm op: 1x128 groups by 128x128 blocks). None off CUDA, or where the GEMM fails."""
    import torch

    from services.target.model import fp8

    device = torch.device(device)
    if device.type != "cuda":
        return None
    gen = torch.Generator(device).manual_seed(0)
    a = torch.randn(n, n, generator=gen, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, n, generator=gen, device=device, dtype=torch.bfloat16)
    try:
        if layout == "rowwise":
            layer = fp8.FP8Linear.rowwise_of(w, None, kernel=True)
            xq, sx = fp8.quantize_rows(a)
            wt, sw = layer.weight.t(), layer.kernel_scale
            call = lambda: torch._scaled_mm(xq, wt, scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)  # noqa: E731
        elif layout == "block":
            layer = fp8.FP8Linear(*fp8.quantize_blocks(w, (128, 128)), (128, 128), None, kernel=True)
            xq, sx = fp8.quantize_blocks(a, (1, 128))
            wq, sw = layer.weight, layer.kernel_scale
            call = lambda: torch.ops.dflash.fp8_block_mm(xq, wq, sx, sw, torch.bfloat16)  # noqa: E731
        else:
            raise ValueError(f"layout {layout!r}: rowwise or block")
        return 2 * n**3 / timed(call, repeats, warmup=3) / 1e12
    except (RuntimeError, NotImplementedError) as exc:
        print(f"no {layout} FP8 GEMM rate on {device}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        return None
