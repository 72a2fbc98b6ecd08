"""Starting and stopping worker processes. No torch here: the launcher never touches CUDA.

Workers are exec'd (subprocess: fork+exec, never a bare fork of this interpreter) with
PR_SET_PDEATHSIG, so the kernel sends them SIGTERM if the launcher dies, even by kill -9.
A worker that gets SIGTERM finishes its step and exits; if it hangs, its own deadline kills it.
"""
from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def spawn(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """Start one worker with its own log file (appended: restarts keep earlier output)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab", buffering=0)
    log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} start: {' '.join(argv)}\n".encode())
    try:
        # own session: a Ctrl-C in the terminal reaches the launcher only, which then stops the
        # workers once, gracefully (a second signal would make them exit hard)
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
                                close_fds=True, start_new_session=True)
    finally:
        log.close()  # the child holds its own descriptor


def tree(pid: int) -> list[psutil.Process]:
    """The process and all its descendants (inductor compile workers included)."""
    try:
        root = psutil.Process(pid)
        return [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    for proc in reversed(tree(pid)):
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def stop_all(pids: list[int], deadline_s: float) -> list[int]:
    """SIGTERM every tree, wait up to deadline_s, then SIGKILL what is left. Returns pids killed hard."""
    procs = [p for pid in pids for p in tree(pid)]
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=deadline_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    return [p.pid for p in alive]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    import socket
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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

