"""The whole lifecycle through the launcher, on the built-in demo (1 target + 2 drafters, CPU):
a drafter is SIGKILLed mid-run, the supervisor restarts the drafter group with --resume, and the
run still trains every batch exactly once, continues its loss curve, evaluates, keeps the best
checkpoint, exports, and `launcher report` summarises and plots it."""

import json
import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from services.drafter.books.ledger import read_all
from services.process.log import events
from tests.launching import PLUMBING, REPO, drafter_stuck, launcher_argv, run_launcher, running, wait_for
from tests.old_configs import before_the_split

# the plumbing settings; steps enough for three evaluations and a loss that falls
STEPS, CHECKPOINT_EVERY, LOG_EVERY, EVAL_EVERY = 60, 10, 5, 20
pytestmark = pytest.mark.training


def test_sigkilled_drafter_resumes_and_every_batch_is_trained_once(tmp_path):
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(
        launcher_argv(
            "up",
            "--demo",
            "--device",
            "cpu",
            "--gpus",
            "0:target,1-2:drafter",
            "--run-dir",
            str(run_dir),
            *PLUMBING,
            f"run.max_steps={STEPS}",
            f"checkpoint.every={CHECKPOINT_EVERY}",
            f"log.every={LOG_EVERY}",
            f"eval.every={EVAL_EVERY}",
        ),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        latest = run_dir / "checkpoints" / "latest"
        wait_for(latest.is_symlink, "the first checkpoint", launcher, 240)
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
    resumed = events(log, "resumed")
    assert len(resumed) == 1 and resumed[0]["step"] % CHECKPOINT_EVERY == 0 and 0 < resumed[0]["step"] < STEPS

    # exactly once: the ledger of the weights' lineage holds every batch index once
    entries = read_all(run_dir)
    assert Counter(e["g"] for e in entries) == Counter(range(2 * STEPS))
    # the loss curve continues from the checkpoint: each logged step once, in order
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if not r.get("eval")]
    assert [r["step"] for r in train] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    assert all(
        r["loss"] > 0
        and 1.0 <= r["tau"]
        and r["tokens_per_s"] > 0
        and 0 <= r["data_wait_frac"] <= 1
        and len(r["accuracy_per_position"]) == 7
        for r in train
    )
    assert train[-1]["loss"] < train[0]["loss"]
    evals = [r for r in records if r.get("eval")]
    assert [r["step"] for r in evals] == list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY)) and evals[0]["batches"] >= 1
    best = max(evals, key=lambda r: r["tau"])
    assert os.readlink(run_dir / "checkpoints" / "best") == f"step-{best['step']:08d}"
    assert os.readlink(run_dir / "checkpoints" / "latest") == f"step-{STEPS:08d}"
    assert json.loads((run_dir / "export" / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]

    report = run_launcher("report", "--run-dir", str(run_dir), cwd=REPO, timeout=120)
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


def as_written_before_the_split(checkpoint: Path) -> None:
    """The checkpoint's config.json as a version before [run] and [drafter] were split into sections
    wrote it (services/run/config/loading.py RENAMED: every moved key under its old name), its manifest to match."""
    from services.run.files import sha256_file

    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps(before_the_split(config)))
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    entry = manifest["files"]["config.json"]
    entry.update(sha256=sha256_file(checkpoint / "config.json"), bytes=(checkpoint / "config.json").stat().st_size)
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def test_stop_while_waiting_for_data_checkpoints_and_resume_finishes_the_run(tmp_path):
    """`launcher down` while the drafters wait for a frozen target: they leave the wait, checkpoint
    and exit 0 (nothing killed hard); `launcher up --resume` then finishes, every batch once, from a
    checkpoint whose config.json uses the key names from before the config's split into sections."""

    steps, run_dir = 60, tmp_path / "run"
    args = launcher_argv(
        "up",
        "--demo",
        "--device",
        "cpu",
        "--gpus",
        "0:target,1-2:drafter",
        "--run-dir",
        str(run_dir),
        *PLUMBING,
        f"run.max_steps={steps}",
        "checkpoint.every=1000",
        f"log.every={LOG_EVERY}",
    )
    up = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        metrics = run_dir / "metrics.jsonl"
        wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, "training", up, 240)
        run = json.loads((run_dir / "run.json").read_text())
        pids = {w["name"]: w["pid"] for w in run["workers"]}
        os.kill(pids["target-0"], signal.SIGSTOP)  # the drafters run dry and wait
        wait_for(lambda: drafter_stuck(run_dir), "drafter-0 to wait for a batch that cannot come", up, 120)
        down = subprocess.Popen(
            launcher_argv("down", "--run-dir", str(run_dir), "--timeout", "120"),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + 60
        while any(running(pids[d]) for d in ("drafter-0", "drafter-1")) and time.monotonic() < deadline:
            time.sleep(0.2)
        os.kill(pids["target-0"], signal.SIGCONT)  # let it see its SIGTERM
        down_out, _ = down.communicate(timeout=150)
        out, _ = up.communicate(timeout=150)
    finally:
        for p in (up,):
            if p.poll() is None:
                p.kill()
    assert up.returncode == 3, out[-3000:]
    assert "killed hard" not in down_out, down_out
    log = (run_dir / "logs" / "drafter-0.log").read_text()
    stopped = events(log, "stopped")[-1]
    assert stopped["signal"] is True and 0 < stopped["step"] < steps
    assert os.readlink(run_dir / "checkpoints" / "latest") == f"step-{stopped['step']:08d}"

    as_written_before_the_split(run_dir / "checkpoints" / f"step-{stopped['step']:08d}")
    again = subprocess.run(args + ["--resume"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert f"resumed from step {stopped['step']}" in again.stdout, (again.stdout + again.stderr)[-3000:]
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert Counter(e["g"] for e in read_all(run_dir)) == Counter(range(2 * steps))
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert logged == sorted(set(logged)) and set(range(LOG_EVERY, steps + 1, LOG_EVERY)) <= set(logged)
