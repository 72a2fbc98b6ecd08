"""Real acceptance by the clock (eval.every_s, services/drafter/books/cadence.py) in a real run: `launcher up
--demo` on a small untrained demo, one target and two drafters on the CPU (rank 0 alone decodes; rank 1
waits for it at the next step), a pass due every half second."""

import json
import subprocess

import pytest

from services.drafter.books.cadence import COST_SHARE
from services.process.log import events
from tests.demo_cache import untrained_demo_cache
from tests.launching import child_env, launcher_argv

pytestmark = pytest.mark.training

EVERY_S = 0.5
RUN = (
    "run.max_steps=60",
    "eval.every=0",  # the clock's passes only
    f"eval.every_s={EVERY_S}",
    "eval.budget_s=0.0001",  # spent by a pass's first verify step, which then ends its rows
    "eval.num_prompts=2",
    "eval.max_new_tokens=8",
    "data.pack_len=256",
    "drafter.num_anchors=16",
    "checkpoint.export_at_end=false",
)


def test_passes_by_the_clock_are_shown_and_recorded_with_their_cost(tmp_path):
    from launcher.report import read_metrics

    env = child_env(DFLASH_CACHE_DIR=untrained_demo_cache(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    argv = launcher_argv("up", "--demo", "--device", "cpu", "--gpus", "0:target,1-2:drafter", "--run-dir", run_dir)
    out = subprocess.run([*argv, *RUN], capture_output=True, text=True, env=env, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    passes = [r for r in lines if r.get("spec")]
    assert passes and all(r["periodic"] and r["held_out"] for r in passes), passes
    assert [r["passes"] for r in passes] == list(range(1, len(passes) + 1))
    for r in passes:  # the figures acceptance.jsonl has (acceptance only: no lossless check), and the cost
        assert r["prompts"] == 2 and "lossless" not in r and r["acceptance_per_step"] >= 1.0
        assert r["cost_frac"] == pytest.approx(r["spent_s"] / r["wall_s"], abs=1e-3) and r["pass_s"] > 0
    # the rule (more passes where this machine is slower than the first pass's set-up; test_cadence.py has
    # it all): each pass starts a full interval after the one before, with the cost so far within its share
    for before, r in zip(passes, passes[1:]):
        start, guess = r["wall_s"] - r["pass_s"], before["pass_s"] if before["passes"] > 1 else 0.0
        assert start - (before["wall_s"] - before["pass_s"]) >= EVERY_S - 0.01
        assert before["spent_s"] + guess <= COST_SHARE * (start + guess) + 0.01
    assert all(r["spec"] for r in lines if "cost_frac" in r)
    # the same lines in acceptance.jsonl; the final one carries the run's total
    spec = [json.loads(line) for line in (run_dir / "acceptance.jsonl").read_text().splitlines()]
    assert spec[:-1] == passes and spec[-1]["final"] and spec[-1]["passes"] == len(passes)
    # a pass by the clock ends its rows where they are once its budget is spent: after one verify step
    # a row here; the final pass decodes the same prompts to their end (its budget is checked between
    # sessions only) and checks them against plain greedy decoding
    assert spec[-1]["lossless"] == spec[-1]["prompts"] == 2 and spec[-1]["steps"] > 2
    assert all(r["steps"] == 2 and r["tokens"] < spec[-1]["tokens"] for r in passes), passes
    # train-line readers (report, status) skip them
    train, evals = read_metrics(run_dir)
    assert train and not evals and all("loss" in r for r in train)

    # the console: a line per pass (the launcher reads drafter 0's health), the total at the end
    said = [line for line in out.stdout.splitlines() if line.startswith("real acceptance @")]
    assert said and said[0].startswith(f"real acceptance @{passes[0]['step']}: "), out.stdout[-3000:]
    assert "lossless not checked on 2 held-out prompts; pass " in said[0] and "% of " in said[0]
    assert f"real acceptance during training: {len(passes)} passes, " in out.stdout
    # and in drafter 0's last event, which a run stopped before its end has too
    (stopped,) = events((run_dir / "logs" / "drafter-0.log").read_text(), "stopped")
    assert stopped["real_acceptance"]["passes"] == len(passes) and stopped["real_acceptance"]["cost_frac"] > 0

    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return
    board = EventAccumulator(str(run_dir / "tensorboard"))
    board.Reload()
    steps = [e.step for e in board.Scalars("spec/cost_frac")]
    assert steps == [r["step"] for r in passes] + [spec[-1]["step"]]
