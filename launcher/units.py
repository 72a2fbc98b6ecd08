"""Render the systemd units of one run for one host: `launcher units --gpus SPEC --config FILE --out DIR`.

The templates in deploy/systemd/ hold every setting and the reasons for it; this module fills
in paths and limits, writes one environment file per instance (rank, world size, GPU,
endpoints) and lists the instances in dflash.target and dflash-drafters.target.

    out_dir/                           a staging folder: nothing in the units points into it
      dflash.target                    the run: Wants= every unit below
      dflash-target@.service           template, instance = GPU index
      dflash-drafter@.service          template, instance = GPU index
      dflash-drafters.target           the drafter group: Wants= every rank
      dflash-drafters-restart.service  restarts the group after one rank failed
      dflash-env/dflash.env            settings shared by the run's workers
      dflash-env/dflash-<role>@<gpu>.env  one per instance
      dflash-env/config.json           the resolved run config

The units are rendered for where they will be installed: unit files in unit_dir
(/etc/systemd/system), the dflash-env/ files in env_dir (/etc/dflash/<run.name>), and
install_command() says how to put them there. Rendering creates nothing outside out_dir (the run
folder is made by the install command, owned by the workers' user). No torch here.
"""

from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path
from typing import Iterable

from launcher.inputs import load_run_config
from launcher.topology import ROLES, Worker, count, parse_gpu_spec
from launcher.worker_argv import worker_argv
from services.net.endpoints import endpoint
from services.run.config import dump_json
from services.run.files import cpu_share, write_text_atomic

SRC_DIR = Path(__file__).resolve().parents[1]
TEMPLATE_DIR = SRC_DIR / "deploy" / "systemd"
ENV_SUBDIR = "dflash-env"
START_LIMIT_INTERVAL_S = 3600  # supervise.max_restarts restarts per hour, then the unit stays failed
DEVICES = ("cuda", "cpu")
_SAFE_VALUE = re.compile(r"[A-Za-z0-9_./:@,+=-]*")
_PLACEHOLDER = re.compile(r"@([A-Z_]+)@")


class UnitsError(ValueError):
    """Units cannot be rendered; the message names the argument or file at fault."""


