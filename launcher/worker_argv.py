"""The command line of one target or drafter worker, for every way the launcher starts one: the
Supervisor (launcher up), the elastic agent of a drafter group across hosts, the systemd units."""

from __future__ import annotations

import sys

from services.process import jobs

WORKER_ROLES = ("target", "drafter")


def worker_argv(
    role: str,
    *,
    config: str,
    run_dir: str,
    device: str,
    rank: int | str | None = None,
    world_size: int | str | None = None,
    num_targets: int | str | None = None,
    resume: bool = False,
    python: str = sys.executable,
) -> list[str]:
    """`PYTHON -m MODULE --config ... --run-dir ... [--rank R --world-size W] --device D` of a worker,
    and for a drafter `--num-targets T [--resume]`: the one place that owns a worker's arguments and
    their order.

    Each value is taken as given (made a string): a path, a number, or a placeholder the caller's
    runner fills in (the systemd units pass `${DFLASH_RANK}` and friends from their environment files).
    rank and world_size: both or neither; neither when something else gives them (torch's elastic
    agent sets RANK and WORLD_SIZE). num_targets: a drafter's only, and required for it.
    resume: a drafter's only; continue from the newest checkpoint when there is one.
    """
    if role not in WORKER_ROLES:
        raise ValueError(f"role must be one of {WORKER_ROLES}, got {role!r}")
    if (rank is None) != (world_size is None):
        raise ValueError(f"give rank and world_size both or neither, got rank={rank!r}, world_size={world_size!r}")
    drafter = role == "drafter"
    if drafter and num_targets is None:
        raise ValueError("a drafter needs num_targets")
    if not drafter and (num_targets is not None or resume):
        raise ValueError("num_targets and resume are a drafter's only")

    argv = [python, *jobs.argv(role)[1:], "--config", str(config), "--run-dir", str(run_dir)]
    if rank is not None:
        argv += ["--rank", str(rank), "--world-size", str(world_size)]
    argv += ["--device", device]
    if drafter:
        argv += ["--num-targets", str(num_targets)]
        if resume:
            argv.append("--resume")
    return argv
