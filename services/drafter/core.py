"""One drafter rank's training with no sockets, signals or health: DrafterCore.step(batch) -> metrics.

    core = DrafterCore.build(cfg, model_cfg, head, device, world_size=W, total_steps=N)
    seconds = core.compile(dummy_batch, with_eval=True)   # every graph, before `ready`
    core.plan(plan)                                       # the lr schedule over the run's real horizon
    metrics = core.step(batch)                            # anchors -> drafter -> loss -> DDP -> AdamW

The shell (worker.py) owns the data source, health, the stop vote and the bookkeeping (ledger,
metrics, eval, checkpoints), and is the only code that calls these; a test trains the same core in
its own interpreter on batches from a target core (tests/inprocess.py).
"""

from __future__ import annotations

import time

from services.data.batch import Batch
from services.drafter.evaluate import evaluate
from services.drafter.target_head import TargetHead
from services.drafter.train import TrainState, build_train_state, check_batch, make_scheduler, train_step
from services.drafter.warmup import warmup
from services.run.config import Config


class DrafterCore:
    def __init__(self, state: TrainState, cfg: Config):
        self.state = state
        self._schedule = (cfg.drafter.warmup_ratio, cfg.drafter.min_lr_ratio)

    @classmethod
    def build(cls, cfg: Config, model_cfg, head: TargetHead, device, *, world_size: int, total_steps: int):
        """The drafter, its optimizer and a provisional lr schedule (plan() sets the real one)."""
        state = build_train_state(cfg, model_cfg, head, device, world_size=world_size, total_steps=total_steps)
        return cls(state, cfg)

    def check(self, batch: Batch) -> Batch:
        """Shapes, dtypes and (on the CPU) values against the run, before a batch goes to the GPU early."""
        return check_batch(batch, self.state)

    def compile(self, dummy: Batch, with_eval: bool) -> float:
        """Compile the train step (and the eval forward, when the run evaluates) on a made-up batch; seconds."""
        seconds = warmup(self.state, dummy)
        if with_eval:  # the forward-only graph, compiled now rather than mid-run
            start = time.perf_counter()
            evaluate(self.state, [dummy])
            seconds += time.perf_counter() - start
        return round(seconds, 3)

    def plan(self, plan) -> None:
        """The lr schedule over the run's plan (schedule.py), known once the targets have said how many
        batches there are."""
        warmup_ratio, min_lr_ratio = self._schedule
        self.state.scheduler = make_scheduler(
            self.state.optimizer, plan.optimizer_steps, warmup_ratio, min_lr_ratio, plan
        )

    def step(self, batch: Batch) -> dict:
        """Train on one batch (the optimizer steps every grad_accum batches): plain-number metrics."""
        return train_step(self.state, batch)
