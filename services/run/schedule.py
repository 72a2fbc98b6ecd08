"""How long a run trains: the one place that turns the data size and the config into step counts,
and the one place that says which global batch a rank trains at a micro-step.

Units: a *micro-batch* is one batch one rank trains (one forward/backward, one ledger line); an
*optimizer step* is grad_accum micro-batches; `run.max_steps` and `--max-steps` count optimizer steps.
The last optimizer step is always whole: micro-batches past the data's end are empty (zero loss
weight), so every real batch counts.

The schedule (docs/design.md, "Scheduling"): a run is one or more *segments*, one per launch with
its own number of drafters D. A segment starts at optimizer step s0 (micro-step m0 = s0·A) with the
g0 global batches before it done, and at micro-step m rank d of D trains

    g = g0 + (m - m0)·D + d

A fresh run is the segment s0 = g0 = 0 (g = m·D + d). A resume from a checkpoint at step s starts a
segment at s0 = s with g0 = the checkpoint's batches done (every rank finished them: a checkpoint
is only taken between optimizer steps), whatever D wrote it.

No torch here: the launcher reads the plan too (schedule.json, `launcher status`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

SYNTHETIC_STEPS = 1000  # synthetic data has no end: this many optimizer steps unless max_steps is set


@dataclass(frozen=True)
class Plan:
    batches_per_epoch: int  # of the split (0: synthetic, endless)
    epochs: int
    drafters: int
    grad_accum: int
    optimizer_steps: int  # what a rank's optimizer does over the run (the last step's number)
    micro_batches: int  # per rank: optimizer_steps * grad_accum (the last micro-step's number)
    total_batches: int  # real batches trained by all ranks together: g in [0, total_batches)
    first_step: int = 0  # this segment's first optimizer step (a resume's checkpoint step)
    first_g: int = 0  # batches g < first_g were trained before it

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        return cls(**{f.name: d[f.name] for f in fields(cls)})

    @property
    def batches_per_step(self) -> int:
        """Global batches one optimizer step trains (all ranks, all micro-batches)."""
        return self.drafters * self.grad_accum

    def g_of(self, micro_step: int, rank: int) -> int:
        """The global batch rank `rank` trains at `micro_step` (>= total_batches: an empty batch)."""
        return self.first_g + (micro_step - self.first_step * self.grad_accum) * self.drafters + rank

    def batches_done(self, micro_step: int) -> int:
        """Real batches done once every rank has finished micro-steps < micro_step (a checkpoint's)."""
        return min(self.g_of(micro_step, 0), self.total_batches)

    @property
    def horizon_batches(self) -> int:
        """Batch slots up to the end of the last optimizer step (empty ones too): the lr schedule's end."""
        return self.g_of(self.micro_batches, 0)

    def describe(self) -> str:
        resumed = f", resumed at step {self.first_step} with {self.first_g} done" if self.first_step else ""
        return (
            f"{self.optimizer_steps} optimizer steps x {self.grad_accum} micro-batches on each of "
            f"{self.drafters} drafters: {self.total_batches} batches{resumed}"
        )


def make_plan(
    batches_per_epoch: int | None,
    epochs: int,
    drafters: int,
    grad_accum: int = 1,
    max_steps: int = 0,
    first_step: int = 0,
    first_g: int = 0,
) -> Plan:
    """batches_per_epoch None: synthetic data (max_steps, or SYNTHETIC_STEPS, optimizer steps).
    first_step, first_g: where a resumed run's segment starts (the checkpoint's step and batches done)."""
    grad_accum, drafters = max(1, grad_accum), max(1, drafters)
    if batches_per_epoch is None:
        steps = max_steps or SYNTHETIC_STEPS
        micro = steps * grad_accum
        total = first_g + max(0, micro - first_step * grad_accum) * drafters
        return Plan(0, 1, drafters, grad_accum, steps, micro, total, first_step, first_g)
    available = batches_per_epoch * epochs
    first_g = min(first_g, available)  # a finished run's empty slots were never data
    steps = first_step + math.ceil(math.ceil((available - first_g) / drafters) / grad_accum)
    if max_steps:
        steps = min(steps, max_steps)
    micro = steps * grad_accum
    total = min(available, first_g + max(0, micro - first_step * grad_accum) * drafters)
    return Plan(batches_per_epoch, epochs, drafters, grad_accum, steps, micro, total, first_step, first_g)
