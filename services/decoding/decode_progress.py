"""A console line at least every `every` seconds while decoding runs long (evaluation, regeneration):
what is being decoded, tokens done of the most there can be, the rate, and the time left at that rate.

    progress = Progress("eval", every=10)
    progress.phase("references", total_tokens=264 * 128)
    progress.add(new_tokens)          # after every target forward; prints when `every` s have passed

The total is an upper bound (a prompt may stop before max_new_tokens), so the time left is one too.
"""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, label: str, every: float = 10.0, say=None, clock=time.monotonic):
        """say(line): where a line goes (default: stderr; a worker passes its log)."""
        self.label, self.every, self.clock = label, every, clock
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.name, self.total, self.done = "", 0, 0
        self.began = self.last = clock()

    def phase(self, name: str, total_tokens: int) -> None:
        self.name, self.total, self.done = name, total_tokens, 0
        self.began = self.clock()

    def add(self, tokens: int) -> None:
        self.done += tokens
        now = self.clock()
        if now - self.last >= self.every:
            self.last = now
            self.say(self.line(now))

    def line(self, now: float) -> str:
        rate = self.done / max(now - self.began, 1e-9)
        left = max(self.total - self.done, 0) / rate if rate > 0 else float("inf")
        share = f" ({100 * self.done / self.total:.0f} %)" if self.total else ""
        return (
            f"{self.label}: {self.name} {self.done:,}/{self.total:,} tokens{share}, {rate:,.0f} tok/s, "
            f"at most {left:.0f} s left"
        )
