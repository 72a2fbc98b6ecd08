"""FP8 (e4m3) decoder linears for the target, and FP8 checkpoints in the published block-scaled layout.

    print(quantize_decoder(model, decoder_layers(model), blocks))   # to_device_in_fp8: layer by layer

FP8Linear computes y = x W^T (+ b) with W stored as float8_e4m3fn and x quantized at every call
(dynamic activations), in one of two layouts:
  rowwise  one scale per output row of W (amax / 448, quantized once at load) and one per token row
           of x: how a bf16 checkpoint runs in FP8;
  block    W in 128 x 128 blocks with an FP8 checkpoint's own scales, x in groups of 128 columns per
           token: how vLLM and SGLang serve Qwen's FP8 checkpoints.
The GEMM is torch's scaled matmul (torch._scaled_mm rowwise, torch.nn.functional.scaled_mm block-
scaled) where this device runs it for the layer's shape, checked once per shape at load against the
plain math. Elsewhere the plain math runs: dequantize both operands, matmul in float32, round to the
output dtype (the CPU's block layout, so the tests run the real quantization). On CUDA a layer
whose block-scaled GEMM does not run is requantized rowwise from its dequantized weight, and a GPU
with no FP8 GEMM at all is an error, never a silent slow path.

`few_token_steps` sends a decoding step's few tokens (at most
fp8_few_tokens.MAX_TOKENS rows) through fp8_few_tokens' Triton GEMM instead (cuBLASLt's FP8 GEMM pads
the tokens to 128 and is no faster than bf16 there), in one of two modes:
  quantized    x quantized as above: the scaled GEMM's numbers (up to the order of the fp32 sums),
               so every token count computes alike;
  weight-only  x left in its dtype: less work, but then a batch of more rows (the scaled GEMM)
               computes differently from one of few, and the lossless rule compares a greedy
               reference and the verification of the same tokens at a few ulps.
The quantized mode is the service's where the kernel runs: target.fp8_decode_gemm = "few-token", the
default since a GPU run of `launcher eval` checked it both ways (docs/guide/targets.md#fp8-targets).

The block-scaled checkpoints themselves (their layout, reading and checking them, loading a model
from one) are fp8_checkpoint.py's, with to_device_in_fp8, the entry of target.quantize = "fp8".
"""

from __future__ import annotations

import functools
import logging
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from services.run.config import ConfigError
from services.target.model import fp8_few_tokens as few

log = logging.getLogger("target")
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
ALIGN = 16  # torch's scaled GEMMs take K and N in multiples of 16
TINY = 1e-12  # amax floor: an all-zero row gets a tiny scale, not 0 / 0
SCALE_SUFFIX = "_scale_inv"  # <name>.weight -> <name>.weight_scale_inv


def gemm_widths(n: int, k: int) -> bool:
    """Whether an [n, k] weight has widths torch's FP8 GEMMs take (the others stay in target.dtype)."""
    return n % ALIGN == 0 and k % ALIGN == 0


class CheckpointError(ConfigError):
    """An FP8 checkpoint that cannot load as it is; the message names the tensor and the file."""


# --- quantization --------------------------------------------------------------------------------


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (fp8 [M, K], float32 scale [M, 1]) with x ~= fp8 * scale per row."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=TINY) / FP8_MAX
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_blocks(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] -> (fp8 [R, C], float32 scale [ceil(R/br), ceil(C/bc)]) with x ~= fp8 * scale per
    br x bc block; the last blocks of a dimension that is not a multiple may be partial."""
    (r, c), (br, bc) = x.shape, block
    padded = F.pad(x, (0, -c % bc, 0, -r % br)) if r % br or c % bc else x
    tiles = padded.unflatten(1, (-1, bc)).unflatten(0, (-1, br))  # [R/br, br, C/bc, bc]
    scale = tiles.abs().amax(dim=(1, 3)).float().clamp(min=TINY) / FP8_MAX
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).flatten(2).flatten(0, 1)
    return (q[:r, :c].contiguous() if q.shape != x.shape else q), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp8 [R, C] and its scales per br x bc block -> float32 [R, C] (rowwise: block (1, C))."""
    r, c = q.shape
    return q.float() * scale.float().repeat_interleave(block[0], 0)[:r].repeat_interleave(block[1], 1)[:, :c]


