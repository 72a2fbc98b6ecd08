"""One log format for every worker process, and its parser (docs/guide/failures.md, "Logs and exit codes").

Every line starts with the time (UTC, milliseconds) and who wrote it (role-rank):

    2026-12-01T02:40:00.123Z target-0 info capture path: packed-reference
    2026-12-01T02:40:00.123Z drafter-1 warning checkpoint at step 40 was not written (...)
    2026-12-01T02:40:00.123Z drafter-0 {"event": "ready", "rank": 0, "compile_s": 41.2, ...}

Text lines carry a level (info, warning, error) and go to stderr; events are one JSON object each
and go to stdout. Tools (the launcher, tests, benches) read events with `parse_event`, from a pipe
or from a log file that holds both streams. A traceback's lines get the prefix too.
"""

from __future__ import annotations

import json
import logging
import sys
import time

EVENTS = logging.getLogger("events")  # what tools read; never mixed with text lines
log = logging.getLogger("worker")


def timestamp(seconds: float) -> str:
    """ISO 8601 in UTC with milliseconds: sortable, and the same on every host of a run."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{int(seconds * 1000) % 1000:03d}Z"


class LineFormat(logging.Formatter):
    """`TIME WHO LEVEL text` for text, `TIME WHO {json}` for events; every line of a record prefixed."""

    def __init__(self, who: str):
        super().__init__()
        self.who = who

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        head = f"{timestamp(record.created)} {self.who}"
        if record.name != EVENTS.name:
            head += " " + record.levelname.lower()
        return "\n".join(f"{head} {line}" for line in text.splitlines() or [""])


def setup_logging(role: str, rank: int) -> None:
    """The process's logging: text (this process's loggers, the libraries', Python warnings) to
    stderr, events to stdout, both in the format above. Call once, first thing in main()."""
    form = LineFormat(f"{role}-{rank}")
    text = logging.StreamHandler(sys.stderr)
    text.setFormatter(form)
    logging.basicConfig(level=logging.INFO, handlers=[text], force=True)
    logging.captureWarnings(True)
    events = logging.StreamHandler(sys.stdout)
    events.setFormatter(form)
    EVENTS.handlers[:] = [events]
    EVENTS.setLevel(logging.INFO)
    EVENTS.propagate = False


def event(name: str, **fields) -> None:
    """One machine-readable line: {"event": name, **fields}."""
    line = json.dumps({"event": name, **fields})
    if EVENTS.handlers:
        EVENTS.info(line)
    else:  # a library caller that set up no logging: the bare JSON
        print(line, flush=True)


def parse_event(line: str) -> dict | None:
    """The event of one log line, or None for a text line (or anything else)."""
    fields = line.split(" ", 2)
    text = line if line.startswith("{") or len(fields) < 3 else fields[2]
    if not text.startswith("{"):
        return None
    try:
        record = json.loads(text)
    except ValueError:
        return None
    return record if isinstance(record, dict) and "event" in record else None


def events(text: str, name: str | None = None) -> list[dict]:
    """Every event in a log (or a captured stdout), or only those called `name`."""
    found = (parse_event(line) for line in text.splitlines())
    return [e for e in found if e is not None and (name is None or e["event"] == name)]


def message_of(line: str) -> str:
    """A text line without its time and writer (for a one-line reason, e.g. in run.json)."""
    fields = line.split(" ", 3)
    if len(fields) == 4 and fields[0].endswith("Z") and fields[2] in ("info", "warning", "error", "critical"):
        return fields[3]
    return line
