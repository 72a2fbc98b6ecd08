"""Rank 0's resume point on every drafter rank, for hosts that do not share a checkpoints folder.

    found = share(found, run_dir, rank, on_received)   # every rank calls it, after joining the group

Only rank 0 writes checkpoints (checkpoint.py), on its own host. On a (re)start of a group across
hosts, rank 0 says which checkpoint it resumes from (its manifest); a rank whose folder holds the
same one (a shared folder, or a copy from an earlier start) keeps it, and when any rank lacks it,
rank 0 broadcasts every file over a gloo group, in pieces, as raw bytes (no pickle). A receiving rank
writes them under a temp name, checks them against the manifest (checkpoint.verify), renames the
folder into place and points `latest` at it, so the next start finds it there.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from services.drafter.checkpoints import checkpoint as ckpt
from services.run.files import fsync_dir, point

PIECE = 64 << 20  # bytes per broadcast: a checkpoint is never one tensor in memory


def _group():
    """The gloo group the files travel on (the drafter group itself when it is gloo already)."""
    return None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


def _bytes(data: bytes | None, group) -> bytes:
    """Rank 0's `data` on every rank (its length first, then the bytes)."""
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, 0, group=group)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(int(size), dtype=torch.uint8)
    if int(size):
        dist.broadcast(buf, 0, group=group)
    return bytes(buf.numpy()) if int(size) else b""


def _file(path: Path | None, dest: Path | None, group) -> None:
    """Rank 0 sends `path` in pieces; a rank with `dest` writes them there, the others drop them."""
    size = torch.tensor([path.stat().st_size if path is not None else 0], dtype=torch.int64)
    dist.broadcast(size, 0, group=group)
    total = int(size)
    src = open(path, "rb") if path is not None else None
    out = open(dest, "wb") if dest is not None else None
    try:
        for start in range(0, total, PIECE):
            n = min(PIECE, total - start)
            buf = (
                torch.frombuffer(bytearray(src.read(n)), dtype=torch.uint8)
                if src
                else torch.empty(n, dtype=torch.uint8)
            )
            dist.broadcast(buf, 0, group=group)
            if out is not None:
                out.write(buf.numpy().tobytes())
        if out is not None:
            out.flush()
            os.fsync(out.fileno())
    finally:
        for f in (src, out):
            if f is not None:
                f.close()


def _install(tmp: Path, local: Path, manifest: bytes) -> None:
    """Rename the received folder into place; another rank of this host may have done so first."""
    if local.exists() and (local / "manifest.json").is_file() and (local / "manifest.json").read_bytes() != manifest:
        try:  # a stale one of that name, moved aside (and left for a look)
            os.rename(local, local.with_name(f".tmp-old-{local.name}-{os.getpid()}"))
        except FileNotFoundError:  # a sibling rank moved it
            pass
    try:
        os.rename(tmp, local)
    except OSError:  # a sibling rank installed the same bytes
        shutil.rmtree(tmp, ignore_errors=True)
        return
    fsync_dir(local.parent)
    point(local.parent / ckpt.LATEST, local)


def share(found: ckpt.Found | None, run_dir: str | Path, rank: int, tick=lambda: None) -> ckpt.Found | None:
    """Every rank's resume point becomes rank 0's (None: no checkpoint, start fresh). Collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return found
    group = _group()
    root = ckpt.checkpoints_dir(run_dir)
    mine = found.path if found is not None else None
    name = _bytes(mine.name.encode() if rank == 0 and mine else None, group).decode()
    manifest = _bytes((mine / "manifest.json").read_bytes() if rank == 0 and mine else None, group)
    if not name:
        return None
    local = root / name
    has = (local / "manifest.json").is_file() and (local / "manifest.json").read_bytes() == manifest
    lacking = torch.tensor([0 if has else 1], dtype=torch.int64)
    dist.all_reduce(lacking, group=group)
    meta = None  # state.json of the checkpoint, once verified here
    if int(lacking):
        tmp = None
        if not has:
            root.mkdir(parents=True, exist_ok=True)
            tmp = root / f".tmp-recv-{name}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        for file in (*ckpt.FILES, "manifest.json"):
            _file(mine / file if rank == 0 else None, tmp / file if tmp else None, group)
            tick()
        if tmp is not None:
            meta = ckpt.verify(tmp, tick)  # CorruptCheckpoint if the bytes did not arrive whole
            fsync_dir(tmp)
            _install(tmp, local, manifest)
    if has and found is not None and found.path.resolve() == local.resolve():
        return found
    if meta is None:  # (bytes received here were hashed once already, above)
        meta = ckpt.verify(local, tick)
    return ckpt.Found(local, meta, json.loads((local / "config.json").read_text()))
