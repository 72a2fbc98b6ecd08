"""The FP8 GEMM of a decoding step: y = x W^T with W float8_e4m3fn, for 1-64 tokens.

    y = few_token_mm(x, layer.weight, layer.weight_scale, layer.block)      # x [M, K], M <= MAX_TOKENS

A verify step multiplies 16 tokens by every weight of the target, so its time is the time to read the
weights. cuBLASLt's FP8 GEMM tiles the tokens by 128 and, at 16 tokens, reads the FP8 weights no
faster than the bf16 GEMM reads twice the bytes (docs/benchmarks.md). This Triton kernel is, in
its first mode, weight-only: x stays in its dtype (no activation quantization), each program streams a
[BLOCK_N, K / SPLIT_K] slab of W, converts it to x's dtype in registers, multiplies on the tensor
cores (W's tile as the first operand: y^T = W x^T), and applies W's scales (one per output row, or
one per 128 x 128 block inside the K loop). On an H200 it reads the 27B's FP8 decoder weights at
about 2 TB/s in a 16-token step, 11.3 ms against cuBLAS's 14 ms for the bf16 weights
(docs/benchmarks.md): better than cuBLASLt's FP8, still short of the 4.8 TB/s the memory allows.
SPLIT_K > 1 writes float32 partial sums that one sum adds up, so narrow layers still fill the GPU.

It is a torch.library.triton_op, so torch.compile traces into it and CUDA graphs capture it. Where
triton does not import (CPU-only torch) `available()` is False. x may also come quantized (FP8 with
its scales, as the scaled GEMM quantizes it): then the kernel gives the scaled GEMM's numbers at any
token count, and on Hopper multiplies the two FP8 tiles on the tensor cores as they are (products
exact in fp32 either way; no conversion of W in registers), which reads the weights faster: 8.0
against 13.7 ms for the 27B's 496 GEMMs at 16 tokens (docs/benchmarks.md). FP8Linear takes the
kernel only after fp8.few_token_steps(model, mode): benchmarks call it, and the target loader in the
quantized mode when target.fp8_decode_gemm = "few-token", the default (docs/guide/targets.md#fp8-targets).
"""

from __future__ import annotations

import functools

import torch

MAX_TOKENS = 64  # beyond this the scaled GEMM's 128-token tiles are no longer mostly padding
DTYPES = (torch.bfloat16, torch.float16)  # x's dtypes: the tensor cores' 16-bit inputs


@functools.cache
def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    if not torch.cuda.is_available():
        return False
    _op()  # registered before any torch.compile traces few_token_mm
    return True


@functools.cache
def fp8_dot(device: torch.device) -> bool:
    """Whether an FP8 x multiplies the FP8 weight on the tensor cores as it is: Hopper and later
    (compute 9.0+; Ada's e4m3 MMA is left out: its shared memory does not hold config_for's stages)."""
    return torch.cuda.get_device_capability(device) >= (9, 0)


