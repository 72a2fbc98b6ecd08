"""Two launchers as two hosts on loopback (127.0.0.1 and 127.0.0.2): targets on one, drafters on
the other, ZMQ over tcp with CURVE keys, torch.distributed rendezvous on the drafter host.
A third party without the key gets nothing from the target.
"""

import json
import subprocess
import time
from collections import Counter

import pytest
import zmq

from services.drafter.books.ledger import read_all
from services.net import wire
from services.net.endpoints import endpoint
from services.run.config import load_config
from tests.launching import PLUMBING, free_ports, launcher_argv, run_launcher

TARGET_HOST, DRAFTER_HOST = "127.0.0.1", "127.0.0.2"
SPEC = f"0:target@{TARGET_HOST},0:drafter@{DRAFTER_HOST}"


def up(run_dir, host, keys, base_port, dist_port):
    return launcher_argv(
        "up",
        "--demo",
        "--device",
        "cpu",
        "--gpus",
        SPEC,
        "--host",
        host,
        "--run-dir",
        str(run_dir),
        f'transport.curve_keys_dir="{keys}"',
        f"transport.base_port={base_port}",
        f"transport.dist_port={dist_port}",
        *PLUMBING,
        "run.epochs=1",
        "run.max_steps=150",  # on long enough for the checks below while it trains
    )


@pytest.mark.training
def test_run_across_two_hosts_with_curve(tmp_path):
    keys = tmp_path / "keys"
    assert subprocess.run(launcher_argv("keys", str(keys)), capture_output=True).returncode == 0
    base_port = free_ports(1024 + 2, align=1024)  # the workers' 1 024 ports, then dist_port and dist_port + 1
    dist_port = base_port + 1024
    target_run, drafter_run = tmp_path / "host-a", tmp_path / "host-b"
    host_a = subprocess.Popen(
        up(target_run, TARGET_HOST, keys, base_port, dist_port),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    host_b = subprocess.Popen(
        up(drafter_run, DRAFTER_HOST, keys, base_port, dist_port),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not (drafter_run / "metrics.jsonl").exists():
            assert time.monotonic() < deadline, "training never started across the hosts"
            assert host_a.poll() is None and host_b.poll() is None, (host_a.stdout.read(), host_b.stdout.read())
            time.sleep(0.5)
        cfg = load_config(target_run / "config.json")
        data_ep = endpoint(target_run, cfg.transport, "target", 0, "data")
        health_ep = endpoint(target_run, cfg.transport, "target", 0, "health")
        assert data_ep.startswith(f"tcp://{TARGET_HOST}:")

        # a third party without the key: no answer from the data socket, none from health
        ctx = zmq.Context()
        intruder = ctx.socket(zmq.DEALER)
        intruder.setsockopt(zmq.LINGER, 0)
        intruder.connect(data_ep)
        intruder.send_multipart(wire.encode({"kind": "request", "want": "info"}))
        assert intruder.poll(3000) == 0, "the target answered a client without the CURVE key"
        intruder.close()
        ctx.term()
        probe = launcher_argv("probe", health_ep, "--timeout", "2")
        assert subprocess.run(probe, capture_output=True).returncode == 2
        assert subprocess.run(probe + ["--keys", str(keys)], capture_output=True).returncode == 0

        out_b, _ = host_b.communicate(timeout=600)
        out_a, _ = host_a.communicate(timeout=120)
    finally:
        for p in (host_a, host_b):
            if p.poll() is None:
                p.kill()
    assert host_b.returncode == 0, out_b[-3000:]
    assert host_a.returncode == 0, out_a[-3000:]
    run_a = json.loads((target_run / "run.json").read_text())
    assert [w["name"] for w in run_a["workers"] if w["pid"]] == ["target-0"]  # each host starts its own
    schedule = json.loads((drafter_run / "schedule.json").read_text())
    trained = Counter(e["g"] for e in read_all(drafter_run))
    assert sorted(trained) == list(range(schedule["total_batches"])) and schedule["optimizer_steps"] == 150
    assert max(trained.values()) == 1


@pytest.mark.processes
def test_host_must_be_named():
    out = run_launcher("up", "--device", "cpu", "--gpus", SPEC)
    assert out.returncode == 2 and "--host" in out.stderr and "Traceback" not in out.stderr
