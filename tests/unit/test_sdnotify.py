"""sd_notify: a real datagram NOTIFY_SOCKET, a real worker-like subprocess, the messages checked."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from services.process import sdnotify
from services.process.sdnotify import Notifier
from tests.launching import child_env

# A stand-in for a worker's main loop, using the real Notifier: load, ready, train, stall, stop.
WORKER = textwrap.dedent("""
    import json, sys, time
    from services.process.sdnotify import Notifier

    n = Notifier(status_every_s=0.0)
    n.status("loading model")
    n.watchdog()                      # before READY: must not be sent
    time.sleep(0.05)
    n.ready("warm, 3 buckets compiled")
    start = time.monotonic()
    calls = 40
    for step in range(calls):
        time.sleep(0.01)
        n.progress(step, 2048.0)
    elapsed = time.monotonic() - start
    n.status("stalled on purpose")
    time.sleep(n.watchdog_s * 1.2)    # no progress: no WATCHDOG=1 may go out
    n.extend(30, "checkpoint")
    n.stopping()
    print(json.dumps({"elapsed": elapsed, "calls": calls, "watchdog_s": n.watchdog_s}))
""")


def _listen(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.2)
    return sock


def _drain(sock: socket.socket, until=lambda: False, max_s: float = 30.0) -> list[str]:
    """Collect datagrams while `until()` is false, then whatever is still queued."""
    messages, deadline = [], time.monotonic() + max_s
    while time.monotonic() < deadline:
        try:
            messages.append(sock.recv(4096).decode())
        except socket.timeout:
            if until():
                break
    return messages


@pytest.mark.processes
def test_worker_subprocess_messages(tmp_path):
    path = str(tmp_path / "notify.sock")
    sock = _listen(path)
    env = child_env(NOTIFY_SOCKET=path, WATCHDOG_USEC="400000")
    env.pop("WATCHDOG_PID", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    messages = _drain(sock, until=lambda: proc.poll() is not None)
    out, err = proc.communicate(timeout=30)
    sock.close()
    assert proc.returncode == 0, err
    facts = json.loads(out)
    assert facts["watchdog_s"] == pytest.approx(0.4)

    assert messages[0] == "STATUS=loading model"
    # READY=1 is the next message: the watchdog() before it was held back.
    assert messages[1] == "READY=1\nSTATUS=warm, 3 buckets compiled"
    assert sum("READY=1" in m for m in messages) == 1
    assert "STATUS=step 0, 2,048 tok/s" in messages
    assert "STATUS=step 39, 2,048 tok/s" in messages

    pings = messages.count("WATCHDOG=1")
    gap = facts["watchdog_s"] / 4
    assert 1 <= pings <= facts["elapsed"] / gap + 1, (pings, facts)
    assert pings < facts["calls"]  # rate-limited, not one per step

    stall = messages.index("STATUS=stalled on purpose")
    assert "WATCHDOG=1" not in messages[stall:]  # no progress, no ping
    assert "EXTEND_TIMEOUT_USEC=30000000\nSTATUS=checkpoint" in messages[stall:]
    assert messages[-1] == "STOPPING=1\nSTATUS=stopping"


def test_abstract_socket_name():
    name = f"dflash-sdnotify-test-{os.getpid()}"
    sock = _listen("\0" + name)
    try:
        n = Notifier(env={"NOTIFY_SOCKET": "@" + name})
        assert n.enabled and n.watchdog_s is None  # no WATCHDOG_USEC: no pings at all
        assert n.ready("up")
        assert not n.ready("again")  # READY=1 once only
        assert not n.watchdog()
        assert n.stopping("bye")
        n.close()
        assert _drain(sock, until=lambda: True, max_s=2) == ["READY=1\nSTATUS=up", "STOPPING=1\nSTATUS=bye"]
    finally:
        sock.close()


def test_module_helpers_send_plain_messages(tmp_path):
    path = str(tmp_path / "n.sock")
    sock = _listen(path)
    env = {"NOTIFY_SOCKET": path}
    assert sdnotify.status("multi\nline   text", env=env)
    assert sdnotify.watchdog(env=env)
    assert sdnotify.ready(env=env)
    assert sdnotify.stopping(env=env)
    got = _drain(sock, until=lambda: True, max_s=2)
    sock.close()
    # A newline inside STATUS would start a new KEY=VALUE line: it is folded to one line.
    assert got == ["STATUS=multi line text", "WATCHDOG=1", "READY=1", "STOPPING=1"]


def test_no_socket_is_a_quiet_no_op(tmp_path):
    assert sdnotify.notify("READY=1", env={}) is False
    n = Notifier(env={})
    assert not n.enabled and not n.ready() and not n.watchdog() and not n.stopping()
    # A socket path that does not exist (the unit's manager went away): False, no exception.
    assert sdnotify.notify("READY=1", env={"NOTIFY_SOCKET": str(tmp_path / "gone.sock")}) is False
    assert sdnotify.notify("READY=1", env={"NOTIFY_SOCKET": "vsock:2:1234"}) is False


def test_watchdog_interval_follows_systemd_rules():
    me = str(os.getpid())
    assert sdnotify.watchdog_interval_s({"WATCHDOG_USEC": "1500000"}) == 1.5
    assert sdnotify.watchdog_interval_s({"WATCHDOG_USEC": "1500000", "WATCHDOG_PID": me}) == 1.5
    # Inherited from a parent unit: the pid is not ours, so this process must not ping.
    assert sdnotify.watchdog_interval_s({"WATCHDOG_USEC": "1500000", "WATCHDOG_PID": str(os.getppid())}) is None
    assert sdnotify.watchdog_interval_s({"WATCHDOG_USEC": "0"}) is None
    assert sdnotify.watchdog_interval_s({"WATCHDOG_USEC": "soon"}) is None
    assert sdnotify.watchdog_interval_s({}) is None
