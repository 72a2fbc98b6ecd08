"""The whole service as a user runs it: `launcher up --demo --device cpu`, real processes, real sockets.

The dense quality run (the demo as a user runs it: the drafter learns and beats the controls), then
lifecycle runs on the plumbing settings (tests/launching.py PLUMBING): a target killed mid-run and
restarted without losing or repeating a batch, the launcher killed, status / down / resume, README's
commands.
"""

import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

from services.drafter.books.ledger import read_all
from services.run.files import sha256_file
from tests.launching import PLUMBING, REPO, child_env, launcher_argv, run_launcher, running

DEMO = ["--demo", "--device", "cpu", "--gpus", "0:target,1-2:drafter"]


def launcher(run_dir: Path, *extra: str) -> list[str]:
    return launcher_argv("up", *DEMO, "--run-dir", str(run_dir), *extra)


def plumbing(run_dir: Path, *extra: str) -> list[str]:
    """The demo on the plumbing settings, its packed data from the asset store."""
    return launcher(run_dir, *PLUMBING, *extra)


def metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if not m.get("eval") and not m.get("spec")]  # the train lines


def assert_exactly_once(run_dir: Path) -> Counter:
    schedule = json.loads((run_dir / "schedule.json").read_text())
    trained = Counter(entry["g"] for entry in read_all(run_dir))
    assert sorted(trained) == list(range(schedule["total_batches"])), "some batch index was never trained"
    assert max(trained.values()) == 1, f"trained twice: {[g for g, n in trained.items() if n > 1][:10]}"
    return trained


def all_pids(run_dir: Path) -> list[int]:
    run = json.loads((run_dir / "run.json").read_text())
    return [pid for w in run["workers"] for pid in w["pids_seen"]]


def assert_no_worker_left(run_dir: Path) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(running(p) for p in all_pids(run_dir)):
        time.sleep(0.2)
    left = [p for p in all_pids(run_dir) if running(p)]
    assert not left, f"workers still running after the launcher exited: {left}"


@pytest.mark.quality
@pytest.mark.timeout(1500)  # the first demo run of a test run builds the demo too
def test_demo_trains_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run(launcher(run_dir, "run.epochs=1"), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "all workers ready" in out.stdout and "training finished" in out.stdout

    run = json.loads((run_dir / "run.json").read_text())
    pids = {w["name"]: w["pids_seen"] for w in run["workers"]}
    assert len({p for ps in pids.values() for p in ps}) == 3 and os.getpid() not in pids.values()
    assert_no_worker_left(run_dir)

    steps = metrics(run_dir)
    first = sum(m["loss"] for m in steps[:5]) / 5
    last = sum(m["loss"] for m in steps[-5:]) / 5
    assert last < first * 0.9, f"loss did not fall: {first:.3f} -> {last:.3f}"
    assert_exactly_once(run_dir)

    # real acceptance at the end: printed, lossless, and far above the controls on the same prompts
    assert "real acceptance (step" in out.stdout
    spec = [json.loads(line) for line in (run_dir / "acceptance.jsonl").read_text().splitlines()]
    assert any(not m.get("final") for m in spec)  # also during training, after each evaluation
    final = spec[-1]
    assert final.get("final") and final["step"] == steps[-1]["step"]
    assert final["lossless"] == final["prompts"] == final["repeat_last"]["lossless"] == final["random"]["lossless"]
    assert final["acceptance_per_prompt"] >= 2 * final["random"]["acceptance_per_prompt"]
    assert final["acceptance_per_prompt"] > final["repeat_last"]["acceptance_per_prompt"]
    if importlib.util.find_spec("tensorboard"):  # the same figures as TensorBoard scalars
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(run_dir / "tensorboard"))
        events.Reload()
        assert [(e.step, e.value) for e in events.Scalars("spec/acceptance_per_prompt")] == [
            (r["step"], pytest.approx(r["acceptance_per_prompt"])) for r in spec
        ]
        assert events.Scalars("spec/random/acceptance_per_prompt")[-1].value == pytest.approx(
            final["random"]["acceptance_per_prompt"]
        )
    # verified by the target worker: drafter rank 0 never held a target model
    events = [
        json.loads(line.split(" ", 2)[2])
        for line in (run_dir / "logs" / "drafter-0.log").read_text().splitlines()
        if '"event": "spec_eval"' in line
    ]
    assert events and all(e["target_models_in_process"] == 0 and e["skipped"] == 0 for e in events)

    # `launcher eval` of the export on two prompt-set files: the same loop, run from the CLI with the
    # target loaded; a table per set and one for both, each with the controls
    chats = [
        json.loads(line)
        for line in Path(json.loads((run_dir / "config.json").read_text())["data"]["path"]).read_text().splitlines()[:8]
    ]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": c["messages"]}) + "\n" for c in chats[:4]))
    (tmp_path / "plain.jsonl").write_text(
        "".join(json.dumps({"prompt": c["messages"][0]["content"]}) + "\n" for c in chats[4:])
    )
    ev = run_launcher(
        "eval",
        "--run-dir",
        str(run_dir),
        "--checkpoint",
        str(run_dir / "export"),
        "--prompts",
        "chat.jsonl",
        "--prompts",
        "plain.jsonl",
        "--max-new-tokens",
        "32",
        timeout=600,
        cwd=tmp_path,
    )
    assert ev.returncode == 0, ev.stderr[-3000:]
    out = ev.stdout.splitlines()
    for head in ("chat (4 prompts):", "plain (4 prompts):", "all sets (8 prompts):"):
        rows = out[out.index(head) + 2 : out.index(head) + 5]
        assert [r.split()[0] for r in rows] == ["drafter", "repeat-last", "random"], ev.stdout
        assert all(r.endswith(("4/4" if head != "all sets (8 prompts):" else "8/8")) for r in rows), ev.stdout
    record = json.loads((run_dir / "spec_eval.jsonl").read_text().splitlines()[-1])
    assert record["prompts"] == 8 and record["lossless"] == 8 and record["random"]["lossless"] == 8
    assert record["acceptance_per_prompt"] > record["repeat_last"]["acceptance_per_prompt"]
    assert record["prompt_files"] == [str(tmp_path / "chat.jsonl"), str(tmp_path / "plain.jsonl")]
    exported = json.loads((run_dir / "export" / "export.json").read_text())["step"]  # what eval measured
    assert record["drafter_step"] == exported and f"(step {exported}, weights sha256 " in ev.stdout
    assert record["drafter_sha256"] == sha256_file(run_dir / "export" / "model.safetensors")
    for name in ("chat", "plain"):
        figures = record["sets"][name]
        assert figures["prompts"] == 4 and figures["lossless"] == figures["random"]["lossless"] == 4
        assert figures["acceptance_per_prompt"] > figures["random"]["acceptance_per_prompt"]


