"""What converting a GGUF target needs, known without torch: the optional packages (the `gguf` extra)
and the dtypes of the converted weights. launcher/gguf.py checks them before it starts
services/tools/gguf_model.py, which converts, in a child process.
"""

from __future__ import annotations

import importlib.util

DTYPES = ("bfloat16", "float16", "float32")
MISSING_HINT = "pip install -e '.[gguf]'"
PACKAGES = ("gguf", "accelerate")  # transformers' GGUF loader needs both


def missing_packages() -> list[str]:
    return [name for name in PACKAGES if importlib.util.find_spec(name) is None]


def missing_line(path, names) -> str:
    return f"target.model_path {path}: loading a GGUF needs the {' and '.join(names)} package(s): {MISSING_HINT}"
