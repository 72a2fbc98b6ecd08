"""One live status line for a long run: step, loss, τ, coverage, trained tokens/s, ETA.

On a terminal the line redraws in place, cut to the terminal's width (a line that wraps can no
longer be redrawn with '\\r'); in a log (systemd, CI) a full line is printed every `every_s`
seconds instead, so the journal is readable.

loss, τ and tok/s are those of the last metrics.jsonl line (drafter 0 reports it as `window`):
all drafter ranks, averaged over the steps since the line before. `launcher status` and
`launcher report` show the same figures.
"""
from __future__ import annotations

import shutil
import sys
import time


def describe_window(window: dict | None) -> str:
    """'@300 (all ranks, last 10 steps): loss 4.1700 τ 3.59 coverage 91% 11.7 Ktok/s', or '' before the
    first line. Coverage: the supervised tokens the anchor rule can train at k = 1."""
    if not window:
        return ""
    coverage = f" coverage {100 * window['coverage']:.0f}%" if window.get("coverage") is not None else ""
    return (f"@{window['step']} (all ranks, last {window.get('steps', '?')} steps): loss {window['loss']:.4f} "
            f"τ {window['tau']:.2f}{coverage} {window['tokens_per_s'] / 1000:.1f} Ktok/s")


class ProgressLine:
    def __init__(self, stream=None, every_s: float = 10.0):
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.every_s = every_s
        self._last_print = 0.0
        self._width = 0
        self._rate_start: tuple[float, int] | None = None

    def format(self, step: int, total: int, window: dict | None = None) -> str:
        now = time.monotonic()
        if self._rate_start is None or step < self._rate_start[1]:
            self._rate_start = (now, step)
        t0, s0 = self._rate_start
        rate = (step - s0) / (now - t0) if now > t0 and step > s0 else 0.0
        eta = f"{_duration((total - step) / rate)}" if rate > 0 and total else "?"
        pct = f" {100 * step / total:5.1f}%" if total else ""
        parts = [f"step {step}/{total or '?'}{pct}", describe_window(window), f"ETA {eta}"]
        return " | ".join(p for p in parts if p)

    def show(self, text: str) -> None:
        if self.tty:
            width = max(10, shutil.get_terminal_size().columns - 1)   # never wrap: '\r' redraws one row only
            text = text[:width]
            pad = max(0, min(self._width, width) - len(text))
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
