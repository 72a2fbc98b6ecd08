"""One launcher per run dir: an exclusive lock on <run_dir>/launcher.lock for the launcher's life.

`up` takes it before it writes anything in an existing run dir (config.json, data, run.json, logs),
and a new run dir as soon as it exists (two launchers preparing the same new folder: the second to
finish preparing finds it taken and stops), so a second `up` on the same folder, even one second
after the first, is refused before it can start workers on the same sockets and files. The lock is
flock(2) on an open file: the kernel releases it when the launcher ends, however it ends (kill -9
included); the file stays, holding the pid of the last launcher that took it.

Before all that, `up` takes a second lock beside the run dir (`lock_early`, <parent>/.<name>.launcher.lock)
as soon as it knows the run dir, before the model is resolved, the demo built or the data prepared:
a second `up` is refused in a second, not after preparing the data too, also while the first
prepares a new run dir that does not exist yet. That file is removed when the launcher exits.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import time
from pathlib import Path

LOCK_FILE = "launcher.lock"
_held: list[int] = []  # open for the whole process: closing the file would release the lock


class RunDirBusy(Exception):
    pass


def lock_run_dir(run_dir: Path) -> None:
    """Take run_dir's lock and write this pid in it, or raise RunDirBusy. `up` takes it before writing
    anything in an existing run dir, and right after a new one appears (it is prepared under a
    hidden name first, launcher/preflight.py `staged`, so a start that fails leaves no folder)."""
    _take(os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600), run_dir)  # never inherited


def lock_early(run_dir: Path) -> None:
    """Take the lock beside run_dir, or raise RunDirBusy naming its holder (see the module's doc)."""
    path = run_dir.parent / f".{run_dir.name}.launcher.lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:  # a parent this user cannot write: the run dir's own lock still guards it
        return
    _take(fd, run_dir)
    atexit.register(_remove, path, fd)


def _remove(path: Path, fd: int) -> None:
    """Unlink the early lock's file at exit, if it is still the one this launcher locked."""
    try:
        if os.fstat(fd).st_ino == os.stat(path).st_ino:
            path.unlink()
    except OSError:
        pass


def _take(fd: int, run_dir: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise RunDirBusy(
            f"another launcher is running on {run_dir} (pid {holder}); stop it first "
            f"(launcher down --run-dir {run_dir}) or choose another --run-dir"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _held.append(fd)


def _holder(fd: int) -> str:
    """The pid the lock's holder wrote (it writes it just after taking the lock: wait a moment for it)."""
    for _ in range(20):
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if text:
            return text
        time.sleep(0.05)
    return "unknown"
