"""A random-weight model saved as an FP8 checkpoint in the published block-scaled layout.

    save_fp8(model, path)     # every decoder linear float8_e4m3fn + weight_scale_inv (128 x 128 blocks)

What Qwen ships as Qwen3.6-27B-FP8, at half the bytes of the bf16 checkpoint: the 27B shape's 64
layers are 27 GB to write and to read instead of 54, which is what lets the benchmarks run the users'
preset at full depth within one device call (bench/e2e.py --fp8-checkpoint). The model is whatever
transformers built (its own initialisation); the decoder linears are quantized here, the rest (the
embeddings, lm_head, norms, the Gated DeltaNet conv and gates) stay in the model's dtype. A vision
tower is left out: the service loads the text model of a composite checkpoint. services/target/model/fp8_checkpoint.py
reads the result (BlockScaledCheckpoint); the layout is the one it documents.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from services.target.model import fp8

BLOCK = (128, 128)
SPEC = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
SHARD_BYTES = 5 << 30


def decoder_linears(model: nn.Module) -> set[str]:
    """The weight names of the linears inside the decoder layers whose widths FP8 GEMMs take."""
    return {
        name + ".weight"
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and ".layers." in name and "visual" not in name and fp8.gemm_widths(*m.weight.shape)
    }


@torch.no_grad()
def save_fp8(model: nn.Module, path: str | Path, shard_bytes: int = SHARD_BYTES) -> int:
    """Write model's config and weights to path with its decoder linears in FP8 blocks; returns how
    many linears went to FP8. Shards of at most shard_bytes, with the index transformers reads."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    quantized, index, shard, size, total = decoder_linears(model), {}, {}, 0, 0

    def flush():  # each shard is written as soon as it is full: host memory holds one at a time
        file = f"model-{len(set(index.values())) + 1:05d}.safetensors"
        save_file(shard, str(path / file), metadata={"format": "pt"})
        index.update(dict.fromkeys(shard, file))
        shard.clear()
        print(f"fp8 checkpoint: {file} written, {total / 1e9:.1f} GB so far", flush=True)  # 27 GB take a while

    for name, tensor in model.state_dict().items():
        if ".visual." in name or name.startswith("visual."):
            continue
        parts = {name: tensor}
        if name in quantized:
            q, scale = fp8.quantize_blocks(tensor.float(), BLOCK)
            parts = {name: q, name + fp8.SCALE_SUFFIX: scale}
        for key, value in parts.items():
            shard[key] = value.detach().to("cpu").contiguous()
            size += value.numel() * value.element_size()
            total += value.numel() * value.element_size()
        if size >= shard_bytes:
            flush()
            size = 0
    if shard:
        flush()
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=1)
    )
    model.config.save_pretrained(path)  # last: a folder with a config.json is a whole checkpoint
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = SPEC
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return len(quantized)
