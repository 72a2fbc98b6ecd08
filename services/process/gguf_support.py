"""What converting a GGUF target needs, known without torch: the optional packages (the `gguf` extra),
the dtypes of the converted weights, and GgufError, the one error type for a GGUF the user gave.

GGUF lives in three modules, one per layer, each with its own job and none repeating another's:
launcher/gguf.py finds the file and its converted folder in the cache (hashing, the seen records) and
checks these packages before it hashes; services/tools/gguf_model.py converts, in a child process
(torch, transformers), and checks them again only because it also runs on its own (`python -m`);
this module holds what both need.
"""

from __future__ import annotations

import importlib.util

DTYPES = ("bfloat16", "float16", "float32")
MISSING_HINT = "pip install -e '.[gguf]'"
PACKAGES = ("gguf", "accelerate")  # transformers' GGUF loader needs both


class GgufError(ValueError):
    """One line for the user (exit 2), from the launcher's resolving or the converter's child."""


def missing_packages() -> list[str]:
    return [name for name in PACKAGES if importlib.util.find_spec(name) is None]


def missing_line(path, names) -> str:
    return f"target.model_path {path}: loading a GGUF needs the {' and '.join(names)} package(s): {MISSING_HINT}"
