"""Small atomic file operations shared by the launcher and the workers (no torch here).

A reader never sees a half-written file or a missing pointer: write aside, then rename.
"""
from __future__ import annotations

import json
import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def point(link: Path, target: Path) -> None:
    """Atomically make `link` a relative symlink to `target`, a sibling (checkpoints/latest, runs/latest)."""
    tmp = link.with_name(f".{link.name}.tmp")     # one writer per folder: a fixed name leaks nothing
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
