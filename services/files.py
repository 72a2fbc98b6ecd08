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
