"""`launcher plan`: the split arithmetic, and the whole command on the demo (real measurement)."""

import pytest

from launcher.gpu_split import best, splits
from tests.launching import run_launcher


@pytest.mark.inprocess
def test_the_split_follows_the_slower_role():
    rows = splits(8, a=9_200, b=33_668)  # 27B-class target: about 3.7 targets per drafter
    assert [r["targets"] for r in rows] == [1, 2, 3, 4, 5, 6, 7]
    pick = best(rows)
    assert (pick["targets"], pick["drafters"], pick["bound"]) == (6, 2, "target")
    assert pick["tok_s"] == 6 * 9_200 and pick["drafter_busy"] == pytest.approx(6 * 9_200 / (2 * 33_668))
    pick = best(splits(8, a=33_000, b=54_000))  # 8B-class target
    assert (pick["targets"], pick["drafters"], pick["tok_s"]) == (5, 3, 162_000)
    assert best(splits(2, a=10.0, b=10.0))["tok_s"] == 10.0


@pytest.mark.training  # it measures a target and a drafter
def test_plan_on_the_demo_measures_both_roles_and_prints_a_split(tmp_path):
    out = run_launcher("plan", "--demo", "--device", "cpu", "--gpus", "3", "--seconds", "1", cwd=tmp_path, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "one cpu: target " in out.stdout and " tok/s (packed capture" in out.stdout
    assert out.stdout.count("<- best") == 1
    assert "use: --gpus 0:target,1-2:drafter" in out.stdout or "use: --gpus 0-1:target,2:drafter" in out.stdout


@pytest.mark.processes
def test_plan_refuses_a_single_gpu():
    out = run_launcher("plan", "--demo", "--device", "cpu", "--gpus", "1", timeout=120)
    assert out.returncode == 2 and "at least 2 GPUs" in out.stderr
