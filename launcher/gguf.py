"""`target.model_path` as a GGUF file (or a folder holding exactly one .gguf and no config.json):
converted once to a plain Hugging Face folder in the cache, which the run's config then names, as
a repo id is resolved to its snapshot folder (launcher/models.py). Every worker, a resume, `eval`
and `export` read that folder; nothing past the launcher knows about GGUF.

The cache: <cache root>/gguf/<sha256 of the file>[-<dtype>]/ (services.run.files.cache_root:
$DFLASH_CACHE_DIR, else $XDG_CACHE_HOME/dflash, else ~/.cache/dflash). Hashing a 15 GB file takes
a minute, so a record keyed by the file's path, size and mtime (gguf/seen/) remembers its sha256:
a second `up` with the same file costs a stat. A file rewritten in place with the same size and
mtime is not noticed; touch it (or remove the folder) to convert again.

The weights are saved in bfloat16 (DFLASH_GGUF_DTYPE=float16|float32 to change it): bf16 rounding
moves a dequantized weight by at most 0.2%, less than the quantization step of a 4- to 8-bit GGUF,
the folder is half a float32 one, and targets run in bfloat16 by default.

The launcher's part of GGUF: the conversion itself is services/tools/gguf_model.py's (a child
process: torch), what both need (packages, dtypes, GgufError) services/process/gguf_support.py's.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

from services.process import jobs
from services.process.gguf_support import DTYPES, GgufError, missing_line, missing_packages
from services.run.files import cache_root, sha256_file, write_json_atomic


def gguf_file(value: str, key: str = "target.model_path") -> Path | None:
    """The .gguf file that value names (a file, or a folder with one .gguf and no config.json), else None."""
    path = Path(value) if value else None
    if path is None or not path.exists():
        return None
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if (path / "config.json").exists():
        return None
    found = sorted(p for p in path.glob("*.gguf") if p.is_file())
    if len(found) > 1:
        raise GgufError(
            f"{key} {path}: the folder holds several .gguf files ({', '.join(p.name for p in found)}); "
            f"name one: {key}={path / found[0].name}"
        )
    return found[0] if found else None


def dtype() -> str:
    value = os.environ.get("DFLASH_GGUF_DTYPE", "bfloat16")
    if value not in DTYPES:
        raise GgufError(f"DFLASH_GGUF_DTYPE={value!r}: expected one of {', '.join(DTYPES)}")
    return value


def resolve(path: Path, key: str = "target.model_path") -> str:
    """The converted folder of the GGUF at path: from the cache, else converted now (a child process)."""
    src, kind = path.resolve(), dtype()
    root = cache_root() / "gguf"
    suffix = "" if kind == "bfloat16" else f"-{kind}"
    try:
        st = src.stat()
        stamp = json.dumps([str(src), st.st_size, st.st_mtime_ns, kind])
        seen = root / "seen" / f"{hashlib.sha256(stamp.encode()).hexdigest()[:32]}.json"
        if seen.is_file():
            folder = root / (json.loads(seen.read_text())["sha256"] + suffix)
            if (folder / "gguf_source.json").is_file():
                return str(folder)
        if missing := missing_packages():  # before hashing a big file for nothing
            raise GgufError(missing_line(path, missing))
        print(f"{key}: hashing {path} ({st.st_size / 2**30:.1f} GiB) ...", flush=True)
        sha = sha256_file(src)
    except OSError as exc:
        raise GgufError(f"{key} {path}: cannot read the file: {exc.strerror or exc}") from None
    folder = root / (sha + suffix)
    if not (folder / "gguf_source.json").is_file():
        print(f"{key}: converting {path} to a Hugging Face folder ({kind}), once: {folder}", flush=True)
        convert(src, folder, kind, sha)
    seen.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(seen, {"gguf": str(src), "sha256": sha})
    return str(folder)


def convert(src: Path, folder: Path, kind: str, sha: str) -> None:
    out = subprocess.run(
        [
            *jobs.argv("gguf-model"),
            "--gguf",
            str(src),
            "--out",
            str(folder),
            "--dtype",
            kind,
            "--sha256",
            sha,
        ],
        capture_output=True,
        text=True,
    )
    if out.returncode == 2:
        lines = out.stderr.strip().splitlines() or ["exit 2"]
        raise GgufError(lines[-1])
    if out.returncode != 0:
        tail = out.stderr.strip().splitlines()[-1:] or [f"exit {out.returncode}"]
        raise GgufError(f"converting {src} failed: {tail[0]}")


def resolve_if_gguf(value: str, key: str = "target.model_path") -> str:
    """value as is, or the converted folder when it names a GGUF."""
    path = gguf_file(value, key)
    return value if path is None else resolve(path, key)
