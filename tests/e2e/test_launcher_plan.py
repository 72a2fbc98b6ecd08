"""`launcher plan` on the demo (a real measurement); its split arithmetic: tests/unit/test_launcher_bookkeeping.py."""

import pytest

from tests.launching import run_launcher


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
