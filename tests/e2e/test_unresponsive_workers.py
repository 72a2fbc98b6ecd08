"""Frozen workers on the CPU demo, real processes: restarted (and only they), no port off loopback,
provenance in the ledger."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import subprocess
import tempfile
from pathlib import Path

import psutil
import pytest

from tests.e2e.test_launcher_demo import all_pids, assert_exactly_once, assert_no_worker_left, metrics, plumbing
from tests.launching import child_env, running, wait_for

pytestmark = pytest.mark.training


def open_ports_off_loopback(pids: list[int]) -> list[str]:
    """Listening tcp and bound udp sockets of these processes (and their children) on an address
    other than loopback: what another host could reach."""
    found = []
    for pid in pids:
        try:
            procs = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        for proc in procs:
            try:
                conns = proc.net_connections(kind="inet")
            except psutil.NoSuchProcess:
                continue
            for c in conns:
                listening = c.status == psutil.CONN_LISTEN or (c.type == 2 and not c.raddr)  # 2: SOCK_DGRAM
                if listening and not ipaddress.ip_address(c.laddr.ip.split("%")[0]).is_loopback:
                    found.append(f"pid {proc.pid} ({' '.join(proc.cmdline()[1:4])}) on {c.laddr.ip}:{c.laddr.port}")
    return found


def live_pids(run_dir: Path) -> list[int]:
    run = json.loads((run_dir / "run.json").read_text())
    return [w["pid"] for w in run["workers"] if w["pid"]]


def worker_pids(run_dir: Path, name: str) -> list[int]:
    run = json.loads((run_dir / "run.json").read_text())
    return next(w["pids_seen"] for w in run["workers"] if w["name"] == name)


def test_frozen_workers_are_restarted_alone_and_no_port_opens_off_loopback():
    """SIGSTOP freezes the health thread too. A frozen target is restarted (not the drafters waiting
    for it, although one of them sits in an all-reduce and reads as stalled); a frozen drafter takes
    its group down (a rank cannot rejoin), not the target. No worker listens off loopback, before or
    after the drafter group's rendezvous is made again."""
    with tempfile.TemporaryDirectory(prefix="h19", dir="/tmp") as folder:  # short: ipc paths < 108 bytes
        run_dir = Path(folder) / "run"
        log = Path(folder) / "out.txt"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                plumbing(
                    run_dir, "run.max_steps=200", "supervise.unresponsive_after_s=4", "supervise.stall_after_s=15"
                ),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=child_env(),
            )
        output = lambda: log.read_text()  # noqa: E731
        try:
            wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(metrics(run_dir)) >= 3, "training", proc)
            assert open_ports_off_loopback(live_pids(run_dir)) == []

            target = worker_pids(run_dir, "target-0")[0]
            os.kill(target, signal.SIGSTOP)
            wait_for(lambda: len(worker_pids(run_dir, "target-0")) == 2, "the frozen target's restart", proc, 90)
            assert re.search(
                r"target-0 unresponsive \(its pid lives, its health has not answered for \d+s\); "
                r"restarting",
                output(),
            ), output()[-3000:]
            assert not running(target)
            steps = len(metrics(run_dir))
            wait_for(lambda: len(metrics(run_dir)) > steps + 2, "training after the target's restart", proc)

            drafter = worker_pids(run_dir, "drafter-1")[0]
            os.kill(drafter, signal.SIGSTOP)
            wait_for(lambda: len(worker_pids(run_dir, "drafter-1")) == 2, "the frozen drafter's restart", proc, 90)
            assert "drafter-1 unresponsive" in output(), output()[-3000:]
            # the new group is ready: its rendezvous is made (a fresh one), gloo's pairs are up
            wait_for(
                lambda: '"event": "ready"' in (run_dir / "logs" / "drafter-0.log").read_text().split("=====")[-1],
                "the new drafter group",
                proc,
            )
            assert open_ports_off_loopback(live_pids(run_dir)) == []
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for pid in all_pids(run_dir):  # a stopped process ignores everything but SIGKILL
                try:
                    os.kill(pid, signal.SIGKILL) if psutil.Process(pid).status() == psutil.STATUS_STOPPED else None
                except (ProcessLookupError, psutil.NoSuchProcess):
                    pass
        text = output()
        assert proc.returncode == 0, text[-3000:]
        run = json.loads((run_dir / "run.json").read_text())
        assert run["restarts"] == {"target": 1, "drafter": 1}, text[-3000:]  # none for the healthy peers
        assert len(worker_pids(run_dir, "target-0")) == 2 and "drafter-0 stalled" not in text
        assert_exactly_once(run_dir)
        assert_no_worker_left(run_dir)

        # provenance: every line names the target incarnation that served it and the ids' digest
        from services.drafter.books.ledger import read_all

        entries = [e for e in read_all(run_dir) if e["tokens"]]  # an empty batch past the end has none
        incarnations = {e["incarnation"].split("-")[0] for e in entries}
        served_by = [str(p) for p in worker_pids(run_dir, "target-0")]
        assert incarnations <= set(served_by) and served_by[-1] in incarnations, incarnations  # the new target served
        assert all(re.fullmatch(r"[0-9a-f]{32}", e["digest"]) for e in entries)
