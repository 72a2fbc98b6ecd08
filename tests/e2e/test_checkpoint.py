"""Checkpoints with real drafter processes (synthetic data, gloo on CPU): exact resume after SIGKILL
and after SIGTERM. Faults (corrupt, incompatible, full disk): test_checkpoint_faults.py; the on-disk
rules (atomic writes, rotation, pointers, verification), in process: tests/unit/test_checkpoint_files.py."""

import json
import signal
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from services.drafter.books.ledger import read_all
from services.drafter.checkpoints import checkpoint as ckpt
from services.process.log import events, parse_event
from tests.launching import free_port, spawn_drafter

SMALL = [
    "data.pack_len=256",
    "drafter.num_anchors=16",
    "drafter.num_layers=1",
    "kernels.compile=false",
    "optimizer.lr=3e-3",
    "optimizer.warmup_ratio=0.1",
    "log.every=1",
]


def run_ranks(run_dir, *args, world_size=2, timeout=180):
    port = free_port()
    procs = [spawn_drafter(run_dir, *args, rank=r, world_size=world_size, port=port) for r in range(world_size)]
    outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return outs


def latest(run_dir) -> Path:
    return ckpt.pointer(ckpt.checkpoints_dir(run_dir), ckpt.LATEST)


def assert_same_training_state(a: Path, b: Path):
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)  # bit for bit
    oa = torch.load(a / "optimizer.pt", weights_only=True)["optimizer"]["state"]
    ob = torch.load(b / "optimizer.pt", weights_only=True)["optimizer"]["state"]
    assert oa.keys() == ob.keys()
    assert all(torch.equal(oa[i][k], ob[i][k]) for i in oa for k in oa[i])


@pytest.mark.parametrize(
    "world_size, grad_accum",
    [
        pytest.param(2, 1, marks=[pytest.mark.training, pytest.mark.untimed]),  # 2 gloo ranks
        pytest.param(1, 2, marks=pytest.mark.processes),
    ],
)
def test_resume_after_sigkill_equals_uninterrupted_training_bit_for_bit(tmp_path, world_size, grad_accum):
    N, K = 24, 4
    args = ["--max-steps", str(N), *SMALL, f"checkpoint.every={K}", f"optimizer.grad_accum={grad_accum}"]
    straight = tmp_path / "straight"
    outs = run_ranks(straight, *args, world_size=world_size)
    final = [e for e in events(outs[0][0]) if e.get("event") == "stopped"][0]
    assert final["step"] == N

    broken = tmp_path / "broken"
    port = free_port()
    procs = [spawn_drafter(broken, *args, rank=r, world_size=world_size, port=port) for r in range(world_size)]
    saved = False
    for line in procs[0].stdout:  # wait for checkpoint K, then two more steps
        e = parse_event(line) or {}
        saved = saved or (e.get("event") == "checkpoint" and e["step"] == K)
        if saved and e.get("event") == "step" and e["step"] >= K + 2:
            break
    for p in procs:
        p.kill()
        p.communicate(timeout=30)
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * world_size
    killed_at = ckpt.step_of(latest(broken))
    assert K <= killed_at < N  # it died mid-run, with steps after its last checkpoint

    outs = run_ranks(broken, "--resume", *args, world_size=world_size)
    resumed = [e for e in events(outs[0][0]) if e.get("event") == "resumed"][0]
    assert resumed["step"] == killed_at and resumed["checkpoint"].endswith(ckpt.step_name(killed_at))
    assert [e for e in events(outs[0][0]) if e.get("event") == "stopped"][0]["params_digest"] == final["params_digest"]
    assert ckpt.step_of(latest(broken)) == N
    assert_same_training_state(latest(straight), latest(broken))

    # every batch exactly once over the whole (interrupted) run; the metrics curve has no repeats
    entries = read_all(broken)
    assert Counter(e["g"] for e in entries) == Counter(range(world_size * grad_accum * N))
    steps = [json.loads(line)["step"] for line in (broken / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, N + 1))
    # the export at the end is the same drafter, in bf16
    ea, eb = (
        load_file(str(straight / "export" / "model.safetensors")),
        load_file(str(broken / "export" / "model.safetensors")),
    )
    assert all(torch.equal(ea[k], eb[k]) and ea[k].dtype == torch.bfloat16 for k in ea)


def train_single(run_dir, steps, *extra, resume=False, preexec_fn=None):
    proc = spawn_drafter(
        run_dir,
        *(["--resume"] if resume else []),
        "--max-steps",
        str(steps),
        *SMALL,
        "checkpoint.every=4",
        *extra,
        preexec_fn=preexec_fn,
    )
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


@pytest.mark.processes  # one drafter rank at a time, synthetic data
def test_resume_without_checkpoints_starts_fresh(tmp_path):
    code, out, err = train_single(tmp_path, 3, resume=True)
    assert code == 0, err[-2000:]
    assert not [e for e in events(out) if e.get("event") == "resumed"]
    assert [e for e in events(out) if e.get("event") == "stopped"][0]["step"] == 3


@pytest.mark.processes  # one drafter rank at a time, synthetic data
def test_sigterm_checkpoints_the_step_in_hand_and_resume_continues_from_it(tmp_path):
    proc = spawn_drafter(tmp_path, "--max-steps", "100000", *SMALL, "checkpoint.every=1000")
    for line in proc.stdout:
        e = parse_event(line) or {}
        if e.get("event") == "step" and e["step"] >= 3:
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err[-2000:]  # exits.STOPPED: before the end
    stopped = [e for e in events(out) if e.get("event") == "stopped"][0]
    assert stopped["signal"] is True and latest(tmp_path).name == ckpt.step_name(stopped["step"])
    assert not (tmp_path / "export").exists()  # stopped, not finished: no export
    code, out, err = train_single(tmp_path, stopped["step"] + 2, resume=True)
    assert code == 0, err[-2000:]
    assert [e for e in events(out) if e.get("event") == "resumed"][0]["step"] == stopped["step"]
    assert (tmp_path / "export" / "config.json").is_file()
    assert Counter(e["g"] for e in read_all(tmp_path)) == Counter(range(stopped["step"] + 2))


# --- the on-disk rules, in-process ------------------------------------------------------------------