def render_units(
    gpu_spec: str,
    config_path: str,
    out_dir: str,
    run_dir: str,
    python: str = sys.executable,
    device: str = "cuda",
    *,
    roles: Iterable[str] = ROLES,
    overrides: Iterable[str] = (),
    start_timeout_s: int = 1800,
    stop_timeout_s: int = 600,
    env_dir: str = "",
    user: str = "",
    group: str = "",
) -> list[Path]:
    """Write the units and environment files of this host's workers into out_dir; return their paths.

    roles: the roles that run on this host ('target', 'drafter' or both). On a host with only
      one role, gpu_spec still names every worker of the run (world sizes come from it), and
      the GPU numbers of the other role refer to the other host.
    start_timeout_s / stop_timeout_s: systemd TimeoutStartSec (load + warm-up) and
      TimeoutStopSec (finish the step, checkpoint). WatchdogSec is supervise.stall_after_s.
    env_dir: where the environment files and config.json will be installed (default
      /etc/dflash/<run.name>). user / group: User= / Group= of the workers (default: root).
    Raises ConfigError (config), GpuSpecError (gpu_spec) or UnitsError (everything else).
    """
    roles = tuple(roles)
    if not roles or any(r not in ROLES for r in roles):
        raise UnitsError(f"roles must be a non-empty subset of {ROLES}, got {roles}")
    if device not in DEVICES:
        raise UnitsError(f"device must be one of {DEVICES}, got {device!r}")
    python = _unit_path(python, "python")
    if not os.access(python, os.X_OK):
        raise UnitsError(f"python {python} is not an executable file")
    cfg = load_run_config(config_path, overrides)  # paths absolute: the units run in run_dir
    workers = parse_gpu_spec(gpu_spec, share_gpus=set(roles) != set(ROLES))
    if len({w.host for w in workers if w.role == "drafter"}) > 1:  # systemd restarts a group on one host only
        raise UnitsError(
            f"--gpus {gpu_spec!r} puts drafters on several hosts: a drafter group across hosts is restarted "
            "as one by the launcher's elastic agents, not by per-worker units; run `launcher up --gpus SPEC "
            "--host HOST` as one systemd service on each host instead (docs/elastic.md, 'Under systemd')"
        )
    local = [w for w in workers if w.role in roles]
    names = [_instance(w) for w in local]
    if len(set(names)) != len(names):
        raise UnitsError(f"--gpus {gpu_spec!r}: one GPU holds two {roles} workers; a unit instance is one GPU")

    run_dir = Path(_unit_path(os.path.abspath(run_dir), "run_dir"))
    env_dir = Path(_unit_path(os.path.abspath(env_dir or f"/etc/dflash/{cfg.run.name}"), "env_dir"))
    for name, value in (("user", user), ("group", group)):
        if value and not re.fullmatch(r"[a-z_][a-z0-9_-]*\$?", value):
            raise UnitsError(f"{name} {value!r} is not a valid user or group name")
    out = Path(os.path.abspath(out_dir))
    staged = out / ENV_SUBDIR
    staged.mkdir(parents=True, exist_ok=True)
    config_json = env_dir / "config.json"
    dump_json(cfg, staged / "config.json")

    common = _common_env(cfg, run_dir, config_json, device, len(local), count(workers, "target"))
    written = [staged / "config.json", _write(staged / "dflash.env", _env_text(common))]
    for w in local:
        env = _instance_env(cfg, w, workers, run_dir, device)
        written.append(_write(staged / f"{_instance(w)}.env", _env_text(env)))
    _remove_stale_env(staged, keep={p.name for p in written})

    values = {
        "SRC_DIR": _unit_path(str(SRC_DIR), "source folder"),
        "ENV_DIR": str(env_dir),
        "RUN_DIR": str(run_dir),
        "PYTHON": python,
        "TARGET_COMMAND": _worker_command("target", python),
        "DRAFTER_COMMAND": _worker_command("drafter", python),
        "RUN_NAME": cfg.run.name,
        "USER_LINES": "\n".join(f"{key}={value}" for key, value in (("User", user), ("Group", group)) if value),
        "START_LIMIT_INTERVAL_S": str(START_LIMIT_INTERVAL_S),
        "START_LIMIT_BURST": str(cfg.supervise.max_restarts + 1),
        "START_TIMEOUT_S": str(int(start_timeout_s)),
        "STOP_TIMEOUT_S": str(int(stop_timeout_s)),
        "RESTART_TIMEOUT_S": str(int(stop_timeout_s) + 120),
        "WATCHDOG_S": str(math.ceil(cfg.supervise.stall_after_s)),
        "WANTS_DRAFTERS": _wants(f"{_instance(w)}.service" for w in local if w.role == "drafter"),
        "WANTS_RUN": _wants(
            [f"{_instance(w)}.service" for w in local if w.role == "target"]
            + (["dflash-drafters.target"] if "drafter" in roles else [])
        ),
    }
    templates = ["dflash.target"]
    if "target" in roles:
        templates.append("dflash-target@.service")
    if "drafter" in roles:
        templates += ["dflash-drafter@.service", "dflash-drafters.target", "dflash-drafters-restart.service"]
    for name in templates:
        written.append(_write(out / name, _fill(name, values)))
    return written


def install_command(
    out_dir: str, env_dir: str, run_dir: str, unit_dir: str = "/etc/systemd/system", user: str = "", group: str = ""
) -> str:
    """The shell command that installs what render_units staged in out_dir where the units expect it."""
    owner = (f" -o {user}" if user else "") + (f" -g {group}" if group else "")
    return (
        f"install -d -m 0755 {env_dir} {unit_dir} && install -m 0644 {out_dir}/{ENV_SUBDIR}/* {env_dir}/ && "
        f"install -d -m 0700{owner} {run_dir} && install -m 0644 {out_dir}/*.service {out_dir}/*.target {unit_dir}/ && "
        f"systemctl daemon-reload && systemctl start dflash.target"
    )


def _worker_command(role: str, python: str) -> str:
    """The ExecStart= of a role's unit: its worker's command line, each value a variable of the
    instance's environment files (dflash.env, dflash-<role>@<gpu>.env), which systemd fills in."""
    drafter = role == "drafter"
    return " ".join(
        worker_argv(
            role,
            config="${DFLASH_CONFIG}",
            run_dir="${DFLASH_RUN_DIR}",
            rank="${DFLASH_RANK}",
            world_size="${DFLASH_WORLD_SIZE}",
            device="${DFLASH_DEVICE}",
            num_targets="${DFLASH_NUM_TARGETS}" if drafter else None,
            resume=drafter,  # continue from the newest checkpoint when there is one (every restart must)
            python=python,
        )
    )


