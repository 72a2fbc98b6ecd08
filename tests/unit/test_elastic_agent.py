"""A drafter group across hosts, the parts that need no second host: the ranks each host's agent
gives its workers (from the --gpus spec) and their check across hosts, what the launcher starts on
each host, and a real agent (torch's engine, one host) over tiny python workers: ranks, restarts,
no restart after a config error, a stop."""

import json

import pytest

from launcher.supervisor import Supervisor
from launcher.topology import host_overrides, parse_gpu_spec
from launcher.units import UnitsError, render_units
from services.drafter.group.agent import check_ranks, parse
from services.run.config import load_config

SPEC = "0:target@10.0.0.1,0-1:drafter@10.0.0.10,0-1:drafter@10.0.0.2"


def supervisor(tmp_path, host: str, spec: str = SPEC) -> Supervisor:
    workers = parse_gpu_spec(spec, local_host=host)
    return Supervisor(
        tmp_path,
        load_config(None, [*host_overrides(workers), f"transport.curve_keys_dir={tmp_path / 'keys'}"]),
        workers,
        "cpu",
        host=host,
    )


def test_ranks_that_add_up_pass_and_others_name_the_hosts():
    assert check_ranks({"10.0.0.10": [0, 1], "10.0.0.2": [2, 3]}, 4) == ""
    twice = check_ranks({"a": [0, 1], "b": [1, 2]}, 3)
    assert "drafter rank 1 is claimed by a and b" in twice and "--gpus" in twice
    assert "no host runs drafter rank(s) [3]" in check_ranks({"a": [0, 1], "b": [2]}, 4)
    assert "past 2" in check_ranks({"a": [0, 1], "b": [2]}, 2)


def test_each_drafter_host_starts_one_agent_with_the_spec_ranks_in_spec_order(tmp_path):
    # 10.0.0.10 sorts before 10.0.0.2 as text (torch's rendezvous order): the ranks come from the spec
    first, second = supervisor(tmp_path, "10.0.0.10"), supervisor(tmp_path, "10.0.0.2")
    assert first.elastic and second.elastic
    a = parse(first.agent_argv([w for w in first.local if w.role == "drafter"])[3:])
    b = parse(second.agent_argv([w for w in second.local if w.role == "drafter"])[3:])
    assert (a.ranks, b.ranks) == ([0, 1], [2, 3]) and a.world_size == b.world_size == 4
    assert a.hosts == b.hosts == ["10.0.0.10", "10.0.0.2"]  # the first is rank 0's: the rendezvous store
    assert a.run_id == b.run_id and a.port == b.port == first.cfg.transport.dist_port
    assert a.keys_dir == b.keys_dir == str(tmp_path / "keys") and not a.insecure_rendezvous
    assert "--rank" not in a.worker and "--world-size" not in a.worker  # RANK, WORLD_SIZE from the agent
    assert a.worker[1:3] == ["-m", "services.drafter"]
    assert "MASTER_ADDR" not in first.env(first.local[0])  # the agent sets it: rank 0's address, dist_port + 1


def test_a_target_host_and_a_one_host_drafter_group_start_no_agent(tmp_path):
    assert not supervisor(tmp_path, "10.0.0.1").local_group
    one = supervisor(tmp_path, "10.0.0.1", "0:target@10.0.0.1,0-1:drafter@10.0.0.2")
    assert not one.elastic


@pytest.mark.processes
def test_units_refuse_a_drafter_group_across_hosts_and_say_what_to_run(tmp_path):
    with pytest.raises(UnitsError, match="launcher up --gpus SPEC --host HOST"):
        render_units(SPEC, None, str(tmp_path / "out"), str(tmp_path / "run"), device="cpu")


