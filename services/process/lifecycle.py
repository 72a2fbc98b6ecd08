"""Stopping a worker: SIGTERM/SIGINT ask the main loop to finish its step and leave.

The first stop signal sets STOP; the loop checks it between steps (and while waiting for data).
It also arms a deadline: a worker that has not exited `grace_s` later (a hung NCCL call, a
stuck kernel) exits hard (143), so `launcher down`, systemd and a dead launcher always end it.

One stop request often arrives more than once, and a repeat must not turn the graceful stop
into a hard exit that loses the final checkpoint:
- the kernel sends the parent-death signal each time the worker is handed to another thread of
  the dying launcher on its way to init (kill -9 of the launcher: two or three signals). The
  launcher sets it to PARENT_DIED, which starts a graceful stop and never anything more;
- a tool signals a process and then its process group (GNU timeout), or a unit and then its
  cgroup (systemd): the same signal twice within milliseconds.
So (StopRequests) a second SIGTERM/SIGINT means "exit now" only when it comes REPEAT_S or more
after the first, and, where the sender is known (the launcher reads it from siginfo, see
watch_with_sender), not from a sender that sent that signal already: a person insisting, never
one sender's duplicate.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time

STOP = threading.Event()
EXIT_HARD = 143
REPEAT_S = 2.0  # a repeat sooner than this after the first is the same request
PARENT_DIED = signal.SIGUSR1  # the launcher's PR_SET_PDEATHSIG for its workers
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

log = logging.getLogger("worker")


class Stopped(Exception):
    """Raised where a worker waits, when a stop was requested meanwhile."""


class StopRequests:
    """Sorts stop signals: "stop" (the first), "repeat" (the same request again), "now" (kill now)."""

    def __init__(self, repeat_s: float = REPEAT_S):
        self.repeat_s, self.first_at, self.senders = repeat_s, None, set()

    def classify(self, signum: int, sender: int = 0, now: float | None = None) -> str:
        """sender: the pid that sent it, 0 when unknown (a Python handler; a terminal's Ctrl-C)."""
        now = time.monotonic() if now is None else now
        again = sender > 0 and (signum, sender) in self.senders
        if sender > 0:
            self.senders.add((signum, sender))
        if self.first_at is None:
            self.first_at = now
            return "stop"
        if signum == PARENT_DIED or again or now - self.first_at < self.repeat_s:
            return "repeat"
        return "now"


def describe(signum: int, sender: int = 0) -> str:
    name = "parent-death signal (the launcher died)" if signum == PARENT_DIED else signal.Signals(signum).name
    return name + (f" from pid {sender}" if sender > 0 else "")


def install(grace_s: float = 600.0) -> threading.Event:
    requests = StopRequests()

    def on_signal(signum, frame):
        verdict = requests.classify(signum)
        if verdict == "repeat":
            log.info("%s again: the same stop request, still finishing the step", describe(signum))
            return
        if verdict == "now":
            log.warning(
                "%s again, %.0fs after the first: exiting now (no final checkpoint)",
                describe(signum),
                time.monotonic() - requests.first_at,
            )
            os._exit(EXIT_HARD)
        STOP.set()
        log.warning("%s: finishing the current step, exiting within %.0fs", describe(signum), grace_s)
        timer = threading.Timer(grace_s, lambda: os._exit(EXIT_HARD))
        timer.daemon = True
        timer.start()

    for signum in (*STOP_SIGNALS, PARENT_DIED):
        signal.signal(signum, on_signal)
    atexit.register(_ignore_while_exiting)
    return STOP


def _ignore_while_exiting() -> None:
    """The work is done (the checkpoint written): a repeat that arrives while the interpreter shuts
    down must not kill it with an unlisted code. Python gives signals back their default action
    (terminate) at shutdown unless they are ignored."""
    for signum in (*STOP_SIGNALS, PARENT_DIED):
        signal.signal(signum, signal.SIG_IGN)


def watch_with_sender(on_signal) -> None:
    """Call on_signal(signum, sender_pid) for each SIGTERM/SIGINT, from a thread of its own.

    Python's handlers do not say who sent a signal; sigwaitinfo does. It needs the signals
    blocked in every thread: call this before starting any thread (threads inherit the mask),
    and unblock them in children (launcher/process.py does). Python handlers stay installed
    for a thread that does not block them, with the sender unknown."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, lambda n, _frame: on_signal(n, 0))
    if not hasattr(signal, "sigwaitinfo"):
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)

    def wait():
        while True:
            info = signal.sigwaitinfo(STOP_SIGNALS)
            on_signal(info.si_signo, info.si_pid)

    threading.Thread(target=wait, name="stop-signals", daemon=True).start()


def check() -> None:
    if STOP.is_set():
        raise Stopped()
