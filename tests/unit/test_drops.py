"""Dropped messages in the launcher's words (launcher/drops.py): the warning line, one per burst of
increases, totals across a worker's restarts, and the health counts it reads (services/process/health.py)."""

from __future__ import annotations

import time

from launcher.drops import DropWatch, describe_drops
from services.net.health_probe import Drops, probe
from services.process.health import HealthServer


def test_the_line_names_the_worker_the_kinds_the_counts_and_the_target():
    line = describe_drops("drafter-0", {"data-incarnation": 3, "data-content": 88}, ["target-0"])
    assert line == (
        "drafter-0 dropped 91 answers (data-content 88, data-incarnation 3): another process answered "
        "for target-0 (see logs/drafter-0.log)"
    )
    # a late answer of a restarted target is not another process; a target drops requests, not answers
    assert (
        describe_drops("drafter-1", {"data-incarnation": 2}, ["target-1"])
        == "drafter-1 dropped 2 answers (data-incarnation 2) (see logs/drafter-1.log)"
    )
    assert (
        describe_drops("target-0", {"data-request": 1})
        == "target-0 dropped 1 messages (data-request 1) (see logs/target-0.log)"
    )


def test_one_warning_per_burst_and_totals_across_restarts():
    watch = DropWatch()
    watch.restarted("drafter-0")  # its first start
    polls = [{}, {"data-content": 2}, {"data-content": 9}, {"data-content": 9}, {"data-content": 12}]
    assert [watch.seen("drafter-0", kinds, ["target-0"]) for kinds in polls] == [False, True, False, False, True]
    watch.restarted("drafter-0")  # a new process counts from 0
    assert watch.seen("drafter-0", {"data-incarnation": 1}) is True
    assert watch.dropped() == {"drafter-0": {"data-content": 12, "data-incarnation": 1}}
    assert watch.dropped_from() == {"drafter-0": ["target-0"]}
    assert watch.describe("drafter-0").startswith("drafter-0 dropped 13 answers (data-content 12, data-incarnation 1)")
    watch.seen("target-0", {})
    assert "target-0" not in watch.dropped()  # nothing dropped: nothing recorded


def test_health_reports_each_kind_and_the_target_it_came_from(tmp_path):
    endpoint = f"ipc://{tmp_path}/h.sock"
    health = HealthServer(endpoint, "drafter", 0, "cpu-0")
    try:
        drops = Drops(health)
        drops("data-content", "target 1: train g=4 has token digest 'x', the data says 'y'")
        drops("data-content", "target 1: train g=5 has token digest 'x', the data says 'z'")
        drops("data-reply", "bad frame")  # no target named: counted, no source
        deadline = time.monotonic() + 10
        while (status := probe(endpoint)[1]) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert status["bad_message_kinds"] == {"data-content": 2, "data-reply": 1}
        assert status["bad_message_from"] == {"target-1": 2}
        assert status["bad_messages"] == 3
    finally:
        health.close()
