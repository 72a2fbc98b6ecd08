"""The launcher's bookkeeping with real processes: which pids it may signal, what runs/latest and
`status` say about a run, a second Ctrl-C, the progress line on a narrow terminal."""

import fcntl
import json
import os
import pty
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import textwrap
import time
from pathlib import Path

import pytest

from launcher import process
from tests.launching import child_env, free_ports, run_launcher, running, start_launcher


@pytest.fixture
def sleepers():
    procs = []

    def start():
        p = subprocess.Popen(["sleep", "3600"])
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait()


def write_run(run_dir: Path, launcher: dict | None, workers: list[dict | None], outcome: dict | None = None) -> None:
    """A run.json as `launcher up` writes it; pids and identities are whatever the test says."""
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = [
        {
            "role": "target" if i == 0 else "drafter",
            "rank": max(0, i - 1),
            "gpu": i,
            "host": "",
            "name": "target-0" if i == 0 else f"drafter-{i - 1}",
            "pid": ident["pid"] if ident else None,
            "identity": ident,
            "pids_seen": [ident["pid"]] if ident else [],
            "endpoints": {"health": f"ipc://{run_dir}/sock/w{i}.health", "data": f"ipc://{run_dir}/sock/w{i}.data"},
        }
        for i, ident in enumerate(workers)
    ]
    run = {"launcher_pid": launcher["pid"] if launcher else 999999, "launcher": launcher, "workers": rows}
    if outcome:
        run["outcome"] = outcome
    (run_dir / "run.json").write_text(json.dumps(run))


def reused(pid: int) -> dict:
    """The identity a worker had before its pid went to another process (as after a reboot)."""
    return {"pid": pid, "create_time": time.time() - 86400, "cmdline": [sys.executable, "-m", "services.drafter"]}


# --- 2: identity before any signal ------------------------------------------------------------------


@pytest.mark.processes
def test_down_leaves_processes_that_only_share_a_recorded_pid_alone(tmp_path, sleepers):
    a, b = sleepers(), sleepers()
    write_run(tmp_path / "run", reused(a.pid), [reused(a.pid), reused(b.pid)])
    out = run_launcher("down", "--run-dir", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"nothing to stop in {tmp_path / 'run'}"), out.stdout
    time.sleep(0.5)
    assert a.poll() is None and b.poll() is None, "down signalled processes it did not start"

    # a run.json from before identities were recorded: pids alone are never trusted
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "run.json").write_text(
        json.dumps(
            {
                "launcher_pid": a.pid,
                "workers": [
                    {
                        "name": "drafter-0",
                        "gpu": 0,
                        "pid": b.pid,
                        "pids_seen": [b.pid],
                        "endpoints": {"health": "ipc:///x"},
                    }
                ],
            }
        )
    )
    out = run_launcher("down", "--run-dir", str(legacy))
    assert out.returncode == 0 and out.stdout.startswith("nothing to stop"), out.stdout + out.stderr
    assert a.poll() is None and b.poll() is None


@pytest.mark.processes
def test_down_stops_a_process_whose_identity_matches(tmp_path, sleepers):
    worker = sleepers()
    write_run(tmp_path / "run", None, [process.identity(worker.pid)])
    out = run_launcher("down", "--run-dir", str(tmp_path / "run"))
    assert out.returncode == 0 and out.stdout.startswith("stopped"), out.stdout + out.stderr
    assert worker.wait(timeout=10) == -signal.SIGTERM


@pytest.mark.processes
def test_identity_survives_only_for_the_same_process(sleepers):
    p = sleepers()
    ident = process.identity(p.pid)
    assert ident["cmdline"] == ["sleep", "3600"]  # not the empty cmdline of a process mid-exec
    assert process.alive(ident) and process.tree(ident)[0].pid == p.pid
    assert not process.alive(dict(ident, create_time=ident["create_time"] - 5))
    assert not process.alive(dict(ident, cmdline=["python3", "worker"]))
    process.kill_tree(dict(ident, cmdline=["other"]))  # a mismatch is never signalled
    assert p.poll() is None
    p.kill()
    p.wait()
    assert not process.alive(ident)


# --- 3, 4: which run, and how it ended ---------------------------------------------------------------


