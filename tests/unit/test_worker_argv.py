"""One worker's command line, built the three ways the launcher starts a worker: the Supervisor
(launcher up), the elastic agent's worker (a drafter group across hosts) and the systemd units'
ExecStart= (its ${VARS} filled from the rendered environment files, as systemd does). All three
come from launcher/worker_argv.py and must give the same arguments."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from launcher.supervisor import Supervisor
from launcher.topology import host_overrides, parse_gpu_spec
from launcher.units import ENV_SUBDIR, render_units
from launcher.worker_argv import worker_argv
from services.drafter.group.agent import parse
from services.run.config import load_config

LOCAL_SPEC = "0-1:target,2-5:drafter"  # 2 targets, 4 drafters on this host
ACROSS_HOSTS = "0-1:target@10.0.0.1,0-1:drafter@10.0.0.10,0-1:drafter@10.0.0.2"  # the same, drafters on 2 hosts


def _env(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#"))


def unit_argv(out: Path, role: str, gpu: int) -> list[str]:
    """The instance's ExecStart= with its environment files' values in place of ${VAR}."""
    env = {**_env(out / ENV_SUBDIR / "dflash.env"), **_env(out / ENV_SUBDIR / f"dflash-{role}@{gpu}.env")}
    unit = (out / f"dflash-{role}@.service").read_text()
    (exec_start,) = [line.removeprefix("ExecStart=") for line in unit.splitlines() if line.startswith("ExecStart=")]
    return re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], exec_start).split(" ")


def without_rank(argv: list[str], rank: int, world_size: int) -> list[str]:
    i = argv.index("--rank")
    assert argv[i : i + 4] == ["--rank", str(rank), "--world-size", str(world_size)]
    return argv[:i] + argv[i + 4 :]


@pytest.fixture
def built(tmp_path):
    """(supervisor, elastic supervisor, units folder) of one run dir; the units' config.json where
    the supervisor's is (env_dir = run dir), device cpu, drafters resuming (the units always do)."""
    run = tmp_path / "run"
    config = tmp_path / "run.toml"
    config.write_text('[run]\nname = "argv-test"\n')
    out = tmp_path / "units"
    render_units(LOCAL_SPEC, str(config), str(out), str(run), python=sys.executable, device="cpu", env_dir=str(run))
    local = Supervisor(run, load_config(str(config)), parse_gpu_spec(LOCAL_SPEC), "cpu", resume=True)
    workers = parse_gpu_spec(ACROSS_HOSTS, local_host="10.0.0.10")
    cfg = load_config(str(config), [*host_overrides(workers), f"transport.curve_keys_dir={tmp_path / 'keys'}"])
    elastic = Supervisor(run, cfg, workers, "cpu", resume=True, host="10.0.0.10")
    return local, elastic, out


def test_supervisor_and_units_start_a_target_with_the_same_command_line(built):
    local, _, out = built
    target = next(w for w in local.workers if w.role == "target" and w.rank == 1)
    argv = local.argv(target)
    assert argv == unit_argv(out, "target", target.gpu)
    assert argv[:3] == [sys.executable, "-m", "services.target"] and "--resume" not in argv


def test_supervisor_units_and_elastic_agent_start_a_drafter_with_the_same_command_line(built):
    local, elastic, out = built
    drafter = next(w for w in local.workers if w.role == "drafter" and w.rank == 0)
    argv = local.argv(drafter)
    assert argv == unit_argv(out, "drafter", drafter.gpu)
    assert argv[:3] == [sys.executable, "-m", "services.drafter"] and argv[-1] == "--resume"
    assert argv[argv.index("--num-targets") + 1] == "2"

    assert elastic.elastic
    agent = parse(elastic.agent_argv([w for w in elastic.local if w.role == "drafter"])[3:])
    assert agent.world_size == 4 and agent.ranks == [0, 1]
    assert agent.worker == without_rank(argv, rank=0, world_size=4)  # RANK, WORLD_SIZE from the agent


def test_a_worker_argv_is_refused_with_arguments_that_do_not_fit_its_role():
    common = {"config": "c.json", "run_dir": "run", "device": "cpu"}
    with pytest.raises(ValueError, match="both or neither"):
        worker_argv("target", rank=0, **common)
    with pytest.raises(ValueError, match="num_targets"):
        worker_argv("drafter", rank=0, world_size=1, **common)
    with pytest.raises(ValueError, match="a drafter's only"):
        worker_argv("target", resume=True, **common)
    with pytest.raises(ValueError, match="role must be"):
        worker_argv("drafter-agent", **common)
    assert worker_argv("drafter", num_targets=3, python="py", **common) == [
        *["py", "-m", "services.drafter", "--config", "c.json", "--run-dir", "run", "--device", "cpu"],
        *["--num-targets", "3"],
    ]
