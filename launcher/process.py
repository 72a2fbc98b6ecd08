"""Starting and stopping worker processes. No torch here: the launcher never touches CUDA.

Workers are exec'd (subprocess: fork+exec, never a bare fork of this interpreter) with
PR_SET_PDEATHSIG, so the kernel signals them if the launcher dies, even by kill -9. That signal
is lifecycle.PARENT_DIED, not SIGTERM: the kernel sends it once per launcher thread the worker
is handed to, and a worker counts any number of them as one stop request (services/process/lifecycle.py).
A worker that gets it, or SIGTERM, finishes its step and exits; if it hangs, its own deadline kills it.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from services.process.lifecycle import PARENT_DIED, STOP_SIGNALS

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, PARENT_DIED, 0, 0, 0)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # the launcher blocks them (lifecycle.watch_with_sender)


def spawn(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """Start one worker with its own log file (appended: restarts keep earlier output)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab", buffering=0)
    log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} start: {' '.join(argv)}\n".encode())
    try:
        # own session: a Ctrl-C in the terminal reaches the launcher only, which then stops the
        # workers once, gracefully
        return subprocess.Popen(
            argv,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            close_fds=True,
            start_new_session=True,
        )
    finally:
        log.close()  # the child holds its own descriptor


def identity(pid: int) -> dict | None:
    """What makes a pid *this* process: its start time and command line, recorded at spawn.

    A pid alone is not enough: after the process ends (or a reboot) the kernel hands the number
    to any other process, and signalling it would hit that one.
    """
    try:
        p = psutil.Process(pid)
        cmdline = p.cmdline()
        for _ in range(100):  # just after exec the kernel shows an empty cmdline for a moment
            if cmdline:
                break
            time.sleep(0.01)
            cmdline = p.cmdline()
        return {"pid": pid, "create_time": p.create_time(), "cmdline": cmdline}
    except psutil.Error:
        return None


def verified(ident: dict | None) -> psutil.Process | None:
    """The live process `ident` recorded, or None when that pid is gone or now belongs to another one."""
    if not ident or not ident.get("pid"):
        return None
    try:
        p = psutil.Process(ident["pid"])
        same = abs(p.create_time() - ident["create_time"]) < 0.05 and p.cmdline() == ident["cmdline"]
        return p if same and p.status() != psutil.STATUS_ZOMBIE else None
    except (psutil.Error, KeyError, TypeError):
        return None


def tree(ident: dict | None) -> list[psutil.Process]:
    """The verified process and all its descendants (inductor compile workers included)."""
    root = verified(ident)
    if root is None:
        return []
    try:
        return [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def kill_tree(ident: dict | None, sig: int = signal.SIGKILL) -> None:
    for proc in reversed(tree(ident)):
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def stop_all(idents: list[dict | None], deadline_s: float, codes: dict[int, int] | None = None) -> list[int]:
    """SIGTERM every verified tree, wait up to deadline_s, then SIGKILL what is left. Returns pids killed hard.
    codes: filled with pid -> exit code of each process that ended (this reaps our children, so
    their Popen.poll() reads 0 afterwards, whatever the code was)."""
    procs = [p for ident in idents for p in tree(ident)]
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    gone, left = psutil.wait_procs(procs, timeout=deadline_s)
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    gone += psutil.wait_procs(left, timeout=5)[0]
    if codes is not None:
        codes.update({p.pid: p.returncode for p in gone})
    return [p.pid for p in left]


def alive(ident: dict | None) -> bool:
    return verified(ident) is not None


def gpu_count() -> int:
    """GPUs the NVIDIA driver shows, read without CUDA: /proc, else nvidia-smi, else 0."""
    proc_dir = Path("/proc/driver/nvidia/gpus")
    if proc_dir.is_dir():
        return len(list(proc_dir.iterdir()))
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
        return sum(line.startswith("GPU ") for line in out.splitlines())
    except (OSError, subprocess.TimeoutExpired):
        return 0
