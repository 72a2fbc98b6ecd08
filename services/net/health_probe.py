"""Health on the wire, the side every process uses: the status answer's fields (Status), the probe
client that asks a worker for its status (the launcher, the drafters before they ask a target),
and Drops, which counts the bad messages a socket loop drops and reports them to the worker's
health responder.

The responder itself (a thread with its own socket, which also drives sd_notify) is the process
layer's: services/process/health.py's HealthServer, which satisfies Reporter. Requests and answers
are msgpack maps. Nothing here unpickles. This module must not import torch: the launcher uses
the probe.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

import msgpack
import zmq

from services.net import curve
from services.net.message_fields import read_fields, rule
from services.net.sockets import secure_socket

log = logging.getLogger(__name__)

STATES = ("starting", "loading", "compiling", "ready", "training", "draining", "stopped", "failed")
STARTUP_STATES = ("starting", "loading", "compiling")  # model loads and cold compiles take minutes
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


class Reporter(Protocol):
    """What a socket loop reports to its worker's health responder (services.process.health.HealthServer)."""

    def set(self, **fields) -> None: ...

    def error(self, text: str) -> None: ...

    def bad_message(self, kind: str, detail: str = "", source: str = "") -> bool: ...


class Drops:
    """Counts dropped messages, reports them to health, logs the first of each kind."""

    def __init__(self, health: Reporter | None):
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
