"""`launcher up --demo hybrid --device cpu`: the Qwen3.5 / Qwen3.6 family end to end on the CPU.

A tiny Gated DeltaNet + full-attention target, saved as the composite Qwen3_5ForConditionalGeneration
checkpoint, trained on the demo data when the demo is built; captured on the packed path; a drafter
trained on it; its export evaluated by `launcher eval`. About two minutes on 2 cores (the test
run's background builder makes the hybrid demo first: tests/conftest.py).
"""

import json
import subprocess
from pathlib import Path

import pytest

from tests.e2e.test_launcher_demo import assert_exactly_once, assert_no_worker_left, metrics
from tests.launching import launcher_argv, run_launcher

pytestmark = pytest.mark.quality
DEMO = ["--demo", "hybrid", "--device", "cpu", "--gpus", "0:target,1-2:drafter"]


@pytest.mark.timeout(1500)  # it builds the hybrid demo first (its target trained 300 steps, one thread)
def test_hybrid_demo_trains_exports_and_evaluates(tmp_path):
    run_dir = tmp_path / "run"
    # one real-acceptance pass in training (step 200) before the final one, 16 prompts x 32 new tokens
    # each: the passes on the CPU hybrid (a prompt at a time) were two thirds of this run's time
    out = run_launcher(
        "up",
        *DEMO,
        "--run-dir",
        str(run_dir),
        "run.epochs=1",
        "eval.every=200",
        "eval.max_new_tokens=32",
        "eval.num_prompts=16",
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "training finished" in out.stdout
    assert_no_worker_left(run_dir)
    config = json.loads(
        Path(json.loads((run_dir / "config.json").read_text())["target"]["model_path"], "config.json").read_text()
    )
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    target_log = (run_dir / "logs" / "target-0.log").read_text()
    assert "capture path: packed-reference" in target_log, target_log[-2000:]
    assert_exactly_once(run_dir)

    # the drafter learns: held-out tau far above an untrained drafter's (which is at most the
    # tau of the first ten steps: about 1.2; an untrained drafter is right 1 time in 704); the
    # held-out evaluation at step 200 (eval.every)
    steps = metrics(run_dir)
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
    assert evals, "no held-out evaluation"
    assert evals[-1]["tau"] >= max(3.0, 2 * steps[0]["tau"]), (steps[0]["tau"], evals[-1]["tau"])
    assert (run_dir / "export" / "model.safetensors").is_file()

    # real acceptance on the hybrid: the Gated DeltaNet state rolls back after every rejected draft
    spec = (
        [json.loads(line) for line in (run_dir / "acceptance.jsonl").read_text().splitlines()]
        if (run_dir / "acceptance.jsonl").is_file()
        else []
    )
    assert spec and spec[-1].get("final"), (
        "no real acceptance at the end of the run: "
        + "; ".join(
            line
            for line in (run_dir / "logs" / "drafter-0.log").read_text().splitlines()
            if "speculative decoding" in line
        )[-1000:]
    )
    final = spec[-1]
    assert final["lossless"] == final["prompts"] == final["repeat_last"]["lossless"] == final["random"]["lossless"]
    assert final["acceptance_per_prompt"] >= 2 * final["random"]["acceptance_per_prompt"]
    assert final["acceptance_per_prompt"] > final["repeat_last"]["acceptance_per_prompt"]

    ev = subprocess.run(
        launcher_argv(
            "eval",
            "--run-dir",
            str(run_dir),
            "--checkpoint",
            str(run_dir / "export"),
            "--prompts",
            "8",
            "--max-new-tokens",
            "32",
            "--batch",
            "3",
        ),  # 3 KV-cache rows for the 8 prompts, each with its Gated DeltaNet state, taking the next prompt
        # when its own ends (slots.py, continuous batching)
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ev.returncode == 0, ev.stderr[-3000:]
    drafter_line = next(line for line in ev.stdout.splitlines() if line.split()[:1] == ["drafter"])
    assert drafter_line.endswith("  8/8"), ev.stdout
    record = json.loads((run_dir / "spec_eval.jsonl").read_text().splitlines()[-1])
    assert record["prompts"] == 8 and record["lossless"] == 8 and record["random"]["lossless"] == 8
    assert record["acceptance_per_prompt"] >= 2 * record["random"]["acceptance_per_prompt"]
    assert record["acceptance_per_prompt"] > record["repeat_last"]["acceptance_per_prompt"]
