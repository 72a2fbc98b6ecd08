"""What the launcher says when a worker exits (launcher/causes.py), one stop per stop request
(services/process/lifecycle.py), and one launcher per run dir (launcher/runlock.py)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from launcher import process
from launcher.causes import exit_cause, last_error_line, read_log
from services.process import exits
from services.process.lifecycle import PARENT_DIED, StopRequests
from tests.launching import child_env

# A worker process as the launcher starts one (process.spawn: its log, its start line), logging in
# the workers' format and ending through services/process/exits.py like every worker.
CRASH = textwrap.dedent("""
    import sys
    from services.process import exits
    from services.process.log import setup_logging
    setup_logging("drafter", 0)
    import torch
    try:
        {what}
    except Exception as exc:
        sys.exit(exits.exit_code(exc))
""")


def crash(log: Path, what: str) -> int:
    env = child_env()
    return process.spawn([sys.executable, "-c", CRASH.format(what=what)], env, log).wait(timeout=120)


@pytest.mark.processes
def test_the_cpu_allocator_running_out_is_an_out_of_memory_that_no_restart_mends(tmp_path):
    log = tmp_path / "drafter-0.log"
    code = crash(log, "torch.empty(1 << 46, dtype=torch.uint8)")  # the real allocator: 64 TiB, refused
    assert code == exits.CRASHED
    cause = exit_cause("drafter", code, read_log(log))
    assert "DefaultCPUAllocator: can't allocate memory: you tried to allocate 70368744177664 bytes" in cause.text
    assert cause.text.startswith("RuntimeError: ") and "Traceback" not in cause.text
    assert cause.fatal.startswith("out of memory: lower data.pack_len or drafter.num_anchors")
    assert "own" in exit_cause("target", code, read_log(log)).fatal


@pytest.mark.processes
def test_a_cuda_out_of_memory_is_named_as_torch_names_it(tmp_path):
    log = tmp_path / "drafter-1.log"
    message = (
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 GiB "
        "of which 1.06 GiB is free."
    )  # torch's wording of a CUDA OOM
    code = crash(log, f"raise torch.OutOfMemoryError({message!r})")
    cause = exit_cause("drafter", code, read_log(log))
    assert cause.text == f"torch.OutOfMemoryError: {message}" and cause.fatal


@pytest.mark.processes
def test_non_finite_data_exits_final_and_no_restart_is_tried(tmp_path):
    """A NonFiniteError (services/drafter/books/bookkeeping.py) repeats on a restart: its own exit code,
    and the launcher's cause is fatal the first time, not after a second exit with the same line."""
    log = tmp_path / "drafter-0.log"
    code = crash(
        log,
        "from services.drafter.books.bookkeeping import NonFiniteError; raise NonFiniteError("
        "'12 optimizer steps in a row skipped: non-finite hidden states of captured layer 2 from target-0')",
    )
    assert code == exits.FINAL == 4
    cause = exit_cause("drafter", code, read_log(log))
    assert cause.text.startswith("NonFiniteError: 12 optimizer steps in a row skipped") and "target-0" in cause.text
    assert cause.fatal and "restart" in cause.fatal
    assert not exit_cause("drafter", exits.CRASHED, read_log(log)).fatal  # the same line as a crash: once, kept


@pytest.mark.processes
def test_last_error_line_reads_the_latest_start_only_and_a_repeat_is_fatal(tmp_path):
    log = tmp_path / "target-0.log"
    first = crash(log, "raise ValueError('first start')")
    assert exit_cause("target", first, read_log(log)).text == "ValueError: first start"
    assert crash(log, "print('no error line')") == 0  # a start whose last line is not an error
    assert last_error_line(read_log(log)) == "no error line"
    crash(log, "raise KeyError('layer 7')")
    one = exit_cause("target", 1, read_log(log))
    assert one.text == "KeyError: 'layer 7'" and not one.fatal  # once: worth a restart
    twice = exit_cause("target", 1, read_log(log), previous=one.text)
    assert twice.fatal == "the same error twice in a row: a restart does not help"


