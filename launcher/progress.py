"""One live status line for a long run: step, samples, tokens/s, loss, τ, coverage, ETA.

On a terminal the line redraws in place; in a log (systemd, CI) a full line is printed
every `every_s` seconds instead, so the journal is readable.
"""
from __future__ import annotations

import sys
import time


class ProgressLine:
    def __init__(self, stream=None, every_s: float = 10.0):
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.every_s = every_s
        self._last_print = 0.0
        self._width = 0
        self._rate_start: tuple[float, int] | None = None

    def format(self, step: int, total: int, samples: int, tokens_per_s: float,
               loss: float | None, tau: float | None, coverage: float | None = None) -> str:
        now = time.monotonic()
        if self._rate_start is None or step < self._rate_start[1]:
            self._rate_start = (now, step)
        t0, s0 = self._rate_start
        rate = (step - s0) / (now - t0) if now > t0 and step > s0 else 0.0
        eta = f"{_duration((total - step) / rate)}" if rate > 0 and total else "?"
        pct = f" {100 * step / total:5.1f}%" if total else ""
        parts = [f"step {step}/{total or '?'}{pct}", f"samples {samples}", f"{tokens_per_s / 1000:.1f} Ktok/s"]
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        if tau is not None:
            parts.append(f"τ {tau:.2f}")
        if coverage is not None:                 # supervised tokens the anchor rule can train at k = 1
            parts.append(f"coverage {100 * coverage:.0f}%")
        parts.append(f"ETA {eta}")
        return " | ".join(parts)

    def show(self, text: str) -> None:
        if self.tty:
            pad = max(0, self._width - len(text))
            self.stream.write("\r" + text + " " * pad)
            self._width = len(text)
            self.stream.flush()
        elif time.monotonic() - self._last_print >= self.every_s:
            self._last_print = time.monotonic()
            print(text, file=self.stream, flush=True)

    def done(self, text: str) -> None:
        """A line that stays (an event, or the final state)."""
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0
        print(text, file=self.stream, flush=True)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
