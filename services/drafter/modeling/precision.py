"""kernels.precision: the matmuls of the drafter's own linears in bf16 (autocast) or in FP8.

"fp8" is torchao's float8 training with dynamic tensorwise scales (recipe "tensorwise": inputs and
weights in e4m3, output gradients in e5m2, one scale per tensor computed each step, cuBLAS's FP8
GEMM). Its "rowwise" recipe (a scale per row, CUTLASS's kernel) was measured slower on an H200:
0.96x and 1.02x of bf16 against 1.06x and 1.15x (docs/benchmarks.md, "FP8 drafter"). Each
nn.Linear of the drafter (fc and every projection of every layer) becomes a Float8Linear: the
parameters stay the same fp32 tensors under the same names, so AdamW, DDP, checkpoints and the
export see nothing new, and a run may switch precision on resume. Only the three GEMMs of each
linear (output, input grad, weight grad) run in FP8; norms, attention, the loss and the update
stay as they are. The frozen lm_head's two GEMMs in the loss run in FP8 too (services/drafter/modeling/loss.py,
`Fp8Head`), with the same tensorwise scales.

FP8 matmuls need a GPU with FP8 tensor cores (compute capability 8.9: Ada, Hopper and newer)
and the `fp8` extra (torchao). docs/guide/drafter.md ("Drafter precision") says when to use it.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from services.drafter.modeling.loss import fp8_dims
from services.process import torchao_gate

FP8_RECIPE = "tensorwise"  # measured fastest (above); bench/drafter_step.py --fp8-recipe tries others


def fp8_unavailable(device: torch.device) -> str | None:
    """Why FP8 training cannot run on this device, or None when it can (the 27B preset asks for it)."""
    need = fp8_need(device)
    return need and f"kernels.precision='fp8' needs {need}; kernels.precision=\"bf16\" trains without it"


def fp8_need(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"a CUDA GPU with FP8 matmuls; this drafter runs on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"compute capability 8.9 or newer; {torch.cuda.get_device_name(device)} is {major}.{minor}"
    try:
        with torchao_gate.quiet_import():
            import torchao.float8  # noqa: F401
    except ImportError:
        return "torchao: pip install 'dflash-service[fp8]' (or torchao>=0.18)"
    return None


def apply_precision(drafter: nn.Module, precision: str, device: torch.device, *, emulate: bool = False) -> nn.Module:
    """Swap the drafter's linears to FP8 training in place (before compile and DDP); bf16 is a no-op.
    emulate: torchao's emulated FP8 matmuls (any device; for tests, not for speed)."""
    if precision == "bf16":  # (config.validate refused any other value but "fp8")
        return drafter
    if not emulate and (why := fp8_unavailable(torch.device(device))):
        raise ValueError(why)
    with torchao_gate.quiet_import():
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(FP8_RECIPE)
    # FP8 GEMMs need inner dimensions in multiples of 16; the token count is the inner dimension of
    # the weight gradient, and pack_len or anchors x block size need not be one
    config = dataclasses.replace(config, pad_inner_dim=True, emulate=emulate)
    return convert_to_float8_training(drafter, config=config, module_filter_fn=fits_fp8)


def fits_fp8(module: nn.Module, name: str) -> bool:
    """A linear whose weight dimensions FP8 GEMMs accept (multiples of 16); others stay bf16, and so
    does Domino's head (embed_proj: its vocabulary-wide W2 is used in the loss's own GEMMs)."""
    return (
        isinstance(module, nn.Linear)
        and fp8_dims(module.in_features, module.out_features)
        and not name.startswith("embed_proj")
    )
