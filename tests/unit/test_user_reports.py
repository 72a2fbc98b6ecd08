"""Defects users met at the command line: an ended run's status, a missing eval checkpoint, a closed
pipe, the stop message of a start that never trained."""

import io
import json
import subprocess
from pathlib import Path

import pytest

from launcher import commands
from launcher.cli import main
from tests.launching import REPO, child_env, launcher_argv

EXIT_PIPE = 141


def ended_run(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    health = f"ipc://{tmp_path}/gone.health"  # nobody answers there: the run has ended
    (run_dir / "run.json").write_text(
        json.dumps(
            {
                "launcher_pid": 1,
                "launcher": None,
                "workers": [{"name": "drafter-0", "gpu": 0, "pid": None, "endpoints": {"health": health}}],
                "outcome": {"state": "finished", "exit": 0, "reason": "", "ended": 0},
            }
        )
    )
    lines = [
        {
            "step": s,
            "loss": 5.0 - s / 100,
            "tau": 1.5 + s / 100,
            "coverage": 0.9,
            "tokens_per_s": 1234.0,
            "data_wait_frac": 0.25,
            "lr": 1e-4,
        }
        for s in (10, 20)
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return run_dir


def test_status_of_an_ended_run_shows_the_last_metrics_line(tmp_path, capsys):
    code = main(["status", "--run-dir", str(ended_run(tmp_path)), "--timeout", "0.2"])
    out = capsys.readouterr().out
    assert code == 0, out
    metrics = [line for line in out.splitlines() if line.startswith("metrics ")]
    assert metrics == [
        "metrics @20 (all ranks, last 10 steps): loss 4.8000 τ 1.70 coverage 90% 1.2 Ktok/s, "
        "data wait 25% (the metrics.jsonl line of that step)"
    ], out


def test_eval_of_a_missing_checkpoint_says_so_before_loading_anything(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(commands.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran")))
    code = main(["eval", "--checkpoint", str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().splitlines() == [f"launcher: error: --checkpoint {tmp_path / 'nope'} does not exist"]


@pytest.mark.processes
def test_a_closed_stdout_ends_status_and_report_quietly(tmp_path):
    run_dir = ended_run(tmp_path)
    for argv in (["status", "--timeout", "0.2"], ["report", "--out", str(tmp_path / "r.png")]):
        proc = subprocess.Popen(
            launcher_argv(*argv, "--run-dir", str(run_dir)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=child_env(),
        )
        proc.stdout.close()  # the reader is gone before the first line (`| head -0`)
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == EXIT_PIPE, err
        assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_a_failed_start_says_it_stops_the_workers_not_that_drafters_checkpoint(tmp_path):
    from launcher.progress import ProgressLine
    from launcher.supervisor import Supervisor
    from launcher.topology import parse_gpu_spec
    from services.run.config import load_config

    sup = Supervisor(tmp_path, load_config(None, []), parse_gpu_spec("0:target,1:drafter"), "cpu")
    sup.progress = ProgressLine(stream=io.StringIO())
    sup.shutdown()  # no worker was ever seen training
    said = sup.progress.stream.getvalue()
    assert "stopping the workers" in said and "checkpoint and exit" not in said, said
    sup.trained.add("drafter-0")
    sup.shutdown()
    assert "drafters checkpoint and exit" in sup.progress.stream.getvalue()


def test_status_and_report_point_to_a_glossary_that_exists():
    from launcher.parser import build_parser
    from launcher.status import STATUS_LEGEND
    from tests.unit.test_docs import anchors

    assert "glossary" in anchors(REPO / "docs" / "guide" / "monitoring.md")
    glossary = (REPO / "docs" / "guide" / "monitoring.md").read_text().split("## Glossary", 1)[1].split("\n## ", 1)[0]
    for word in (
        "τ",
        "cov",
        "real acceptance",
        "starting… waiting for drafter-0:?",
        "probe",
        "samples",
        "rss",
        "gpu_mem",
        "bad_msgs",
    ):
        assert word in glossary, word
    status_help = build_parser()._subparsers._group_actions[0].choices["status"].format_help()
    assert "docs/guide/monitoring.md#glossary" in status_help and "docs/guide/monitoring.md#glossary" in STATUS_LEGEND
    assert "docs/guide/monitoring.md#glossary" in (REPO / "launcher" / "report.py").read_text()
