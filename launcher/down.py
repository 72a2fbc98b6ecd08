"""`launcher down`: stop a run gracefully (the launcher first: drafters checkpoint), then kill what is left."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from launcher import process
from launcher.rundir import describe_live, describe_outcome, read_run


def cmd_down(args) -> int:
    run_dir = Path(args.run_dir).resolve()
    run = read_run(run_dir)
    # Only processes whose start time and command line match what `up` recorded are signalled:
    # a pid in an old run.json may belong to anything by now.
    launcher = run.get("launcher") if process.alive(run.get("launcher")) else None
    workers = [w.get("identity") for w in run["workers"] if process.alive(w.get("identity"))]
    if launcher is None and not workers:
        print(
            f"nothing to stop in {run_dir}: {describe_outcome(run, live=False)}; "
            f"{describe_live(run_dir.parent, run_dir)}"
        )
        return 0
    if launcher:
        try:  # psutil re-checks the start time before signalling: a pid reused since is left alone
            process.verified(launcher).send_signal(signal.SIGTERM)  # drafters checkpoint, then targets stop
        except (AttributeError, process.psutil.Error):
            pass
        deadline = time.monotonic() + args.timeout
        while process.alive(launcher) and time.monotonic() < deadline:
            time.sleep(0.2)
    hard = process.stop_all([w for w in workers if process.alive(w)], deadline_s=10)
    if process.alive(launcher):
        process.kill_tree(launcher)
        hard.append(launcher["pid"])
    print(f"stopped {run_dir}" + (f"; killed hard: {hard}" if hard else ""))
    return 0
