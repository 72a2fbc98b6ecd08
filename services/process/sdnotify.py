"""sd_notify without libsystemd: tell systemd when a worker is ready, alive, busy or stopping.

systemd (Type=notify) passes $NOTIFY_SOCKET, an AF_UNIX datagram socket; a message is
newline-separated KEY=VALUE lines. A name starting with '@' is an abstract socket.
With no $NOTIFY_SOCKET (a plain shell, the launcher, CI) every call is a no-op.

Worker loops use a Notifier:

    notifier = Notifier()
    notifier.status("loading model")          # any time
    ...load, compile, warm up...
    notifier.ready()                          # only now: READY=1
    while training:
        ...one step...
        notifier.progress(step, tokens_per_s) # STATUS=, and WATCHDOG=1 when due
        # idle loop turns (waiting for a request) call notifier.watchdog()
    notifier.stopping()                       # STOPPING=1 on shutdown

WATCHDOG=1 is sent only from the main loop, only after READY=1: systemd arms the watchdog
at READY (and at the first WATCHDOG=1, so an early one would arm it during a long compile).
A loop hung in an NCCL call or a kernel stops pinging, and systemd restarts the unit.
"""

from __future__ import annotations

import os
import socket
import time

__all__ = ["notify", "ready", "status", "watchdog", "stopping", "watchdog_interval_s", "Notifier"]


def _address(env) -> str | None:
    path = env.get("NOTIFY_SOCKET", "")
    if not path:
        return None
    if path.startswith("@"):
        return "\0" + path[1:]  # abstract namespace
    if path.startswith("/"):
        return path
    return None  # vsock: and other forms systemd may pass: unsupported here


def notify(message: str, env=None, sock: socket.socket | None = None) -> bool:
    """Send one notification. True when sent; False when there is no socket or sending failed.

    Never raises: a missing or broken notify socket must not kill a training worker.
    """
    env = os.environ if env is None else env
    address = _address(env)
    if address is None:
        return False
    own = sock is None
    try:
        if own:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        sock.sendto(message.encode("utf-8"), address)
        return True
    except OSError:
        return False
    finally:
        if own and sock is not None:
            sock.close()


def ready(text: str = "", env=None) -> bool:
    return notify("READY=1" + (f"\nSTATUS={_one_line(text)}" if text else ""), env)


def status(text: str, env=None) -> bool:
    return notify(f"STATUS={_one_line(text)}", env)


def watchdog(env=None) -> bool:
    return notify("WATCHDOG=1", env)


def stopping(text: str = "", env=None) -> bool:
    return notify("STOPPING=1" + (f"\nSTATUS={_one_line(text)}" if text else ""), env)


def watchdog_interval_s(env=None) -> float | None:
    """The unit's WatchdogSec in seconds, or None when no watchdog applies to this process.

    Like sd_watchdog_enabled(): $WATCHDOG_USEC must be a positive integer and, when
    $WATCHDOG_PID is set, it must name this process (a child that inherited the
    variables must not ping for its parent).
    """
    env = os.environ if env is None else env
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    pid = env.get("WATCHDOG_PID", "")
    if usec <= 0 or (pid and pid != str(os.getpid())):
        return None
    return usec / 1e6


def _one_line(text: str) -> str:
    return " ".join(str(text).split())[:200]


class Notifier:
    """What a worker's main loop calls. Cheap to call every step: it rate-limits itself.

    - WATCHDOG=1 at most every WatchdogSec/4, so a loop that makes progress at least every
      3/4 WatchdogSec is never killed, and one that stops is killed within WatchdogSec.
    - STATUS= at most every `status_every_s` from progress(); status() always sends.
    """

    def __init__(self, env=None, status_every_s: float = 2.0, clock=time.monotonic):
        self._env = dict(os.environ if env is None else env)
        self._clock = clock
        self.enabled = _address(self._env) is not None
        self.watchdog_s = watchdog_interval_s(self._env) if self.enabled else None
        self._ping_gap = self.watchdog_s / 4 if self.watchdog_s else None
        self._status_every = status_every_s
        self._is_ready = False
        self._last_ping = float("-inf")
        self._last_status = float("-inf")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) if self.enabled else None

    def _send(self, message: str) -> bool:
        return self.enabled and notify(message, self._env, self._sock)

    def status(self, text: str) -> bool:
        return self._send(f"STATUS={_one_line(text)}")

    def ready(self, text: str = "ready") -> bool:
        """READY=1, once. Call after the model is loaded and compile warm-up is done."""
        if self._is_ready:
            return False
        self._is_ready = True
        self._last_ping = self._clock()  # READY arms the watchdog: count it as a ping
        return self._send(f"READY=1\nSTATUS={_one_line(text)}")

    def watchdog(self) -> bool:
        """The main loop is alive. Sends WATCHDOG=1 when due; no-op before ready()."""
        if not (self._is_ready and self._ping_gap):
            return False
        now = self._clock()
        if now - self._last_ping < self._ping_gap:
            return False
        self._last_ping = now
        return self._send("WATCHDOG=1")

    def progress(self, step: int, tokens_per_s: float, extra: str = "") -> None:
        """A step finished: refresh STATUS (rate-limited) and ping the watchdog when due."""
        now = self._clock()
        if now - self._last_status >= self._status_every:
            self._last_status = now
            text = f"step {step}, {tokens_per_s:,.0f} tok/s"
            self.status(f"{text}, {extra}" if extra else text)
        self.watchdog()

    def extend(self, seconds: float, text: str = "") -> bool:
        """Ask for `seconds` more before the start/stop timeout or the watchdog fires.

        For known long pauses of the main loop: a checkpoint save, an evaluation pass.
        """
        message = f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}"
        return self._send(message + (f"\nSTATUS={_one_line(text)}" if text else ""))

    def stopping(self, text: str = "stopping") -> bool:
        return self._send(f"STOPPING=1\nSTATUS={_one_line(text)}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self.enabled = False
