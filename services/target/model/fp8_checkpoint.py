"""Block-scaled FP8 checkpoints (Qwen3-*-FP8, Qwen3.6-27B-FP8, DeepSeek-V3): their tensors read and
checked, a model loaded from one, and the target's decoder put in FP8 (fp8.py's FP8Linear).

    checkpoint = BlockScaledCheckpoint.open(path)                         # None: not an FP8 checkpoint
    with loading(checkpoint, config): model = from_pretrained(...)        # on the CPU, then either
    checkpoint.dequantize_into(model.to(device))                          # the model as loaded, or
    print(to_device_in_fp8(model, decoder_layers(model), checkpoint, device))  # target.quantize = "fp8"

The checkpoint layout (Qwen3-*-FP8, Qwen3.6-27B-FP8, DeepSeek-V3): config.json has
"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}, and each quantized linear stores <name>.weight float8_e4m3fn [N, K]
with <name>.weight_scale_inv float32 [ceil(N/128), ceil(K/128)]: real weight = fp8 * scale_inv per
block. The tensors' dtypes say which linears are quantized (modules_to_not_convert only lists them).
transformers loads the rest of the checkpoint with its own FP8 quantizer bypassed (that one needs
accelerate, and a GPU for anything but dequantizing); the FP8 tensors are read here with
safetensors and their dequantized values written into the model's parameters.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path

import torch
from torch import nn

from services.target.model.fp8 import SCALE_SUFFIX, CheckpointError, Summary, dequantize, quantize_decoder

log = logging.getLogger("target")
PROGRESS_S = 10.0  # seconds between the layer-by-layer load's progress lines


def to_device_in_fp8(
    model: nn.Module, layers: nn.ModuleList, checkpoint: BlockScaledCheckpoint | None, device
) -> Summary:
    """target.quantize = "fp8" while the model loads (on the CPU) goes to `device`: each decoder layer
    moves there and its linears go to FP8 (an FP8 checkpoint's with their blocks, a bf16 checkpoint's
    rowwise) before the next layer moves, then the rest of the model. The device never holds the
    decoder whole in bf16: a 27B's load peaks near its FP8 size (~30 GB), not the bf16 54 GB. An FP8
    checkpoint's FP8 weights left outside FP8Linears are dequantized into the model."""
    names = checkpoint.parameters_of(model) if checkpoint else {}
    blocks = checkpoint.blocks_of(names) if checkpoint else None
    summary, started = Summary(), time.monotonic()
    said = started  # a progress line at most every PROGRESS_S: a 27B's 64 layers take minutes
    for done, layer in enumerate(layers, 1):
        layer.to(device)
        summary.update(quantize_decoder(model, [layer], blocks))
        if time.monotonic() - said >= PROGRESS_S:
            said = time.monotonic()
            log.info("FP8 load: %d of %d decoder layers on %s, %.0f s", done, len(layers), device, said - started)
    model.to(device)
    if checkpoint:
        params = dict(model.named_parameters())
        checkpoint.dequantize_into(model, {name: key for name, key in names.items() if name in params})
    log.info("FP8 load: %d decoder layers on %s in %.1f s", len(layers), device, time.monotonic() - started)
    return summary