@pytest.mark.processes
def test_down_and_status_name_the_live_runs(tmp_path, sleepers):
    launcher_a = sleepers()
    runs = tmp_path / "runs"
    write_run(runs / "A", process.identity(launcher_a.pid), [None, None])
    write_run(
        runs / "B",
        None,
        [None, None],
        outcome={
            "state": "failed",
            "exit": 1,
            "ended": time.time(),
            "reason": "target-0 exited with code 1 while starting",
        },
    )
    out = run_launcher("down", "--run-dir", str(runs / "B"))
    assert out.returncode == 0 and "stopped" not in out.stdout.split(":")[0], out.stdout
    assert f"live runs: {runs / 'A'} (launcher pid {launcher_a.pid})" in out.stdout
    assert "failed: target-0 exited with code 1 while starting" in out.stdout
    assert launcher_a.poll() is None
    status = run_launcher("status", "--run-dir", str(runs / "B"), "--timeout", "0.5")
    assert status.returncode == 1, status.stdout  # the run's own exit code, not "unreachable"
    assert status.stdout.startswith(f"run {runs / 'B'}: failed: target-0 exited with code 1 while starting (exit 1, ")
    assert f"live runs: {runs / 'A'}" in status.stdout


@pytest.mark.processes
@pytest.mark.parametrize("state, code", [("finished", 0), ("stopped", 3)])
def test_status_of_an_ended_run_says_how_it_ended(tmp_path, state, code):
    write_run(
        tmp_path / "run", None, [None, None], outcome={"state": state, "exit": code, "ended": time.time(), "reason": ""}
    )
    out = run_launcher("status", "--run-dir", str(tmp_path / "run"), "--timeout", "0.5")
    assert out.returncode == code and f": {state} (exit {code}" in out.stdout.splitlines()[0], out.stdout


# --- 5: labelled columns, probes in parallel ------------------------------------------------------------


@pytest.mark.processes
def test_status_probes_dead_workers_in_parallel_and_labels_columns(tmp_path):
    write_run(tmp_path / "run", None, [None, None, None])
    start = time.monotonic()
    out = run_launcher("status", "--run-dir", str(tmp_path / "run"), "--timeout", "3")
    elapsed = time.monotonic() - start
    assert out.returncode == 2, out.stdout + out.stderr  # no outcome recorded: every worker unreachable
    assert elapsed < 7.5, f"3 dead workers took {elapsed:.1f}s: probed one after another"
    header = out.stdout.splitlines()[1].split()
    assert header[:8] == ["name", "gpu", "pid", "state", "step", "batches", "tok/s", "samples"]
    assert "ended without recording an outcome" in out.stdout.splitlines()[0]
    assert "tokens this rank trained per second over the last metrics window" in out.stdout


# --- 9: signals, terminal, help -------------------------------------------------------------------------

STUBBORN = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from launcher.supervisor import Supervisor
    from launcher.topology import parse_gpu_spec
    from services.run.config import load_config

    class Stubborn(Supervisor):
        def argv(self, w):   # a worker whose graceful stop hangs (ignores SIGTERM)
            hang = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
            return [sys.executable, "-c", hang]

    sup = Stubborn(Path(sys.argv[1]), load_config(None, []), parse_gpu_spec("0:target,1:drafter"), "cpu",
                   stop_timeout_s=300)
    sup.install_signal_handlers()
    sup.start_all()
    print("pids", *[p.pid for p in sup.procs.values()], flush=True)
    while not sup.stopping:
        time.sleep(0.1)
    start = time.monotonic()
    code = sup.shutdown()
    print("exit", code, round(time.monotonic() - start, 1), flush=True)
