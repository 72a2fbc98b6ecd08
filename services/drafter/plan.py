"""How long a run trains: the one place that turns the data size and the config into step counts.

Units: a *micro-batch* is one batch one rank trains (one forward/backward, one ledger line); an
*optimizer step* is grad_accum micro-batches; `run.max_steps` and `--max-steps` count optimizer steps.
At micro-step s, rank d of D trains global batch g = s·D + d. The last optimizer step is always
whole: micro-batches past the data's end are empty (zero loss weight), so every real batch counts.

No torch here: the launcher reads the plan too (schedule.json, `launcher status`).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

SYNTHETIC_STEPS = 1000        # synthetic data has no end: this many optimizer steps unless max_steps is set


@dataclass(frozen=True)
class Plan:
    batches_per_epoch: int        # of the split (0: synthetic, endless)
    epochs: int
    drafters: int
    grad_accum: int
    optimizer_steps: int          # what a rank's optimizer does over the run
    micro_batches: int            # per rank: optimizer_steps * grad_accum
    total_batches: int            # real batches trained by all ranks together: g in [0, total_batches)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        return cls(**{name: d[name] for name in cls.__dataclass_fields__})

    def describe(self) -> str:
        return (f"{self.optimizer_steps} optimizer steps x {self.grad_accum} micro-batches on each of "
                f"{self.drafters} drafters: {self.total_batches} batches")


def make_plan(batches_per_epoch: int | None, epochs: int, drafters: int, grad_accum: int = 1,
              max_steps: int = 0) -> Plan:
    """batches_per_epoch None: synthetic data (max_steps, or SYNTHETIC_STEPS, optimizer steps)."""
    grad_accum, drafters = max(1, grad_accum), max(1, drafters)
    if batches_per_epoch is None:
        steps = max_steps or SYNTHETIC_STEPS
        return Plan(0, 1, drafters, grad_accum, steps, steps * grad_accum, steps * grad_accum * drafters)
    available = batches_per_epoch * epochs
    steps = math.ceil(math.ceil(available / drafters) / grad_accum)
    if max_steps:
        steps = min(steps, max_steps)
    micro = steps * grad_accum
    return Plan(batches_per_epoch, epochs, drafters, grad_accum, steps, micro, min(available, micro * drafters))
