"""Elastic resume through the launcher, on the demo (CPU, real workers, ZMQ and gloo): a run stopped
with `launcher down` and resumed with `launcher up --resume` on another `--gpus` split (other
target and drafter counts) trains every batch exactly once over the whole run, and after the
resume drafter d of D asks target g mod T for g = g0 + (m - m0)·D + d."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from services.drafter.books.ledger import read_all
from services.process.log import events
from tests.launching import PLUMBING, REPO, drafter_stuck, launcher_argv, running, wait_for

STEPS, LOG_EVERY = 30, 2
SMALL = [
    *PLUMBING,
    f"run.max_steps={STEPS}",
    f"log.every={LOG_EVERY}",
    "checkpoint.every=1000",
    "eval.every=0",
]
pytestmark = pytest.mark.training


def up(run_dir: Path, gpus: str, *extra: str) -> list[str]:
    return launcher_argv("up", "--demo", "--device", "cpu", "--gpus", gpus, "--run-dir", str(run_dir), *SMALL, *extra)


def target_pids(run_dir: Path) -> dict[int, int]:
    """pid -> target number, of the launch that wrote run.json."""
    run = json.loads((run_dir / "run.json").read_text())
    return {
        pid: int(w["name"].split("-")[1])
        for w in run["workers"]
        if w["name"].startswith("target-")
        for pid in w["pids_seen"]
    }


def stop_after_some_steps(run_dir: Path, args: list[str]) -> int:
    """Start the run; once it has trained a few steps, freeze its targets (so that no machine is fast
    enough to finish first), `launcher down`, thaw them. The step the drafters stopped at."""

    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        metrics = run_dir / "metrics.jsonl"
        wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, "training", proc, 240)
        run = json.loads((run_dir / "run.json").read_text())
        targets = [w["pid"] for w in run["workers"] if w["name"].startswith("target-")]
        drafters = [w["pid"] for w in run["workers"] if w["name"].startswith("drafter-")]
        for pid in targets:
            os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: drafter_stuck(run_dir), "drafter-0 to wait for data", proc, 120)
        down = subprocess.Popen(
            launcher_argv("down", "--run-dir", str(run_dir), "--timeout", "120"),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(running(p) for p in drafters):
            time.sleep(0.2)
        for pid in targets:
            os.kill(pid, signal.SIGCONT)  # let them see their SIGTERM
        down_out, _ = down.communicate(timeout=150)
        out, _ = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert down.returncode == 0 and "killed hard" not in down_out, down_out
    assert proc.returncode == 3, out[-3000:]  # stopped before the end, checkpointed
    stopped = events((run_dir / "logs" / "drafter-0.log").read_text(), "stopped")[-1]
    assert stopped["signal"] is True and 0 < stopped["step"] < STEPS, stopped
    return stopped["step"]


@pytest.mark.parametrize(
    "before, d_before, after, d_after, accum",
    [
        ("0:target,1-2:drafter", 2, "0-1:target,2:drafter", 1, 1),  # 1 target, 2 drafters -> 2 targets, 1 drafter
        ("0-1:target,2:drafter", 1, "0:target,1-2:drafter", 2, 2),  # and back, with gradient accumulation
    ],
)
def test_resume_on_another_split_trains_every_batch_once(tmp_path, before, d_before, after, d_after, accum):
    run_dir = tmp_path / "run"
    stopped = stop_after_some_steps(run_dir, up(run_dir, before, f"optimizer.grad_accum={accum}"))
    first_targets = target_pids(run_dir)
    done = stopped * accum * d_before  # every rank finished the steps before the stop

    again = subprocess.run(
        up(run_dir, after, f"optimizer.grad_accum={accum}", "--resume"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    resumed = events((run_dir / "logs" / "drafter-0.log").read_text(), "resumed")[-1]
    assert resumed["step"] == stopped
    schedule = json.loads((run_dir / "schedule.json").read_text())
    total = done + (STEPS - stopped) * accum * d_after
    assert (schedule["drafters"], schedule["first_step"], schedule["first_g"]) == (d_after, stopped, done)
    assert schedule["optimizer_steps"] == STEPS and schedule["total_batches"] == total

    entries = read_all(run_dir)  # every ledger file, of both launches
    assert sorted(e["g"] for e in entries) == list(range(total)), "a batch trained twice or never"
    assert all(e["tokens"] > 0 for e in entries)
    second_targets, boundary = target_pids(run_dir), stopped * accum
    # a rank the second launch does not have keeps only what it trained before the checkpoint
    assert all(e["step"] < boundary for e in entries if e["rank"] >= d_after)
    for e in entries:
        if e["step"] < boundary:  # before the stop: g = m·D + d, from target g mod T
            assert e["g"] == e["step"] * d_before + e["rank"]
            assert first_targets[int(e["incarnation"].split("-")[0])] == e["g"] % len(set(first_targets.values()))
        else:  # after: g = g0 + (m - m0)·D' + d, from target g mod T'
            assert e["g"] == done + (e["step"] - boundary) * d_after + e["rank"]
            assert second_targets[int(e["incarnation"].split("-")[0])] == e["g"] % len(set(second_targets.values()))
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == STEPS  # one curve, no step twice
