"""python -m services.drafter [--config FILE] [--run-dir DIR] [--rank R --world-size D] [--num-targets T]
                             [--device cpu|cuda] [--synthetic] [--max-steps N] [--resume] [section.key=value ...]

The drafter's side of the one worker bootstrap (services/process/worker_main.py): its options, its environment,
then worker.DrafterWorker."""

from __future__ import annotations

import os
import sys

from services.drafter.group import agent
from services.process import exits
from services.process.compile_setup import setup_environment
from services.process.worker_main import Role, workers_on_node
from services.process.worker_main import main as worker_main


def defaults() -> dict:
    # torchrun-style RANK/WORLD_SIZE are read here, once, as defaults; the launcher passes the arguments
    return {
        "rank": int(os.environ.get("RANK", 0)),
        "world_size": int(os.environ.get("WORLD_SIZE", 1)),
        "device": "cuda" if os.environ.get("CUDA_VISIBLE_DEVICES") else "cpu",
    }


def add_arguments(p) -> None:
    p.add_argument(
        "--num-targets", type=int, default=1, help="number of target workers (batch g comes from target g mod T)"
    )
    p.add_argument(
        "--dist-backend",
        choices=("auto", "nccl", "gloo"),
        default="auto",
        help="auto = nccl on cuda, gloo on cpu; gloo lets several ranks share one GPU",
    )
    p.add_argument("--synthetic", action="store_true", help="train on synthetic batches (no target, no transport)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after N optimizer steps (default run.max_steps)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest good checkpoint in <run-dir>/checkpoints; start fresh if there is none",
    )


def prepare(args, cfg) -> None:
    os.makedirs(args.run_dir, exist_ok=True)
    setup_environment(args.run_dir, workers_on_node=workers_on_node(args))  # before torch is imported
    if args.device == "cuda" and cfg.run.alloc_conf:
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", cfg.run.alloc_conf)


def make_worker(args, device, health):
    from services.drafter.worker import DrafterWorker  # torch: after prepare()

    return DrafterWorker(args, device, health, workers_on_node(args))


ROLE = Role(
    name="drafter",
    usage="One DFlash drafter training process.",
    make_worker=make_worker,
    run_dir="runs/drafter",
    defaults=defaults,
    add_arguments=add_arguments,
    prepare=prepare,
    cpu_label="cpu-{rank}",
    stopped=exits.STOPPED,
)


def main(argv=None) -> int:
    rank = defaults()["rank"]
    if agent.worker_side(rank):  # started by services/drafter/group/agent.py: a restart of the group resumes
        argv = [*(sys.argv[1:] if argv is None else argv), "--resume"]
    return agent.worker_exit(rank, worker_main(ROLE, argv))


if __name__ == "__main__":
    exits.end_process(main())
