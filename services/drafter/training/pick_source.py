"""Which source a drafter's batches come from, for a run: the targets over ZMQ (source.py's ZmqSource)
or made up (--synthetic: synthetic.py), and the interface both give the worker (BatchSource).
"""

from __future__ import annotations

import logging
from typing import Iterator, Protocol

import torch

from services.data.batch import Batch
from services.drafter.modeling.model import DrafterModelConfig
from services.drafter.training.source import SourceSettings, ZmqSource
from services.drafter.training.synthetic import SyntheticEval, SyntheticSource
from services.process.health import HealthServer
from services.run.runspec import RunSpec
from services.run.schedule import Plan, make_plan

log = logging.getLogger("drafter")


class BatchSource(Protocol):
    """What the drafter worker asks of its training batches: ZmqSource, or SyntheticSource (which has
    no targets, so its hooks do nothing)."""

    def __iter__(self) -> Iterator[Batch]: ...

    def check_targets(self, spec: RunSpec) -> None:
        """Raise HandshakeError unless the targets loaded what this drafter's run spec says."""

    def provenance_of(self, g: int) -> dict | None:
        """What the ledger records of where batch g came from (None: nothing to record)."""

    def target_of(self, g: int) -> int | None:
        """The target that built batch g (None: no target did)."""

    def close(self) -> None: ...


def train_batches(
    settings: SourceSettings,
    model_cfg: DrafterModelConfig,
    health: HealthServer,
    device: torch.device,
    *,
    synthetic: bool,
    max_steps: int,
    start_step: int,
    first_g: int | None = None,
    check=None,
) -> tuple[BatchSource, Plan]:
    """(this rank's training batches from micro-step start_step on, the run's plan), the targets'
    handshake done. first_g: batches done before start_step (a resume: the checkpoint's, whatever split
    wrote it). check: validates a batch on the CPU."""
    rank, world_size = settings.at.rank, settings.at.world_size
    first_g = start_step * world_size if first_g is None else first_g
    if synthetic:
        accum = settings.grad_accum
        plan = make_plan(None, 1, world_size, accum, max_steps, first_step=start_step // accum, first_g=first_g)
        source = SyntheticSource(
            model_cfg,
            settings.pack_len,
            rank=rank,
            world_size=world_size,
            seed=settings.seed,
            total_steps=plan.micro_batches,
            start_step=start_step,
            device=device,
            with_target_labels=settings.labels_from_target,
            first_g=first_g,
        )
        return source, plan
    source = ZmqSource(
        settings, health, max_steps=max_steps, start_step=start_step, device=device, check=check, first_g=first_g
    )
    return source, source.connect()


def eval_batches(
    settings: SourceSettings,
    model_cfg: DrafterModelConfig,
    health: HealthServer,
    device: torch.device,
    *,
    synthetic: bool,
    check=None,
) -> ZmqSource | SyntheticEval | None:
    """The held-out split (rank d evaluates batches i*D + d), the targets' handshake done, or None when
    evaluation is off or empty."""
    if not settings.evaluate:
        return None
    if synthetic:
        return SyntheticEval(
            SyntheticSource(
                model_cfg,
                settings.pack_len,
                seed=settings.seed,
                device=device,
                with_target_labels=settings.labels_from_target,
            ),
            settings.at.rank,
            settings.at.world_size,
        )
    source = ZmqSource(settings, health, split="eval", device=device, check=check)
    source.connect()
    if source.total_batches == 0:
        log.warning(
            "eval.every is set but the data has no held-out batches (data.eval_fraction / "
            "data.eval_path); evaluation is off"
        )
        source.close()
        return None
    return source
