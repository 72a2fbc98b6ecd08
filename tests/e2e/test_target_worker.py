"""The target worker as a real process: health states, info, batches over real ZMQ, errors, SIGTERM, and a
config error's exit code. What its core answers, target labels included: tests/unit/test_cores.py."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import msgpack
import pytest
import torch
import zmq
from transformers import AutoTokenizer

from services.net.batch_client import BatchArrived, BatchClient, BatchRefused, Event, InfoArrived
from services.net.endpoints import endpoint
from services.net.health_probe import probe
from services.process import log
from services.run.config import load_config
from services.target.batches.packing import Packing, open_or_build
from services.target.model.model import load_target
from tests.assets import random_demo
from tests.launching import REPO, target_argv

pytestmark = pytest.mark.processes

START_TIMEOUT_S = 90


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return random_demo()


def _start(run_dir: Path, overrides: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        target_argv(run_dir, *overrides), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _wait_state(proc, health_ep, states, timeout=START_TIMEOUT_S) -> dict:
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"target exited early: {proc.communicate()[1][-3000:]}"
        _, status, _ = probe(health_ep, timeout_s=1.0)
        if status:
            seen.append(status["state"])
            if status["state"] in states:
                return status
        time.sleep(0.1)
    raise AssertionError(f"no state in {states} within {timeout}s; saw {seen[-5:]}")


def _events(client: BatchClient, want: int, timeout=60.0) -> list[Event]:
    out, deadline = [], time.monotonic() + timeout
    while len(out) < want and time.monotonic() < deadline:
        out += client.poll(200)
    assert len(out) >= want, f"got {len(out)} of {want} replies"
    return out


def test_worker_serves_info_batches_errors_and_stops_on_sigterm(tmp_path, demo):
    data = tmp_path / "data.jsonl"
    data.write_text(Path(demo["data_path"]).read_text() + "{ a broken line\n")
    overrides = demo["overrides"] + [
        f"data.path={data}",
        "data.on_bad_sample=skip",
        "data.pack_len=256",
        "target.labels_from_target=false",
    ]  # the early-exit path
    cfg = load_config(None, overrides)
    run = tmp_path / "run"
    health_ep = endpoint(run, cfg.transport, "target", 0, "health")
    proc = _start(run, overrides)
    client = None
    try:
        status = _wait_state(proc, health_ep, ("ready",))
        assert status["bad_samples"] == 1 and status["role"] == "target" and status["gpu"] == "cpu"

        client = BatchClient([endpoint(run, cfg.transport, "target", 0, "data")], cfg.transport)
        client.request_info(0)
        (answer,) = _events(client, 1)
        assert isinstance(answer, InfoArrived) and answer.target == 0
        info = answer.info
        tokenizer = AutoTokenizer.from_pretrained(demo["model_path"])
        assert info["layer_ids"] == [2] and info["hidden_size"] == 128 and info["hidden_width"] == 128
        assert info["seq_len"] == 256 and info["mask_token_id"] == tokenizer.mask_token_id != -1
        assert info["num_batches"] > 2 and info["num_eval_batches"] >= 1 and info["bad_samples"] == 1
        assert info["vocab_size"] == 704 and info["model_path"] == demo["model_path"]

        # garbage on the data socket is counted and dropped; the worker keeps serving
        rogue = zmq.Context.instance().socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.connect(endpoint(run, cfg.transport, "target", 0, "data"))
        rogue.send_multipart([msgpack.packb({"kind": "request", "want": "everything"})])
        rogue.send(b"\x00not msgpack")

        total = info["num_batches"] * cfg.run.epochs
        for g in (0, 1, info["num_batches"] + 1):
            client.request(0, g)
        client.request(0, 0, "eval")
        client.request(0, total)  # one past the end
        events = _events(client, 5)
        batches = {(e.split, e.batch.g): e.batch for e in events if isinstance(e, BatchArrived)}
        errors = [e for e in events if isinstance(e, BatchRefused)]
        assert sorted(batches) == [("eval", 0), ("train", 0), ("train", 1), ("train", info["num_batches"] + 1)]
        assert len(errors) == 1 and errors[0].g == total and "out of range" in errors[0].message

        # the batches are what this process computes for the same g from the same cache
        data_local = open_or_build(Packing.from_config(cfg), run, tokenizer, info["vocab_size"], log=lambda _m: None)
        target = load_target(cfg.target, "cpu", cfg.drafter.num_layers)
        for (split, g), batch in batches.items():
            batch.validate(hidden_width=info["hidden_width"])
            assert batch.target_labels is None and batch.hidden.dtype == torch.bfloat16
            row = data_local.batch(g, split)
            for name, tensor in row.items():
                assert torch.equal(getattr(batch, name), tensor), name
            hidden, _ = target.capture(row["input_ids"], row["position_ids"], row["document_ids"])
            assert torch.equal(batch.hidden, hidden)

        status = _wait_state(proc, health_ep, ("training",))
        assert status["batches_served"] == 4 and status["step"] == 4
        assert status["samples_done"] == sum(int(b.document_ids.max()) + 1 for b in batches.values())
        assert status["tokens_per_s"] > 0 and status["bad_messages"] >= 2 and not status["stalled"]

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        ready, stopped = log.events(proc.stdout.read())
        assert ready["event"] == "ready" and ready["num_batches"] == info["num_batches"]
        assert stopped == {"event": "stopped", "rank": 0, "batches_served": 4}
    finally:
        if client:
            client.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    "bad, message",
    [
        ("target.model_path={missing}", "model directory not found: {missing}"),
        ("target.layer_ids=[1, 9]", "target.layer_ids [9] out of range: the target has 4 decoder layers"),
        ("target.no_such_key=1", "unknown key target.no_such_key"),
    ],
)
def test_a_config_error_is_exit_2_with_one_clear_line(tmp_path, demo, bad, message):
    """As in the drafter (test_drafter_process.py): exit 2, one line naming the error, no traceback."""
    missing = tmp_path / "missing-model"
    proc = _start(tmp_path / "run", demo["overrides"] + [bad.format(missing=missing)])
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err[-3000:]
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if " error " in line]
    assert line.split(" ", 3)[1:3] == ["target-0", "error"]
    assert " error config error: " in line and message.format(missing=missing) in line
