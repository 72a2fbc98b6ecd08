"""python -m services.drafter [--config FILE] [--run-dir DIR] [--rank R --world-size D] [--num-targets T]
                             [--device cpu|cuda] [--synthetic] [--max-steps N] [--resume] [section.key=value ...]"""
from __future__ import annotations

import argparse
import os
import sys

from services.compile_setup import setup_environment


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m services.drafter", description="One DFlash drafter training process.")
    p.add_argument("--config", help="TOML config (or the launcher's resolved JSON)")
    p.add_argument("--run-dir", default="runs/drafter", help="run directory: sockets, compile cache, logs")
    # torchrun-style RANK/WORLD_SIZE are read here, once, as defaults; the launcher passes the arguments
    p.add_argument("--rank", type=int, default=int(os.environ.get("RANK", 0)), help="drafter rank (default env RANK, or 0)")
    p.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)),
                   help="number of drafter ranks (default env WORLD_SIZE, or 1)")
    p.add_argument("--num-targets", type=int, default=1, help="number of target workers (batch g comes from target g mod T)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if os.environ.get("CUDA_VISIBLE_DEVICES") else "cpu")
    p.add_argument("--dist-backend", choices=("auto", "nccl", "gloo"), default="auto",
                   help="auto = nccl on cuda, gloo on cpu; gloo lets several ranks share one GPU")
    p.add_argument("--synthetic", action="store_true", help="train on synthetic batches (no target, no transport)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after N optimizer steps (default run.max_steps)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest good checkpoint in <run-dir>/checkpoints; start fresh if there is none")
    p.add_argument("overrides", nargs="*", help="config overrides, section.key=value")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from services import exits                                # no torch in here
    from services.config import ConfigError, load_config
    from services.log import setup_logging
    setup_logging("drafter", args.rank)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:                                 # bad config: one clear line, no traceback
        return exits.exit_code(exc)
    os.makedirs(args.run_dir, exist_ok=True)
    workers_on_node = int(os.environ.get("LOCAL_WORLD_SIZE", args.world_size))
    setup_environment(args.run_dir, workers_on_node=workers_on_node)   # before torch is imported
    if args.device == "cuda" and cfg.run.alloc_conf:
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", cfg.run.alloc_conf)
    from services.drafter.worker import run
    return run(args, cfg, workers_on_node)


if __name__ == "__main__":
    sys.exit(main())
