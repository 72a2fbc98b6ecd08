"""services.process.health: a real responder in a real worker process, probed from outside."""

from __future__ import annotations

import os
import select
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from services.net.health_probe import EXIT_HEALTHY, EXIT_UNHEALTHY, EXIT_UNREACHABLE, probe
from services.process.health import HealthServer
from tests.launching import REPO, child_env

# A worker main loop: stamps progress every 50 ms until the stall file appears.
WORKER = """
import os, sys, time
from services.process.health import HealthServer
endpoint, stall_file = sys.argv[1], sys.argv[2]
health = HealthServer(endpoint, role="drafter", rank=1, gpu=3, stall_after_s=0.5)
health.set(state="training")
print("ready", flush=True)
step = 0
while True:
    if not os.path.exists(stall_file):
        step += 1
        health.progress(step=step, samples_done=4 * step, tokens_per_s=123.0)
    time.sleep(0.05)
"""


@pytest.fixture
def worker(tmp_path):
    sock_dir = tmp_path / "sock"
    sock_dir.mkdir(mode=0o700)
    endpoint = f"ipc://{sock_dir}/drafter-1.health"
    stall_file = tmp_path / "stall"
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, endpoint, str(stall_file)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    assert ready and proc.stdout.readline().strip() == "ready"
    yield proc, endpoint, stall_file
    proc.kill()
    proc.wait(10)


def _until(endpoint: str, condition, timeout_s: float = 10.0):
    """Probe until condition(code, status) holds; the last probe's (code, status, reason)."""
    deadline = time.monotonic() + timeout_s
    while True:
        code, status, reason = probe(endpoint, 3)
        if condition(code, status) or time.monotonic() > deadline:
            return code, status, reason
        time.sleep(0.05)


def test_healthy_worker_answers_with_its_status(worker):
    proc, endpoint, _ = worker
    code, status, reason = _until(endpoint, lambda c, s: c == EXIT_HEALTHY and s["step"] > 0)
    assert code == EXIT_HEALTHY, reason
    assert (status["role"], status["rank"], status["gpu"], status["pid"]) == ("drafter", 1, 3, proc.pid)
    assert status["state"] == "training" and status["stalled"] is False
    assert status["step"] > 0 and status["samples_done"] == 4 * status["step"]
    assert 0 <= status["last_progress_age_s"] <= 0.5  # healthy: not past stall_after_s
    assert status["rss_bytes"] > 0 and status["bad_messages"] == 0
    socket_file = endpoint[len("ipc://") :]
    assert stat.S_IMODE(os.stat(socket_file).st_mode) == 0o600


def test_stalled_main_loop_reads_as_unhealthy_although_the_responder_answers(worker):
    _, endpoint, stall_file = worker
    assert _until(endpoint, lambda c, s: c == EXIT_HEALTHY)[0] == EXIT_HEALTHY
    stall_file.touch()
    code, status, reason = _until(endpoint, lambda c, s: c == EXIT_UNHEALTHY)
    assert code == EXIT_UNHEALTHY and "stalled" in reason
    assert status["stalled"] is True and status["last_progress_age_s"] > 0.5
    stall_file.unlink()  # the loop recovers: healthy again
    assert _until(endpoint, lambda c, s: c == EXIT_HEALTHY)[0] == EXIT_HEALTHY


def test_killed_worker_is_unreachable_within_the_timeout(worker):
    proc, endpoint, _ = worker
    proc.kill()
    proc.wait(10)
    start = time.monotonic()
    code, status, reason = probe(endpoint, 1.0)
    assert code == EXIT_UNREACHABLE and status is None and "no answer" in reason
    assert time.monotonic() - start < 1.5