class FP8Linear(nn.Module):
    """nn.Linear with an FP8 weight; `kernel` says whether torch's scaled GEMM runs it (else the
    plain math of the module docstring)."""

    def __init__(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor,
        block: tuple[int, int] | None,
        bias: torch.Tensor | None,
        kernel: bool,
    ):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.block = tuple(block) if block else (1, self.in_features)  # rowwise: one block per row
        self.rowwise, self.kernel, self.bias = block is None, kernel, bias
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", scale.float())
        self.register_buffer("kernel_scale", self._kernel_scale() if kernel else None)
        self.few = ""  # a decoding step's few tokens through fp8_few_tokens: "quantized", "weight-only" or not

    @classmethod
    def rowwise_of(cls, weight: torch.Tensor, bias: torch.Tensor | None, kernel: bool) -> "FP8Linear":
        w, scale = quantize_rows(weight.detach())
        return cls(w, scale, None, bias, kernel)

    def _kernel_scale(self) -> torch.Tensor:
        if self.rowwise:
            return self.weight_scale.t().contiguous()  # [1, N]
        # cuBLAS wants the 128x128 scales as [ceil(K/128) rounded up to 4, ceil(N/128)], K-major
        return F.pad(self.weight_scale, (0, -self.weight_scale.shape[1] % 4)).t()

    def extra_repr(self) -> str:
        layout = "rowwise" if self.rowwise else f"block {self.block[0]}x{self.block[1]}"
        return f"in={self.in_features}, out={self.out_features}, {layout}, {'kernel' if self.kernel else 'plain math'}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.few and rows.shape[0] <= few.MAX_TOKENS and x.dtype in few.DTYPES:
            out = self._few_tokens(rows, x.dtype)
        else:
            out = self._rowwise(rows, x.dtype) if self.rowwise else self._block(rows, x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def _few_tokens(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.few == "weight-only":
            return few.few_token_mm(rows, self.weight, self.weight_scale, self.block)
        xq, sx = quantize_rows(rows) if self.rowwise else quantize_blocks(rows, (1, self.block[1]))
        return few.few_token_mm(xq, self.weight, self.weight_scale, self.block, x_scale=sx, out_dtype=dtype)

    def _rowwise(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        xq, sx = quantize_rows(rows)
        if self.kernel:
            return torch._scaled_mm(xq, self.weight.t(), scale_a=sx, scale_b=self.kernel_scale, out_dtype=dtype)
        return self._plain(xq, sx, (1, self.in_features), dtype)

    def _block(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        m, group = rows.shape[0], (1, self.block[1])
        if not self.kernel:
            return self._plain(*quantize_blocks(rows, group), group, dtype)
        rows = F.pad(rows, (0, 0, 0, -m % 4)) if m % 4 else rows  # cuBLAS: token count a multiple of 4
        xq, sx = quantize_blocks(rows, group)
        # cuBLAS reads these scales token-major: laid out so here, a compiled layer's quantization
        # kernel writes them so, instead of a transposing copy per GEMM inside the op
        return torch.ops.dflash.fp8_block_mm(xq, self.weight, sx.t().contiguous().t(), self.kernel_scale, dtype)[:m]

    def _plain(self, xq, sx, group, dtype) -> torch.Tensor:
        w = dequantize(self.weight, self.weight_scale, self.block)
        return (dequantize(xq, sx, group) @ w.t()).to(dtype)


# flexible_layout: inductor hands the op its inputs as it wrote them, and the op lays them out (a
# no-op for what FP8Linear._block traces). With the default exact strides inductor split the
# quantization in front of it into two kernels: 217 against 128 us for the 27B's down_proj input
# on an H100 (docs/benchmarks.md, "The block-FP8 capture at 17 K tok/s")
@torch.library.custom_op("dflash::fp8_block_mm", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def fp8_block_mm(
    xq: torch.Tensor, w: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """cuBLAS's 128 x 128 block-scaled GEMM, xq [M, K] (scales [M, K/128], token-major: no copy
    when FP8Linear._block lays them out so) by w [N, K] (sw as _kernel_scale lays it out), as one op:
    dynamo does not trace torch._scaled_mm_v2, which F.scaled_mm calls, so without it every FP8
    linear of a compiled capture was a graph break."""
    recipe = F.ScalingType
    return F.scaled_mm(
        xq.contiguous(),
        w.t(),
        sx.t().contiguous().t(),
        recipe.BlockWise1x128,
        sw,
        recipe.BlockWise128x128,
        output_dtype=dtype,
    )


@fp8_block_mm.register_fake
def _(xq, w, sx, sw, dtype):
    return xq.new_empty((xq.shape[0], w.shape[0]), dtype=dtype)


@functools.cache
def runs_kernel(layout: str, n: int, k: int, device: str, dtype: torch.dtype) -> bool:
    """Whether torch's scaled GEMM of `layout` ("rowwise" | "block", 128x128) runs on `device` for an
    [n, k] weight and agrees with the plain math (any failure of the kernel means no)."""
    gen = torch.Generator(device).manual_seed(0)
    weight = torch.randn(n, k, generator=gen, device=device, dtype=dtype)
    x = torch.randn(2 * few.MAX_TOKENS + 2, k, generator=gen, device=device, dtype=dtype)  # padded to 4 rows too
    try:
        layers = [
            FP8Linear.rowwise_of(weight, None, kernel)
            if layout == "rowwise"
            else FP8Linear(*quantize_blocks(weight, (128, 128)), (128, 128), None, kernel)
            for kernel in (True, False)
        ]
        got, want = (layer(x).float() for layer in layers)
    except Exception as exc:  # noqa: BLE001 - no kernel for this layout, shape, dtype or device
        log.debug("no %s FP8 GEMM for [%d, %d] %s on %s: %s", layout, n, k, dtype, device, exc)
        return False
    return bool(torch.isfinite(got).all()) and float((got - want).norm() / want.norm().clamp(min=TINY)) < 0.02


FEW_TOKEN_MODES = ("quantized", "weight-only")


def few_token_steps(model: nn.Module, mode: str = "quantized") -> int:
    """Send every FP8Linear's few-token calls through fp8_few_tokens' kernel in `mode` (one of
    FEW_TOKEN_MODES; "" sends none), where it runs and agrees (runs_few_tokens); returns how many."""
    if mode and mode not in FEW_TOKEN_MODES:
        raise ValueError(f"few-token mode {mode!r}: one of {FEW_TOKEN_MODES} or empty")
    count = 0
    for layer in model.modules():
        if isinstance(layer, FP8Linear):
            layout, (n, k) = ("rowwise" if layer.rowwise else "block"), layer.weight.shape
            usable = bool(mode) and layer.weight.is_cuda and few.available()
            layer.few = mode if usable and runs_few_tokens(layout, n, k, str(layer.weight.device), mode) else ""
            count += bool(layer.few)
    return count


@functools.cache
def runs_few_tokens(layout: str, n: int, k: int, device: str, mode: str) -> bool:
    """Whether fp8_few_tokens' kernel runs on `device` for an [n, k] weight of `layout` in `mode` and
    agrees with that mode's math (x, or x quantized, times the dequantized weight); any failure
    means no."""
    gen = torch.Generator(device).manual_seed(0)
    weight = torch.randn(n, k, generator=gen, device=device)
    x = torch.randn(13, k, generator=gen, device=device, dtype=torch.bfloat16)
    block = (1, k) if layout == "rowwise" else (128, 128)
    q, scale = quantize_rows(weight) if layout == "rowwise" else quantize_blocks(weight, block)
    group = (1, block[1])
    xq, sx = quantize_rows(x) if layout == "rowwise" else quantize_blocks(x, group)
    try:
        if mode == "weight-only":
            got, want = few.few_token_mm(x, q, scale, block), x.float()
        else:
            got, want = few.few_token_mm(xq, q, scale, block, sx, torch.bfloat16), dequantize(xq, sx, group)
    except Exception as exc:  # noqa: BLE001 - no triton kernel for this device or shape
        log.warning(
            "FP8 few-token GEMM unavailable for [%d, %d] on %s (%s): decoding steps use scaled_mm", n, k, device, exc
        )
        return False
    want = want @ dequantize(q, scale, block).t()
    got = got.float()
    return bool(torch.isfinite(got).all()) and float((got - want).norm() / want.norm().clamp(min=TINY)) < 0.01


# --- swapping the decoder's linears --------------------------------------------------------------


class Summary(Counter):
    """How many decoder linears went which way, for the log."""

    WORDS = {
        "block": "with the checkpoint's block scales",
        "requantized": "requantized rowwise from the checkpoint's blocks (no block-scaled FP8 GEMM here)",
        "rowwise": "quantized rowwise",
    }

    def __str__(self) -> str:
        fp8 = [f"{self[kind]} {words}" for kind, words in self.WORDS.items() if self[kind]]
        total = sum(self[k] for k in self.WORDS)
        text = f"target.quantize=fp8: {total} decoder linears in FP8 ({', '.join(fp8) or 'none'})"
        if self["kept"]:
            text += (
                f", {self['kept']} kept in the target dtype (a dimension not a multiple of {ALIGN}, "
                "or left unquantized by the checkpoint)"
            )
        return text + f"; GEMM: torch scaled_mm for {self['kernel']}, plain torch math for {self['plain']}"


def quantize_decoder(model: nn.Module, layers: nn.ModuleList, blocks=None, keep_blocks: bool | None = None) -> Summary:
    """Swap every nn.Linear inside `layers` (the decoder: never the embeddings or lm_head) for an FP8Linear.

    blocks(name) -> (fp8 weight, scale_inv, block) of a linear an FP8 checkpoint stores block-scaled,
    None for one it keeps in high precision; blocks None: every linear is quantized rowwise.
    keep_blocks: keep the checkpoint's blocks (True), requantize them rowwise (False), or None: keep
    them where the block-scaled GEMM runs, and on the CPU (plain math either way)."""
    inside = {id(m) for layer in layers for m in layer.modules()}
    summary = Summary()
    for name, module in list(model.named_modules()):
        if id(module) in inside and isinstance(module, nn.Linear):
            fp8 = _fp8_linear(
                module, blocks(name + ".weight") if blocks else None, blocks is not None, keep_blocks, summary
            )
            if fp8 is not None:
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, fp8)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the bf16 weights just freed: a drafter on the same GPU may use them
    return summary


def _fp8_linear(module: nn.Linear, stored, from_checkpoint: bool, keep_blocks, summary: Summary) -> FP8Linear | None:
    (n, k), w = module.weight.shape, module.weight
    device, dtype = w.device, w.dtype
    kind = "rowwise"
    if from_checkpoint:
        if stored is None:
            summary["kept"] += 1
            return None
        q, scale, block = (stored[0].to(device), stored[1].to(device), stored[2])
        kernel = tuple(block) == (128, 128) and runs_kernel("block", n, k, str(device), dtype)
        if keep_blocks or (keep_blocks is None and (kernel or device.type == "cpu")):
            summary.update(["block", "kernel" if kernel else "plain"])
            return FP8Linear(q, scale, block, module.bias, kernel)
        kind, w = "requantized", dequantize(q, scale, block)
    if not gemm_widths(n, k):
        summary["kept"] += 1
        return None
    kernel = runs_kernel("rowwise", n, k, str(device), dtype)
    if not kernel and device.type == "cuda":
        raise ConfigError(
            f"target.quantize=fp8: this GPU runs no FP8 GEMM (torch._scaled_mm, rowwise, {dtype}); "
            "FP8 needs compute capability 8.9 or newer (L40S, H100, H200, B200), or set target.quantize=none"
        )
    summary.update([kind, "kernel" if kernel else "plain"])
    return FP8Linear.rowwise_of(w, module.bias, kernel)
