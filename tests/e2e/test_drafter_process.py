"""Real drafter processes: `python -m services.drafter --synthetic --device cpu`, gloo, cold compile cache."""

import json
import signal
import stat
import time

import psutil
import pytest

from services.net.endpoints import endpoint, socket_dir
from services.net.health_probe import probe
from services.process.log import events, parse_event
from services.run.config import TransportConfig
from tests.launching import free_port, spawn_drafter

SMALL = ["data.pack_len=256", "drafter.num_anchors=16", "optimizer.lr=3e-3", "optimizer.warmup_ratio=0.1"]


@pytest.mark.training
def test_three_ranks_cold_compile_train_in_lockstep(tmp_path):
    port = free_port()
    procs = [
        spawn_drafter(
            tmp_path,
            "--max-steps",
            "25",
            *SMALL,
            "drafter.num_layers=1",
            "kernels.compile=true",
            rank=r,
            world_size=3,
            port=port,
        )
        for r in range(3)
    ]
    # ranks on one host without a launcher (as systemd units run them): the group's store is rank 0's
    # ipc socket in the run's 0700 socket folder; nothing listens on MASTER_PORT
    store = socket_dir(tmp_path) / "drafter-store"
    deadline = time.monotonic() + 180
    while not store.exists() and time.monotonic() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.2)
    assert store.exists() and stat.S_IMODE(store.parent.stat().st_mode) == 0o700
    listening = set()
    for p in procs:
        try:
            listening |= {c.laddr.port for c in psutil.Process(p.pid).net_connections("tcp") if c.status == "LISTEN"}
        except psutil.NoSuchProcess:
            pass
    assert port not in listening, listening
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    assert any((tmp_path / "compile-cache").iterdir())  # the cache was built here, cold
    digests = set()
    for rank, (out, _) in enumerate(outs):
        (ready,) = events(out, "ready")
        (stopped,) = events(out, "stopped")
        steps = events(out, "step")
        assert ready["compile_s"] > 0 and stopped["recompiles"] == 0 and stopped["step"] == 25
        assert (ready["objective"], ready["precision"]) == ("domino", "bf16")  # the defaults, said in the log
        assert [m["g"] for m in steps] == [s * 3 + rank for s in range(25)]  # g = s*D + d
        assert sum(m["loss"] for m in steps[-5:]) < sum(m["loss"] for m in steps[:5]) - 1.0
        digests.add(stopped["params_digest"])
    assert len(digests) == 1  # identical parameters on all ranks


@pytest.mark.training
def test_two_domino_ranks_all_reduce_the_head_too(tmp_path):
    """drafter.objective = "domino": the head (prefix_gru, embed_proj) runs outside the DDP-wrapped forward,
    and its gradients are all-reduced all the same: both ranks end with identical parameters."""
    port, domino = free_port(), ['drafter.objective="domino"', "drafter.domino_emb_dim=16", "drafter.domino_gru_dim=24"]
    procs = [
        spawn_drafter(
            tmp_path,
            "--max-steps",
            "12",
            *SMALL,
            *domino,
            "drafter.num_layers=1",
            "kernels.compile=false",
            rank=r,
            world_size=2,
            port=port,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    stopped = [events(out, "stopped")[0] for out, _ in outs]
    assert [s["step"] for s in stopped] == [12, 12]
    assert stopped[0]["params_digest"] == stopped[1]["params_digest"]
    steps = events(outs[0][0], "step")
    assert all("base_tau" in m and 0.0 <= m["lambda_base"] <= 1.0 for m in steps)
    assert steps[-1]["lambda_base"] < steps[0]["lambda_base"]


@pytest.mark.processes
def test_health_while_training_then_sigterm_drains_and_exits_stopped(tmp_path):
    proc = spawn_drafter(tmp_path, "--max-steps", "100000", *SMALL, "kernels.compile=false", "log.every=1")
    try:
        for line in proc.stdout:  # wait for a trained step
            if (parse_event(line) or {}).get("event") == "step":
                break
        code, status, reason = probe(endpoint(tmp_path, TransportConfig(), "drafter", 0, "health"), 5.0)
        assert code == 0, reason
        assert status["state"] == "training" and status["role"] == "drafter" and status["step"] >= 1
        assert status["tokens_per_s"] > 0 and "loss" in status and "tau" in status and status["recompiles"] == 0
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 3, err[-3000:]  # exits.STOPPED: stopped before the end
    (stopped,) = events(out, "stopped")
    assert stopped["signal"] is True and 1 <= stopped["step"] < 100000
    # the anchors' reach is in the health status (the launcher's progress line) and in metrics.jsonl
    assert 0.8 < status["coverage"] <= 1.0
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines and all(0.8 < r["coverage"] <= 1.0 and 0 < r["sampled_coverage"] <= r["coverage"] for r in lines)


@pytest.mark.processes
def test_bad_config_fails_fast_with_a_named_error(tmp_path):
    start = time.monotonic()
    proc = spawn_drafter(tmp_path, "--max-steps", "1", *SMALL, "target.layer_ids=[1, 9]")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "target.layer_ids [9] out of range: the target has 8 decoder layers" in err
    assert "Traceback" not in err and time.monotonic() - start < 60
    proc = spawn_drafter(tmp_path, "--max-steps", "1", "data.pack_len=8", "drafter.num_anchors=16")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "drafter.num_anchors=16 is larger than data.pack_len=8" in err
