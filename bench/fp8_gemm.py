"""The FP8 GEMM of a decoding step, side by side: bf16, cuBLASLt's FP8 and the few-token kernel.

    python bench/fp8_gemm.py                       # the 27B hybrid's decoder linears at 1, 16 and 64 tokens
    python bench/fp8_gemm.py --sweep               # also every kernel config at 16 tokens, best per shape

For each distinct decoder linear of the shape (bench/shapes.py) and each token count, the time of
  bf16        F.linear with the bf16 weight (cuBLAS)
  scaled_mm   FP8Linear rowwise through torch._scaled_mm, the activations quantized per row (cuBLASLt)
  few_tokens  FP8Linear rowwise through services/target/model/fp8_few_tokens.py (weight-only, Triton)
  few_block   the same kernel with 128 x 128 block scales (an FP8 checkpoint's layout)
  few_quantized  the kernel with the activations quantized as scaled_mm quantizes them (its numbers)
  few_fp8_dot    its GEMM alone: x quantized once beforehand, FP8 times FP8 on the tensor cores
each weight read from HBM (copies cycled so they do not stay in L2), the calls in one CUDA graph
(GPU time, no launch overhead: as in a graphed verify step), with the bandwidth it reaches
and the error against the exact product. Then the sum over the shape's decoder linears (how many of
each), which is the GEMM part of one verify step. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from bench.shapes import text_config  # noqa: E402
from services.target.model import fp8  # noqa: E402
from services.target.model import fp8_few_tokens as few  # noqa: E402

L2_BYTES = 256 << 20  # cycle through copies of at least this many bytes: more than any L2


def decoder_linears(shape: str) -> Counter:
    """(N, K) -> how many decoder linears of that shape (multiples of 16 only: the rest stay bf16)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(text_config(shape))
    return Counter(
        (m.out_features, m.in_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and ".layers." in name and m.out_features % 16 == 0
    )


def time_cycled(fns: list, reps: int) -> float:
    """GPU milliseconds per call: `reps` calls cycling through fns (one per weight copy) captured in
    one CUDA graph and replayed, so the host's launch time is not in the figure (as in a verify step)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:  # compile and warm outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fns[i % len(fns)]()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


def bench_shape(n: int, k: int, tokens: list[int], iters: int, sweep: list | None, fp8_sweep: list | None) -> dict:
    copies = max(2, -(-L2_BYTES // (n * k)))  # FP8 bytes; the bf16 copies are twice that
    gen = torch.Generator("cuda").manual_seed(0)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(copies)]
    rowwise = [fp8.FP8Linear.rowwise_of(w, None, kernel=True) for w in weights]
    block = [fp8.FP8Linear(*fp8.quantize_blocks(w, (128, 128)), (128, 128), None, kernel=False) for w in weights]
    quantized = [fp8.FP8Linear(layer.weight, layer.weight_scale, None, None, kernel=False) for layer in rowwise]
    for layer in rowwise + block:  # their few-token calls through the kernel (off in the service)
        fp8.few_token_steps(layer, "weight-only")
    for layer in quantized:
        fp8.few_token_steps(layer, "quantized")
    out = {"n": n, "k": k, "copies": copies}
    for m in tokens:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        exact = x.float() @ fp8.dequantize(rowwise[0].weight, rowwise[0].weight_scale, rowwise[0].block).t()
        xq, sx = fp8.quantize_rows(x)
        exact_block = x.float() @ fp8.dequantize(block[0].weight, block[0].weight_scale, block[0].block).t()

        paths = {
            "bf16": [lambda w=w: F.linear(x, w) for w in weights],
            "scaled_mm": [lambda layer=layer: layer._rowwise(x, x.dtype) for layer in rowwise],
            "few_tokens": [lambda layer=layer: layer(x) for layer in rowwise],
            "few_block": [lambda layer=layer: layer(x) for layer in block],
            "few_quantized": [lambda layer=layer: layer(x) for layer in quantized],
            "few_fp8_dot": [
                lambda layer=layer: few.few_token_mm(xq, layer.weight, layer.weight_scale, layer.block, sx, x.dtype)
                for layer in quantized
            ],
        }
        row = {name: round(time_cycled(fns, max(iters, len(fns))), 4) for name, fns in paths.items()}
        row["few_tokens_GBps"] = round(n * k / row["few_tokens"] / 1e6, 1)
        row["bf16_GBps"] = round(2 * n * k / row["bf16"] / 1e6, 1)
        row["err_few_tokens"] = rel_err(rowwise[0](x), exact)
        row["err_few_block"] = rel_err(block[0](x), exact_block)
        row["err_few_quantized_vs_scaled_mm"] = rel_err(quantized[0](x), rowwise[0]._rowwise(x, x.dtype).float())
        row["err_scaled_mm"] = rel_err(rowwise[0]._rowwise(x, x.dtype), exact)
        row["config"] = few.config_for(m, n, k)
        row["config_fp8_dot"] = few.config_for(m, n, k, fp8_x=True)
        if sweep and m == 16:
            row["sweep_best"] = best_config(x, rowwise, sweep, iters)
        if fp8_sweep and m == 16:
            row["fp8_dot_sweep_best"] = best_config(xq, quantized, fp8_sweep, iters, sx)
        out[m] = row
    return out


def best_config(x: torch.Tensor, layers: list, sweep: list, iters: int, x_scale=None) -> dict:
    """The sweep's configs ranked at x's tokens (x_scale: x is FP8, the quantized mode's GEMM)."""
    times = {}
    for config in sweep:
        fns = [
            lambda layer=layer: few.launch(
                x, layer.weight, layer.weight_scale, 1, 0, config, x_scale=x_scale, out_dtype=torch.bfloat16
            )
            for layer in layers
        ]
        try:
            times[config] = time_cycled(fns, max(iters, len(fns)))
        except Exception as exc:  # noqa: BLE001 - a config the compiler or the GPU refuses
            print(f"config {config}: {type(exc).__name__}", file=sys.stderr)
    ranked = sorted(times.items(), key=lambda kv: kv[1])
    return {"best": [[list(c), round(t, 4)] for c, t in ranked[:5]], "worst": round(ranked[-1][1], 4)}


SWEEP = [
    (16, bn, bk, split, warps, stages)
    for bn in (32, 64, 128)
    for bk in (128, 256)
    for split in (1, 2, 4)
    for warps, stages in ((4, 3), (4, 4), (8, 4))
]
FP8_DOT_SWEEP = [  # the FP8 x FP8 GEMM reads a K tile of half the bytes: deeper tiles, fewer splits
    (16, bn, bk, split, warps, stages)
    for bn, bk in ((64, 128), (64, 256), (128, 128), (128, 256), (32, 512))
    for split in (1, 2, 4)
    for warps, stages in ((4, 3), (4, 5))
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="27b-hybrid")
    p.add_argument("--tokens", default="1,16,64")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--sweep", action="store_true", help="time every config of SWEEP at 16 tokens")
    p.add_argument("--sweep-fp8-dot", action="store_true", help="time FP8_DOT_SWEEP's configs at 16 tokens")
    args = p.parse_args(argv)
    if not few.available():
        print(json.dumps({"error": "needs CUDA and triton: the few-token kernel runs on the GPU only"}))
        return 1
    tokens = [int(t) for t in args.tokens.split(",")]
    linears = decoder_linears(args.shape)
    sweeps = (SWEEP if args.sweep else None, FP8_DOT_SWEEP if args.sweep_fp8_dot else None)
    shapes = [bench_shape(n, k, tokens, args.iters, *sweeps) for (n, k) in linears]
    step = {
        m: {
            path: round(sum(s[m][path] * linears[(s["n"], s["k"])] for s in shapes), 2)
            for path in ("bf16", "scaled_mm", "few_tokens", "few_block", "few_quantized", "few_fp8_dot")
        }
        for m in tokens
    }
    fp8_bytes = sum(n * k * count for (n, k), count in linears.items())
    floor = fp8_bytes / 4.8e12 * 1e3  # H200 HBM3e, 4.8 TB/s (NVIDIA's datasheet)
    print(
        json.dumps(
            {
                "shape": args.shape,
                "device": torch.cuda.get_device_name(),
                "linears": sum(linears.values()),
                "fp8_GB": round(fp8_bytes / 1e9, 2),
                "fp8_read_floor_ms_at_4.8TBps": round(floor, 2),
                "per_step_ms": step,
                "shapes": shapes,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
