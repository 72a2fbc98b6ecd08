"""Checkpoints: write atomically, keep the last few, find the newest good one, restore every rank.

    <run_dir>/checkpoints/
        step-00000400/              one checkpoint (written as .tmp-step-00000400-<pid>, then renamed)
            model.safetensors       drafter weights, fp32 (the master weights); every file 0666 minus the umask
            optimizer.pt            {"optimizer": AdamW state_dict, "scheduler": LambdaLR state_dict}
            rng.safetensors         torch CPU (and CUDA) RNG state of every rank: cpu.<rank>, cuda.<rank>
            state.json              step, micro_step, counters, data position, model config, eval result
            config.json             the resolved run config
            manifest.json           format version, sha256 and size of every file above
        latest -> step-00000400     symlinks, replaced atomically (symlink to a temp name, then rename)
        best   -> step-00000300     highest held-out tau; never deleted by rotation

Data position: state.json's next_g says how many global batches are done (every g < next_g, all
ranks finished them: a checkpoint is taken between optimizer steps only). A resume on any number of
drafters D asks for g = next_g + (m - m_ckpt)·D + d next (schedule.py). Only rank 0 writes; every rank
restores, from the same files.
A failed write (full disk, quota, I/O error) removes its temp dir and leaves the previous
checkpoint as latest; the caller reports it and training goes on. A full disk says so: "no space
left on <folder>, need about N GB" (torch.save's own error for it is a cryptic "unexpected pos"),
and the free space is checked before each write (checkpoint_space.py).
Here: the files, writing, finding and restoring; written in the background by
checkpoint_writer.BackgroundWriter; whether one fits this run, checkpoint_compat.py.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from services.drafter.checkpoints.checkpoint_space import checkpoint_bytes, no_space, out_of_space
from services.drafter.modeling.model import DrafterModelConfig
from services.run.checkpoint_compat import compatibility_errors
from services.run.config import ConfigError
from services.run.files import default_file_mode, fsync_dir, point, sha256_file

FORMAT_VERSION = 1
FILES = ("model.safetensors", "optimizer.pt", "rng.safetensors", "state.json", "config.json")
LATEST, BEST = "latest", "best"


class CorruptCheckpoint(Exception):
    """A checkpoint whose files fail their checksums or do not parse."""


def nonfinite_tensors(weights: dict[str, torch.Tensor]) -> list[str]:
    """Names of the tensors holding a NaN or an infinity: such weights are never written."""
    return [name for name, t in weights.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def refuse_nonfinite(weights: dict[str, torch.Tensor], what: str) -> None:
    if bad := nonfinite_tensors(weights):
        raise ValueError(
            f"{what} not written: non-finite values in {len(bad)} weight tensor(s), e.g. {', '.join(bad[:3])}"
        )


@dataclass
class Found:
    path: Path
    meta: dict  # state.json
    config: dict  # config.json (the run config that wrote it)
    skipped: list[str] = field(default_factory=list)  # "NAME: why" of each newer one that did not verify

    @property
    def micro_step(self) -> int:
        return int(self.meta["micro_step"])

    @property
    def batches_done(self) -> int:
        """Global batches g < this are trained (state.json's next_g)."""
        return int(self.meta["next_g"])


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(path: Path) -> int | None:
    try:
        return int(path.name.split("-", 1)[1]) if path.name.startswith("step-") else None
    except ValueError:
        return None


def list_checkpoints(root: Path) -> list[Path]:
    """Finished checkpoint dirs, newest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and step_of(p) is not None]
    return sorted(found, key=step_of, reverse=True)


def pointer(root: Path, name: str) -> Path | None:
    """Where `latest` / `best` points (None if missing or dangling)."""
    link = root / name
    if not link.is_symlink():
        return None
    target = root / os.readlink(link)
    return target if target.is_dir() else None


# --- files -------------------------------------------------------------------------------------


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


# --- writing (rank 0) ---------------------------------------------------------------------------


def write_checkpoint(
    root: Path,
    step: int,
    *,
    weights: dict[str, torch.Tensor],
    optimizer: dict,
    rng: dict[str, torch.Tensor],
    meta: dict,
    config: dict,
    keep: int,
    tick: Callable[[], None] | None = None,
) -> Path:
    """Write step-<step> atomically, point `latest` at it, rotate. Raises on failure after removing
    the temp dir (the previous checkpoint stays as it was)."""
    from safetensors.torch import save_file

    tick = tick or (lambda: None)
    refuse_nonfinite(weights, f"checkpoint at step {step}")
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):  # left by a crash mid-write
        shutil.rmtree(stale, ignore_errors=True)
    final = root / step_name(step)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    tmp.mkdir()
    try:
        save_file(
            {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in weights.items()},
            str(tmp / "model.safetensors"),
            metadata={"format": "pt"},
        )
        tick()
        torch.save(optimizer, tmp / "optimizer.pt")
        tick()
        save_file({k: v.contiguous() for k, v in rng.items()}, str(tmp / "rng.safetensors"))
        for name in ("model.safetensors", "rng.safetensors"):  # like the other files here (docs/guide/resume.md)
            default_file_mode(tmp / name)
        _write_json(tmp / "state.json", meta)
        _write_json(tmp / "config.json", config)
        files = {}
        for name in FILES:
            _fsync_file(tmp / name)
            files[name] = {"sha256": sha256_file(tmp / name, tick), "bytes": (tmp / name).stat().st_size}
        _write_json(tmp / "manifest.json", {"format": FORMAT_VERSION, "step": step, "files": files})
        fsync_dir(tmp)
        if final.exists():  # a leftover of a run that crashed before `latest` moved
            trash = root / f".tmp-old-{final.name}-{os.getpid()}"
            os.rename(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(tmp, final)
        fsync_dir(root)
    except BaseException as exc:
        full = out_of_space(exc, root)  # before the temp dir goes: then the disk is full
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise no_space(root, checkpoint_bytes(weights, optimizer)) from exc
        raise
    point(root / LATEST, final)
    rotate(root, keep)
    return final


def set_best_pointer(root: Path, path: Path) -> None:
    point(root / BEST, path)


def rotate(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints (0 = keep all); never what latest/best point to."""
    if keep < 1:
        return []
    protected = {p.resolve() for p in (pointer(root, LATEST), pointer(root, BEST)) if p}
    removed = []
    for old in list_checkpoints(root)[keep:]:
        if old.resolve() not in protected:
            shutil.rmtree(old, ignore_errors=True)
            removed.append(old)
    return removed


# --- finding and checking ------------------------------------------------------------------------


def verify(path: Path, tick: Callable[[], None] | None = None) -> dict:
    """The checkpoint's state.json if every file matches the manifest and parses; else CorruptCheckpoint."""
    from safetensors import SafetensorError, safe_open

    try:
        manifest = json.loads((path / "manifest.json").read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpoint(f"manifest.json unreadable ({exc})") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise CorruptCheckpoint(f"manifest format {manifest.get('format')!r}, this code reads {FORMAT_VERSION}")
    for name in FILES:
        entry = files.get(name)
        file = path / name
        if entry is None or not file.is_file():
            raise CorruptCheckpoint(f"{name} missing")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise CorruptCheckpoint(f"{name} has {size} bytes, manifest says {entry['bytes']} (truncated?)")
        if sha256_file(file, tick) != entry["sha256"]:
            raise CorruptCheckpoint(f"{name}: sha256 mismatch")
    for name in ("model.safetensors", "rng.safetensors"):
        try:
            with safe_open(str(path / name), framework="pt") as f:
                f.keys()
        except (SafetensorError, OSError) as exc:
            raise CorruptCheckpoint(f"{name}: {exc}") from None
    try:
        return json.loads((path / "state.json").read_text())
    except ValueError as exc:
        raise CorruptCheckpoint(f"state.json: {exc}") from None


def find_resume_point(
    run_dir: str | Path,
    model_cfg: DrafterModelConfig,
    run_config: dict,
    world_size: int,
    warn: Callable[[str], None],
    tick: Callable[[], None] | None = None,
) -> Found | None:
    """The checkpoint to resume from: `latest`, or the next older one that verifies (each corrupt one
    is skipped with a warning). None when there is none at all (start fresh). ConfigError when
    checkpoints exist but none verifies, or the newest good one belongs to an incompatible config."""
    root = checkpoints_dir(run_dir)
    candidates = list_checkpoints(root)
    latest = pointer(root, LATEST)
    if latest is not None:
        candidates = [latest] + [p for p in candidates if p.resolve() != latest.resolve()]
    problems = []
    for path in candidates:
        try:
            meta = verify(path, tick)
        except CorruptCheckpoint as exc:
            problems.append(f"{path.name}: {exc}")
            nxt = candidates[candidates.index(path) + 1].name if path is not candidates[-1] else None
            warn(
                f"checkpoint {path} is corrupt ({exc}); "
                + (f"falling back to {nxt}" if nxt else "no older checkpoint left")
            )
            continue
        if "next_g" not in meta:
            raise ConfigError(
                f"checkpoint {path} records no data position (next_g): a checkpoint this version "
                "does not resume. Start a new --run-dir, or move checkpoints/ aside to start fresh"
            )
        config = json.loads((path / "config.json").read_text())
        errors = compatibility_errors(meta, config, model_cfg, run_config)
        if errors:
            raise ConfigError(
                f"checkpoint {path} was written by an incompatible config: "
                + "; ".join(errors)
                + ". Start a new --run-dir, or move checkpoints/ aside to start fresh"
            )
        return Found(path, meta, config, skipped=problems)
    if problems:
        raise ConfigError(
            f"no usable checkpoint in {root}: " + "; ".join(problems) + ". Move the folder aside to start fresh"
        )
    return None


# --- restoring (every rank) ------------------------------------------------------------------------


def restore(state, found: Found, rank: int) -> list[str]:
    """Load weights, optimizer, scheduler, this rank's RNG and the counters into a TrainState.
    Returns notes worth printing (e.g. a changed lr horizon)."""
    from safetensors.torch import load_file

    path, notes = found.path, []
    state.drafter.load_state_dict(load_file(str(path / "model.safetensors"), device="cpu"), strict=True)
    blob = torch.load(path / "optimizer.pt", map_location=state.device, weights_only=True)
    state.optimizer.load_state_dict(blob["optimizer"])
    curve = state.scheduler.lr_lambdas[0]
    now = dict(vars(curve))  # this run's schedule: its horizon, and its clock from here
    state.scheduler.load_state_dict(blob["scheduler"])  # the step count (and the saved schedule's fields)
    then = {k: vars(curve).get(k) for k in curve.horizon()}
    vars(curve).clear()
    vars(curve).update(now)
    for group, base in zip(state.optimizer.param_groups, state.scheduler.base_lrs):
        group["lr"] = base * curve(state.scheduler.last_epoch)
    if then != curve.horizon():  # e.g. run.max_steps changed, or the split (rounding)
        notes.append(f"lr schedule changed from {then} to {curve.horizon()} (in batches); continuing on the new one")
    rng = load_file(str(path / "rng.safetensors"))
    # a rank the checkpoint did not have (more drafters now) keeps its seeded generators: a train
    # step draws nothing from them (anchors are seeded by (seed, g), there is no dropout)
    if f"cpu.{rank}" in rng:
        torch.set_rng_state(rng[f"cpu.{rank}"])
    if state.device.type == "cuda" and f"cuda.{rank}" in rng:
        torch.cuda.set_rng_state(rng[f"cuda.{rank}"], state.device)
    meta = found.meta
    state.step, state.micro_step = int(meta["step"]), int(meta["micro_step"])
    state.samples_done, state.tokens_done = int(meta["samples_done"]), int(meta["tokens_done"])
    return notes


def make_meta(
    counters: dict, model_cfg: DrafterModelConfig, world_size: int, batches_done: int | None = None, **extra
) -> dict:
    """state.json: counters of an optimizer-step boundary (TrainState.counters()), model shape, extras.
    batches_done: global batches done at that boundary (Plan.batches_done; default: one split from
    the start)."""
    done = counters["micro_step"] * world_size if batches_done is None else batches_done
    return {
        **counters,
        "world_size": world_size,
        "next_g": done,  # batches g < next_g are done
        "model": model_cfg.to_dict(),
        "time": time.time(),
        **extra,
    }
