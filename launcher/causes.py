"""Why a worker exited, in the launcher's words, and whether restarting it can help.

The supervisor learns the cause from two things only: the exit status (a negative code is the
signal that ended the process) and the worker's log, whose last `error` line since the latest
start is the cause the worker itself reported (services/process/exits.py writes it last). Some causes
come back on every restart; those end the run at once, with what to change:

- out of memory (CUDA's torch.OutOfMemoryError, or the CPU allocator's "can't allocate memory"),
- a config error (exit 2),
- a final error (exit 4, services/process/exits.py FinalError: non-finite data from a target),
- the same error line as the worker's previous exit (a restart reproduced it).

Everything else (a signal, a hard exit, a crash seen once) keeps the restart budget.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

from services.process.log import message_of

START_MARK = "===== "  # launcher/process.py writes it into the log at each start
CONFIG_EXIT, FINAL_EXIT, HARD_EXIT = 2, 4, 143
OUT_OF_MEMORY = ("OutOfMemoryError", "out of memory", "can't allocate memory", "not enough memory", "MemoryError")
LEVELS = ("error", "critical")


@dataclass
class Cause:
    text: str  # "killed by SIGSEGV", "torch.OutOfMemoryError: CUDA out of memory. ..."
    fatal: str = ""  # not empty: no restart can help; what to change instead


def last_error_line(log_text: str) -> str:
    """The last error line of the worker's latest start (its own words), else its last line."""
    lines = log_text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(START_MARK)]
    lines = [line.strip() for line in lines[starts[-1] + 1 if starts else 0 :] if line.strip()]
    for line in reversed(lines):
        fields = line.split(" ", 3)
        if len(fields) == 4 and fields[0].endswith("Z") and fields[2] in LEVELS and fields[3].strip():
            return message_of(line)
    return message_of(lines[-1]) if lines else ""


def signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def out_of_memory_advice(role: str) -> str:
    if role == "drafter":
        return (
            "out of memory: lower data.pack_len or drafter.num_anchors (or kernels.loss_chunk), "
            "or give each drafter a GPU of its own (no --share-gpus)"
        )
    return "out of memory: lower data.pack_len, or give each target a GPU of its own (no --share-gpus)"


def exit_cause(role: str, code: int, log_text: str, previous: str = "") -> Cause:
    """The cause of an exit with `code`; `previous` is the cause text of this worker's last exit."""
    if code < 0:
        name = signal_name(code)
        text = f"killed by {name}"
        if name == "SIGKILL":
            text += " (often the kernel's OOM killer: see `dmesg`)"
        return Cause(text)
    line = last_error_line(log_text)
    if code == HARD_EXIT:
        return Cause(
            "hard exit: a second stop signal, or supervise.stop_timeout_s passed" + (f" ({line})" if line else "")
        )
    if code == CONFIG_EXIT:
        return Cause(line or "config error", fatal="no restart can fix a config error")
    text = line or f"no error line in its log (exit code {code})"
    if code == FINAL_EXIT:
        return Cause(text, fatal="a restart would meet the same error (exit 4: final)")
    if any(marker in line for marker in OUT_OF_MEMORY):
        return Cause(text, fatal=out_of_memory_advice(role))
    if line and line == previous:
        return Cause(text, fatal="the same error twice in a row: a restart does not help")
    return Cause(text)


def read_log(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
