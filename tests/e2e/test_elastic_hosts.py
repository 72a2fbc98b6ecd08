"""A drafter group across two "hosts" on loopback, restarted as one by torch's elastic agents.

Three launchers: the target on 127.0.0.1, drafter ranks 0-1 on 127.0.0.2 (rank 0's host: the
rendezvous store, the ledger's rank 0, the checkpoints), ranks 2-3 on 127.0.0.3. Each "host" has its
own run folder, so the checkpoint a restart resumes from reaches ranks 2-3 over the gloo group.
"""

import json
import signal
import time
from collections import Counter

import psutil
import pytest

from services.config import load_config
from services.drafter.ledger import read_all
from services.endpoints import endpoint
from services.health import probe
from tests.launching import PLUMBING, free_ports, run_launcher, start_launcher

pytestmark = pytest.mark.training
TARGET, FIRST, SECOND = "127.0.0.1", "127.0.0.2", "127.0.0.3"
SPEC = f"0:target@{TARGET},0-1:drafter@{FIRST},2-3:drafter@{SECOND}"


def start(tmp_path, steps: int, rendezvous_s: int) -> dict:
    base_port = free_ports(1024 + 2, align=1024)  # the workers' 1 024 ports, then dist_port and dist_port + 1
    dist_port = base_port + 1024
    launchers = {}
    for host in (TARGET, FIRST, SECOND):
        launchers[host] = start_launcher(
            "up",
            "--demo",
            "--device",
            "cpu",
            "--gpus",
            SPEC,
            "--host",
            host,
            "--run-dir",
            tmp_path / host,
            f"transport.base_port={base_port}",
            f"transport.dist_port={dist_port}",
            *PLUMBING,
            "run.epochs=1",
            f"run.max_steps={steps}",
            "run.checkpoint_every=4",
            f"run.rendezvous_timeout_s={rendezvous_s}",
            "run.export_at_end=false",
        )
    return launchers


def drafter_pid(run_dir, rank: int) -> int | None:
    """The pid of drafter `rank` while it trains (its health, on its host), else None."""
    if not (run_dir / "config.json").exists():  # the launcher has not staged the run folder yet
        return None
    cfg = load_config(run_dir / "config.json")
    status = probe(endpoint(run_dir, cfg.transport, "drafter", rank, "health"), timeout_s=2)[1]
    return status["pid"] if status and status.get("state") == "training" else None


def wait(condition, what: str, launchers: dict, timeout_s: float = 400) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        for host, p in launchers.items():
            assert p.poll() is None, f"launcher {host} ended while waiting for {what}: {p.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def finish(launchers: dict, timeout_s: float = 400) -> dict[str, tuple[int, str]]:
    out = {}
    try:
        for host, p in launchers.items():
            text, _ = p.communicate(timeout=timeout_s)
            out[host] = (p.returncode, text)
    finally:
        for p in launchers.values():
            if p.poll() is None:
                kill_tree(p.pid)
    return out


def kill_tree(pid: int) -> None:
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def test_a_drafter_killed_on_the_second_host_restarts_the_whole_group_and_every_batch_trains_once(tmp_path):
    launchers = start(tmp_path, steps=40, rendezvous_s=120)
    first, second = tmp_path / FIRST, tmp_path / SECOND
    wait(lambda: (first / "checkpoints" / "latest").exists(), "a checkpoint", launchers)
    wait(lambda: drafter_pid(second, 2) is not None, "drafter-2 training", launchers)
    victim = drafter_pid(second, 2)
    assert victim is not None, "drafter-2 ended before it could be killed"
    psutil.Process(victim).send_signal(signal.SIGKILL)
    ended = finish(launchers)
    for host, (code, text) in ended.items():
        assert code == 0, f"{host}: {text[-3000:]}"
    for run_dir in (first, second):  # the agents restarted the group once, on both hosts
        elastic = json.loads((run_dir / "run.json").read_text())["elastic"]
        assert elastic["restarts"] >= 1 and elastic["state"] == "finished", elastic
    status = run_launcher("status", "--run-dir", first, "--json", "--timeout", "1")
    assert [a["restarts"] >= 1 for a in json.loads(status.stdout)["elastic"]] == [True], status.stdout
    # the second host shares no folder: the checkpoint it resumed from came from rank 0
    assert (second / "checkpoints" / "latest").is_dir()
    schedule = json.loads((first / "schedule.json").read_text())
    trained = Counter(e["g"] for run_dir in (first, second) for e in read_all(run_dir))
    assert sorted(trained) == list(range(schedule["total_batches"])) and max(trained.values()) == 1
    assert {e["rank"] for e in read_all(second)} == {2, 3}


def test_a_whole_drafter_host_killed_is_named_in_one_line_and_the_other_stops(tmp_path):
    launchers = start(tmp_path, steps=400, rendezvous_s=30)
    first, second = tmp_path / FIRST, tmp_path / SECOND
    wait(lambda: drafter_pid(second, 3) is not None and drafter_pid(first, 0) is not None, "training", launchers)
    kill_tree(launchers[SECOND].pid)  # its launcher, its agent and its workers
    launchers[SECOND].wait()
    code, text = finish({FIRST: launchers[FIRST]}, timeout_s=300)[FIRST]
    assert code == 1, text[-3000:]
    lines = [line for line in text.splitlines() if "run failed" in line]
    assert lines and f"drafter host {SECOND} is gone" in lines[0], text[-3000:]
    outcome = json.loads((first / "run.json").read_text())["outcome"]
    assert outcome["state"] == "failed" and SECOND in outcome["reason"]
    launchers[TARGET].send_signal(signal.SIGTERM)  # the target host would wait for the drafters a while longer
    assert finish({TARGET: launchers[TARGET]}, timeout_s=120)[TARGET][0] in (0, 3)


def test_a_stop_on_one_drafter_host_stops_the_group_on_every_host_with_a_checkpoint(tmp_path):
    launchers = start(tmp_path, steps=400, rendezvous_s=60)
    first, second = tmp_path / FIRST, tmp_path / SECOND
    wait(lambda: drafter_pid(second, 3) is not None and drafter_pid(first, 0) is not None, "training", launchers)
    launchers[SECOND].send_signal(signal.SIGTERM)  # what `launcher down` sends, on the second drafter host
    ended = finish(launchers, timeout_s=300)
    assert {host: code for host, (code, _) in ended.items()} == {TARGET: 3, FIRST: 3, SECOND: 3}, ended
    for run_dir in (first, second):
        assert json.loads((run_dir / "run.json").read_text())["elastic"]["state"] == "stopped"
    assert (first / "checkpoints" / "latest").is_dir()  # the final checkpoint, on rank 0's host