def _instance(w: Worker) -> str:
    return f"dflash-{w.role}@{w.gpu}"


def _common_env(
    cfg, run_dir: Path, config_json: Path, device: str, local_workers: int, num_targets: int
) -> dict[str, str]:
    threads = str(cpu_share(local_workers))
    env = {
        "DFLASH_RUN_NAME": cfg.run.name,
        "DFLASH_CONFIG": str(config_json),
        "DFLASH_RUN_DIR": str(run_dir),
        "DFLASH_DEVICE": device,
        "DFLASH_NUM_TARGETS": str(num_targets),  # the drafters' --num-targets: batch g comes from target g mod T
        "PYTHONPATH": str(SRC_DIR),
        "PYTHONUNBUFFERED": "1",
        "PYTHONFAULTHANDLER": "1",  # a watchdog SIGABRT prints every thread's stack
        "TORCHINDUCTOR_CACHE_DIR": str(run_dir / "compile-cache"),
        "TORCHINDUCTOR_COMPILE_THREADS": threads,
    }
    if device == "cuda":
        env["PYTORCH_CUDA_ALLOC_CONF"] = cfg.run.alloc_conf
    else:
        env["OMP_NUM_THREADS"] = threads  # CPU workers share the cores
    if cfg.transport.scheme == "tcp" and cfg.transport.curve_keys_dir:
        env["DFLASH_CURVE_KEYS_DIR"] = os.path.abspath(cfg.transport.curve_keys_dir)  # for `launcher probe`
    return env


def _instance_env(cfg, w: Worker, workers: list[Worker], run_dir: Path, device: str) -> dict[str, str]:
    world = count(workers, w.role)
    env = {
        "DFLASH_ROLE": w.role,
        "DFLASH_RANK": str(w.rank),
        "DFLASH_WORLD_SIZE": str(world),
        "DFLASH_GPU": str(w.gpu),
        # Inside the worker its GPU is always cuda:0, so compile-cache keys match across workers.
        "CUDA_VISIBLE_DEVICES": str(w.gpu) if device == "cuda" else "",
        "DFLASH_HEALTH_ENDPOINT": endpoint(run_dir, cfg.transport, w.role, w.rank, "health"),
        "DFLASH_DATA_ENDPOINT": endpoint(run_dir, cfg.transport, w.role, w.rank, "data"),
    }
    # No MASTER_ADDR for a drafter: the units refuse a group across hosts, so its ranks meet in
    # the store rank 0 serves on an ipc socket of the run dir (collectives.local_store): no TCP port.
    return env


def _env_text(env: dict[str, str]) -> str:
    lines = ["# Written by `launcher units`; rendering again replaces this file."]
    for key, value in env.items():
        if "\n" in value:
            raise UnitsError(f"environment value {key}={value!r} has a newline")
        if not _SAFE_VALUE.fullmatch(value):
            value = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        lines.append(f"{key}={value}")
    return "\n".join(lines) + "\n"


def _wants(units: Iterable[str]) -> str:
    units = list(units)
    return f"Wants={' '.join(units)}" if units else ""


def _fill(name: str, values: dict[str, str]) -> str:
    path = TEMPLATE_DIR / name
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UnitsError(f"unit template {path} not found (render from a source checkout)") from None

    def sub(match: re.Match) -> str:
        if match.group(1) not in values:
            raise UnitsError(f"{path}: unknown placeholder {match.group(0)}")
        return values[match.group(1)]

    return _PLACEHOLDER.sub(sub, text)


def _unit_path(path: str, what: str) -> str:
    """Absolute paths only, and none that unit-file quoting or specifiers would change."""
    if not os.path.isabs(path):
        raise UnitsError(f"{what} must be an absolute path, got {path!r}")
    bad = set(path) & set(" \t%$\"'\\;")
    if bad:
        raise UnitsError(f"{what} {path!r} contains {''.join(sorted(bad))!r}, which unit files would mangle")
    return path


def _write(path: Path, text: str) -> Path:
    return write_text_atomic(path, text, mode=0o644)


def _remove_stale_env(env_dir: Path, keep: set[str]) -> None:
    """Instances of an earlier, larger topology: their files would only mislead."""
    for path in env_dir.glob("dflash-*@*.env"):
        if path.name not in keep:
            path.unlink()
