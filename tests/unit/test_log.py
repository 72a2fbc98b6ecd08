"""The one log format of every worker (services/process/log.py) and the exit codes (services/process/exits.py)."""

import io
import logging
import re

import pytest

from services.process import exits, lifecycle, log
from services.run.config import ConfigError

PREFIX = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z drafter-3 "


@pytest.fixture
def streams(monkeypatch):
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr("sys.stderr", err)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    log.setup_logging("drafter", 3)
    yield out, err
    root.handlers[:], _ = saved
    root.setLevel(saved[1])
    log.EVENTS.handlers.clear()
    logging.captureWarnings(False)


def test_events_go_to_stdout_and_text_to_stderr_every_line_prefixed(streams):
    out, err = streams
    log.event("ready", rank=3, plan="3 steps")
    logging.getLogger("drafter").warning("low disk")
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("drafter").exception("crashed")
    assert re.fullmatch(PREFIX + r'\{"event": "ready", "rank": 3, "plan": "3 steps"\}\n', out.getvalue())
    lines = err.getvalue().splitlines()
    assert re.fullmatch(PREFIX + "warning low disk", lines[0])
    assert all(re.match(PREFIX + "error ", line) for line in lines[1:])  # the traceback too
    assert lines[-1].endswith("error ValueError: boom")


def test_parse_event_reads_events_from_a_log_with_both_streams():
    text = (
        "2026-12-01T02:40:00.123Z drafter-0 info compiling\n"
        '2026-12-01T02:40:01.000Z drafter-0 {"event": "ready", "rank": 0}\n'
        "2026-12-01T02:40:02.000Z drafter-0 error Traceback (most recent call last):\n"
        '2026-12-01T02:40:03.000Z drafter-0 {"event": "step", "step": 1, "loss": 4.5}\n'
        '{"event": "stopped", "step": 1}\n'  # bare JSON (a library caller): read too
        '2026-12-01T02:40:04.000Z drafter-0 {"no": "event"}\n'
        "2026-12-01T02:40:05.000Z drafter-0 {not json\n"
    )
    assert [e["event"] for e in log.events(text)] == ["ready", "step", "stopped"]
    assert log.events(text, "step") == [{"event": "step", "step": 1, "loss": 4.5}]
    assert log.parse_event("2026-12-01T02:40:00.123Z drafter-0 info {x}") is None


def test_message_of_drops_time_and_writer_only_from_log_lines():
    assert (
        log.message_of("2026-12-01T02:40:00.123Z target-0 error DataError: data.jsonl:7: bad JSON")
        == "DataError: data.jsonl:7: bad JSON"
    )
    assert log.message_of("RuntimeError: plain") == "RuntimeError: plain"


class Health:
    def __init__(self):
        self.states, self.errors = [], []

    def set(self, state):
        self.states.append(state)

    def error(self, message):
        self.errors.append(message)


def test_one_exit_code_per_outcome_and_health_says_why(streams):
    _, err = streams
    health = Health()
    assert exits.exit_code(lifecycle.Stopped(), health) == exits.OK == 0
    # a drafter stopped while starting has not finished training: stopped, like a stop mid-run
    assert exits.exit_code(lifecycle.Stopped(), health, stopped=exits.STOPPED) == exits.STOPPED == 3
    assert exits.exit_code(ConfigError("drafter.block_size must be >= 2"), health) == exits.CONFIG == 2
    assert err.getvalue().splitlines()[-1].endswith("error config error: drafter.block_size must be >= 2")
    assert "Traceback" not in err.getvalue()
    try:
        {}["x"]
    except KeyError as exc:
        assert exits.exit_code(exc, health) == exits.CRASHED == 1
    assert "Traceback" in err.getvalue() and err.getvalue().splitlines()[-1].endswith("error KeyError: 'x'")
    assert health.states == ["stopped", "stopped", "failed", "failed"]
    assert health.errors == ["config error: drafter.block_size must be >= 2", "KeyError: 'x'"]
