"""`target.model_path` as users write it: a local folder, a Hugging Face repo id (`Qwen/Qwen3-8B`),
or a GGUF file (launcher/gguf.py: converted once to a cached folder).

A repo id resolves through the local Hugging Face cache (HF_HUB_CACHE / HF_HOME), and is
downloaded when the machine can reach the Hub, as SpecForge and speculators accept. `launcher up`
resolves it once, before any worker starts, and writes the local folder into the run's config, so
every worker (and a resume) reads the same files. huggingface_hub comes with transformers and
does not import torch.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class ModelNotFound(ValueError):
    pass


def resolve_model_path(value: str) -> str:
    """A local folder as is; a GGUF as its converted folder; a repo id as the folder of its cached (or
    freshly downloaded) snapshot."""
    from launcher.gguf import GgufError, resolve_if_gguf

    try:
        value = resolve_if_gguf(value)
    except GgufError as exc:
        raise ModelNotFound(str(exc)) from None
    if not value or Path(value).exists() or not REPO_ID.match(value):
        return value  # a path (missing paths are reported by the caller, naming the key)
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(value, local_files_only=True)
    except Exception:  # not cached: try the Hub
        pass
    try:
        return snapshot_download(value, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
    except Exception as exc:
        raise ModelNotFound(
            f"target.model_path {value!r}: not a local folder, not in the Hugging Face cache, and "
            f"not downloadable here ({type(exc).__name__}); download it where the Hub is reachable "
            f"(`hf download {value}`) or give the local folder"
        ) from None
