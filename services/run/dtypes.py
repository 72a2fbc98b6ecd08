"""The torch dtypes by name: one table, from which the wire's names, target.dtype's names and the
export's --dtype choices are taken (the launcher never imports this: it imports torch)."""

from __future__ import annotations

import torch

from services.run.config import TARGET_DTYPES

BY_NAME = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}
LONG = {short: name for name, short in SHORT.items()}
WEIGHTS = ("bfloat16", "float16", "float32")  # what a model's weights are stored in

WIRE = {SHORT.get(name, name): dtype for name, dtype in BY_NAME.items()}  # the names a tensor spec carries
TARGET = {name: BY_NAME[LONG.get(name, name)] for name in TARGET_DTYPES}  # target.dtype, aliases included
EXPORT = {name: BY_NAME[name] for name in WEIGHTS}  # export --dtype
