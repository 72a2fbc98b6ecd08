"""The whole lifecycle through the launcher, on the built-in demo (1 target + 2 drafters, CPU):
a drafter is SIGKILLed mid-run, the supervisor restarts the drafter group with --resume, and the
run still trains every batch exactly once, continues its loss curve, evaluates, keeps the best
checkpoint, exports, and `launcher report` summarises and plots it."""
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from services.drafter.ledger import read_all

REPO = Path(__file__).resolve().parents[1]
STEPS, CHECKPOINT_EVERY, LOG_EVERY, EVAL_EVERY = 120, 20, 5, 40


def wait_for(predicate, timeout, proc, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        assert proc.poll() is None, f"launcher exited ({proc.returncode}) while waiting for {what}"
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_sigkilled_drafter_resumes_and_every_batch_is_trained_once(tmp_path):
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "launcher", "up", "--demo", "--device", "cpu", "--gpus", "0:target,1-2:drafter",
         "--run-dir", str(run_dir), f"run.max_steps={STEPS}", f"run.checkpoint_every={CHECKPOINT_EVERY}",
         f"run.log_every={LOG_EVERY}", f"run.eval_every={EVAL_EVERY}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        latest = run_dir / "checkpoints" / "latest"
        wait_for(latest.is_symlink, 240, launcher, "the first checkpoint")
        run = json.loads((run_dir / "run.json").read_text())
        victim = [w for w in run["workers"] if w["name"] == "drafter-1"][0]["pid"]
        os.kill(victim, signal.SIGKILL)
        out, err = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            launcher.communicate(timeout=60)
    assert launcher.returncode == 0, (out + err)[-4000:]
    assert "drafter-1 exited with code -9" in out + err

    run = json.loads((run_dir / "run.json").read_text())
    assert run["restarts"]["drafter"] == 1
    log = (run_dir / "logs" / "drafter-0.log").read_text()
    resumed = [json.loads(line) for line in log.splitlines() if line.startswith('{"event": "resumed"')]
    assert len(resumed) == 1 and resumed[0]["step"] % CHECKPOINT_EVERY == 0 and 0 < resumed[0]["step"] < STEPS

    # exactly once: the ledger of the weights' lineage holds every batch index once
    entries = read_all(run_dir)
    assert Counter(e["g"] for e in entries) == Counter(range(2 * STEPS))
    # the loss curve continues from the checkpoint: each logged step once, in order
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if not r.get("eval")]
    assert [r["step"] for r in train] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    assert all(r["loss"] > 0 and 1.0 <= r["tau"] and r["tokens_per_s"] > 0 and 0 <= r["data_wait_frac"] <= 1
               and len(r["accuracy_per_position"]) == 7 for r in train)
    assert train[-1]["loss"] < train[0]["loss"]
    evals = [r for r in records if r.get("eval")]
    assert [r["step"] for r in evals] == list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY)) and evals[0]["batches"] >= 1
    best = max(evals, key=lambda r: r["tau"])
    assert os.readlink(run_dir / "checkpoints" / "best") == f"step-{best['step']:08d}"
    assert os.readlink(run_dir / "checkpoints" / "latest") == f"step-{STEPS:08d}"
    assert json.loads((run_dir / "export" / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]

    report = subprocess.run([sys.executable, "-m", "launcher", "report", "--run-dir", str(run_dir)],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert f"steps: {STEPS}" in report.stdout and f"best tau {best['tau']:.3f} at step {best['step']}" in report.stdout
    assert f"export: {run_dir / 'export'}" in report.stdout
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in report.stdout
    else:
        png = run_dir / "report.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