def test_garbage_is_counted_and_the_responder_keeps_answering(worker):
    proc, endpoint, _ = worker
    ctx = zmq.Context()
    try:
        garbage = [
            b"\xc1\xc1",
            msgpack.packb([1, 2, 3]),
            msgpack.packb({"op": "shutdown"}),
            msgpack.packb({"op": "status", "x": b"\x00" * 10}),
        ]
        for payload in garbage:  # REQ: each gets an error answer
            req = ctx.socket(zmq.REQ)
            req.setsockopt(zmq.LINGER, 0)
            req.connect(endpoint)
            req.send(payload)
            assert req.poll(3000), "responder stopped answering"
            assert "error" in msgpack.unpackb(req.recv())
            req.close()
        dealer = ctx.socket(zmq.DEALER)  # too many frames
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        dealer.send_multipart([b"", b"a", b"b", msgpack.packb({"op": "status"})])
        big = ctx.socket(zmq.DEALER)  # over MAX_REQUEST_BYTES: ZMQ itself drops this peer
        big.setsockopt(zmq.LINGER, 0)
        big.connect(endpoint)
        big.send(b"\x00" * 100_000)
        time.sleep(0.3)
        code, status, reason = probe(endpoint, 3)
        assert code == EXIT_HEALTHY, reason
        assert status["bad_messages"] == len(garbage) + 1
        assert status["bad_message_kinds"] == {"health-request": len(garbage) + 1}
        assert proc.poll() is None
        dealer.close()
        big.close()
    finally:
        ctx.term()


def test_probe_of_a_closed_tcp_port_returns_2_within_the_timeout():
    start = time.monotonic()
    code, status, reason = probe("tcp://127.0.0.1:9", 1.0)
    assert code == EXIT_UNREACHABLE and status is None
    assert time.monotonic() - start < 1.5


def test_probe_of_a_bad_endpoint_returns_2():
    code, _, reason = probe("nonsense://x", 1.0)
    assert code == EXIT_UNREACHABLE and reason


@pytest.mark.parametrize(
    "answer",
    [
        b"\xc1",
        msgpack.packb([1]),
        msgpack.packb({"state": "dancing"}),
        msgpack.packb({"state": "ready", "stalled": True}),
    ],
)
def test_probe_of_a_garbage_answer_returns_2(answer):
    code, status, reason = probe_answered_with(answer)
    assert code == EXIT_UNREACHABLE and status is None and "garbage" in reason


def probe_answered_with(answer: bytes) -> tuple[int, dict | None, str]:
    """probe() of a real socket that answers `answer`, whatever it is."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def answer_once():
        if router.poll(3000):
            identity, empty, _ = router.recv_multipart()
            router.send_multipart([identity, empty, answer])

    thread = threading.Thread(target=answer_once)
    thread.start()
    try:
        return probe(f"tcp://127.0.0.1:{port}", 2.0)
    finally:
        thread.join()
        router.close()
        ctx.term()


@pytest.mark.parametrize(
    "field, value",
    [("step", "3"), ("last_progress_age_s", None), ("errors", [7]), ("window", [1]), ("total_steps", 2.5)],
)
def test_a_status_with_one_field_of_the_wrong_type_is_garbage_and_names_it(tmp_path, field, value):
    """A real worker's status with one field the launcher reads changed to the wrong type: probe says
    garbage (exit 2) naming the field, instead of handing it to the launcher's arithmetic."""
    health = HealthServer(f"ipc://{tmp_path}/w.health", role="drafter", rank=0, gpu=0)
    try:
        health.progress(state="training", step=3, total_steps=10, window={"loss": 1.0})
        answer = msgpack.packb({**health.snapshot(), field: value})
    finally:
        health.close()
    code, status, reason = probe_answered_with(answer)
    assert code == EXIT_UNREACHABLE and status is None and f"status field {field!r}" in reason, reason


def test_failed_state_and_odd_fields(tmp_path):
    """In-process responder: a failed worker is unhealthy; a non-msgpack field does not kill it."""
    health = HealthServer(f"ipc://{tmp_path}/w.health", role="target", rank=0, gpu=0)
    try:
        health.set(state="ready", checkpoint=Path("/runs/x"), odd=object())
        code, status, _ = probe(health.endpoint, 3)
        assert code == EXIT_HEALTHY and status["checkpoint"] == "/runs/x"
        health.set(state="failed")
        health.error("CUDA out of memory")
        code, status, reason = probe(health.endpoint, 3)
        assert code == EXIT_UNHEALTHY and "failed" in reason and status["errors"] == ["CUDA out of memory"]
        with pytest.raises(ValueError):
            health.set(state="sleeping")
    finally:
        health.close()
