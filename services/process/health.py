"""Health: a responder thread each worker runs, the probe client the launcher uses, and Drops,
which counts the bad messages a worker drops and reports them here.

The responder owns its own ZMQ socket on its own thread, so it answers while the main loop
works. The main loop stamps progress; if it stops stamping for longer than `stall_after_s`
the status says so (`stalled: true`), although the responder itself still answers.

Requests and answers are msgpack maps. Nothing here unpickles. Garbage is counted
(`bad_messages`) and answered with an error map; it never stops the responder.
This module must not import torch: the launcher uses the probe.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import msgpack
import psutil
import zmq

from services import __version__
from services.net import curve
from services.net.message_fields import read_fields, rule
from services.net.sockets import bind_private, secure_socket
from services.process.sdnotify import Notifier

log = logging.getLogger(__name__)

STATES = ("starting", "loading", "compiling", "ready", "training", "draining", "stopped", "failed")
STARTUP_STATES = ("starting", "loading", "compiling")  # model loads and cold compiles take minutes
MAX_REQUEST_BYTES = 4096

EXIT_HEALTHY, EXIT_UNHEALTHY, EXIT_UNREACHABLE = 0, 1, 2


COUNT = rule(low=0)
ABSENT = rule(absent=None)  # a field only some roles or states report


@dataclass(frozen=True)
class Status:
    """The fields of a status answer that the launcher and the drafters read, typed: probe() checks each
    one (message_fields.read_fields) before anyone reads it, so an answer with a field of the wrong
    type is garbage (exit 2) rather than a crash in the reader's arithmetic. Other fields a worker adds
    pass through unchecked."""

    state: str = field(metadata=rule(choices=STATES))
    pid: int = field(metadata=COUNT)
    step: int = field(metadata=COUNT)
    samples_done: int = field(metadata=COUNT)
    tokens_per_s: float
    stalled: bool
    last_progress_age_s: float
    stall_after_s: float
    bad_messages: int = field(metadata=COUNT)
    bad_message_kinds: dict
    bad_message_from: dict
    errors: list[str]
    rss_bytes: int = field(metadata=COUNT)
    gpu_mem_bytes: int = field(metadata=COUNT)
    total_steps: int | None = field(metadata=ABSENT)
    batches_served: int | None = field(metadata=ABSENT)
    train_s: float | None = field(metadata=ABSENT)
    window: dict | None = field(metadata=ABSENT)
    integrity: dict | None = field(metadata=ABSENT)
    warning: str | None = field(metadata=ABSENT)
    incarnation: str | None = field(metadata=ABSENT)


class HealthServer:
    """Answers status requests on `endpoint` from a daemon thread.

    Main loop API: set(**fields), progress(**fields), bad_message(kind), error(text), close().
    Under systemd (Type=notify) the same calls drive sd_notify: state "ready" sends READY=1,
    progress() sends WATCHDOG=1 and STATUS=, "draining"/"stopped" send STOPPING=1. So the
    watchdog fires exactly when health would read "stalled".
    """

    def __init__(
        self,
        endpoint: str,
        role: str,
        rank: int,
        gpu: int | str,
        stall_after_s: float = 300.0,
        startup_stall_after_s: float = 1800.0,
        keys_dir: str = "",
    ):
        self.endpoint = endpoint
        self._lock = threading.Lock()
        self._status = {
            "role": role,
            "rank": rank,
            "gpu": gpu,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "version": __version__,
            "state": "starting",
            "step": 0,
            "samples_done": 0,
            "tokens_per_s": 0.0,
            "compile_s": 0.0,
            "gpu_mem_bytes": 0,
            "bad_messages": 0,
            "errors": [],
            "stall_after_s": float(stall_after_s),
        }
        self._bad_kinds: dict[str, int] = {}
        self._bad_from: dict[str, int] = {}  # who sent them, where known ("target-0")
        self._stall_after = {"startup": float(startup_stall_after_s), "running": float(stall_after_s)}
        self._last_progress = time.monotonic()
        self._notify = Notifier()
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        secure_socket(self._sock, MAX_REQUEST_BYTES)
        if keys_dir:  # tcp with CURVE keys: only key holders get an answer
            curve.apply_server(self._sock, keys_dir)
        bind_private(self._sock, endpoint)
        self._thread = threading.Thread(target=self._serve, name="health", daemon=True)
        self._thread.start()

    # --- main-loop side -------------------------------------------------
    def set(self, **fields) -> None:
        if "state" in fields and fields["state"] not in STATES:
            raise ValueError(f"unknown state {fields['state']!r}")
        with self._lock:
            self._status.update(fields)
        state = fields.get("state")
        if state == "ready":
            self._notify.ready(f"{self._status['role']}-{self._status['rank']} ready")
        elif state in ("draining", "stopped"):
            self._notify.stopping(state)

    def progress(self, **fields) -> None:
        """Stamp that the main loop is alive, optionally updating fields."""
        with self._lock:
            self._status.update(fields)
            self._last_progress = time.monotonic()
            step, rate = self._status["step"], self._status["tokens_per_s"]
        self._notify.progress(step, rate)

    def bad_message(self, kind: str, detail: str = "", source: str = "") -> bool:
        """Count a dropped message; True the first time this kind is seen (log it once)."""
        with self._lock:
            self._status["bad_messages"] += 1
            first = kind not in self._bad_kinds
            self._bad_kinds[kind] = self._bad_kinds.get(kind, 0) + 1
            if source:
                self._bad_from[source] = self._bad_from.get(source, 0) + 1
        return first

    def error(self, text: str) -> None:
        with self._lock:
            self._status["errors"] = (self._status["errors"] + [text])[-10:]

    def snapshot(self) -> dict:
        with self._lock:
            status = dict(self._status)
            status["bad_message_kinds"] = dict(self._bad_kinds)
            status["bad_message_from"] = dict(self._bad_from)
            age = time.monotonic() - self._last_progress
        # The reported age decides "stalled", so the two never disagree (0.5004 s was "0.5" and stalled).
        status["last_progress_age_s"] = round(age, 3)
        status["stall_after_s"] = self._stall_after["startup" if status["state"] in STARTUP_STATES else "running"]
        status["stalled"] = (
            status["state"] not in ("stopped", "failed") and status["last_progress_age_s"] > status["stall_after_s"]
        )
        try:
            status["rss_bytes"] = psutil.Process().memory_info().rss
        except psutil.Error:
            status["rss_bytes"] = 0
        return status

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(linger=0)
        self._ctx.term()
        self._notify.close()

    # --- responder thread ----------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(100):
                    continue
                frames = self._sock.recv_multipart()
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                continue
            identity, payload = frames[0], frames[-1]
            reply = self._answer(payload, len(frames))
            try:
                # default=str: a field the main loop set to a non-msgpack value (numpy int, Path)
                # must not kill this thread
                packed = msgpack.packb(reply, default=str)
            except Exception as exc:
                packed = msgpack.packb({"error": f"status not serialisable: {exc}"[:200]})
            try:
                self._sock.send_multipart([identity, b"", packed], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # the asker went away; nothing to do

    def _answer(self, payload: bytes, nframes: int) -> dict:
        try:
            request = msgpack.unpackb(
                payload,
                raw=False,
                strict_map_key=True,
                max_bin_len=0,
                max_str_len=MAX_REQUEST_BYTES,
                max_array_len=16,
                max_map_len=16,
            )
            if not isinstance(request, dict) or request.get("op") != "status" or nframes > 3:
                raise ValueError("expected {'op': 'status'}")
        except Exception as exc:  # any garbage: count, answer, carry on
            self.bad_message("health-request", str(exc))
            return {"error": f"bad request: {exc}"[:200]}
        return self.snapshot()


class Drops:
    """Counts dropped messages, reports them to health, logs the first of each kind."""

    def __init__(self, health: HealthServer | None):
        self.health = health
        self.counts: Counter[str] = Counter()

    def __call__(self, kind: str, detail: str) -> None:
        self.counts[kind] += 1
        # a drafter's details start "target N: ...": the launcher names that target in its warning
        source = detail.split(":", 1)[0].replace(" ", "-") if detail.startswith("target ") else ""
        first = self.health.bad_message(kind, detail, source) if self.health else self.counts[kind] == 1
        if first:
            log.warning("dropped a bad %s message: %s", kind, detail)


def probe(endpoint: str, timeout_s: float = 3.0, keys_dir: str = "") -> tuple[int, dict | None, str]:
    """Ask one worker for its status. Returns (exit code, status or None, one-line reason).

    0 healthy; 1 answered but unhealthy (failed, stopped, or stalled); 2 unreachable or garbage.
    Never waits longer than timeout_s: poll with a timeout, LINGER 0.
    """
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    secure_socket(sock, 1 << 20)
    try:
        if keys_dir:
            curve.apply_client(sock, keys_dir)
        sock.connect(endpoint)
        sock.send(msgpack.packb({"op": "status"}))
        if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            return EXIT_UNREACHABLE, None, f"{endpoint}: no answer within {timeout_s:g}s"
        raw = sock.recv()
    except zmq.ZMQError as exc:
        return EXIT_UNREACHABLE, None, f"{endpoint}: {exc}"
    finally:
        sock.close(linger=0)
    try:
        status = msgpack.unpackb(raw, raw=False)
        read_fields(Status, status, "status")
        age = status["last_progress_age_s"]
    except Exception as exc:
        return EXIT_UNREACHABLE, None, f"{endpoint}: garbage answer ({exc})"
    if status["state"] in ("failed", "stopped"):
        return EXIT_UNHEALTHY, status, f"{endpoint}: state {status['state']}"
    if status["stalled"]:
        return EXIT_UNHEALTHY, status, f"{endpoint}: stalled, no progress for {age:.0f}s"
    return EXIT_HEALTHY, status, f"{endpoint}: {status['state']}"
