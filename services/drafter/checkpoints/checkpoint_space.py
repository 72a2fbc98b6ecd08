"""Disk space for checkpoints, the one home of its rule: what one takes (checkpoint_bytes), the free
space of its folder's file system (free_bytes), and the three moments that use them, each called once
per checkpoint:

    space_warning   before the snapshot, on rank 0's main loop (books/bookkeeping.py): a warning well
                    ahead of a full disk (fewer than ROOM_FOR_WARNING checkpoints fit); it computes the
                    checkpoint's size once and hands it on
    ensure_space    on the writer's thread, right before writing (checkpoint_writer.py), with that size:
                    a write that cannot fit is refused before anything is written
    out_of_space    after a write failed (checkpoint.write_checkpoint): a full disk named as such
                    ("no space left on <folder>, need about N GB") instead of torch.save's "unexpected pos"

The launcher's own full-disk line (launcher/errors.py cannot_write) is about the files it writes
itself (logs, run.json), not a checkpoint's room.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import torch

ROOM_FOR_WARNING = 3  # warn while fewer checkpoints than this fit in the free space


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f}" if nbytes >= 1e8 else f"{nbytes / 1e9:.3f}"


def tensor_bytes(tree) -> int:
    """Bytes of every tensor in a (nested) state dict, as a checkpoint stores them (weights in fp32)."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(v) for v in tree)
    return 0


def checkpoint_bytes(weights: dict[str, torch.Tensor], optimizer: dict) -> int:
    """About what one checkpoint takes on disk (+ 64 KB for the JSON files and headers)."""
    return sum(v.numel() * 4 for v in weights.values()) + tensor_bytes(optimizer) + (64 << 10)


def free_bytes(root: Path) -> int:
    path = Path(root)
    while not path.exists():  # the folder may not exist yet: its file system does
        path = path.parent
    return shutil.disk_usage(path).free


def no_space(root: Path, need: int) -> OSError:
    return OSError(
        errno.ENOSPC, f"no space left on {root}, need about {_gb(need)} GB ({_gb(free_bytes(root))} GB free)"
    )


def ensure_space(root: Path, need: int) -> None:
    """Refuse a write that cannot fit, before writing anything."""
    if free_bytes(root) < need:
        raise no_space(root, need)


def space_warning(root: Path, need: int) -> str | None:
    """A warning well ahead of a full disk: fewer than ROOM_FOR_WARNING checkpoints still fit."""
    free = free_bytes(root)
    if free >= ROOM_FOR_WARNING * need:
        return None
    return (
        f"disk almost full: {_gb(free)} GB free on {root}, a checkpoint needs about {_gb(need)} GB "
        f"(room for {free // need}); free space or lower checkpoint.keep"
    )


def out_of_space(exc: BaseException, root: Path) -> bool:
    """ENOSPC/EDQUOT, or any error raised on a disk that is now full (torch.save says "unexpected
    pos", safetensors "I/O error": neither is an OSError with an errno)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if isinstance(exc, Exception) and "No space left on device" in str(exc):
        return True
    return isinstance(exc, Exception) and free_bytes(root) < (1 << 20)
