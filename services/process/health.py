"""Health's responder: a thread each worker runs, answering status requests on its own socket.

The responder owns its own ZMQ socket on its own thread, so it answers while the main loop
works. The main loop stamps progress; if it stops stamping for longer than `stall_after_s`
the status says so (`stalled: true`), although the responder itself still answers. Under systemd
the same calls drive sd_notify (services/process/sdnotify.py), which is why this sits in the
process layer; the wire side (the Status fields, the probe client, Drops) is
services/net/health_probe.py, one layer down, which the socket loops of services/net use.

Requests and answers are msgpack maps. Nothing here unpickles. Garbage is counted
(`bad_messages`) and answered with an error map; it never stops the responder.
This module must not import torch: the launcher imports it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import msgpack
import psutil
import zmq

from services import __version__
from services.net import curve
from services.net.health_probe import STARTUP_STATES, STATES
from services.net.sockets import bind_private, secure_socket
from services.process.sdnotify import Notifier

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 4096


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
