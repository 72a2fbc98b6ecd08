"""One graceful stop per stop request, and one launcher per run dir, on the real demo (CPU).

kill -9 of the launcher: the kernel sends each worker the parent-death signal once for every
launcher thread the worker is handed to on its way to init; every drafter must still finish its
step, write the checkpoint and exit 3 (stopped before the end). A signal sent twice by one sender
(GNU timeout signals the launcher, then its process group) is one stop too. A stop sent to one
drafter stops its group, and the launcher records the run as stopped (exit 3), not finished."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from services.process.log import events
from tests.launching import PLUMBING, REPO, child_env, launcher_argv, run_launcher, start_launcher, wait_metrics


def up_args(run_dir: Path, *extra: str) -> list[str]:
    """The demo on the plumbing settings, running until stopped."""
    return [
        "up",
        "--demo",
        "--device",
        "cpu",
        "--gpus",
        "0:target,1-2:drafter",
        "--run-dir",
        str(run_dir),
        *PLUMBING,
        "run.epochs=50",
        "checkpoint.every=100000",
        *extra,
    ]


# The launcher's orphans come to this process (a child subreaper), so their exit codes can be read.
KILL_9 = textwrap.dedent("""
    import ctypes, json, os, signal, subprocess, sys, time
    from pathlib import Path
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)                  # PR_SET_CHILD_SUBREAPER
    run_dir = Path(sys.argv[1])
    launcher = subprocess.Popen(sys.argv[2:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2) and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = {w["name"]: w["pid"] for w in json.loads((run_dir / "run.json").read_text())["workers"]}
    launcher.kill()
    launcher.wait()
    codes, deadline = {}, time.monotonic() + 120
    while len(codes) < len(pids) and time.monotonic() < deadline:
        for name, pid in pids.items():
            if name in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[name] = os.waitstatus_to_exitcode(status)
        time.sleep(0.1)
    for name, pid in pids.items():
        if name not in codes:
            os.kill(pid, signal.SIGKILL)
            codes[name] = "still running"
    print(json.dumps(codes))
""")


@pytest.mark.training
def test_kill_9_of_the_launcher_every_drafter_checkpoints_and_exits_stopped(tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-c", KILL_9, str(run_dir), *launcher_argv(*up_args(run_dir))],
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    codes = json.loads(out.stdout.strip().splitlines()[-1])
    assert codes == {"target-0": 0, "drafter-0": 3, "drafter-1": 3}, codes  # stopped; nothing hard (143)
    stops = []
    for rank in (0, 1):
        log = (run_dir / "logs" / f"drafter-{rank}.log").read_text()
        assert "parent-death signal (the launcher died): finishing the current step" in log
        assert "exiting now" not in log
        stops.append(events(log, "stopped")[-1])
    assert all(s["signal"] is True for s in stops) and stops[0]["step"] == stops[1]["step"] > 0
    assert os.readlink(run_dir / "checkpoints" / "latest") == f"step-{stops[0]['step']:08d}"


def stopped_once(run_dir: Path, rank: int = 0) -> dict:
    """drafter-<rank> began one graceful stop, never exited hard, and checkpointed the step it stopped at."""
    log = (run_dir / "logs" / f"drafter-{rank}.log").read_text().split("\n===== ")[-1]  # its latest start
    assert log.count(": finishing the current step") == 1 and "exiting now" not in log, log[-3000:]
    stopped = events(log, "stopped")[-1]
    assert stopped["signal"] is True and stopped["step"] > 0
    assert os.readlink(run_dir / "checkpoints" / "latest") == f"step-{stopped['step']:08d}"
    return stopped


@pytest.mark.processes  # the first launcher is killed while it prepares: no worker starts
def test_a_second_launcher_is_refused_in_under_two_seconds_while_the_first_prepares(tmp_path):
    """The first `up` holds the lock beside a new run dir while it builds the demo and packs the data
    (the run dir does not exist yet); a second `up` on it exits 2 at once, naming the first, without
    preparing anything itself."""
    run_dir = tmp_path / "run"
    early = tmp_path / ".run.launcher.lock"
    first = start_launcher(
        *up_args(run_dir), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )  # its group: the data packer dies with it
    try:
        deadline = time.monotonic() + 120
        while not (early.exists() and early.read_text().strip() == str(first.pid)):
            assert time.monotonic() < deadline and first.poll() is None, "the first launcher never took its lock"
            time.sleep(0.02)
        assert not run_dir.exists(), "the first launcher finished preparing already: the test proves nothing"
        started = time.monotonic()
        second = run_launcher(*up_args(run_dir), cwd=REPO, timeout=120)
        took = time.monotonic() - started
        assert not run_dir.exists() and first.poll() is None  # the first was still preparing all along
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert second.returncode == 2, second.stdout + second.stderr
    assert second.stdout == "" and second.stderr.strip().splitlines() == [
        f"launcher: error: another launcher is running on {run_dir} (pid {first.pid}); stop it first "
        f"(launcher down --run-dir {run_dir}) or choose another --run-dir"
    ], second.stderr
    assert took < 2.0, f"refused after {took:.1f}s"


@pytest.mark.training
def test_one_stop_per_request_and_one_launcher_per_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    first = start_launcher(*up_args(run_dir))
    try:
        lock = run_dir / "launcher.lock"
        deadline = time.monotonic() + 180  # after the demo is loaded and its data packed
        while not (lock.exists() and lock.read_text().strip() == str(first.pid)):
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.05)
        busy = f"another launcher is running on {run_dir} (pid {first.pid})"
        for extra in ((), ("--resume",)):  # a second `up` on the same run dir, before anything is written
            second = run_launcher(*up_args(run_dir, *extra), cwd=REPO, timeout=120)
            assert second.returncode == 2 and busy in second.stderr, second.stdout + second.stderr
        pids = wait_metrics(run_dir, first)
        assert json.loads((run_dir / "run.json").read_text())["launcher_pid"] == first.pid
        os.kill(pids["drafter-1"], signal.SIGTERM)  # a worker: twice by one sender within the debounce
        time.sleep(0.1)  # (sooner, the kernel may merge the two into one)
        with contextlib.suppress(ProcessLookupError):  # a step that ends at once: it has left already
            os.kill(pids["drafter-1"], signal.SIGTERM)
        out, _ = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    # the group stopped before the end: the run is stopped (exit 3, the resume command), not finished
    assert first.returncode == 3 and "exited with code" not in out, out[-3000:]
    assert "stopped before the end; to continue: " in out and "--resume" in out, out[-3000:]
    outcome = json.loads((run_dir / "run.json").read_text())["outcome"]
    assert outcome["state"] == "stopped" and outcome["exit"] == 3 and "drafter-1" in outcome["reason"], outcome
    assert not (run_dir / "export").exists()  # an export is a finished run's
    step = stopped_once(run_dir, rank=1)["step"]

    logged = len((run_dir / "metrics.jsonl").read_text().splitlines())
    again = start_launcher(*up_args(run_dir, "--resume"))
    try:
        wait_metrics(run_dir, again, lines=logged + 2)  # the resumed run trains
        os.kill(again.pid, signal.SIGTERM)  # the launcher, as GNU timeout does: the pid, then the group
        # the second once the launcher says it is stopping: the first was taken (sooner, the kernel may
        # merge the two into one), and the stop of this tiny run cannot be over (a fixed pause was)
        seen = []
        while (line := again.stdout.readline()) and not line.startswith("stopping:"):
            seen.append(line)
        os.kill(again.pid, signal.SIGTERM)
        rest, _ = again.communicate(timeout=300)
        out = "".join(seen) + line + rest
    finally:
        if again.poll() is None:
            again.kill()
    assert again.returncode == 3, out[-3000:]  # stopped, gracefully
    assert f"SIGTERM from pid {os.getpid()} again: the same stop request" in out
    assert "second signal" not in out and "killed after" not in out
    assert stopped_once(run_dir)["step"] > step
