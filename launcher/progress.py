"""One live status line for a long run: step and ETA first, then loss, τ, coverage, trained tokens/s.

    step 305/1000 30.5% ETA 3m02s | loss 4.170 τ 3.59 cov 91% 11.7 Ktok/s

It fits 80 columns for runs up to 100 000 steps, so a terminal cuts nothing that matters. On a
terminal the line redraws in place, cut to the terminal's width (a line that wraps can no longer
be redrawn with '\\r'); in a log (systemd, CI, a file) a line is printed at most every `every_s`
seconds and only when it changed, so a pause (an evaluation, a checkpoint) adds no lines.

The ETA counts training time, not the clock: the drafter's `train_s` (seconds in batches: data
wait and train step, not evaluations or checkpoints), so it neither grows during a pause nor
drops after one. loss, τ and tok/s are those of the last metrics.jsonl line (drafter 0 reports it
as `window`): all drafter ranks, averaged over the steps since the line before. `launcher status`
(describe_window, with the window's step and length) and `launcher report` show the same figures.

Real acceptance measured during training (drafter 0's health `acceptance`: the figures of its last
acceptance.jsonl line) gets a line that stays, one per pass (describe_acceptance).
"""

from __future__ import annotations

import shutil
import sys
import time

from services.decoding.acceptance_text import describe_prompts
from services.decoding.lossless import describe_lossless


def describe_window(window: dict | None) -> str:
    """'@300 (all ranks, last 10 steps): loss 4.1700 τ 3.59 coverage 91% 11.7 Ktok/s', or '' before the
    first line. Coverage: the supervised tokens the anchor rule can train at k = 1. A Domino drafter's
    τ is followed by its backbone's alone: 'τ 4.70 (backbone alone 3.71)'."""
    if not window:
        return ""
    coverage = f" coverage {100 * window['coverage']:.0f}%" if window.get("coverage") is not None else ""
    base = f" (backbone alone {window['base_tau']:.2f})" if window.get("base_tau") is not None else ""
    return (
        f"@{window['step']} (all ranks, last {window.get('steps', '?')} steps): loss {window['loss']:.4f} "
        f"τ {window['tau']:.2f}{base}{coverage} {rate(window['tokens_per_s'])}"
    )


def describe_acceptance(figures: dict) -> str:
    """'real acceptance @1200: 3.21 per prompt, 3.05 per step, 2.95 tokens/forward, lossless 16/16 on
    16 held-out prompts; pass 4.1 s, real acceptance so far 1.3% of 900 s of training'."""
    line = (
        f"real acceptance @{figures['step']}: {figures['acceptance_per_prompt']:.2f} per prompt, "
        f"{figures['acceptance_per_step']:.2f} per step, {figures['tokens_per_forward']:.2f} tokens/forward, "
        f"{describe_lossless(figures)} on "
        f"{describe_prompts(figures['prompts'], figures.get('held_out'), figures.get('sets') or ())}"
    )
    if figures.get("skipped"):
        line += f" ({figures['skipped']} skipped)"
    if "cost_frac" in figures:
        line += (
            f"; pass {figures.get('pass_s', 0):.1f} s, real acceptance so far {100 * figures['cost_frac']:.1f}% "
            f"of {figures['wall_s']:.0f} s of training"
        )
    return line


def compact_window(window: dict | None) -> str:
    """The live line's part of describe_window: 'loss 4.170 τ 3.59 cov 91% 11.7 Ktok/s'."""
    if not window:
        return ""
    coverage = f" cov {100 * window['coverage']:.0f}%" if window.get("coverage") is not None else ""
    return f"loss {window['loss']:.3f} τ {window['tau']:.2f}{coverage} {rate(window['tokens_per_s'])}"


def rate(tokens_per_s: float) -> str:
    """'17.3 tok/s', '11.7 Ktok/s', '1.2 Mtok/s': the unit that keeps three figures (a small CPU run
    trains tens of tok/s, which '0.0 Ktok/s' hid)."""
    for scale, unit in ((1e6, "Mtok/s"), (1e3, "Ktok/s")):
        if tokens_per_s >= scale:
            return f"{tokens_per_s / scale:.1f} {unit}"
    return f"{tokens_per_s:.1f} tok/s"


class ProgressLine:
    def __init__(self, stream=None, every_s: float = 10.0):
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.every_s = every_s
        self._last_print = float("-inf")  # the first line is always due
        self._last_text = ""
        self._width = 0
        self._rate_start: tuple[float, int] | None = None

    def format(self, step: int, total: int, window: dict | None = None, train_s: float | None = None) -> str:
        """train_s: the drafter's seconds of training so far (its health's `train_s`); without it
        the ETA falls back to the clock since the first call."""
        clock = time.monotonic() if train_s is None else train_s
        if self._rate_start is None or step < self._rate_start[1] or clock < self._rate_start[0]:
            self._rate_start = (clock, step)  # first sight, or a restarted drafter
        t0, s0 = self._rate_start
        rate = (step - s0) / (clock - t0) if clock > t0 and step > s0 else 0.0
        eta = duration((total - step) / rate) if rate > 0 and total else "?"
        pct = f" {100 * step / total:.1f}%" if total else ""
        head = f"step {step}/{total or '?'}{pct} ETA {eta}"
        return " | ".join(p for p in (head, compact_window(window)) if p)

    def show(self, text: str) -> None:
        if self.tty:
            width = max(10, shutil.get_terminal_size().columns - 1)  # never wrap: '\r' redraws one row only
            text = text[:width]
            pad = max(0, min(self._width, width) - len(text))
            self.stream.write("\r" + text + " " * pad)
            self._width = len(text)
            self.stream.flush()
        elif text != self._last_text and time.monotonic() - self._last_print >= self.every_s:
            self._last_print, self._last_text = time.monotonic(), text
            print(text, file=self.stream, flush=True)

    def done(self, text: str) -> None:
        """A line that stays (an event, or the final state)."""
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0
        print(text, file=self.stream, flush=True)


def duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
