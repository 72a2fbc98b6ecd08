"""Stopping a worker: SIGTERM/SIGINT ask the main loop to finish its step and leave.

The first signal sets STOP; the loop checks it between steps (and while waiting for data).
It also arms a deadline: a worker that has not exited `grace_s` later (a hung NCCL call, a
stuck kernel) exits hard, so `launcher down`, systemd and a dead launcher's parent-death
signal always end it. A second signal exits at once.
"""
from __future__ import annotations

import logging
import os
import signal
import threading

STOP = threading.Event()
EXIT_HARD = 143

log = logging.getLogger("worker")


class Stopped(Exception):
    """Raised where a worker waits, when a stop was requested meanwhile."""


def install(grace_s: float = 600.0) -> threading.Event:
    def on_signal(signum, frame):
        if STOP.is_set():
            os._exit(EXIT_HARD)
        STOP.set()
        log.warning("signal %s: finishing the current step, exiting within %.0fs", signal.Signals(signum).name, grace_s)
        timer = threading.Timer(grace_s, lambda: os._exit(EXIT_HARD))
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return STOP


def check() -> None:
    if STOP.is_set():
        raise Stopped()
