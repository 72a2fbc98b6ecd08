"""`launcher report` on a real (synthetic, one rank) run: summary, PNG, and the path without matplotlib.
Neither `report` nor `export` imports torch into the launcher process."""

import json
import os
import subprocess
import sys

import pytest

from tests.launching import REPO, drafter_env

pytestmark = pytest.mark.processes  # one drafter rank (synthetic data), the launcher in a fresh interpreter


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("report") / "run"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.drafter",
            "--run-dir",
            str(run),
            "--synthetic",
            "--device",
            "cpu",
            "--max-steps",
            "12",
            "data.pack_len=256",
            "drafter.num_anchors=16",
            "drafter.num_layers=1",
            "kernels.compile=false",
            "optimizer.lr=3e-3",
            "eval.every=6",
            "checkpoint.every=6",
        ],
        cwd=REPO,
        env=drafter_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return run


def launcher_in_process(*args, block_matplotlib=False):
    """Run launcher.cli.main in a fresh interpreter; report whether torch got imported."""
    code = (
        "import sys, json\n"
        + ("sys.modules['matplotlib'] = None\n" if block_matplotlib else "")
        + "from launcher.cli import main\n"
        + f"code = main({list(args)!r})\n"
        + "print(json.dumps({'code': code, 'torch': 'torch' in sys.modules}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=180)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result, out.stdout, out.stderr


def test_report_prints_a_summary_and_writes_a_png(run_dir, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "curves.png"
    result, out, err = launcher_in_process("report", "--run-dir", str(run_dir), "--out", str(png))
    assert result == {"code": 0, "torch": False}, err
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r.get("eval")]
    best = max(evals, key=lambda r: r["tau"])
    assert "steps: 12" in out and f"best tau {best['tau']:.3f} at step {best['step']}" in out
    assert "checkpoints: latest step-00000012" in out and f"export: {run_dir / 'export'} (step 12: last" in out
    assert "vLLM num_speculative_tokens = 15 (block_size 16 - 1)" in out
    # the export at the end holds step 12; it is also the best only if step 12's eval was the best
    record = json.loads((run_dir / "export" / "export.json").read_text())
    best_step = int(os.readlink(run_dir / "checkpoints" / "best").split("-")[1])
    assert best_step == best["step"] and record["best_step"] == best_step
    assert record["best"] == (best_step == 12) and record["last"] and record["step"] == 12
    assert record["eval_tau"] == [r["tau"] for r in evals if r["step"] == 12][0]
    assert "tokens/s" in out and f"plot: {png}" in out
    train = [r for r in records if not r.get("eval")]  # each line's window: tokens since the line before
    assert all(
        r["window_tokens"] == r["tokens_done"] - p["tokens_done"] and r["window_s"] > 0
        for p, r in zip(train, train[1:])
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_report_without_matplotlib_still_summarises_and_says_how_to_get_the_plot(run_dir):
    result, out, err = launcher_in_process("report", "--run-dir", str(run_dir), block_matplotlib=True)
    assert result == {"code": 0, "torch": False}, err
    assert "steps: 12" in out and "matplotlib is not installed" in out and "[report]" in out
    assert not (run_dir / "report.png").exists()


def test_report_on_a_dir_without_metrics_is_one_clear_line(tmp_path):
    result, out, err = launcher_in_process("report", "--run-dir", str(tmp_path))
    assert result["code"] == 2 and "no metrics in" in err and "Traceback" not in err


def test_export_runs_in_a_child_process(run_dir, tmp_path):
    result, out, err = launcher_in_process(
        "export", "--checkpoint", str(run_dir / "checkpoints" / "best"), "--out", str(tmp_path / "best")
    )
    assert result == {"code": 0, "torch": False}, err
    assert json.loads((tmp_path / "best" / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]


def test_tensorboard_events_when_the_extra_is_installed(run_dir):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 13))
    assert [e.step for e in events.Scalars("eval/tau")] == [6, 12]
    assert {"train/tokens_per_s", "train/data_wait_frac", "train/accuracy_pos1", "eval/loss"} <= set(
        events.Tags()["scalars"]
    )
    assert "train/time" not in events.Tags()["scalars"]  # the wall time of each point instead
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if not r.get("eval")]
    assert [e.wall_time for e in events.Scalars("train/loss")] == pytest.approx([r["time"] for r in train])


def test_report_shows_real_acceptance_beside_tau(run_dir, tmp_path):
    """Real-acceptance lines (training's acceptance.jsonl, `launcher eval`'s spec_eval.jsonl) are summarised
    and plotted on the τ axes."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, symlinks=True, ignore=shutil.ignore_patterns("sock"))  # no sockets
    fig = {
        "prompts": 4,
        "steps": 10,
        "tokens": 40,
        "acceptance_per_step": 3.5,
        "acceptance_per_prompt": 3.75,
        "tokens_per_forward": 2.86,
        "lossless": 4,
        "seconds": 1.0,
    }
    control = dict(fig, acceptance_per_step=1.0, acceptance_per_prompt=1.0, tokens_per_forward=0.9)
    with open(copy / "acceptance.jsonl", "a") as f:
        f.write(json.dumps({"step": 6, "spec": True, **fig}) + "\n")
        f.write(
            json.dumps({"step": 12, "spec": True, "final": True, **fig, "repeat_last": control, "random": control})
            + "\n"
        )
    (copy / "spec_eval.jsonl").write_text(json.dumps({"event": "spec_eval", "drafter": "export X", **fig}) + "\n")
    result, out, err = launcher_in_process("report", "--run-dir", str(copy), "--out", str(tmp_path / "p.png"))
    assert result["code"] == 0, err
    assert "real acceptance (step 12, end of training;" in out and "real acceptance (`launcher eval` of export X" in out
    table = out.splitlines()
    header = table.index("  " + " " * 12 + " per prompt  per step  tokens/forward  lossless")
    assert table[header + 1 : header + 4] == [
        "  drafter            3.75      3.50            2.86  4/4",
        "  repeat-last        1.00      1.00            0.90  4/4",
        "  random             1.00      1.00            0.90  4/4",
    ]
    assert "steps: 12" in out  # spec lines are not train lines
