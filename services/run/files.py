"""Small atomic file operations shared by the launcher and the workers (no torch here).

A reader never sees a half-written file or a missing pointer: write aside, then rename.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str, mode: int | None = None) -> Path:
    """Write `text` beside `path`, then rename it into place (with `mode`, if given)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    if mode is not None:
        os.chmod(tmp, mode)
    os.replace(tmp, path)
    return path


def write_json_atomic(path: Path, data: dict) -> None:
    write_text_atomic(path, json.dumps(data, indent=2))


def sha256_file(path: Path, tick: Callable[[], None] | None = None) -> str:
    """The file's sha256, read in 8 MB chunks; `tick` is called after each (health stays fresh)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
            if tick:
                tick()
    return digest.hexdigest()


def cache_root() -> Path:
    """Where built things are kept between runs (the demo, converted GGUF targets):
    $DFLASH_CACHE_DIR, else $XDG_CACHE_HOME/dflash, else ~/.cache/dflash."""
    root = (
        os.environ.get("DFLASH_CACHE_DIR")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash"
    )
    return Path(root)


def cpu_share(workers: int) -> int:
    """The cores each of `workers` processes on this machine may use (threads, compile workers):
    several workers oversubscribing the cores slow every one of them down."""
    return max(1, (os.cpu_count() or 1) // max(1, workers))


def point(link: Path, target: Path) -> None:
    """Atomically make `link` a relative symlink to `target`, a sibling (checkpoints/latest, runs/latest)."""
    tmp = link.with_name(f".{link.name}.tmp")  # one writer per folder: a fixed name leaks nothing
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(target.name, tmp)
    os.replace(tmp, link)
    fsync_dir(link.parent)


def current_umask() -> int:
    """The process umask, read without changing it (Linux /proc; else set and restore at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_file_mode(path: str | os.PathLike) -> None:
    """Give `path` the mode any new file gets here: 0666 minus the umask (0644 under the usual 022).

    safetensors >= 0.8 creates its files 0600, so a serving engine under another account, or in
    another container, could not read weights whose folder it can read. Files written with open()
    already follow the umask; this makes the weights agree with them."""
    os.chmod(path, 0o666 & ~current_umask())
