"""Checkpoint files in this process: rotation, pointers, verification, a write cut short, a full
disk, and a background write that saves the state at its snapshot. With real drafter processes:
tests/e2e/test_checkpoint.py, test_checkpoint_faults.py, test_checkpoint_background.py."""

import os

import pytest
import torch
from safetensors.torch import load_file

from services.drafter.checkpoints import checkpoint as ckpt
from services.drafter.checkpoints.checkpoint_writer import BackgroundWriter


def write(root, step, keep=3, value=1.0):
    return ckpt.write_checkpoint(
        root,
        step,
        weights={"w": torch.full((4,), value)},
        optimizer={"state": {}},
        rng={"cpu.0": torch.get_rng_state()},
        meta={"step": step, "micro_step": step},
        config={},
        keep=keep,
    )


def test_rotation_keeps_the_newest_and_the_best(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        write(root, step)
    ckpt.set_best_pointer(root, root / "step-00000001")
    for step in (4, 5):
        write(root, step)
    assert sorted(p.name for p in ckpt.list_checkpoints(root)) == [
        "step-00000001",
        "step-00000003",
        "step-00000004",
        "step-00000005",
    ]
    assert ckpt.pointer(root, "best").name == "step-00000001" and ckpt.pointer(root, "latest").name == "step-00000005"
    assert os.readlink(root / "latest") == "step-00000005"  # relative: the run dir can move


def test_a_crash_mid_write_leaves_latest_alone(tmp_path):
    root = tmp_path / "checkpoints"
    write(root, 1)
    half = root / ".tmp-step-00000002-12345"  # what a SIGKILL mid-write leaves
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"partial")
    assert ckpt.pointer(root, "latest").name == "step-00000001"
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step-00000001"]
    write(root, 2)  # the next write cleans it up
    assert not half.exists() and ckpt.pointer(root, "latest").name == "step-00000002"


def test_verify_names_what_is_wrong(tmp_path):
    root = tmp_path / "checkpoints"
    path = write(root, 1)
    assert ckpt.verify(path)["step"] == 1
    (path / "rng.safetensors").unlink()
    with pytest.raises(ckpt.CorruptCheckpoint, match="rng.safetensors missing"):
        ckpt.verify(path)
    path = write(root, 2)
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(ckpt.CorruptCheckpoint, match="manifest.json unreadable"):
        ckpt.verify(path)


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


def test_a_write_that_fills_the_disk_says_so_with_the_space_needed(small_disk):
    import torch

    root = small_disk("1m") / "checkpoints"
    weights = {"w": torch.zeros(1 << 20)}  # 4 MB in fp32: cannot fit
    with pytest.raises(OSError, match=rf"^\[Errno 28\] no space left on {root}, need about 0\.004 GB"):
        ckpt.write_checkpoint(
            root, 4, weights=weights, optimizer={}, rng={"cpu.0": torch.zeros(4)}, meta={"step": 4}, config={}, keep=3
        )
    assert sorted(p.name for p in root.iterdir()) == []  # the half-written temp dir is gone
