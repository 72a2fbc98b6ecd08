"""Days under load, compressed: the CPU demo trained for a long time with worker kills and stop/resume,
every process's resources sampled, growth per hour reported.

    python bench/soak.py --minutes 120 --out soak.json            # two hours on CPU
    python bench/soak.py --minutes 10 --kill-every 60 --restart-every 240   # a quick look
    python bench/soak.py --device cuda --minutes 25 --out soak-gpu.json     # one GPU, both roles on it

One `launcher up --demo --device cpu` (one target, one drafter; real processes, sockets, ledger) runs
with epochs enough to outlast --minutes. Every --kill-every seconds one worker, target or drafter in
turn, is SIGKILLed (the launcher restarts it); every --restart-every seconds the launcher is stopped
with SIGTERM and the run resumed with `launcher up --resume`. Every --sample-every seconds, for the
launcher and each worker (by role): RSS, open file descriptors and threads (psutil); on CUDA each
worker's peak allocated and reserved GPU memory (its health status, through `launcher status
--json`); and the run folder's size and the ledger's size.

Growth per hour compares the median of each figure over the first and the last third of the samples
(after --warmup seconds): a restart resets a process, so a straight-line fit over the whole run
would say little; a figure that grows without bound grows between the thirds whatever happens in
between. The ledger grows by design (one line per optimizer step): it is reported per step too.
Prints one JSON object (and writes it to --out).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
ROLES = ("launcher", "target", "drafter")


def child_env(**extra) -> dict:
    """This checkout first on the path, what the caller's PYTHONPATH holds after it (e.g. wheels
    installed into a folder)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def role_of(proc: psutil.Process) -> str | None:
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return None
    if "services.target" in cmd:
        return "target"
    if "services.drafter" in cmd:
        return "drafter"
    return "launcher" if "-m launcher" in cmd else None


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def sample(launcher: subprocess.Popen, run_dir: Path, start: float) -> dict:
    """One sample: per role the sum over its processes of RSS (MB), fds and threads, and the folders."""
    out = {"t": round(time.monotonic() - start, 1), "roles": {}}
    try:
        procs = [psutil.Process(launcher.pid)] + psutil.Process(launcher.pid).children(recursive=True)
    except psutil.Error:
        procs = []
    for proc in procs:
        role = role_of(proc)
        if role is None:
            continue
        try:
            with proc.oneshot():
                figures = {
                    "rss_mb": proc.memory_info().rss / 2**20,
                    "fds": proc.num_fds(),
                    "threads": proc.num_threads(),
                }
        except psutil.Error:
            continue
        into = out["roles"].setdefault(role, {"rss_mb": 0.0, "fds": 0, "threads": 0, "processes": 0})
        for key, value in figures.items():
            into[key] += value
        into["processes"] += 1
    for worker in worker_statuses(run_dir):
        into = out["roles"].get(worker["name"].split("-")[0])
        if into is not None:
            for key in ("gpu_mem_bytes", "gpu_reserved_bytes"):
                into[key.replace("_bytes", "_mb")] = (
                    into.get(key.replace("_bytes", "_mb"), 0.0) + (worker.get(key) or 0) / 2**20
                )
    out["run_dir_mb"] = folder_bytes(run_dir) / 2**20
    out["ledger_kb"] = folder_bytes(run_dir / "ledger") / 2**10
    out["step"] = last_step(run_dir)
    return out


def worker_statuses(run_dir: Path) -> list[dict]:
    """Every worker's health row, as `launcher status --json` reports it ([] when it cannot say)."""
    try:
        out = subprocess.run(
            [sys.executable, "-m", "launcher", "status", "--json", "--run-dir", str(run_dir)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
            env=child_env(),
        )
        return json.loads(out.stdout).get("workers", [])
    except (subprocess.TimeoutExpired, ValueError):
        return []


def last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    step = 0
    for line in path.read_text().splitlines():
        try:
            step = max(step, int(json.loads(line).get("step", 0)))
        except (json.JSONDecodeError, ValueError, TypeError):
            pass
    return step


def start_launcher(run_dir: Path, resume: bool, log, device: str = "cpu") -> subprocess.Popen:
    gpus = ["--gpus", "0:target,1:drafter"] if device == "cpu" else ["--gpus", "0:target,0:drafter", "--share-gpus"]
    cmd = [sys.executable, "-m", "launcher", "up", "--demo", "--device", device, *gpus, "--run-dir", str(run_dir)]
    # the same overrides on a resume: --demo's own (a few epochs) would otherwise end the run at once
    cmd += (["--resume"] if resume else []) + [
        "run.epochs=100000",
        "checkpoint.every=100",
        "eval.every=200",
        "eval.num_prompts=4",
        "log.every=10",
    ]
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=child_env(PYTHONUNBUFFERED="1"),
    )


