"""Checkpoints written in the background: a process killed in the middle of a background write
leaves the previous checkpoint intact (the state saved at the snapshot: tests/unit/test_checkpoint_files.py)."""

import json
import signal
import subprocess
import sys

import pytest
import torch

from services.drafter.checkpoints import checkpoint as ckpt
from services.drafter.checkpoints.checkpoint_writer import BackgroundWriter
from tests.launching import REPO
from tests.unit.test_checkpoint_files import _state, _write

KILLED_WRITER = """
import sys, time, torch
from pathlib import Path
from services.drafter.checkpoints.checkpoint_writer import BackgroundWriter
from tests.unit.test_checkpoint_files import _state, _write
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
