"""What a run folder records, read and guarded: run.json and its outcome, runs/latest, the live runs, the lock.

runs/latest is the last run started here whose workers all became ready (or that finished while
starting): a run that fails while starting never takes it over from one that trains. `status`
and `down` default to it, and both name the live runs when the one they reach is not live.
"""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path

from launcher import process
from launcher.errors import UsageError
from launcher.preflight import check_resume
from launcher.runlock import RunDirBusy, lock_early, lock_run_dir
from launcher.supervisor import EXIT_DONE, EXIT_FAILED, EXIT_STOPPED

LATEST = Path("runs") / "latest"
OUTCOME_EXIT = {"finished": EXIT_DONE, "failed": EXIT_FAILED, "stopped": EXIT_STOPPED}


def read_run(run_dir: Path) -> dict:
    path = run_dir / "run.json"
    if not path.is_file():
        raise UsageError(f"no run in {run_dir} (missing {path}); pass --run-dir")
    return json.loads(path.read_text())


def run_holding(path: str | None) -> Path | None:
    """The run folder that `path` is, or holds it (a checkpoint or the export of that run): the
    nearest of it and its two parents with run.json and config.json; None if there is none."""
    if not path:
        return None
    p = Path(path).resolve()
    return next(
        (d for d in (p, p.parent, p.parent.parent) if (d / "run.json").is_file() and (d / "config.json").is_file()),
        None,
    )


def choose_run_dir(args, name: str) -> tuple[Path, bool]:
    """(run dir, whether `up` named it): --run-dir, else runs/latest for --resume, else a new
    runs/<run.name>-<time>, which becomes runs/latest once its workers are ready. Not made here:
    a new folder appears only once the checks pass (preflight.staged)."""
    if args.run_dir:
        return Path(args.run_dir).resolve(), False
    if args.resume:
        if not LATEST.exists():
            raise UsageError("--resume without --run-dir needs runs/latest (no earlier run here); pass --run-dir")
        return LATEST.resolve(), False
    return (Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve(), True


def resume_command(argv: list[str], run_dir: Path) -> str:
    """The same `up` command, pointed at this run dir with --resume."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--run-dir":
            skip = True
        elif arg != "--resume" and not arg.startswith("--run-dir="):
            kept.append(arg)
    return shlex.join(["launcher", *kept, "--run-dir", str(run_dir), "--resume"])


def live_runs(root: Path) -> list[tuple[Path, int]]:
    """(run dir, launcher pid) of every run under root whose launcher is still running."""
    live = []
    for run_json in sorted(root.glob("*/run.json")):
        if run_json.parent.is_symlink():  # runs/latest: the run itself is listed
            continue
        try:
            launcher = json.loads(run_json.read_text()).get("launcher")
        except (OSError, ValueError):
            continue
        if process.alive(launcher):
            live.append((run_json.parent, launcher["pid"]))
    return live


def describe_live(root: Path, but: Path) -> str:
    others = [f"{d} (launcher pid {pid})" for d, pid in live_runs(root) if d != but]
    return f"live runs: {', '.join(others)}" if others else f"no live run in {root}"


def describe_outcome(run: dict, live: bool) -> str:
    outcome = run.get("outcome") or {}
    if live:
        return "running"
    if outcome.get("state") in OUTCOME_EXIT:
        ended = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(outcome.get("ended", 0)))
        why = f": {outcome['reason']}" if outcome.get("reason") else ""
        return f"{outcome['state']}{why} (exit {outcome.get('exit')}, {ended})"
    return "ended without recording an outcome (launcher killed?)"


def lock(run_dir: Path, early: bool = False) -> None:
    """early: the lock beside the run dir, before anything that takes time (launcher/runlock.py)."""
    try:
        (lock_early if early else lock_run_dir)(run_dir)
    except RunDirBusy as exc:
        raise UsageError(str(exc)) from None


def claim(run_dir: Path, resume: bool) -> bool:
    """Refuse a run dir that another launcher runs in, or that has checkpoints without --resume.
    One launcher per run dir: an existing one is locked here, before anything is written in it;
    a new one as soon as it exists (after `staged`). Returns whether it was locked here."""
    if resume:
        check_resume(run_dir)
    locked = run_dir.is_dir()
    if locked:
        lock(run_dir)
    if (run_dir / "run.json").is_file():
        old = json.loads((run_dir / "run.json").read_text())
        if process.alive(old.get("launcher")):  # the recorded launcher itself, not a reused pid
            raise UsageError(
                f"a run is active in {run_dir} (launcher pid {old['launcher_pid']}); "
                f"`launcher down --run-dir {run_dir}` first"
            )
    if (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()) and not resume:
        raise UsageError(f"{run_dir} has checkpoints; pass --resume to continue, or choose another --run-dir")
    return locked
