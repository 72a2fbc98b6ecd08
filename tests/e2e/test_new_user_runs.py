"""What a new user met in the first week (issue 49) that only a real run shows: short runs of
`launcher up --demo` on a small untrained demo (tests/demo_cache.py), real workers and sockets."""

import json
import subprocess
import time

import pytest

from tests.demo_cache import untrained_demo_cache
from tests.launching import child_env, launcher_argv, spawn_drafter

SHORT = ["run.epochs=1", "run.max_steps=6", "eval.every=0", "eval.num_prompts=2", "checkpoint.export_at_end=false"]

pytestmark = pytest.mark.training  # each test runs launcher up with real workers


def test_up_piped_into_head_goes_on_to_its_end_and_records_its_outcome(tmp_path):
    """`launcher up ... | head -3`: the reader goes away after three lines; the run trains to its
    end and records it, its output to the closed pipe dropped."""
    env = child_env(DFLASH_CACHE_DIR=untrained_demo_cache(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    argv = launcher_argv("up", "--demo", "--device", "cpu", "--gpus", "0:target,1:drafter", "--run-dir", run_dir)
    proc = subprocess.Popen([*argv, *SHORT], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    head = [proc.stdout.readline() for _ in range(3)]
    proc.stdout.close()  # `head -3` exits
    code = proc.wait(timeout=300)
    outcome = json.loads((run_dir / "run.json").read_text()).get("outcome") or {}
    assert code == 0 and outcome.get("state") == "finished", (code, outcome, head)
    assert (run_dir / "metrics.jsonl").read_text().count("\n") >= 1


def test_a_worker_exits_within_a_second_of_its_last_line(tmp_path):
    """A drafter that ends (here its plan done; a NonFiniteError ends it the same way) leaves at
    once: the interpreter's teardown of torch and the rest took 3 to 8 s of a busy CPU after its
    last line, seconds the launcher waited before it ended the run."""
    proc = spawn_drafter(
        tmp_path, "--max-steps", "2", "data.pack_len=256", "drafter.num_anchors=16", "drafter.num_layers=1"
    )
    last = time.monotonic()
    for _ in proc.stdout:  # its log lines, unbuffered, as they come
        last = time.monotonic()
    proc.wait(timeout=120)
    took = time.monotonic() - last
    assert proc.returncode == 0, proc.stderr.read()[-2000:]
    assert took < 1.0, f"exited {took:.1f}s after its last line"


def test_the_live_line_says_what_the_drafters_wait_for_while_a_target_restarts(tmp_path):
    """target-0 killed mid-run: while it restarts and loads its model again (30-40 s on a busy CPU),
    the live line (a terminal here: it redraws every half second) says so first."""
    import os
    import pty
    import signal
    import threading

    env = child_env(DFLASH_CACHE_DIR=untrained_demo_cache(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    argv = launcher_argv("up", "--demo", "--device", "cpu", "--gpus", "0:target,1:drafter", "--run-dir", run_dir)
    terminal, console = pty.openpty()
    proc = subprocess.Popen(
        [*argv, "run.max_steps=30", "eval.every=0", "eval.num_prompts=0"],
        stdout=console,
        stderr=console,
        env=env,
    )
    os.close(console)
    seen = bytearray()

    def read():
        try:
            while chunk := os.read(terminal, 4096):
                seen.extend(chunk)
        except OSError:  # the launcher ended: the terminal is gone
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, seen.decode(errors="replace")[-2000:]
            time.sleep(0.2)
        workers = json.loads((run_dir / "run.json").read_text())["workers"]
        os.kill(next(w["pid"] for w in workers if w["name"] == "target-0"), signal.SIGKILL)
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=10)
        os.close(terminal)
    text = seen.decode(errors="replace")
    assert code == 0 and "target-0 exited with code -9" in text, text[-3000:]
    assert "\rwaiting for target-0 (loading, " in text or "\rwaiting for target-0 (starting, " in text, text[-3000:]
