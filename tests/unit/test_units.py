"""Rendered systemd units: `systemd-analyze verify` accepts them, and their wiring is what the docs say."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.topology import GpuSpecError
from launcher.units import UnitsError, install_command, render_units
from services.net.endpoints import endpoint
from services.run.config import ConfigError, TransportConfig, load_config

SPEC = "0-4:target,5-7:drafter"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="systemd-analyze not installed (apt-get install -y --no-install-recommends systemd)"
)


def _config(tmp_path: Path, text: str = "") -> Path:
    path = tmp_path / "run.toml"
    path.write_text('[run]\nname = "units-test"\nstall_after_s = 120.5\nmax_restarts = 2\n' + text)
    return path


def _render(tmp_path: Path, spec: str = SPEC, config_text: str = "", **kw) -> tuple[Path, Path]:
    out, run = tmp_path / "units", tmp_path / "run"
    kw.setdefault("env_dir", str(tmp_path / "etc-dflash"))
    render_units(spec, str(_config(tmp_path, config_text)), str(out), str(run), **kw)
    return out, run


def _env(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            key, value = line.split("=", 1)
            env[key] = value
    return env


def _directives(path: Path) -> list[tuple[str, str]]:
    return [
        tuple(line.split("=", 1)) for line in path.read_text().splitlines() if "=" in line and not line.startswith("#")
    ]


def _verify(units: list[Path]) -> subprocess.CompletedProcess:
    return subprocess.run([SYSTEMD_ANALYZE, "verify", *map(str, units)], capture_output=True, text=True, timeout=120)


@pytest.mark.processes
@needs_systemd
def test_rendered_units_pass_systemd_analyze_verify(tmp_path):
    out, _ = _render(tmp_path)
    instances = [out / f"dflash-target@{g}.service" for g in range(5)] + [
        out / f"dflash-drafter@{g}.service" for g in (5, 6, 7)
    ]
    units = [out / "dflash.target", out / "dflash-drafters.target", out / "dflash-drafters-restart.service", *instances]
    result = _verify(units)
    # Unknown keys, bad values, missing executables and ordering cycles all print here.
    assert result.returncode == 0 and result.stderr == "", result.stderr


@pytest.mark.processes
@needs_systemd
def test_verify_catches_a_broken_unit(tmp_path):
    out, _ = _render(tmp_path)
    bad = out / "dflash-target@.service"
    bad.write_text(bad.read_text().replace("Type=notify", "Type=notifi"))
    result = _verify([out / "dflash-target@0.service"])
    assert "notifi" in result.stderr  # the check above would have failed on this


@pytest.mark.processes
def test_service_settings(tmp_path):
    out, run = _render(tmp_path)
    for role in ("target", "drafter"):
        unit = dict(_directives(out / f"dflash-{role}@.service"))
        assert unit["Type"] == "notify"
        assert unit["KillMode"] == "control-group"
        assert unit["LimitMEMLOCK"] == "infinity"
        assert unit["WatchdogSec"] == str(math.ceil(120.5))  # supervise.stall_after_s
        assert unit["TimeoutStopSec"] == "600" and unit["TimeoutStartSec"] == "1800"
        assert unit["StartLimitBurst"] == "3"  # supervise.max_restarts + 1
        assert unit["EnvironmentFile"] == f"{tmp_path / 'etc-dflash'}/dflash-{role}@%i.env"  # where it is installed
        assert "User" not in unit and "Group" not in unit
        assert unit["ExecStart"].startswith(f"{sys.executable} -m services.{role} --config ${{DFLASH_CONFIG}}")
        assert unit["ExecStart"].endswith("--resume") == (role == "drafter")
        assert "--rank ${DFLASH_RANK} --world-size ${DFLASH_WORLD_SIZE}" in unit["ExecStart"]
        assert ("--num-targets ${DFLASH_NUM_TARGETS}" in unit["ExecStart"]) == (role == "drafter")
        assert unit["ExecStartPost"] == f"{sys.executable} -m launcher probe ${{DFLASH_HEALTH_ENDPOINT}}"
        assert unit["WorkingDirectory"] == str(run.resolve())
    assert not re.search(r"@[A-Z_]+@", "".join(p.read_text() for p in out.rglob("*") if p.is_file()))
    assert str(out) not in "".join(p.read_text() for p in out.rglob("*") if p.is_file())  # staging only
    assert not run.exists() and not (tmp_path / "etc-dflash").exists()  # rendering made neither


def test_targets_restart_alone_and_drafters_as_a_group(tmp_path):
    out, _ = _render(tmp_path)
    target = dict(_directives(out / "dflash-target@.service"))
    assert target["Restart"] == "on-failure" and target["PartOf"] == "dflash.target"
    assert "OnFailure" not in target

    drafter = dict(_directives(out / "dflash-drafter@.service"))
    assert drafter["Restart"] == "no"  # never alone
    assert drafter["OnFailure"] == "dflash-drafters-restart.service"
    assert drafter["SuccessExitStatus"] == "3"  # stopped before the end (exits.STOPPED): no group restart
    assert "SuccessExitStatus" not in target  # a target's stop exits 0
    assert drafter["PartOf"] == "dflash-drafters.target"  # group restart reaches every rank
    assert "dflash-drafters.target" in drafter["After"].split()  # all stop before any starts

    conditions = [v for k, v in _directives(out / "dflash-drafters-restart.service") if k == "ExecCondition"]
    restart = dict(_directives(out / "dflash-drafters-restart.service"))
    assert restart["Type"] == "oneshot"
    assert conditions[0] == "systemctl is-active --quiet dflash-drafters.target"
    # a rank that exited 4 (exits.FINAL: the same error again after a restart) keeps the group down
    assert "ExecMainStatus" in conditions[1] and "!= 4 ] || exit 1" in conditions[1]
    assert restart["ExecStart"] == "systemctl restart --job-mode=fail dflash-drafters.target"
    assert restart["StartLimitBurst"] == "3"

    group = dict(_directives(out / "dflash-drafters.target"))
    assert group["Wants"].split() == [
        "dflash-drafter@5.service",
        "dflash-drafter@6.service",
        "dflash-drafter@7.service",
    ]
    assert group["PartOf"] == "dflash.target"
    run = dict(_directives(out / "dflash.target"))
    assert run["Wants"].split() == [f"dflash-target@{g}.service" for g in range(5)] + ["dflash-drafters.target"]
    assert "units-test" in run["Description"]


def test_environment_files(tmp_path):
    out, run = _render(tmp_path)
    run = run.resolve()
    cfg = load_config(out / "dflash-env" / "config.json")
    assert cfg.run.name == "units-test" and cfg.supervise.stall_after_s == 120.5

    common = _env(out / "dflash-env" / "dflash.env")
    assert common["DFLASH_CONFIG"] == str(tmp_path / "etc-dflash" / "config.json")
    assert common["DFLASH_RUN_DIR"] == str(run) and common["DFLASH_DEVICE"] == "cuda"
    assert common["TORCHINDUCTOR_CACHE_DIR"] == str(run / "compile-cache")
    assert int(common["TORCHINDUCTOR_COMPILE_THREADS"]) >= 1
    assert common["PYTORCH_CUDA_ALLOC_CONF"] == cfg.run.alloc_conf and "OMP_NUM_THREADS" not in common
    assert common["DFLASH_NUM_TARGETS"] == "5"
    assert "DFLASH_CURVE_KEYS_DIR" not in common  # ipc: no keys

    target = _env(out / "dflash-env" / "dflash-target@3.env")
    assert (target["DFLASH_ROLE"], target["DFLASH_RANK"], target["DFLASH_WORLD_SIZE"]) == ("target", "3", "5")
    assert target["CUDA_VISIBLE_DEVICES"] == "3" and target["DFLASH_GPU"] == "3"
    assert target["DFLASH_HEALTH_ENDPOINT"] == endpoint(run, cfg.transport, "target", 3, "health")
    assert target["DFLASH_DATA_ENDPOINT"] == endpoint(run, cfg.transport, "target", 3, "data")
    assert "MASTER_ADDR" not in target

    drafter = _env(out / "dflash-env" / "dflash-drafter@6.env")
    assert (drafter["DFLASH_RANK"], drafter["DFLASH_WORLD_SIZE"], drafter["CUDA_VISIBLE_DEVICES"]) == ("1", "3", "6")
    assert "RANK" not in drafter and "WORLD_SIZE" not in drafter  # the unit passes --rank, --world-size
    assert "MASTER_ADDR" not in drafter and "MASTER_PORT" not in drafter  # rank 0's ipc store: no port
    assert drafter["DFLASH_HEALTH_ENDPOINT"] == f"ipc://{run}/sock/drafter-1.health"
    assert sorted(p.name for p in (out / "dflash-env").iterdir()) == sorted(
        ["config.json", "dflash.env"]
        + [f"dflash-target@{g}.env" for g in range(5)]
        + [f"dflash-drafter@{g}.env" for g in (5, 6, 7)]
    )


def test_cpu_device_hides_gpus(tmp_path):
    out, _ = _render(tmp_path, "0:target,1-2:drafter", device="cpu")
    common = _env(out / "dflash-env" / "dflash.env")
    assert common["DFLASH_DEVICE"] == "cpu" and "PYTORCH_CUDA_ALLOC_CONF" not in common
    assert common["OMP_NUM_THREADS"] == common["TORCHINDUCTOR_COMPILE_THREADS"]
    assert common["DFLASH_NUM_TARGETS"] == "1"
    assert _env(out / "dflash-env" / "dflash-drafter@2.env")["CUDA_VISIBLE_DEVICES"] == ""


@pytest.mark.processes
@needs_systemd
def test_drafter_host_of_a_two_host_run(tmp_path):
    # Host B runs the drafters only; the spec still names host A's targets (0-1) for the world sizes.
    keys = tmp_path / "keys"
    out, _ = _render(
        tmp_path,
        "0-1:target,0-2:drafter",
        roles=("drafter",),
        config_text=f'[transport]\nscheme = "tcp"\nhost = "10.0.0.1"\ncurve_keys_dir = "{keys}"\n',
    )
    assert not (out / "dflash-target@.service").exists()
    assert dict(_directives(out / "dflash.target"))["Wants"] == "dflash-drafters.target"
    drafter = _env(out / "dflash-env" / "dflash-drafter@2.env")
    assert (drafter["DFLASH_RANK"], drafter["DFLASH_WORLD_SIZE"]) == ("2", "3")
    assert "MASTER_ADDR" not in drafter  # the ranks meet on an ipc socket: no TCPStore on the drafter host
    assert drafter["DFLASH_HEALTH_ENDPOINT"] == endpoint(
        "/unused", TransportConfig(scheme="tcp", host="10.0.0.1"), "drafter", 2, "health"
    )
    common = _env(out / "dflash-env" / "dflash.env")
    assert (common["DFLASH_CURVE_KEYS_DIR"], common["DFLASH_NUM_TARGETS"]) == (str(keys), "2")
    result = _verify([out / "dflash.target", out / "dflash-drafter@0.service"])
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_rendering_again_for_fewer_gpus_drops_stale_instances(tmp_path):
    out, _ = _render(tmp_path)
    out, _ = _render(tmp_path, "0:target,1:drafter")
    assert sorted(p.name for p in (out / "dflash-env").iterdir()) == [
        "config.json",
        "dflash-drafter@1.env",
        "dflash-target@0.env",
        "dflash.env",
    ]
    assert dict(_directives(out / "dflash-drafters.target"))["Wants"] == "dflash-drafter@1.service"


@pytest.mark.processes
@needs_systemd
def test_the_printed_install_puts_everything_where_the_units_look(tmp_path):
    """The install command, run (without systemctl) into folders under tmp: the installed units
    verify, read their environment from the installed files, and run as the given account."""
    out, run = _render(tmp_path, "0:target,1:drafter", user="daemon", group="daemon")
    for role in ("target", "drafter"):
        unit = dict(_directives(out / f"dflash-{role}@.service"))
        assert (unit["User"], unit["Group"]) == ("daemon", "daemon")
    unit_dir, env_dir = tmp_path / "systemd", tmp_path / "etc-dflash"
    command = install_command(str(out), str(env_dir), str(run), str(unit_dir), "daemon", "daemon")
    assert command.endswith("systemctl daemon-reload && systemctl start dflash.target")
    subprocess.run(command.split(" && systemctl")[0], shell=True, check=True, timeout=60)
    shutil.rmtree(out)  # nothing may depend on the staging folder
    assert run.is_dir() and (run.stat().st_mode & 0o777) == 0o700
    assert load_config(env_dir / "config.json").run.name == "units-test"
    assert _env(env_dir / "dflash.env")["DFLASH_CONFIG"] == str(env_dir / "config.json")
    result = _verify(
        [unit_dir / "dflash.target", unit_dir / "dflash-target@0.service", unit_dir / "dflash-drafter@1.service"]
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_bad_arguments_are_named(tmp_path):
    config = str(_config(tmp_path))
    out, run = str(tmp_path / "u"), str(tmp_path / "r")
    with pytest.raises(UnitsError, match="python must be an absolute path"):
        render_units(SPEC, config, out, run, python="python3")
    with pytest.raises(UnitsError, match="device must be one of"):
        render_units(SPEC, config, out, run, device="tpu")
    with pytest.raises(UnitsError, match="run_dir .* contains ' '"):
        render_units(SPEC, config, out, str(tmp_path / "my run"))
    with pytest.raises(GpuSpecError, match="no drafter GPU"):
        render_units("0-4:target", config, out, run)
    (tmp_path / "bad.toml").write_text("[run]\nstall_after = 3\n")
    with pytest.raises(ConfigError, match="unknown key run.stall_after"):
        render_units(SPEC, str(tmp_path / "bad.toml"), out, run)
    with pytest.raises(UnitsError, match="roles must be"):
        render_units(SPEC, config, out, run, roles=("trainer",))
    with pytest.raises(UnitsError, match="user 'Bad User' is not a valid user or group name"):
        render_units(SPEC, config, out, run, user="Bad User")