def config_for(m: int, n: int, k: int, fp8_x: bool = False) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages), as bench/fp8_gemm.py's sweeps
    found best on an H200 for every decoder linear of the 27B hybrid at 16 tokens.
    x in bf16 (--sweep): 64 weight rows by 128 columns per tile (32 by 256 for a narrow layer), K
    split in 4. x in FP8 multiplied as it is (--sweep-fp8-dot: a K tile is half the bytes): 64 by 256,
    K whole (no partial sums to add), 5 stages in flight where the layer gives few tiles (N < 12 288),
    3 where it gives many."""
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    if fp8_x:
        return block_m, 64, 256, 1, 4, 3 if n >= 12288 else 5
    block_n, block_k = (64, 128) if n >= 2048 else (32, 256)
    split = 4
    while split > 1 and k < block_k * split * 4:  # each part at least 4 tiles deep
        split //= 2
    return block_m, block_n, block_k, split, 4, 3


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def fp8_weight_mm_kernel(
        x_ptr,
        w_ptr,
        scale_ptr,
        x_scale_ptr,
        out_ptr,
        M,
        N,
        K,
        stride_scale_n,
        stride_scale_k,
        stride_x_scale_m,
        stride_x_scale_k,
        X_SCALED: tl.constexpr,  # x is FP8 with its scales, laid out as W's along K (per row or per block)
        X_AS_FP16: tl.constexpr,  # an FP8 x multiplies as fp16 (an fp16 output), else as bf16
        FP8_DOT: tl.constexpr,  # an FP8 x multiplies FP8 W on the tensor cores as it is (fp8_dot)
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
        SCALE_ROWS: tl.constexpr,  # rows of W per scale: 1 (rowwise) or the block's 128
        SCALE_COLS: tl.constexpr,  # columns of W per scale: 0 (rowwise: no K blocks) or 128
    ):
        pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        chunk = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
        start = pid_k * chunk
        # y^T = W x^T: W's tile is the dot's first operand (its rows fill the tensor cores' 64-row
        # side, the few tokens the narrow side)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(start, tl.minimum(start + chunk, K), BLOCK_K):
            kk = k0 + rk
            w = tl.load(w_ptr + rn[:, None] * K + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
            xt = tl.load(x_ptr + rm[None, :] * K + kk[:, None], mask=(rm[None, :] < M) & (kk[:, None] < K), other=0.0)
            if FP8_DOT:  # products exact in fp32 either way; no conversion of W's tile in registers
                part = tl.dot(w, xt)
            else:
                if X_SCALED:  # exact either way: every e4m3 value is a bf16 and an fp16 value
                    if X_AS_FP16:
                        xt = xt.to(tl.float16)
                    else:
                        xt = xt.to(tl.bfloat16)
                part = tl.dot(w.to(xt.dtype), xt)
            if SCALE_COLS:  # block-scaled: this K block's scale for each output column (and token)
                s = tl.load(
                    scale_ptr + (rn // SCALE_ROWS) * stride_scale_n + (k0 // SCALE_COLS) * stride_scale_k,
                    mask=rn < N,
                    other=0.0,
                )
                part = part * s[:, None]
                if X_SCALED:
                    sx = tl.load(
                        x_scale_ptr + rm * stride_x_scale_m + (k0 // SCALE_COLS) * stride_x_scale_k,
                        mask=rm < M,
                        other=0.0,
                    )
                    part = part * sx[None, :]
            acc += part
        if SCALE_COLS == 0:
            acc = acc * tl.load(scale_ptr + rn * stride_scale_n, mask=rn < N, other=0.0)[:, None]
            if X_SCALED:
                acc = acc * tl.load(x_scale_ptr + rm * stride_x_scale_m, mask=rm < M, other=0.0)[None, :]
        out = out_ptr + pid_k * M * N + rm[None, :] * N + rn[:, None]
        tl.store(out, acc, mask=(rm[None, :] < M) & (rn[:, None] < N))

    return fp8_weight_mm_kernel


def launch(
    x, w, scale, scale_rows: int, scale_cols: int, config=None, wrap=lambda kernel: kernel, x_scale=None, out_dtype=None
) -> torch.Tensor:
    """Run the kernel with config (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages), config_for's
    when None; x_scale: x is FP8 and these its scales ([M, 1], or [M, ceil(K/128)] for a block-scaled W),
    out_dtype then the output's dtype."""
    (m, k), n = x.shape, w.shape[0]
    x_scaled = x_scale is not None
    fp8_x = x_scaled and fp8_dot(x.device)
    block_m, block_n, block_k, split, warps, stages = config or config_for(m, n, k, fp8_x)
    dtype = out_dtype or x.dtype
    out = x.new_empty((split, m, n), dtype=dtype if split == 1 else torch.float32)
    grid = (-(-n // block_n), split, -(-m // block_m))
    wrap(_kernel())[grid](
        x,
        w,
        scale,
        x_scale if x_scaled else scale,  # any pointer when unused
        out,
        m,
        n,
        k,
        scale.stride(0),
        scale.stride(1) if scale_cols else 0,
        x_scale.stride(0) if x_scaled else 0,
        x_scale.stride(1) if x_scaled and scale_cols else 0,
        X_SCALED=x_scaled,
        X_AS_FP16=dtype == torch.float16,
        FP8_DOT=fp8_x,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=min(block_k, scale_cols) if scale_cols else block_k,  # a K tile within one scale block
        SPLIT_K=split,
        SCALE_ROWS=scale_rows,
        SCALE_COLS=scale_cols,
        num_warps=warps,
        num_stages=stages,
    )
    return out[0] if split == 1 else out.sum(0).to(dtype)


@functools.cache
def _op():
    from torch.library import triton_op, wrap_triton

    @triton_op("dflash::fp8_weight_mm", mutates_args=())
    def fp8_weight_mm(
        x: torch.Tensor,
        w: torch.Tensor,
        scale: torch.Tensor,
        x_scale: torch.Tensor | None,
        scale_rows: int,
        scale_cols: int,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        return launch(x, w, scale, scale_rows, scale_cols, None, wrap_triton, x_scale, out_dtype)

    return fp8_weight_mm


def few_token_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    x_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [M, K] (contiguous, bf16/fp16) times the FP8 weight [N, K] with its float32 scales: [N, 1]
    rowwise (block (1, K)) or [ceil(N/br), ceil(K/bc)] block-scaled -> [M, N] in x's dtype.
    x_scale: x is FP8, quantized as the scaled GEMM quantizes it (fp8.quantize_rows, or groups of
    block[1] columns per token for a block-scaled W), and the result is in out_dtype."""
    rowwise = block[0] == 1
    dtype = out_dtype or x.dtype
    return torch.ops.dflash.fp8_weight_mm(
        x.contiguous(), weight, scale, x_scale, block[0], 0 if rowwise else block[1], dtype
    )
