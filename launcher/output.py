"""`launcher up`'s console output survives its reader going away (`launcher up ... | head -3`).

A run outlives the terminal that started it: once the pipe is closed, what `up` prints is dropped
(the logs, metrics.jsonl and run.json keep everything) and the run goes on to its end and records
its outcome. Other commands still end quietly with 141 on a closed pipe (launcher/cli.py).
"""

from __future__ import annotations

import io
import os
import sys


class DropOnClosedPipe(io.TextIOBase):
    """A text stream over `stream` that, once a write or flush meets a closed pipe, points the file
    descriptor at /dev/null (so nothing, the interpreter's last flush included, raises again) and
    drops everything after."""

    def __init__(self, stream):
        self.stream = stream
        self.dropped = False

    def write(self, text: str) -> int:
        if not self.dropped:
            try:
                self.stream.write(text)
            except BrokenPipeError:
                self._drop()
        return len(text)

    def flush(self) -> None:
        if not self.dropped:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self._drop()

    def _drop(self) -> None:
        self.dropped = True
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())
        except (OSError, ValueError):
            pass

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self):
        return self.stream.encoding


def keep_running_on_closed_pipes() -> None:
    """For `up`: stdout and stderr drop their output once their reader is gone, instead of raising."""
    sys.stdout, sys.stderr = DropOnClosedPipe(sys.stdout), DropOnClosedPipe(sys.stderr)
