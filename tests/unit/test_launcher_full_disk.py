"""The launcher on a disk that is full (a real tmpfs that fills up), supervising real worker
processes that are ready at once and stay healthy."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.launching import child_env, running


def fill(folder: Path) -> None:
    """Take every free byte of the file system that holds folder."""
    with open(folder / "filler", "wb", buffering=0) as f:
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                pass


FAKE_RUN = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from launcher.up import run_supervised
    from launcher.supervisor import Supervisor
    from launcher.topology import parse_gpu_spec
    from services.run.config import load_config

    WORKER = ("import sys, time; from services.process.health import HealthServer; "
              "h = HealthServer(sys.argv[1], 'target', 0, 0); h.set(state='ready')\\n"
              "while True: h.progress(); time.sleep(0.2)")

    class Fake(Supervisor):
        def argv(self, w):            # a worker that is ready at once and stays healthy
            return [sys.executable, "-c", WORKER, self.endpoints(w)["health"]]

    sup = Fake(Path(sys.argv[1]), load_config(None, []), parse_gpu_spec("0:target,1:drafter"), "cpu")
    pids = lambda: [p.pid for p in sup.procs.values()]
    code, reason = run_supervised(sup, on_ready=lambda: print("ready", *pids(), flush=True))
    sup.record_outcome(code, reason)
    print("exit", code, flush=True)
""")


@pytest.mark.processes
def test_a_launcher_that_cannot_write_fails_the_run_in_one_line_and_stops_the_workers(small_disk):
    run_dir = small_disk("8m") / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", FAKE_RUN, str(run_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        line = ""
        while not line.startswith("ready"):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, proc.stderr.read()
        target, drafter = map(int, line.split()[1:])
        fill(run_dir.parent)
        os.kill(target, signal.SIGKILL)  # its restart needs a log and run.json: no room
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert out.splitlines()[-1] == "exit 1", out + err
    assert "Traceback" not in err and "Errno" not in out + err, err
    failed = [line for line in out.splitlines() if line.startswith("run failed:")]
    assert len(failed) == 1 and f"no space left on {run_dir}" in failed[0], out
    assert "outcome not recorded: no space left on" in out
    assert not running(drafter)
