"""A random-weight target put in each precision on the same weights (bench/target_precision.py,
bench/target_capture.py --precision).

    linears = decoder_linears(layers)                              # the bf16 nn.Linears, kept
    print(set_precision(model, layers, linears, "fp8-block"))      # quantize_decoder's summary line

  bf16         the weights as they are
  fp8 / fp8-rowwise  target.quantize=fp8 on a bf16 checkpoint: the decoder linears quantized rowwise
  fp8-block    what target.quantize=fp8 does with an FP8 checkpoint: each weight in the published
               128x128 blocks with their scales, kept block-scaled where the GPU runs that GEMM
The bf16 linears stay referenced while an FP8 precision is set (set_precision puts them back), so
the bf16 weights and one FP8 copy are in memory together: the 27B hybrid at full depth is about
54 + 27 GB, more than an 80 GB H100 holds. With offload=True (`needs_offload` says when) each layer's
bf16 linears go to host memory as soon as that layer is in FP8, and come back for bf16: the GPU
holds one copy at a time, for a few seconds of copying per switch.
"""

from __future__ import annotations

from torch import nn

BLOCK = (128, 128)


def decoder_linears(layers: nn.ModuleList) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, module) of every nn.Linear in the decoder: what FP8 replaces and bf16 restores."""
    return [
        (parent, child, module)
        for layer in layers
        for parent in layer.modules()
        for child, module in parent.named_children()
        if isinstance(module, nn.Linear)
    ]


def needs_offload(bf16_linears) -> bool:
    """Whether the bf16 decoder linears and an FP8 copy of them (half their bytes) overfill 90 % of the GPU."""
    import torch

    if not torch.cuda.is_available():
        return False
    weights = sum(m.weight.numel() * m.weight.element_size() for _, _, m in bf16_linears)
    return 1.5 * weights > 0.9 * torch.cuda.get_device_properties(0).total_memory


def set_precision(model, layers, bf16_linears, precision: str, offload: bool = False) -> str:
    """Put the bf16 linears back, then quantize for `precision` ("bf16", "fp8" or "fp8-rowwise",
    "fp8-block"); returns the summary line. offload: the bf16 linears wait in host memory while FP8 runs."""
    from services.target.model import fp8

    device = model.get_input_embeddings().weight.device
    for parent, child, module in bf16_linears:
        setattr(parent, child, module.to(device))
    if precision == "bf16":
        return "bf16"
    if precision not in ("fp8", "fp8-rowwise", "fp8-block"):
        raise ValueError(f"unknown precision {precision!r}")

    def as_fp8_checkpoint(name: str):
        weight = model.get_submodule(name.removesuffix(".weight")).weight
        return (*fp8.quantize_blocks(weight, BLOCK), BLOCK)

    blocks = as_fp8_checkpoint if precision == "fp8-block" else None
    if not offload:
        return str(fp8.quantize_decoder(model, layers, blocks))
    summary = fp8.Summary()
    for layer in layers:  # one layer at a time: its bf16 linears leave the GPU before the next is quantized
        bf16 = decoder_linears([layer])
        summary.update(fp8.quantize_decoder(model, [layer], blocks))
        for _, _, module in bf16:
            module.to("cpu")
    return str(summary)


def gemm_layout(layers) -> str:
    """ "block" if any decoder linear runs block-scaled FP8, "rowwise" if any runs rowwise FP8, else "bf16"."""
    from services.target.model.fp8 import FP8Linear

    fp8 = [m for layer in layers for m in layer.modules() if isinstance(m, FP8Linear)]
    if not fp8:
        return "bf16"
    return "rowwise" if all(m.rowwise for m in fp8) else "block"
