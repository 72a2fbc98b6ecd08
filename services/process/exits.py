"""How a worker process ends: the same exit codes in every role (docs/guide/failures.md, "Logs and exit codes").

    0  finished: a drafter's plan is done; a target stopped by a signal (it has no end of its own)
    1  crashed: anything unexpected; the traceback is in the log, its last line names the error
    2  config error: a bad config, checkpoint or handshake; one line says what, no traceback
    3  stopped: a drafter stopped by a stop request before the end of training (its checkpoint
       saved, or still starting: nothing to save); --resume continues, and the launcher records
       the run as stopped, not finished
    4  final: a crash that a restart would meet again (FinalError: non-finite data from a target);
       the launcher ends the run at once instead of restarting

143 is a hard exit (lifecycle.py: a stop signal from a second sender, or the stop deadline passed).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys

from services.process import lifecycle
from services.run.config import ConfigError

OK, CRASHED, CONFIG, STOPPED, FINAL = 0, 1, 2, 3, 4

log = logging.getLogger("worker")


class FinalError(RuntimeError):
    """An error that a restart meets again (the same batches, the same weights): exit FINAL."""


def error_name(exc: BaseException) -> str:
    """The exception's name as users search for it: torch.OutOfMemoryError, ValueError."""
    cls = type(exc)
    return f"{cls.__module__}.{cls.__qualname__}" if cls.__module__.split(".")[0] == "torch" else cls.__qualname__


def exit_code(exc: BaseException, health=None, stopped: int = OK) -> int:
    """Log why the worker ends with `exc` and return its exit code; the health status says it too.
    stopped: the code of a stop while starting (a drafter's is STOPPED: its training did not end)."""
    if isinstance(exc, lifecycle.Stopped):  # stopped while starting (waiting for a target): nothing to save
        if health is not None:
            health.set(state="stopped")
        return stopped
    if isinstance(exc, ConfigError):
        message, code = f"config error: {exc}", CONFIG
        log.error("%s", message)
    else:
        message, code = f"{error_name(exc)}: {exc}", FINAL if isinstance(exc, FinalError) else CRASHED
        log.error("crashed", exc_info=exc)
        log.error("%s", message)  # the last line: the cause the launcher reports
    if health is not None:
        health.set(state="failed")
        health.error(message)
    return code


def end_process(code: int):
    """End a worker whose work is done and whose files are closed (worker_main closes them): the
    atexit handlers run (logging flushes, compile pools stop), then os._exit skips the interpreter's
    teardown of every module (torch, transformers...): 3 to 8 s of a busy CPU after the worker's
    last line, with nothing logged, that the launcher waited before it saw the exit."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