""")


@pytest.mark.processes
def test_second_ctrl_c_kills_a_stuck_stop(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", STUBBORN, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()[1:]]
        assert len(pids) == 2
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        assert "Ctrl-C again" in proc.stdout.readline()  # the graceful stop has begun, and hangs
        proc.send_signal(signal.SIGINT)  # the same sender again: the same request
        time.sleep(2.5)
        subprocess.run(["kill", "-INT", str(proc.pid)], check=True)  # another sender, later: a person
        out, err = proc.communicate(timeout=30)  # not the 300 s stop timeout
    finally:
        proc.kill()
    assert f"SIGINT from pid {os.getpid()} again: the same stop request" in err
    assert "second signal: killing every worker now" in err
    assert out.split()[:2] == ["exit", "3"] and float(out.split()[2]) < 20, out
    assert not any(running(p) for p in pids)


@pytest.mark.processes
def test_progress_line_fits_a_narrow_terminal():
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 60, 0, 0))
    code = (
        "from launcher.progress import ProgressLine\n"
        "p = ProgressLine()\n"
        "p.show('starting… waiting for ' + ' '.join(f'drafter-{i}:compiling' for i in range(8)))\n"
        "p.show('short')\n"
        "p.done('end')\n"
    )
    env = {k: v for k, v in child_env().items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=child, stdout=child, stderr=child, env=env)
    os.close(child)
    proc.wait(timeout=30)
    out = b""
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    os.close(main)
    redraws = out.decode().replace("\r\n", "\n").split("\r")
    assert any(r.startswith("starting… waiting for drafter-0") for r in redraws), redraws
    assert max(len(r.rstrip("\n")) for r in redraws) <= 59, [len(r) for r in redraws]


@pytest.mark.processes
def test_help_describes_every_option_with_defaults():
    from launcher.parser import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for name, sub in commands.items():
        for action in sub._actions:
            assert action.help, f"launcher {name} {action.option_strings or action.dest}: no help"
    up = " ".join(run_launcher("up", "--help").stdout.split())  # argparse wraps lines anywhere
    assert "(default: 3600.0)" in up and "(default: cuda)" in up
    assert "3 stopped by a signal before the end" in up
    version = run_launcher("--version")
    assert version.returncode == 0 and version.stdout.startswith("launcher ")


@pytest.mark.processes
def test_gpus_with_a_comma_inside_a_role_suggests_plus():
    out = run_launcher("up", "--device", "cpu", "--gpus", "0,1:target,2:drafter")
    assert out.returncode == 2 and "did you mean 0+1:target?" in out.stderr, out.stderr


# --- 7 and 3 on the demo: errors before workers, and runs/latest ------------------------------------------


@pytest.mark.processes
def test_target_too_shallow_is_a_config_error_before_any_worker(tmp_path):
    out = run_launcher(
        "up",
        "--demo",
        "--device",
        "cpu",
        "--gpus",
        "0:target,1:drafter",
        "--run-dir",
        str(tmp_path / "run"),
        "drafter.num_layers=5",
        timeout=300,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "4 decoder layers, too few for drafter.num_layers=5" in out.stderr and "target.layer_ids" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert not (tmp_path / "run" / "run.json").exists()  # no worker was started


@pytest.mark.processes
def test_a_run_that_fails_while_starting_does_not_become_latest(sleepers):
    # a short folder: ipc socket paths under runs/<name>-<time>/sock must stay within 107 bytes
    tmp_path = Path(tempfile.mkdtemp(prefix="dfl"))
    runs = tmp_path / "runs"
    live = sleepers()
    write_run(runs / "A", process.identity(live.pid), [None, None])
    os.symlink("A", runs / "latest")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\nnot json\n')
    out = run_launcher(
        "up", "--demo", "--device", "cpu", "--gpus", "0:target,1:drafter", f"data.path={bad}", cwd=tmp_path, timeout=400
    )
    assert out.returncode != 0, out.stdout
    assert os.readlink(runs / "latest") == "A"
    failed = [d for d in runs.iterdir() if d.name not in ("A", "latest")]
    if failed and (failed[0] / "run.json").exists():  # it got as far as starting workers
        outcome = json.loads((failed[0] / "run.json").read_text())["outcome"]
        assert outcome["state"] == "failed" and outcome["exit"] == 1 and "bad.jsonl:1" in outcome["reason"], outcome
    status = run_launcher("status", "--timeout", "0.5", cwd=tmp_path)  # runs/latest: still A
    assert status.stdout.startswith(f"run {runs / 'A'}: running"), status.stdout
    shutil.rmtree(tmp_path)


@pytest.mark.training  # its second launch starts the workers
def test_a_bad_data_line_stops_up_before_any_worker_and_skips_are_reported(tmp_path):
    bad = tmp_path / "bad.jsonl"
    good = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}\n'
    bad.write_text(good * 20 + "not json\n" + good * 20)
    start = time.monotonic()
    out = run_launcher(
        "up",
        "--demo",
        "--device",
        "cpu",
        "--gpus",
        "0:target,1:drafter",
        f"data.path={bad}",
        "--run-dir",
        str(tmp_path / "run"),
        cwd=tmp_path,
        timeout=400,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "bad.jsonl:21:" in out.stderr and len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert not (tmp_path / "run" / "run.json").exists() and not (tmp_path / "run" / "logs").exists()  # no worker
    assert time.monotonic() - start < 200

    proc = start_launcher(
        "up",
        "--demo",
        "--device",
        "cpu",
        "--gpus",
        "0:target,1:drafter",
        f"data.path={bad}",
        "data.on_bad_sample=skip",
        "--run-dir",
        str(tmp_path / "skip"),
        cwd=tmp_path,
    )
    try:
        lines = [proc.stdout.readline() for _ in range(3)]
        line = next(l for l in lines if l.startswith("data: "))
        assert "skipped 1 bad lines (data.on_bad_sample=skip), first: " in line and "bad.jsonl:21:" in line, line
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=300)
    data = json.loads((tmp_path / "skip" / "data.json").read_text())
    assert data["bad_samples"] == 1 and data["train_rows"] >= 1
    status = run_launcher("status", "--run-dir", str(tmp_path / "skip"), "--timeout", "0.5", cwd=tmp_path)
    assert "data: " in status.stdout and "skipped 1 bad lines" in status.stdout, status.stdout + status.stderr


# --- how a run ends: finished only when the drafters reached their last step ----------------------------

WAITS = [sys.executable, "-c", "import time; time.sleep(600)"]  # a worker that never answers health


def ending_supervisor(
    run_dir: Path, drafters: list[str], spec: str = "0:target,1-2:drafter", host: str = "", overrides: tuple = ()
):
    """A Supervisor whose target waits and whose drafter rank r runs the Python code drafters[r]."""
    from launcher.supervisor import Supervisor
    from launcher.topology import parse_gpu_spec
    from services.run.config import load_config

    class Ending(Supervisor):
        def argv(self, w):
            return WAITS if w.role == "target" else [sys.executable, "-c", drafters[w.rank]]

    return Ending(
        run_dir,
        load_config(None, list(overrides)),
        parse_gpu_spec(spec),
        "cpu",
        host=host,
        ready_timeout_s=60,
        stop_timeout_s=30,
    )


@pytest.mark.processes
@pytest.mark.parametrize(
    "codes, exit_code, state, reason",
    [
        ((3, 3), 3, "stopped", "drafter-0, drafter-1 stopped before the end of training (a stop request sent to it)"),
        ((0, 3), 3, "stopped", "drafter-1 stopped before the end of training (a stop request sent to it)"),
        ((0, 0), 0, "finished", ""),  # e.g. --resume of a finished run: load the last step, export, exit 0
    ],
)
def test_drafters_that_end_before_they_are_seen_ready(tmp_path, codes, exit_code, state, reason):
    """A drafter that exits 3 (exits.STOPPED) before the launcher saw it ready has stopped: the run
    is stopped, not "failed while starting" and not finished; only exit 0 from all of them finishes it."""
    from launcher.up import run_supervised

    sup = ending_supervisor(tmp_path, [f"import sys; sys.exit({c})" for c in codes])
    code, why = run_supervised(sup)
    sup.record_outcome(code, why)
    outcome = json.loads((tmp_path / "run.json").read_text())["outcome"]
    assert (code, outcome["state"], outcome["exit"], outcome["reason"]) == (exit_code, state, exit_code, reason)
    assert all(p.poll() is not None for p in sup.procs.values())  # the target was stopped too


SIGTERM_EXITS = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit({})); time.sleep(600)"


@pytest.mark.processes
@pytest.mark.parametrize(
    "drafter, exit_code",
    [
        (SIGTERM_EXITS.format(3), 3),  # stopped mid-run: checkpoint, exit 3
        ("import sys; sys.exit(0)", 0),  # the drafters had finished before the stop: training is done
    ],
    ids=["stopped-mid-run", "finished-before-the-stop"],
)
def test_a_stop_of_the_launcher_is_stopped_unless_training_had_ended(tmp_path, drafter, exit_code):
    sup = ending_supervisor(tmp_path, [drafter, drafter])
    sup.start_all()
    if exit_code == 0:
        for w in sup.local:
            if w.role == "drafter":
                sup.procs[w.name].wait(timeout=60)
    else:
        time.sleep(1.0)  # the handlers are installed
    sup.stopping = True  # what SIGTERM/SIGINT to the launcher sets
    assert sup.supervise() == exit_code
    assert not any(process.alive(ident) for ident in sup.idents.values())


@pytest.mark.processes
@pytest.mark.parametrize("step, exit_code", [(37, 3), (150, 0)])
def test_a_host_with_targets_only_ends_as_the_remote_drafters_did(tmp_path, step, exit_code):
    """The drafters' host reports "stopped" both at the end and after a stop: the target host
    reads the last step from that status, so a run stopped at step 37/150 is stopped there too."""
    from launcher.topology import host_overrides, parse_gpu_spec
    from services.net.endpoints import endpoint
    from services.process.health import HealthServer

    spec = "0:target@127.0.0.1,0:drafter@127.0.0.2"
    overrides = (
        *host_overrides(parse_gpu_spec(spec)),
        f"transport.base_port={free_ports(1024, align=1024)}",
    )
    sup = ending_supervisor(tmp_path, [], spec=spec, host="127.0.0.1", overrides=overrides)
    remote = HealthServer(endpoint(tmp_path, sup.cfg.transport, "drafter", 0, "health"), "drafter", 0, 0)
    try:
        remote.set(state="stopped", step=step, total_steps=150)
        sup.start_all()
        assert sup.supervise() == exit_code
    finally:
        remote.close()
    assert sup.stop_reason == (
        "" if exit_code == 0 else "drafter-0 at step 37/150 stopped before the end of training (seen from this host)"
    )
    assert sup.procs["target-0"].poll() is not None