def kill_one_worker(launcher: subprocess.Popen, turn: int) -> str:
    """SIGKILL one worker: the target on even turns, the drafter on odd ones."""
    want = "target" if turn % 2 == 0 else "drafter"
    try:
        children = psutil.Process(launcher.pid).children(recursive=True)
    except psutil.Error:
        return "none"
    for proc in children:
        if role_of(proc) == want:
            proc.kill()
            return want
    return "none"


def stop(launcher: subprocess.Popen, timeout_s: float = 120) -> None:
    if launcher.poll() is None:
        launcher.send_signal(signal.SIGTERM)
        try:
            launcher.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


def third_medians(samples: list[dict], figure) -> tuple[float, float, float] | None:
    """(median over the first third, over the last third, hours between their middles)."""
    points = [(s["t"], figure(s)) for s in samples if figure(s) is not None]
    if len(points) < 6:
        return None
    third = len(points) // 3
    first, last = points[:third], points[-third:]
    hours = (statistics.median(t for t, _ in last) - statistics.median(t for t, _ in first)) / 3600
    return statistics.median(v for _, v in first), statistics.median(v for _, v in last), hours


def growth(samples: list[dict]) -> dict:
    out = {}
    for role in ROLES:
        for key in ("rss_mb", "fds", "threads", "gpu_mem_mb", "gpu_reserved_mb"):
            got = third_medians(samples, lambda s: s["roles"].get(role, {}).get(key))
            if got:
                first, last, hours = got
                out[f"{role}.{key}"] = {
                    "first": round(first, 1),
                    "last": round(last, 1),
                    "per_hour": round((last - first) / hours, 2) if hours > 0 else None,
                }
    for key in ("run_dir_mb", "ledger_kb"):
        got = third_medians(samples, lambda s: s[key])
        if got:
            first, last, hours = got
            out[key] = {
                "first": round(first, 2),
                "last": round(last, 2),
                "per_hour": round((last - first) / hours, 2) if hours > 0 else None,
            }
    steps = samples[-1]["step"] - samples[0]["step"] if samples else 0
    if steps > 0:
        out["ledger_bytes_per_step"] = round((samples[-1]["ledger_kb"] - samples[0]["ledger_kb"]) * 1024 / steps, 1)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=120)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--kill-every", type=float, default=300, help="seconds between worker SIGKILLs (0: none)")
    ap.add_argument("--restart-every", type=float, default=1200, help="seconds between stop/resume (0: none)")
    ap.add_argument("--sample-every", type=float, default=30)
    ap.add_argument("--warmup", type=float, default=120, help="seconds left out of the growth figures")
    ap.add_argument("--run-dir", help="default: a fresh folder under /tmp")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    folder = Path(a.run_dir or tempfile.mkdtemp(prefix="soak", dir="/tmp"))
    folder.mkdir(parents=True, exist_ok=True)
    run_dir = folder / "run"
    log = open(run_dir.parent / "soak.log", "a")
    start = time.monotonic()
    launcher = start_launcher(run_dir, resume=False, log=log, device=a.device)
    samples, events = [], []
    next_kill = start + a.kill_every if a.kill_every else float("inf")
    next_restart = start + a.restart_every if a.restart_every else float("inf")
    turn = 0
    try:
        while time.monotonic() - start < a.minutes * 60:
            time.sleep(a.sample_every)
            now = time.monotonic()
            if launcher.poll() is not None:
                events.append({"t": round(now - start, 1), "event": f"launcher exited {launcher.returncode}"})
                break
            if now - start >= a.warmup:
                samples.append(sample(launcher, run_dir, start))
            if now >= next_kill:
                events.append({"t": round(now - start, 1), "event": f"SIGKILL {kill_one_worker(launcher, turn)}"})
                turn, next_kill = turn + 1, now + a.kill_every
            if now >= next_restart:
                stop(launcher)
                events.append(
                    {"t": round(time.monotonic() - start, 1), "event": f"stopped ({launcher.returncode}), resumed"}
                )
                launcher = start_launcher(run_dir, resume=True, log=log, device=a.device)
                next_restart = time.monotonic() + a.restart_every
    finally:
        stop(launcher)
        log.close()
    result = {
        "minutes": round((time.monotonic() - start) / 60, 1),
        "samples": len(samples),
        "steps": samples[-1]["step"] if samples else 0,
        "events": events,
        "growth": growth(samples),
        "last_sample": samples[-1] if samples else None,
        "run_dir": str(run_dir),
    }
    text = json.dumps(result)
    print(text, flush=True)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0 if samples else 1


if __name__ == "__main__":
    sys.exit(main())