@pytest.mark.training
def test_killed_target_is_restarted_and_nothing_is_lost(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        plumbing(run_dir, "run.max_steps=60", "log.every=1", "transport.credits=3"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # wait until training is under way
            if (run_dir / "metrics.jsonl").exists() and len(metrics(run_dir)) >= 3:
                break
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        else:
            pytest.fail("training never started")
        target_pid = json.loads((run_dir / "run.json").read_text())["workers"][0]["pid"]
        os.kill(target_pid, signal.SIGKILL)
        output, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    assert (
        "target-0 exited with code -9 on gpu 0: killed by SIGKILL "
        "(often the kernel's OOM killer: see `dmesg`); restarting" in output
    )
    run = json.loads((run_dir / "run.json").read_text())
    target = next(w for w in run["workers"] if w["name"] == "target-0")
    assert len(target["pids_seen"]) == 2 and target["pids_seen"][0] == target_pid
    assert_exactly_once(run_dir)
    assert_no_worker_left(run_dir)


@pytest.mark.training
def test_launcher_kill_9_leaves_no_orphans(tmp_path):
    """kill -9 of the launcher: the kernel's parent-death signal takes the workers down."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(plumbing(run_dir), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (run_dir / "run.json").exists():
        time.sleep(0.2)
    while time.monotonic() < deadline and len([p for p in all_pids(run_dir) if psutil.pid_exists(p)]) < 3:
        time.sleep(0.2)
    pids = all_pids(run_dir)
    assert len(pids) == 3
    proc.kill()
    proc.wait()
    gone_by = time.monotonic() + 60  # workers finish their step (or their load) and exit
    while time.monotonic() < gone_by and any(running(p) for p in pids):
        time.sleep(0.5)
    assert_no_worker_left(run_dir)


STATUS_RUN = ("run.max_steps=200", "log.every=5", "eval.num_prompts=2", "eval.max_new_tokens=16")


@pytest.mark.training
def test_status_down_and_resume(tmp_path):
    """`launcher status` sees every worker; `launcher down` stops gracefully (drafters checkpoint);
    `launcher up --resume` finishes the run, and no batch is trained twice or skipped."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        # real acceptance on 2 prompts: the finished run's final pass must not run again on a resume
        plumbing(run_dir, *STATUS_RUN),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not ((run_dir / "metrics.jsonl").exists() and len(metrics(run_dir)) >= 5):
            assert time.monotonic() < deadline and proc.poll() is None, "training never started"
            time.sleep(0.2)
        status = run_launcher("status", "--run-dir", str(run_dir), "--json", timeout=60)
        assert status.returncode == 0, status.stdout + status.stderr
        rows, plan = json.loads(status.stdout)["workers"], json.loads(status.stdout)["plan"]
        assert [r["name"] for r in rows] == ["target-0", "drafter-0", "drafter-1"]
        assert all(r["state"] == "training" and r["probe"] == 0 for r in rows), rows
        assert plan == {k: v for k, v in json.loads((run_dir / "schedule.json").read_text()).items() if k != "targets"}
        assert [r["total_steps"] for r in rows] == [None, plan["optimizer_steps"], plan["optimizer_steps"]]
        # loss, τ, tok/s: exactly the metrics.jsonl line of that step (all ranks, its window)
        window = json.loads(status.stdout)["window"]
        line = next(m for m in metrics(run_dir) if m["step"] == window["step"])
        assert {k: line[k] for k in ("loss", "tau", "tokens_per_s", "data_wait_frac")} == {
            k: window[k] for k in ("loss", "tau", "tokens_per_s", "data_wait_frac")
        }
        assert rows[0]["batches_served"] > 0 and rows[1]["tokens_per_s"] > 0
        table = run_launcher("status", "--run-dir", str(run_dir), timeout=60).stdout
        assert "drafter-1" in table and "training" in table and f"run {run_dir}: running" in table
        assert "metrics @" in table and "(all ranks, last " in table
        assert f"plan: {plan['optimizer_steps']} optimizer steps x 1 micro-batches on each of 2 drafters" in table

        down = run_launcher("down", "--run-dir", str(run_dir), timeout=400)
        assert down.returncode == 0 and "killed hard" not in down.stdout, down.stdout
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, output[-2000:]  # stopped before the end
    assert_no_worker_left(run_dir)
    stopped_at = max(m["step"] for m in metrics(run_dir))
    assert (run_dir / "checkpoints" / "latest").exists()
    assert json.loads((run_dir / "run.json").read_text())["outcome"]["state"] == "stopped"
    hint = output.split("stopped before the end; to continue: ")[1].splitlines()[0]
    resume = [sys.executable, "-m"] + shlex.split(hint)  # the printed command, as the user would paste it
    assert resume[-3:] == ["--run-dir", str(run_dir), "--resume"] and all(o in resume for o in STATUS_RUN)

    saved = (run_dir / "checkpoints" / "latest").resolve()
    again = subprocess.run(resume, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-2000:]
    assert f"resumed from step {int(saved.name.split('-')[1])} ({saved})" in again.stdout, again.stdout[-3000:]
    resumed = json.loads((run_dir / "run.json").read_text())["resumed"]  # recorded beside the outcome too
    assert resumed == {"step": int(saved.name.split("-")[1]), "checkpoint": str(saved), "skipped": []}, resumed
    steps = [m["step"] for m in metrics(run_dir)]
    assert steps == sorted(steps) and steps[-1] > stopped_at  # the curve continues, no step twice
    assert_exactly_once(run_dir)
    status = run_launcher("status", "--run-dir", str(run_dir), "--timeout", "0.5", timeout=60)
    assert status.returncode == 0 and status.stdout.startswith(f"run {run_dir}: finished (exit 0"), status.stdout

    # --resume of a finished run: the drafters load the last step, export and exit 0 at once; the
    # launcher must end the run then, not wait --ready-timeout for drafters that will never be ready
    start = time.monotonic()
    done = subprocess.run(resume + ["--ready-timeout", "500"], capture_output=True, text=True, timeout=400)
    assert done.returncode == 0 and time.monotonic() - start < 300, done.stdout[-3000:] + done.stderr[-2000:]
    assert json.loads((run_dir / "run.json").read_text())["outcome"]["state"] == "finished"
    assert f"resumed from step {steps[-1]} " in done.stdout, done.stdout[-3000:]
    finals = [line for line in (run_dir / "acceptance.jsonl").read_text().splitlines() if '"final": true' in line]
    assert len(finals) == 1, finals  # the finished run's final eval is not run again
    assert_exactly_once(run_dir)


def readme_command(start: str) -> list[str]:
    """The README's command that starts with `start` (after any `cmd &&`), comment dropped, as argv."""
    import shlex

    readme = (REPO / "README.md").read_text()
    for line in readme.splitlines():
        command = line.split("&&")[-1].split("#")[0].strip()
        if command.startswith(start):
            argv = shlex.split(command)
            return launcher_argv(*argv[1:])
    raise AssertionError(f"README.md has no `{start}` command")


@pytest.mark.training
def test_the_readme_export_command_works_right_after_the_readme_demo():
    """README's demo (a few steps of it), then README's export command, as written, from the same folder."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rd", dir="/tmp") as folder:  # short: ipc paths stay < 108 bytes
        readme_demo_then_export(Path(folder))


def readme_demo_then_export(tmp_path: Path) -> None:
    env = child_env()
    up = subprocess.run(
        # a few steps, no real-acceptance pass (the quality run checks that one)
        readme_command("launcher up --demo") + ["run.max_steps=4", "eval.num_prompts=0"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        umask=0o022,
    )
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    assert "(step 4: last); vLLM num_speculative_tokens = 7 (block_size 8 - 1)" in up.stdout  # the demo's B = 8

    export = readme_command("launcher export")
    export[export.index("DIR")] = str(tmp_path / "served")
    out = subprocess.run(export, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, umask=0o022)
    assert out.returncode == 0, out.stderr[-3000:]
    assert '"num_speculative_tokens": 7' in out.stdout
    files = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "served").iterdir()}
    assert files == {"config.json": 0o644, "export.json": 0o644, "model.safetensors": 0o644}
    record = json.loads((tmp_path / "served" / "export.json").read_text())
    assert (record["step"], record["last"], record["best"]) == (4, True, False)
