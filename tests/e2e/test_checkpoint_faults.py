"""Checkpoints that go wrong, with real drafter processes: corrupt and truncated checkpoints,
incompatible configs, a full disk (a real EFBIG from the kernel, through RLIMIT_FSIZE)."""

import json
import resource

import pytest

from services.drafter.checkpoints import checkpoint as ckpt
from services.process.log import events
from tests.e2e.test_checkpoint import latest, train_single

pytestmark = pytest.mark.processes  # one drafter rank at a time, synthetic data


def test_corrupt_or_truncated_latest_falls_back_to_the_previous_one_with_a_warning(tmp_path):
    code, _, err = train_single(tmp_path, 8)
    assert code == 0, err[-2000:]
    root = ckpt.checkpoints_dir(tmp_path)
    assert latest(tmp_path).name == "step-00000008" and (root / "step-00000004").is_dir()

    weights = root / "step-00000008" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF  # one flipped bit pattern inside a tensor
    weights.write_bytes(bytes(data))
    code, out, err = train_single(tmp_path, 12, resume=True)
    assert code == 0, err[-2000:]
    assert "step-00000008 is corrupt (model.safetensors: sha256 mismatch); falling back to step-00000004" in err
    assert [e for e in events(out) if e.get("event") == "resumed"][0]["step"] == 4
    assert latest(tmp_path).name == "step-00000012"

    opt = root / "step-00000012" / "optimizer.pt"
    opt.write_bytes(opt.read_bytes()[: opt.stat().st_size // 2])  # a write cut short
    code, out, err = train_single(tmp_path, 16, resume=True)
    assert code == 0, err[-2000:]
    assert "step-00000012 is corrupt (optimizer.pt has" in err and "(truncated?)" in err
    assert [e for e in events(out) if e.get("event") == "resumed"][0]["step"] == 8
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 17))  # the curve continues from the checkpoint used


def test_incompatible_checkpoint_is_refused_naming_the_fields(tmp_path):
    code, _, err = train_single(tmp_path, 4)
    assert code == 0, err[-2000:]
    code, _, err = train_single(tmp_path, 8, "target.layer_ids=[2]", "drafter.block_size=8", resume=True)
    assert code == 2, err[-2000:]
    assert "incompatible config" in err and "Traceback" not in err
    assert "model target_layer_ids: checkpoint [4], now [2]" in err and "model block_size: checkpoint 16, now 8" in err
    code, _, err = train_single(tmp_path, 8, "run.seed=5", resume=True)
    assert code == 2 and "run.seed: checkpoint 0, now 5" in err
    code, _, err = train_single(tmp_path, 8)  # fresh start over checkpoints
    assert code == 2 and "pass --resume" in err
    assert latest(tmp_path).name == "step-00000004"  # nothing was touched


def test_full_disk_keeps_the_previous_checkpoint_and_training_goes_on(tmp_path):
    code, _, err = train_single(tmp_path, 4)
    assert code == 0, err[-2000:]
    weights_bytes = (latest(tmp_path) / "model.safetensors").stat().st_size
    limit = weights_bytes // 3  # the OS refuses any file larger than this

    def small_files_only():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # EFBIG from the kernel (Python ignores SIGXFSZ)

    code, out, err = train_single(tmp_path, 12, resume=True, preexec_fn=small_files_only)
    assert code == 0, err[-3000:]
    assert "checkpoint at step 8 was not written" in err and "File too large" in err
    assert "the previous checkpoint step-00000004 is kept as latest; training goes on" in err
    assert "checkpoint at step 12 was not written" in err  # the final one failed the same way
    assert [e for e in events(out) if e.get("event") == "stopped"][0]["step"] == 12
    root = ckpt.checkpoints_dir(tmp_path)
    assert latest(tmp_path).name == "step-00000004" and ckpt.verify(root / "step-00000004")["step"] == 4
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000004"]  # no half-written dirs
    code, out, err = train_single(tmp_path, 12, resume=True)  # space again: resumes from step 4
    assert code == 0, err[-2000:]
    assert [e for e in events(out) if e.get("event") == "resumed"][0]["step"] == 4


# --- a disk that is really full (a small tmpfs) ----------------------------------------------------------


def test_checkpoints_on_a_filling_disk_warn_ahead_then_skip_with_the_space_needed(small_disk):
    run_dir = small_disk("1m") / "run"
    # the disk holds one checkpoint of the plain drafter (a Domino head would make it twice the size)
    code, out, err = train_single(run_dir, 12, 'drafter.objective="dflash"')
    assert code == 0, err[-3000:]
    root = ckpt.checkpoints_dir(run_dir)
    assert "disk almost full: " in err and f"GB free on {root}, a checkpoint needs about 0.001 GB" in err, err
    assert f"checkpoint at step 8 was not written (OSError: [Errno 28] no space left on {root}, need about" in err
    assert "the previous checkpoint step-00000004 is kept as latest; training goes on" in err
    assert "Traceback" not in err and "unexpected pos" not in err
    assert [e for e in events(out) if e.get("event") == "stopped"][0]["step"] == 12
    assert latest(run_dir).name == "step-00000004" and ckpt.verify(root / "step-00000004")["step"] == 4
