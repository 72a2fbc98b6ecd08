"""Where a worker stands in its run: one object the worker's shell builds from its command line, which
its components take beside their settings (rather than four loose arguments each)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Placement:
    run_dir: Path  # sockets, logs, checkpoints, the data cache
    role: str  # "target" | "drafter"
    rank: int = 0  # among the role's ranks
    world_size: int = 1  # the role's ranks
    num_targets: int = 1  # the target workers the drafters read batches from (0: synthetic batches)

    def __post_init__(self):
        object.__setattr__(self, "run_dir", Path(self.run_dir))
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"{self.role} rank {self.rank} is not in [0, {self.world_size})")