def quantization_config(model_path: str | Path) -> dict | None:
    """config.json's quantization_config (top level, or a composite checkpoint's text_config)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # load_hf_model reports a missing or broken config.json
    return config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")


def _block_size(spec: dict, where: Path) -> tuple[int, int]:
    """The weight block of an FP8 quantization_config, or CheckpointError for what does not load."""

    def bad(what: str):
        return CheckpointError(f"{where}: quantization_config.{what}; block-scaled e4m3 with dynamic activations loads")

    if str(spec.get("fmt", "e4m3")).lower() != "e4m3":
        raise bad(f"fmt = {spec['fmt']!r}")
    if str(spec.get("activation_scheme", "dynamic")).lower() != "dynamic":
        raise bad(f"activation_scheme = {spec['activation_scheme']!r} (static input scales are not supported)")
    if spec.get("scale_fmt", "float") != "float":
        raise bad(f"scale_fmt = {spec['scale_fmt']!r}")
    block = spec.get("weight_block_size") or [128, 128]  # transformers' default for quant_method fp8
    if not isinstance(block, list) or len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise bad(f"weight_block_size = {block!r} (expected two positive integers)")
    return tuple(block)


class BlockScaledCheckpoint:
    """The FP8 tensors of a checkpoint whose config.json declares quant_method "fp8": headers are
    read and checked at open (before the model loads), data on demand."""

    def __init__(self, root: Path, block: tuple[int, int], files: dict[str, Path], weights: dict[str, list[int]]):
        self.root, self.block = root, block
        self.files = files  # every FP8 weight key and its scale key -> the file that holds it
        self.weights = weights  # FP8 weight key -> [N, K]

    @classmethod
    def open(cls, model_path: str | Path) -> "BlockScaledCheckpoint | None":
        """None where config.json declares no FP8 quantization (other methods are transformers' own)."""
        root = Path(model_path)
        spec = quantization_config(root)
        if not spec or spec.get("quant_method") != "fp8":
            return None
        block = _block_size(spec, root / "config.json")
        headers = _headers(root)  # key -> (file, dtype, shape)
        files, weights = {}, {}
        for key, (file, dtype, shape) in headers.items():
            if not dtype.startswith("F8"):
                continue
            if dtype != "F8_E4M3" or not key.endswith(".weight") or len(shape) != 2:
                raise CheckpointError(
                    f"{file}: {key} is {dtype} {shape}; only 2-D linear weights in float8_e4m3fn (<name>.weight) load"
                )
            _check_scale(key, shape, block, headers, file)
            files[key], files[key + SCALE_SUFFIX], weights[key] = file, headers[key + SCALE_SUFFIX][0], shape
        return cls(root, block, files, weights)

    def parameters_of(self, model: nn.Module) -> dict[str, str]:
        """model parameter name -> the checkpoint's FP8 weight key, for every FP8 weight the model has.
        A composite checkpoint's text weights (model.language_model.*) are the text model's model.*;
        the keys transformers skips for this model (vision tower, MTP layers) are skipped here too."""
        import re

        params = dict(model.named_parameters())
        skipped = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
        found = {}
        for key, shape in self.weights.items():
            names = [key, key.replace("model.language_model.", "model.", 1), key.removeprefix("language_model.")]
            name = next((n for n in names if n in params), None)
            if name is None:
                if any(p.search(key) for p in skipped):
                    continue
                raise CheckpointError(
                    f"{self.files[key]}: FP8 tensor {key} matches no parameter of {type(model).__name__}"
                )
            if list(params[name].shape) != shape:
                raise CheckpointError(
                    f"{self.files[key]}: {key} has shape {shape}, the model's {name} {list(params[name].shape)}"
                )
            found[name] = key
        return found

    def read(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp8 weight, float32 scale_inv) of an FP8 weight key, on the CPU."""
        from safetensors import safe_open

        out = []
        for k in (key, key + SCALE_SUFFIX):
            with safe_open(str(self.files[k]), framework="pt", device="cpu") as f:
                out.append(f.get_tensor(k))
        return out[0], out[1].float()

    @torch.no_grad()
    def dequantize_into(self, model: nn.Module, names: dict[str, str] | None = None) -> int:
        """Write fp8 * scale_inv (per block, rounded to the parameter's dtype) into the model's
        parameters (names: parameters_of's, or some of them), on their device; returns how many."""
        names = self.parameters_of(model) if names is None else names
        for name, key in names.items():
            param = model.get_parameter(name)
            q, scale = self.read(key)
            param.copy_(dequantize(q.to(param.device), scale.to(param.device), self.block))
        log.info(
            "FP8 checkpoint (%dx%d blocks): %d linears dequantized to %s",
            *self.block,
            len(names),
            str(next(model.parameters()).dtype).removeprefix("torch."),
        )
        return len(names)

    def blocks_of(self, names: dict[str, str]):
        """The `blocks` argument of quantize_decoder, from parameters_of's names for the model."""
        return lambda name: (*self.read(names[name]), self.block) if name in names else None


def _headers(root: Path) -> dict[str, tuple[Path, str, list[int]]]:
    """Every tensor of the checkpoint's safetensors files: key -> (file, dtype, shape); no data read."""
    from safetensors import safe_open

    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{root}: config.json declares FP8 (quantization_config) but there is no *.safetensors "
            "file; FP8 checkpoints load from safetensors"
        )
    out = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                out[key] = (file, piece.get_dtype(), list(piece.get_shape()))
    return out


def _check_scale(key: str, shape: list[int], block: tuple[int, int], headers: dict, file: Path) -> None:
    scale_key = key + SCALE_SUFFIX
    want = [-(-shape[0] // block[0]), -(-shape[1] // block[1])]
    if scale_key not in headers:
        raise CheckpointError(
            f"{file}: {key} is float8_e4m3fn but {scale_key} is missing (its {block[0]}x{block[1]} "
            f"block scales, shape {want})"
        )
    scale_file, dtype, got = headers[scale_key]
    if got != want or dtype not in ("F32", "BF16", "F16"):
        raise CheckpointError(
            f"{scale_file}: {scale_key} is {dtype} {got}, expected float32 {want} for {key} {shape} "
            f"in {block[0]}x{block[1]} blocks"
        )


@contextlib.contextmanager
def loading(checkpoint: BlockScaledCheckpoint | None, config):
    """Around transformers' from_pretrained of `config`: for an FP8 checkpoint, its quantizer is
    bypassed (quantization_config taken off the config) and the scale tensors, read by this module,
    are expected keys, not a warning. The FP8 weights arrive cast without their scales, and
    dequantize_into then overwrites them."""
    if checkpoint is None:
        yield
        return
    from transformers import AutoModelForCausalLM

    if hasattr(config, "quantization_config"):
        del config.quantization_config
    cls = AutoModelForCausalLM._model_mapping[type(config)]
    own = cls.__dict__.get("_keys_to_ignore_on_load_unexpected", _UNSET)
    cls._keys_to_ignore_on_load_unexpected = [*(cls._keys_to_ignore_on_load_unexpected or []), r"\.weight_scale_inv$"]
    try:
        yield
    finally:
        if own is _UNSET:
            del cls._keys_to_ignore_on_load_unexpected
        else:
            cls._keys_to_ignore_on_load_unexpected = own


_UNSET = object()