def run_agent(tmp_path, worker_code: str, ranks="0,1", world_size=2, max_restarts=2) -> tuple[int, dict, str]:
    """A real agent (torch's engine, one host: 127.0.0.1) over a tiny python worker."""
    import subprocess
    import sys

    from tests.launching import REPO, child_env, free_port

    argv = [
        sys.executable, "-m", "services.drafter.group.agent", "--run-dir", str(tmp_path), "--host", "127.0.0.1",
        "--hosts", "127.0.0.1", "--ranks", ranks, "--world-size", str(world_size), "--port", str(free_port()),
        "--run-id", "t", "--max-restarts", str(max_restarts), "--rendezvous-timeout", "60", "--stop-timeout", "10",
        "--", sys.executable, "-c", worker_code,
    ]  # fmt: skip
    (tmp_path / "logs").mkdir(exist_ok=True)
    done = subprocess.run(argv, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
    status = json.loads((tmp_path / "elastic" / "agent-127.0.0.1.json").read_text())
    return done.returncode, status, done.stderr


@pytest.mark.processes  # a real agent starts its workers three times
def test_a_real_agent_gives_the_spec_ranks_and_stops_restarting_on_a_config_error(tmp_path):
    record = (  # the drafter's side first: its output to logs/drafter-<RANK>.log
        "import os, json; from services.drafter.group.agent import worker_side; worker_side(int(os.environ['RANK'])); "
        "print(json.dumps({k: os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'DFLASH_AGENT_STORE')}), flush=True)"
    )
    code, status, _ = run_agent(tmp_path, record)
    assert code == 0 and status["state"] == "finished" and status["restarts"] == 0
    assert status["store"]["served"] > 0 and status["store"]["refused"] == status["store"]["dropped"] == 0
    logs = [
        json.loads(line)
        for r in (0, 1)
        for line in (tmp_path / "logs" / f"drafter-{r}.log").read_text().splitlines()
        if line.startswith("{")
    ]
    store = f"ipc://{tmp_path.resolve()}/sock/drafter-store"  # one host: the store on an owner-only ipc socket
    assert sorted((d["RANK"], d["WORLD_SIZE"], d["DFLASH_AGENT_STORE"]) for d in logs) == [
        ("0", "2", store),
        ("1", "2", store),
    ]  # the workers' process group meets in the agents' store

    code, status, _ = run_agent(tmp_path, record, ranks="2,3", world_size=4)  # hosts started with other specs
    assert code == 1 and "no host runs drafter rank(s) [0, 1]" in status["reason"]

    code, status, err = run_agent(tmp_path, "raise SystemExit(1)")
    assert (
        code == 1 and status["restarts"] == 2 and "restarts exhausted (supervise.max_restarts=2)" in status["reason"]
    ), err

    code, status, err = run_agent(tmp_path, "raise SystemExit(2)")  # what a restart would meet again
    assert code == 1 and status["starts"] == 1 and "exited with code 2" in status["reason"], err
    assert "config" in status["reason"] and "see logs/drafter-" in status["reason"]


@pytest.mark.processes
def test_a_stop_is_exit_0_to_torch_and_3_from_the_agent(tmp_path):
    stop = (
        "import os, sys; from services.drafter.group.agent import worker_exit as e; "
        "sys.exit(e(int(os.environ['RANK']), 3))"
    )
    code, status, err = run_agent(tmp_path, stop)
    assert code == 3 and status["state"] == "stopped" and status["restarts"] == 0, err


@pytest.mark.processes
def test_a_group_across_hosts_without_keys_is_refused_unless_insecure_rendezvous_says_so(tmp_path):
    from launcher.elastic import rendezvous_problems
    from tests.launching import run_launcher

    spec = "0:target@127.0.0.1,0:drafter@127.0.0.2,1:drafter@127.0.0.3"
    out = run_launcher("up", "--device", "cpu", "--gpus", spec, "--host", "127.0.0.2", "--run-dir", tmp_path / "run")
    assert out.returncode == 2 and not (tmp_path / "run").exists(), out.stderr
    assert "transport.curve_keys_dir" in out.stderr and "transport.insecure_rendezvous=true" in out.stderr
    cfg = load_config(None, ["transport.scheme=tcp", "transport.insecure_rendezvous=true"])
    refusal, warning = rendezvous_problems(cfg.transport, ["127.0.0.2", "127.0.0.3"])
    assert not refusal and "anyone who reaches that port can read and write it" in warning
    assert rendezvous_problems(cfg.transport, ["127.0.0.2", "127.0.0.2"]) == ("", "")  # one host: ipc/file
    with pytest.raises(SystemExit):  # and the agent, started by hand without keys
        parse(["--run-dir", "r", "--host", "a", "--hosts", "a,b", "--ranks", "0", "--world-size", "2", "--port", "1"]
              + ["--run-id", "x", "--", "w"])  # fmt: skip


@pytest.mark.slow  # two real agents (127.0.0.2, 127.0.0.3) over the store, behind real CURVE keys
@pytest.mark.processes
def test_a_host_that_comes_back_restarts_the_other_hosts_workers_without_a_stop(tmp_path):
    """A membership change (a drafter host's agent killed, then back) restarts the other host's
    workers with SIGKILL, not SIGTERM: a SIGTERM is a stop to a drafter, which would end the run."""
    import subprocess
    import sys
    import time

    import psutil

    from services.net.curve import generate_keys
    from tests.launching import REPO, child_env, free_port

    generate_keys(tmp_path / "keys")
    port, hosts = free_port("127.0.0.2"), ["127.0.0.2", "127.0.0.3"]
    worker = (  # records each start and any SIGTERM, then waits to be stopped
        "import os, signal, sys, time; from pathlib import Path; from services.drafter.group.agent import worker_side; "
        "r = int(os.environ['RANK']); worker_side(r); d = Path(os.environ['DFLASH_AGENT_DIR']); "
        "signal.signal(signal.SIGTERM, lambda *a: ((d / f'sigterm-{r}').touch(), sys.exit(0))); "
        "(d / f'started-{os.environ[\"DFLASH_GROUP_START\"]}').touch(); time.sleep(120)"
    )

    def agent(i: int) -> subprocess.Popen:
        run = tmp_path / hosts[i]
        (run / "logs").mkdir(parents=True, exist_ok=True)
        argv = [
            sys.executable, "-m", "services.drafter.group.agent", "--run-dir", str(run), "--host", hosts[i],
            "--hosts", ",".join(hosts), "--ranks", str(i), "--world-size", "2", "--port", str(port), "--run-id", "t",
            "--keys-dir", str(tmp_path / "keys"), "--max-restarts", "1", "--rendezvous-timeout", "60",
            "--stop-timeout", "10", "--", sys.executable, "-c", worker,
        ]  # fmt: skip
        return subprocess.Popen(argv, cwd=REPO, env=child_env(), stderr=subprocess.PIPE, text=True)

    def until(path, timeout_s: float = 60) -> bool:
        deadline = time.monotonic() + timeout_s
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        return path.exists()

    def kill_tree(p: subprocess.Popen) -> None:
        for proc in [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]:
            proc.kill()
        p.wait()

    first, second = agent(0), agent(1)
    marks = [tmp_path / h / "elastic" for h in hosts]
    try:
        assert until(marks[0] / "started-1") and until(marks[1] / "started-1")
        kill_tree(second)  # the second host dies: its agent and its worker
        second = agent(1)  # ... and comes back
        assert until(marks[0] / "started-2"), "the first host's worker was not restarted for the second's return"
        assert not (marks[0] / "sigterm-0").exists()  # killed, not sent a stop
        status = json.loads((marks[0] / "agent-127.0.0.2.json").read_text())
        assert status["state"] == "running" and status["starts"] == 2
    finally:
        for p in (first, second):
            if p.poll() is None:
                kill_tree(p)
