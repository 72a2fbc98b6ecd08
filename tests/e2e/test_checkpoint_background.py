"""Checkpoints written in the background: what is saved is the state at the snapshot, and a
process killed in the middle of a background write leaves the previous checkpoint intact."""

import json
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from services.drafter import checkpoint as ckpt
from services.drafter.checkpoint_writer import BackgroundWriter
from tests.launching import REPO


def _state(n: int, value: float) -> tuple[dict, dict]:
    weights = {"layer.weight": torch.full((n,), value), "norm.weight": torch.full((7,), value)}
    optimizer = {
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.full((n,), value / 2)}},
            "param_groups": [{"lr": 1e-4, "params": [0]}],
        },
        "scheduler": {"last_epoch": 3},
    }
    return weights, optimizer


def _write(writer: BackgroundWriter, step: int, weights: dict, optimizer: dict) -> float:
    return writer.snapshot_and_write(
        step,
        weights=weights,
        optimizer=optimizer,
        rng={"cpu.0": torch.get_rng_state()},
        meta={"step": step},
        config={"run": {}},
        set_best=False,
    )


@pytest.mark.inprocess
def test_the_files_hold_the_state_at_the_snapshot_not_later(tmp_path):
    writer = BackgroundWriter(tmp_path / "checkpoints", keep=2, device=torch.device("cpu"))
    weights, optimizer = _state(1000, 1.0)
    _write(writer, 5, weights, optimizer)
    for t in weights.values():  # training goes on and changes everything in place
        t.add_(100.0)
    optimizer["optimizer"]["state"][0]["exp_avg"].add_(100.0)
    outcome = writer.wait()
    assert outcome["error"] is None and outcome["path"].name == "step-00000005"
    assert outcome["stall_s"] >= 0 and outcome["write_s"] >= 0
    saved = load_file(str(outcome["path"] / "model.safetensors"))
    assert torch.equal(saved["layer.weight"], torch.full((1000,), 1.0))
    blob = torch.load(outcome["path"] / "optimizer.pt", weights_only=True)
    assert torch.equal(blob["optimizer"]["state"][0]["exp_avg"], torch.full((1000,), 0.5))
    assert ckpt.verify(outcome["path"])["step"] == 5
    assert ckpt.pointer(tmp_path / "checkpoints", ckpt.LATEST).name == "step-00000005"
    assert writer.done() is None  # each outcome is reported once


KILLED_WRITER = """
import sys, time, torch
from pathlib import Path
from services.drafter.checkpoint_writer import BackgroundWriter
from tests.e2e.test_checkpoint_background import _state, _write
root = Path(sys.argv[1])
writer = BackgroundWriter(root, keep=3, device=torch.device("cpu"))
_write(writer, 1, *_state(1000, 1.0))
assert writer.wait()["error"] is None
_write(writer, 2, *_state(100_000_000, 2.0))         # 400 MB of weights: the write takes a while
while not list(root.glob(".tmp-step-00000002-*")):
    time.sleep(0.001)
print("writing", flush=True)
time.sleep(60)
"""


@pytest.mark.processes
def test_sigkill_during_a_background_write_keeps_the_previous_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(root)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "writing", proc.stderr.read()
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    assert ckpt.pointer(root, ckpt.LATEST).name == "step-00000001"
    assert ckpt.verify(root / "step-00000001")["step"] == 1
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step-00000001"]  # the half-written one is a .tmp-
    writer = BackgroundWriter(root, keep=3, device=torch.device("cpu"))  # the next write clears it away
    _write(writer, 3, *_state(10, 3.0))
    assert writer.wait()["error"] is None
    assert not list(root.glob(".tmp-*"))
    assert json.loads((root / "step-00000003" / "state.json").read_text())["step"] == 3
