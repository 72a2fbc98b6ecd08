"""A worker that exits after `ready`: the launcher names it, its GPU and the cause (the signal by
name, or the worker's last error line), keeps it in run.json and `launcher status`, and ends the
run at once when no restart can help. Real launcher, real demo workers, CPU."""

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.launching import PLUMBING, REPO, run_launcher, start_launcher, wait_ready_then_metrics

pytestmark = pytest.mark.training
ONE_DRAFTER = ["--demo", "--device", "cpu", "--gpus", "0:target,1:drafter"]


def up(run_dir: Path, *extra: str) -> subprocess.Popen:
    return start_launcher("up", *ONE_DRAFTER, "--run-dir", str(run_dir), *PLUMBING, "run.max_steps=2000", *extra)


def status(run_dir: Path) -> subprocess.CompletedProcess:
    return run_launcher("status", "--run-dir", str(run_dir), "--timeout", "0.5", cwd=REPO, timeout=60)


def test_a_drafter_killed_by_sigsegv_is_named_in_the_last_lines_and_in_status(tmp_path):
    run_dir = tmp_path / "run"
    proc = up(run_dir, "supervise.max_restarts=0")
    try:
        pids = wait_ready_then_metrics(run_dir, proc)
        os.kill(pids["drafter-0"], signal.SIGSEGV)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out[-3000:]
    last = "\n".join(out.strip().splitlines()[-3:])
    assert "drafter-0 exited with code -11 on gpu 1: killed by SIGSEGV; drafter restarts exhausted" in last, last
    run = json.loads((run_dir / "run.json").read_text())
    assert "killed by SIGSEGV" in run["outcome"]["reason"]
    drafter = next(w for w in run["workers"] if w["name"] == "drafter-0")
    assert drafter["last_exit"]["code"] == -11 and drafter["last_exit"]["cause"] == "killed by SIGSEGV"
    shown = status(run_dir)
    assert shown.returncode == 1
    assert "failed: drafter-0 exited with code -11 on gpu 1: killed by SIGSEGV" in shown.stdout.splitlines()[0]
    assert "drafter-0: last exit at " in shown.stdout and ", code -11: killed by SIGSEGV" in shown.stdout


def test_an_error_no_restart_can_mend_ends_the_run_at_once_with_its_line(tmp_path):
    """The target restarts after a SIGKILL (a transient failure: budget 1/3) and then fails on a
    config error, as after an edit of the run's config.json: the run ends there, not after 3 tries."""
    run_dir = tmp_path / "run"
    proc = up(run_dir, "supervise.max_restarts=3")
    try:
        pids = wait_ready_then_metrics(run_dir, proc)
        config = json.loads((run_dir / "config.json").read_text())
        config["data"]["on_bad_sample"] = "bogus"
        (run_dir / "config.json").write_text(json.dumps(config))
        os.kill(pids["target-0"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out[-3000:]
    assert "target-0 exited with code -9 on gpu 0: killed by SIGKILL (often the kernel's OOM killer" in out
    assert "restarting in 1s (1/3)" in out and "(2/3)" not in out
    error = "config error: data.on_bad_sample must be 'fail' or 'skip', got 'bogus'"
    reason = json.loads((run_dir / "run.json").read_text())["outcome"]["reason"]
    assert reason == f"target-0 exited with code 2 on gpu 0: {error}; no restart can fix a config error", reason
    assert json.loads((run_dir / "run.json").read_text())["restarts"] == {"target": 1, "drafter": 0}
    assert "target-0: last exit at " in status(run_dir).stdout and error in status(run_dir).stdout
