"""docs/quickstart.md's CPU walkthrough, run as written: its run-cpu.toml and its commands, read
from the markdown (so the doc and the test cannot drift), on a tiny random model made on the spot
in models/my-model and the demo's chat data in data/chat.jsonl."""

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.assets import random_demo
from tests.launching import child_env
from tests.unit.test_docs import quickstart_block


@pytest.mark.training
@pytest.mark.untimed  # commands, their output and files
def test_the_cpu_walkthrough_runs_as_written(tmp_path):
    demo = random_demo(1500)  # a random target, 70 rows
    work = Path(tempfile.mkdtemp(prefix="qs-", dir="/tmp"))  # short: ipc socket paths are at most 107 bytes
    try:
        run_walkthrough(demo, work, tmp_path)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_walkthrough(demo, work, tmp_path):
    (work / "models").mkdir(parents=True)
    (work / "data").mkdir()
    os.symlink(demo["model_path"], work / "models" / "my-model")
    os.symlink(demo["data_path"], work / "data" / "chat.jsonl")
    (work / "run-cpu.toml").write_text(quickstart_block("# run-cpu.toml:"))
    bin_dir = tmp_path / "bin"  # `launcher` as installed: this checkout's CLI
    bin_dir.mkdir()
    (bin_dir / "launcher").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m launcher "$@"\n')
    (bin_dir / "launcher").chmod(0o755)
    env = child_env(PATH=f"{bin_dir}:{os.environ['PATH']}")
    commands = [
        line
        for line in quickstart_block("# the CPU walkthrough").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert [c.split()[1] for c in commands] == ["up", "status", "report", "eval", "export"]
    said = {}
    for command in commands:
        out = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, f"{command}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        said[command.split()[1]] = out.stdout
    assert "training finished" in said["up"] and "real acceptance (step 30" in said["up"], said["up"][-2000:]
    assert "finished" in said["status"] and "plan: 30 optimizer steps" in said["status"], said["status"]
    assert "steps: 30" in said["report"] and "real acceptance" in said["report"]
    drafter_line = next(line for line in said["eval"].splitlines() if line.split()[:1] == ["drafter"])
    assert drafter_line.endswith("  4/4"), said["eval"]  # its table row: lossless 4 of 4
    assert json.loads((work / "my-drafter" / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
