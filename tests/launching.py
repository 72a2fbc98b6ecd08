"""Starting the launcher and the workers from tests, and waiting on them.

REPO is this checkout; PLUMBING the overrides of a lifecycle or fault test's demo run; child_env()
is the environment every child gets (this checkout first on PYTHONPATH, so the code under test
runs, not an installed copy). run_launcher() runs `python -m
launcher ...` to its end, start_launcher() in the background; spawn_drafter() starts one drafter
rank on its own (drafter_env() is its environment). The waits: wait_for (any condition while a
process lives), running (a pid alive and not a zombie), wait_metrics (N lines of metrics.jsonl),
wait_ready_then_metrics (the launcher's "all workers ready", then a metrics line), drafter_stuck
(drafter-0 waits for a batch, makes no step).
"""

import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]

# The plumbing run: what a lifecycle or fault test needs of training (real workers, steps, checkpoints,
# restarts) at a fraction of the demo's cost: rows of 256 tokens, 16 anchors, no real-acceptance pass
# (each test sets its steps). The demo's own settings are for the quality runs, which check that it
# learns: test_launcher_demo.py's first test and test_demo_hybrid.py.
PLUMBING = ("data.pack_len=256", "drafter.num_anchors=16", "eval.num_prompts=0")


def child_env(**extra) -> dict[str, str]:
    """os.environ with this checkout on PYTHONPATH, and `extra` (values made strings)."""
    return {**os.environ, "PYTHONPATH": str(REPO), **{k: str(v) for k, v in extra.items()}}


def launcher_argv(*args) -> list[str]:
    """`python -m launcher ARGS` as an argv (each argument made a string)."""
    return [sys.executable, "-m", "launcher", *map(str, args)]


def target_argv(run_dir, *args) -> list[str]:
    """`python -m services.target --run-dir RUN_DIR --device cpu ARGS` (rank 0 of 1) as an argv."""
    return [sys.executable, "-m", "services.target", "--run-dir", str(run_dir), "--device", "cpu", *map(str, args)]


def run_launcher(*args, cwd=None, timeout: float = 120, env: dict | None = None, **run) -> subprocess.CompletedProcess:
    """`python -m launcher ARGS` to its end; stdout and stderr captured as text (`run`: more of
    subprocess.run's keywords)."""
    return subprocess.run(
        launcher_argv(*args), capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env or child_env(), **run
    )


def start_launcher(*args, cwd=REPO, env: dict | None = None, **popen) -> subprocess.Popen:
    """`python -m launcher ARGS` in the background; by default stdout and stderr in one text pipe."""
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, **popen}
    return subprocess.Popen(launcher_argv(*args), cwd=cwd, env=env or child_env(), **popen)


def drafter_env(**extra) -> dict[str, str]:
    """child_env() without what would make a lone drafter join someone else's group or compile cache."""
    return {
        k: v
        for k, v in child_env(**extra).items()
        if not k.startswith(("TORCHINDUCTOR_", "MASTER_", "RANK", "WORLD_SIZE"))
    }


def spawn_drafter(run_dir, *args, rank=0, world_size=1, port=None, preexec_fn=None, synthetic=True):
    """One drafter rank, `python -m services.drafter [--synthetic] --device cpu` (synthetic data, or from
    the targets over ZMQ); with world_size > 1, a gloo rank rendezvousing on `port`."""
    env = drafter_env(PYTHONUNBUFFERED=1)
    if world_size > 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.drafter",
            "--run-dir",
            str(run_dir),
            *(["--synthetic"] if synthetic else []),
            "--rank",
            str(rank),
            "--world-size",
            str(world_size),
            "--device",
            "cpu",
            *args,
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=preexec_fn,
    )


# the loopback addresses the multi-host tests run their "hosts" on (Linux routes all of 127/8 to lo)
TEST_HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")


def free_port(host: str = "127.0.0.1") -> int:
    """A tcp port nobody listens on right now (the rendezvous of a lone drafter rank)."""
    return free_ports(1, host)


def free_ports(count: int, host: str | None = None, align: int = 1) -> int:
    """The first of `count` consecutive tcp ports (the first a multiple of align) that bind right now
    on `host`, or on every one of TEST_HOSTS, all below the kernel's ephemeral range: a port found
    free inside that range can be taken by any outgoing connection (gloo and the stores open many)
    before the worker binds it. Every test host: a port free on 127.0.0.1 was held on 127.0.0.2 by
    another test's workers (a clean-clone CI run failed on "Address already in use")."""
    hosts = (host,) if host else TEST_HOSTS
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768  # Linux's default
    for _ in range(100):
        first = random.randrange(-(-10000 // align) * align, ephemeral - count, align)
        if all(_binds(h, port) for port in range(first, first + count) for h in hosts):
            return first
    raise RuntimeError(f"no {count} free tcp ports in a row below {ephemeral} on {', '.join(hosts)}")


def _binds(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


# --- waiting on a real run ---------------------------------------------------------------------


def running(pid: int) -> bool:
    """Whether pid is a live process (not gone, not a zombie); a process that exits while it is asked is gone."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_for(condition, what: str, proc: subprocess.Popen, timeout_s: float = 300, every_s: float = 0.2) -> None:
    """Until condition() holds, while proc lives."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"the run ended while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every_s)


def worker_pids(run_dir: Path) -> dict[str, int]:
    """{worker name: pid} from the run's run.json."""
    return {w["name"]: w["pid"] for w in json.loads((Path(run_dir) / "run.json").read_text())["workers"]}


def metrics_lines(run_dir: Path) -> int:
    metrics = Path(run_dir) / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def wait_metrics(run_dir: Path, proc: subprocess.Popen, lines: int = 2, timeout_s: float = 300) -> dict[str, int]:
    """The worker pids once metrics.jsonl has `lines` lines (the launcher `proc` still running)."""
    deadline = time.monotonic() + timeout_s
    while metrics_lines(run_dir) < lines:
        assert time.monotonic() < deadline and proc.poll() is None, "training never started"
        time.sleep(0.2)
    return worker_pids(run_dir)


def wait_ready_then_metrics(run_dir: Path, proc: subprocess.Popen, timeout_s: float = 300) -> dict[str, int]:
    """The worker pids once the launcher `proc` has printed "all workers ready" (read from its stdout) and
    drafter-0 has logged a metrics line. Metrics alone are not enough: the tiny drafter can train 10 steps
    before the launcher's poll sees the target ready, and an exit then is one 'while starting' to the launcher."""
    deadline = time.monotonic() + timeout_s
    seen = []
    while "all workers ready" not in (line := proc.stdout.readline()):
        assert line, "".join(seen)[-3000:]  # the launcher ended first
        assert time.monotonic() < deadline, "the launcher never saw every worker ready"
        seen.append(line)
    metrics = Path(run_dir) / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().strip()):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "training never started"
        time.sleep(0.2)
    return worker_pids(run_dir)


def drafter_stuck(run_dir: Path) -> bool:
    """drafter-0 waits for a batch and makes no step for a second (its status, not a fixed sleep)."""
    from services.net.endpoints import endpoint
    from services.net.health_probe import probe
    from services.run.config import load_config

    health = endpoint(run_dir, load_config(run_dir / "config.json").transport, "drafter", 0, "health")
    first = probe(health, 2)[1] or {}
    time.sleep(1.0)
    second = probe(health, 2)[1] or {}
    return (
        "waiting_for_g" in second
        and first.get("step") == second.get("step")
        and first.get("waiting_for_g") == second.get("waiting_for_g")
    )
