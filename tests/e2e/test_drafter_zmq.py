"""Drafters trained over real ZMQ by a real target process (the tiny demo model on CPU): how long a run
trains (the plan) and the split's end when the drafter count does not divide it."""

import json
import signal
import subprocess
import time
from collections import Counter

import pytest

from services.drafter.books.ledger import read_all
from services.net.endpoints import endpoint
from services.net.health_probe import probe
from services.process.log import events
from services.run.config import load_config
from tests.assets import random_demo
from tests.launching import PLUMBING, REPO, free_port, spawn_drafter, target_argv

DRAFTERS = 2
# 100 demo conversations at pack_len 256, 30% held out: 15 train batches and 7 eval batches, both odd;
# no real-acceptance pass (the demo's 8 held-out prompts x 64 tokens, 3 times, ran past the drafters'
# 300 s on a loaded 2-core machine; these tests check the plan and the split)
SMALL = [
    *PLUMBING,
    "data.pack_len=256",
    "data.eval_fraction=0.3",
    "run.epochs=1",
    "drafter.num_anchors=16",
    "log.every=1",
    "checkpoint.every=0",
    "checkpoint.export_at_end=false",
]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return random_demo(100)  # transport only


def train_over_zmq(run_dir, overrides: list[str]) -> list[dict]:
    """One target and DRAFTERS drafter ranks until the drafters finish; each rank's "stopped" line."""
    target = subprocess.Popen(
        target_argv(run_dir, *overrides),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    port = free_port()
    drafters = [
        spawn_drafter(
            run_dir, "--num-targets", "1", *overrides, rank=r, world_size=DRAFTERS, port=port, synthetic=False
        )
        for r in range(DRAFTERS)
    ]
    try:
        outs = [p.communicate(timeout=300) for p in drafters]
    finally:
        for p in drafters:
            p.kill()
        target.send_signal(signal.SIGTERM)
        target.communicate(timeout=60)
    stopped = []
    for p, (out, err) in zip(drafters, outs):
        assert p.returncode == 0, err[-3000:]
        stopped += events(out, "stopped")
    assert len(stopped) == DRAFTERS
    return stopped


def metrics(run_dir, evals: bool) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if bool(r.get("eval")) == evals]


@pytest.mark.training
@pytest.mark.untimed  # steps, batches and the ledger
def test_grad_accum_with_max_steps_trains_max_steps_optimizer_steps(tmp_path, demo):
    stopped = train_over_zmq(tmp_path, demo["overrides"] + SMALL + ["optimizer.grad_accum=2", "run.max_steps=3"])
    assert [(m["step"], m["micro_step"], m["signal"]) for m in stopped] == [(3, 6, False)] * DRAFTERS
    schedule = json.loads((tmp_path / "schedule.json").read_text())
    assert schedule["batches_per_epoch"] == 15  # more than the 12 batches that 3 steps take
    assert (schedule["optimizer_steps"], schedule["micro_batches"], schedule["total_batches"]) == (3, 6, 12)
    ledger = read_all(tmp_path)
    assert Counter(e["g"] for e in ledger) == Counter(range(12))  # 3 steps x 2 micro-batches x 2 ranks
    assert sorted((e["rank"], e["step"], e["g"]) for e in ledger) == [
        (r, s, s * DRAFTERS + r) for r in range(DRAFTERS) for s in range(6)
    ]
    assert [m["step"] for m in metrics(tmp_path, evals=False)] == [1, 2, 3]


@pytest.mark.training
@pytest.mark.untimed
def test_target_labels_with_a_split_the_drafters_do_not_divide(tmp_path, demo):
    """15 train and 7 eval batches on 2 drafters: rank 1 pads each split's end with an empty batch,
    which must carry target labels too."""
    stopped = train_over_zmq(tmp_path, demo["overrides"] + SMALL + ["target.labels_from_target=true", "eval.every=4"])
    assert [(m["step"], m["signal"]) for m in stopped] == [(8, False)] * DRAFTERS
    schedule = json.loads((tmp_path / "schedule.json").read_text())
    assert (schedule["batches_per_epoch"], schedule["micro_batches"], schedule["total_batches"]) == (15, 8, 15)
    ledger = read_all(tmp_path)
    real = Counter(e["g"] for e in ledger if e["g"] < 15)
    assert real == Counter(range(15))  # every batch once
    assert [(e["rank"], e["g"], e["tokens"]) for e in ledger if e["g"] >= 15] == [(1, 15, 0)]  # the padding
    evals = metrics(tmp_path, evals=True)
    assert [e["step"] for e in evals] == [4, 8] and all(e["batches"] == 7 for e in evals)  # 7 real of 8 evaluated
    assert len(metrics(tmp_path, evals=False)) == 8


@pytest.mark.processes  # it stops at the handshake: nothing trains
def test_a_drafter_whose_config_disagrees_with_its_target_refuses_to_train(tmp_path, demo):
    """The handshake: the target packs rows of 256 tokens, the drafter was told 128. It stops at
    connect with exit 2 naming the field and both values, before training on anything."""
    target = subprocess.Popen(
        target_argv(tmp_path, *demo["overrides"], *SMALL),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    drafter = spawn_drafter(
        tmp_path, "--num-targets", "1", *demo["overrides"], *SMALL, "data.pack_len=128", synthetic=False
    )
    try:
        out, err = drafter.communicate(timeout=300)
    finally:
        drafter.kill()
        target.send_signal(signal.SIGTERM)
        target.communicate(timeout=60)
    assert drafter.returncode == 2, err[-2000:]
    assert "disagree on seq_len: target 256, drafter 128" in err and "config_digest: target" in err
    assert not (tmp_path / "ledger").exists() or not read_all(tmp_path)


@pytest.mark.processes  # a drafter alone, stopped before it trains
def test_a_drafter_stopped_while_it_waits_for_its_target_exits_stopped(tmp_path, demo):
    """No target yet: the drafter waits for target 0's info. A stop then is a stop before the end of
    training too: exit 3 (exits.STOPPED), not the 0 that the launcher reads as a finished run."""
    overrides = [*demo["overrides"], *SMALL]
    drafter = spawn_drafter(tmp_path, "--num-targets", "1", *overrides, synthetic=False)
    health = endpoint(tmp_path, load_config(None, overrides).transport, "drafter", 0, "health")
    try:
        deadline = time.monotonic() + 300
        while (probe(health, 1.0)[1] or {}).get("waiting_for") != "target info":
            assert time.monotonic() < deadline and drafter.poll() is None, drafter.stderr.read()[-2000:]
            time.sleep(0.2)
        drafter.send_signal(signal.SIGTERM)
        out, err = drafter.communicate(timeout=60)
    finally:
        drafter.kill()
    assert drafter.returncode == 3, err[-2000:]
    assert "SIGTERM: finishing the current step" in err and "Traceback" not in err, err[-2000:]
    assert not events(out, "stopped") and not (tmp_path / "export").exists()  # nothing trained, nothing exported
