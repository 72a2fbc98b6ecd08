"""A GGUF file as a plain Hugging Face folder: transformers' GGUF loader dequantizes it, and the
folder gets config.json, model.safetensors, the tokenizer (with its chat template),
generation_config.json and gguf_source.json (where it came from). The launcher runs this once per
file, in a child process (torch stays out of the launcher), and every worker reads the folder.

    python -m services.tools.gguf_model --gguf FILE --out FOLDER [--dtype bfloat16] [--sha256 HEX]

Prints one JSON line; a user's error (missing packages, an architecture transformers does not
convert, an unreadable file) is one line on stderr and exit 2. The packages it needs are
services/process/gguf_support.py's, which the launcher checks first.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from services.process.gguf_support import DTYPES, GgufError, missing_line, missing_packages


def architecture(path: Path) -> str:
    """general.architecture of the file; GgufError for a file that is not a readable GGUF."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(path)).fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except Exception as exc:  # bad magic, truncated, unreadable: the reader's own words
        raise GgufError(
            f"target.model_path {path}: not a readable GGUF file "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'})"
        ) from None


def unsupported_line(path, arch: str) -> str:
    return (
        f"target.model_path {path}: GGUF architecture {arch!r} is not one transformers' GGUF support converts; "
        "convert the model to a Hugging Face folder another way (e.g. the original safetensors checkpoint) "
        "and give that folder"
    )


def load(path: Path, dtype: str):
    """(model, tokenizer, generation config or None) dequantized from the GGUF, on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    arch = architecture(path)
    kw = dict(gguf_file=path.name)
    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=getattr(torch, dtype), **kw)
    except ValueError as exc:
        if "not supported" in str(exc) or "architecture" in str(exc):
            raise GgufError(unsupported_line(path, arch)) from None
        raise
    tokenizer = AutoTokenizer.from_pretrained(path.parent, **kw)
    try:
        generation = GenerationConfig.from_pretrained(path.parent, **kw)
    except Exception:  # optional: the model's generation_config is enough
        generation = getattr(model, "generation_config", None)
    return model, tokenizer, generation


def plain_copy(model):
    """The same weights in a model that save_pretrained accepts: transformers refuses to save a
    GGUF-loaded model (its quantization_config), so build the class from the config without it."""
    import torch

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = type(model)(config)
    plain.load_state_dict(model.state_dict(), strict=True, assign=True)
    plain.tie_weights()
    return plain


def convert(path: Path, out: Path, dtype: str = "bfloat16", sha256: str = "") -> dict:
    """Write the folder for the GGUF at path into out (aside, then renamed); its gguf_source.json."""
    import transformers

    from services.run.files import default_file_mode, sha256_file

    start = time.monotonic()
    model, tokenizer, generation = load(path, dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        plain_copy(model).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if generation is not None:
            generation.save_pretrained(tmp)
        for weights in tmp.glob("*.safetensors"):  # saved 0600: the serving commands printed point here
            default_file_mode(weights)
        source = {
            "gguf": str(path.resolve()),
            "size": path.stat().st_size,
            "mtime_ns": path.stat().st_mtime_ns,
            "sha256": sha256 or sha256_file(path),
            "dtype": dtype,
            "transformers": transformers.__version__,
            "architecture": type(model).__name__,
            "seconds": round(time.monotonic() - start, 1),
        }
        (tmp / "gguf_source.json").write_text(json.dumps(source, indent=2))
        try:
            os.rename(tmp, out)
        except OSError:  # another launcher converted the same file meanwhile: its folder is as good
            if not (out / "gguf_source.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return source


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m services.tools.gguf_model", description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", required=True, help="the .gguf file")
    p.add_argument("--out", required=True, help="the folder to write (made aside, then renamed into place)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="of model.safetensors")
    p.add_argument("--sha256", default="", help="the file's sha256, when the caller has it (else computed)")
    args = p.parse_args(argv)
    path = Path(args.gguf)
    try:
        if missing := missing_packages():
            raise GgufError(missing_line(path, missing))
        source = convert(path, Path(args.out), args.dtype, args.sha256)
    except GgufError as exc:
        print(exc, file=sys.stderr, flush=True)
        return 2
    print(json.dumps({"model_path": str(Path(args.out).resolve()), **source}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