@pytest.mark.parametrize(
    "code, text, fatal",
    [
        (-signal.SIGSEGV, "killed by SIGSEGV", False),
        (-signal.SIGKILL, "killed by SIGKILL (often the kernel's OOM killer: see `dmesg`)", False),
        (143, "hard exit: a second stop signal, or supervise.stop_timeout_s passed", False),
    ],
)
def test_signals_and_hard_exits_keep_the_restart_budget(code, text, fatal):
    cause = exit_cause("drafter", code, "")
    assert cause.text == text and bool(cause.fatal) == fatal


def test_a_config_error_is_fatal_with_its_line():
    log = "2026-12-01T02:40:00.123Z drafter-0 error config error: drafter.block_size must be >= 2\n"
    cause = exit_cause("drafter", 2, log)
    assert cause.text == "config error: drafter.block_size must be >= 2" and "no restart" in cause.fatal


def test_stop_requests_repeat_within_the_window_or_from_the_same_sender():
    r = StopRequests(repeat_s=2.0)
    assert r.classify(signal.SIGTERM, sender=100, now=0.0) == "stop"
    assert r.classify(signal.SIGTERM, sender=100, now=0.001) == "repeat"  # GNU timeout: pid, then group
    assert r.classify(signal.SIGTERM, sender=100, now=30.0) == "repeat"  # one sender's duplicate, ever
    assert r.classify(signal.SIGTERM, sender=200, now=1.0) == "repeat"  # too soon
    assert r.classify(signal.SIGTERM, sender=300, now=3.0) == "now"  # a second sender, later: a person
    ctrl_c = StopRequests(repeat_s=2.0)  # a terminal: no sender pid
    assert [ctrl_c.classify(signal.SIGINT, 0, t) for t in (0.0, 0.5, 2.5)] == ["stop", "repeat", "now"]
    orphan = StopRequests(repeat_s=2.0)  # the launcher died
    assert [orphan.classify(PARENT_DIED, 0, t) for t in (0.0, 0.08, 10.0)] == ["stop", "repeat", "repeat"]
    assert orphan.classify(signal.SIGTERM, 0, 11.0) == "now"


HOLD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from launcher.runlock import lock_run_dir
    lock_run_dir(Path(sys.argv[1]))
    print("locked", flush=True)
    time.sleep(600)
""")


@pytest.mark.processes
def test_the_run_dir_lock_names_its_holder_and_dies_with_it(tmp_path):
    from launcher.runlock import RunDirBusy, lock_run_dir

    run_dir = tmp_path / "run"
    run_dir.mkdir()  # `up` locks a run dir once it exists
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True, env=child_env()
    )
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(RunDirBusy, match=f"another launcher is running on {run_dir} \\(pid {holder.pid}\\)"):
            lock_run_dir(run_dir)
    finally:
        holder.kill()
        holder.wait()
    lock_run_dir(run_dir)  # kill -9 released it; the file now names this process
    assert (run_dir / "launcher.lock").read_text() == f"{os.getpid()}\n"
    assert oct((run_dir / "launcher.lock").stat().st_mode & 0o777) == "0o600"


LATE = textwrap.dedent("""
    import time
    from services.process import lifecycle
    stop = lifecycle.install()
    print("ready", flush=True)

    class Slow:              # work left for the interpreter's shutdown (a big model's teardown)
        def __del__(self):
            time.sleep(1.5)

    slow = Slow()
    stop.wait()
    print("done", flush=True)
""")


@pytest.mark.processes
def test_a_repeat_while_the_interpreter_shuts_down_does_not_kill_it():
    """Python gives signals back their default action (terminate) at shutdown: a repeat arriving
    then, after the checkpoint was written, must not end the worker with -15 instead of 0."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LATE], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=child_env()
    )
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.readline() == "done\n"
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(PARENT_DIED)
    assert proc.wait(timeout=30) == 0
