"""One bootstrap for the workers of both roles (python -m services.target, python -m services.drafter).

    main(role, argv): the command line -> the log -> the config (a bad one: one line, exit 2)
        -> role.prepare (the environment before torch: compile cache, the CPU share)
        -> the health socket -> the stop signals (lifecycle.py) -> role.make_worker
        -> worker.setup(cfg) -> worker.train(stop) -> the exit code (exits.py); worker.close(), health.close()

A worker has one shape in both roles (Worker): setup(cfg) loads (and compiles) up to `ready`, turning the
config into the components it builds (no worker keeps the whole config); train(stop)
works until its end or a stop request, finishes (draining, final checkpoint, `stopped`) and says
whether it reached its end; close() frees what it still holds, however it ended.
No torch at import: the drafter's compile environment is set before torch is imported.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from services.net import curve
from services.net.endpoints import endpoint
from services.process import exits, lifecycle, torchao_gate
from services.process.health import HealthServer
from services.process.log import setup_logging
from services.run.config import Config, ConfigError, load_config

STOPPED_LINGER_S = 3.0  # across hosts, the launchers of other hosts probe every second or so


class Worker(Protocol):
    def setup(self, cfg: Config) -> None:
        """Load (and compile) up to `ready`; config and checkpoint errors come before any GPU work."""

    def train(self, stop: threading.Event) -> bool:
        """Work until the end or a stop request, then finish. True: it reached its end (exit 0)."""

    def close(self) -> None:
        """Free what is still held, however the worker ended."""


@dataclass(frozen=True)
class Role:
    """What differs between the two workers' bootstraps."""

    name: str  # "target" | "drafter": log, health, endpoints
    usage: str  # the argument parser's description
    # (args, device, health) -> the worker, not started (no I/O until setup(cfg))
    make_worker: Callable[[argparse.Namespace, object, HealthServer], Worker]
    run_dir: str | None = None  # --run-dir's default (None: required)
    defaults: Callable[[], dict] = dict  # defaults of --rank, --world-size, --device
    add_arguments: Callable[[argparse.ArgumentParser], None] = lambda parser: None  # the role's own options
    prepare: Callable[[argparse.Namespace, Config], None] = lambda args, cfg: None  # the environment, before torch
    cpu_label: str = "cpu"  # health's gpu on the CPU ({rank}: the rank)
    stopped: int = exits.OK  # the exit code of a stop while starting


def workers_on_node(args: argparse.Namespace) -> int:
    """Workers of this role on this node, the divisor of its CPU share: LOCAL_WORLD_SIZE, else --world-size."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", args.world_size))


def parse_args(role: Role, argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m services.{role.name}", description=role.usage)
    p.add_argument("--config", help="TOML config (or the launcher's resolved JSON)")
    p.add_argument(
        "--run-dir",
        required=role.run_dir is None,
        default=role.run_dir,
        help="run directory: sockets, compile cache, logs",
    )
    p.add_argument("--rank", type=int, default=0, help=f"{role.name} rank")
    p.add_argument("--world-size", type=int, default=1, help=f"number of {role.name} ranks")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    role.add_arguments(p)
    p.add_argument("overrides", nargs="*", help="config overrides, section.key=value")
    p.set_defaults(**role.defaults())
    return p.parse_args(argv)


def main(role: Role, argv=None) -> int:
    args = parse_args(role, argv)
    setup_logging(role.name, args.rank)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:  # bad config: one clear line, no traceback
        return exits.exit_code(exc)
    if not (role.name == "drafter" and cfg.kernels.precision == "fp8"):
        torchao_gate.hide()  # FP8 drafter training is its only user (its import prints warnings)
    role.prepare(args, cfg)
    import torch  # after prepare: the compile environment is set

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    cpu = role.cpu_label.format(rank=args.rank)
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0") if device.type == "cuda" else cpu
    health = HealthServer(
        endpoint(Path(args.run_dir), cfg.transport, role.name, args.rank, "health"),
        role.name,
        args.rank,
        gpu,
        stall_after_s=cfg.supervise.stall_after_s,
        startup_stall_after_s=cfg.supervise.startup_stall_after_s,
        keys_dir=curve.keys_for(cfg.transport),
    )
    stop = lifecycle.install(grace_s=cfg.supervise.stop_timeout_s)
    worker = None
    try:
        worker = role.make_worker(args, device, health)
        worker.setup(cfg)
        return exits.OK if worker.train(stop) else exits.STOPPED  # stopped before its end: not finished
    except Exception as exc:  # stopped while starting, a config error, a crash
        return exits.exit_code(exc, health, stopped=role.stopped)
    finally:
        if worker is not None:
            worker.close()
        if role.name == "drafter" and health.endpoint.startswith("tcp://") and health.snapshot()["state"] == "stopped":
            time.sleep(STOPPED_LINGER_S)  # a host without drafters reads "stopped" here (launcher/supervisor.py)
        health.close()
