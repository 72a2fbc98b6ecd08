"""metrics.jsonl lines and real-acceptance lines as TensorBoard scalars and W&B history: the same
figures under the same names, at the optimizer step; `time` is the wall time, never a scalar. W&B
runs offline (WANDB_MODE=offline, a temporary WANDB_DIR); without the package, one clear error."""

import json
import struct
import sys
import time

import pytest

from services.drafter.books.metrics import MetricsLog
from services.run.config import ConfigError, load_config

TRAIN = {
    "step": 3,
    "loss": 4.5,
    "tau": 1.75,
    "accuracy": 0.25,
    "accuracy_per_position": [0.5, 0.25],
    "tokens_per_s": 1000.0,
    "window_tokens": 2000,
    "window_s": 2.0,
    "time": 1_700_000_000.5,
}
EVAL = {"step": 3, "eval": True, "loss": 4.75, "tau": 1.5, "batches": 2, "blocks": 8, "eval_s": 0.5}
CONTROL = {
    "prompts": 4,
    "steps": 40,
    "tokens": 40,
    "acceptance_per_step": 1.0,
    "acceptance_per_prompt": 1.0,
    "tokens_per_forward": 0.9,
    "lossless": 4,
    "seconds": 1.0,
}
SPEC = {
    "step": 3,
    "spec": True,
    "final": True,
    **CONTROL,
    "acceptance_per_step": 3.5,
    "acceptance_per_prompt": 3.75,
    "tokens_per_forward": 2.86,
    "lossless": 3,
    "repeat_last": CONTROL,
    "random": dict(CONTROL, lossless=4),
}
EXPECTED = {
    "train/loss": 4.5,
    "train/accuracy_pos1": 0.5,
    "train/accuracy_pos2": 0.25,
    "train/window_s": 2.0,
    "eval/tau": 1.5,
    "eval/eval_s": 0.5,
    "spec/acceptance_per_prompt": 3.75,
    "spec/acceptance_per_step": 3.5,
    "spec/tokens_per_forward": 2.86,
    "spec/lossless": 3,
    "spec/lossless_frac": 0.75,
    "spec/random/acceptance_per_prompt": 1.0,
    "spec/repeat_last/tokens_per_forward": 0.9,
}


def log_records(run_dir, **kwargs):
    metrics = MetricsLog(run_dir, resume_step=0, enabled=True, **kwargs)
    metrics.write(TRAIN)
    metrics.write(EVAL)
    metrics.plot("spec", SPEC)
    metrics.close()


def tensorboard_scalars(run_dir) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: events.Scalars(tag) for tag in events.Tags()["scalars"]}


def test_tensorboard_has_real_acceptance_and_its_controls_and_no_time_scalar(tmp_path):
    pytest.importorskip("tensorboard")
    log_records(tmp_path)
    scalars = tensorboard_scalars(tmp_path)
    for tag, value in EXPECTED.items():
        assert [(e.step, round(e.value, 4)) for e in scalars[tag]] == [(3, value)], tag
    assert not [tag for tag in scalars if tag.endswith(("/time", "/step", "/final", "/spec", "/eval"))]
    assert scalars["train/loss"][0].wall_time == TRAIN["time"]  # the line's clock is the x-axis wall time
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [3, 3]


def test_wandb_missing_is_one_clear_error_before_any_file(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ConfigError) as err:
        MetricsLog(tmp_path, resume_step=0, enabled=True, wandb_project="drafters")
    message = str(err.value)
    assert "\n" not in message and "log.wandb_project" in message and "dflash-service[wandb]" in message
    assert not (tmp_path / "metrics.jsonl").exists()
    MetricsLog(tmp_path, resume_step=0, enabled=False, wandb_project="drafters")  # other ranks: nothing to do


def test_wandb_project_is_a_checked_run_key():
    assert load_config(None, ["log.wandb_project=drafters"]).log.wandb_project == "drafters"
    assert load_config(None, []).log.wandb_project == ""
    with pytest.raises(ConfigError, match="wandb_projekt"):
        load_config(None, ["run.wandb_projekt=drafters"])


def wandb_history(path) -> list[dict]:
    """The history rows of an offline run file (a LevelDB-style log of wandb's protobuf Records)."""
    from wandb.proto import wandb_internal_pb2

    data, records, chunk = path.read_bytes(), [], b""
    assert data[:4] == b":W&B"
    pos, block = 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header: padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        if length == 0 and kind == 0:
            pos += block - pos % block
            continue
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            records.append(chunk)
            chunk = b""
    rows = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows


def test_wandb_offline_logs_what_tensorboard_logs_and_a_resume_continues_the_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb-dir").mkdir()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    log_records(run_dir, wandb_project="drafters", config={"run": {"name": "t"}})
    run_id = (run_dir / "wandb_id").read_text().strip()
    files = list((tmp_path / "wandb-dir" / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 1, list((tmp_path / "wandb-dir").rglob("*"))
    logged = {}
    rows, deadline = wandb_history(files[0]), time.monotonic() + 30
    while not rows and time.monotonic() < deadline:  # wandb's own service may still be writing it (a busy CI)
        time.sleep(0.5)
        rows = wandb_history(files[0])
    for row in rows:
        assert row["step"] == 3
        logged.update({k: v for k, v in row.items() if not k.startswith("_") and k != "step"})
    tb = {tag: events[0].value for tag, events in tensorboard_scalars(run_dir).items()}
    assert set(logged) == set(tb)
    assert all(logged[tag] == pytest.approx(tb[tag], rel=1e-6) for tag in tb)
    assert all(logged[tag] == pytest.approx(value) for tag, value in EXPECTED.items())

    MetricsLog(run_dir, resume_step=3, enabled=True, wandb_project="drafters").close()  # a resume: same W&B run
    assert (run_dir / "wandb_id").read_text().strip() == run_id
    assert len(list((tmp_path / "wandb-dir" / "wandb").glob(f"offline-run-*-{run_id}"))) >= 1
