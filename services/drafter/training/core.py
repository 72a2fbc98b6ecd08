"""One drafter rank's training with no sockets, signals or health: DrafterCore.step(batch) -> metrics.

    core = DrafterCore.build(cfg, model_cfg, head, device, total_steps=N, world_size=W)
    seconds = core.compile(dummy_batch, with_eval=True)   # every graph, before `ready`
    core.plan(plan)                                       # the lr schedule over the run's real horizon
    metrics = core.step(batch)                            # anchors -> drafter -> loss -> DDP -> AdamW

The shell (worker.py) owns the data source, health, the stop vote and the bookkeeping (ledger,
metrics, eval, checkpoints), and is the only code that calls these; a test trains the same core in
its own interpreter on batches from a target core (tests/inprocess.py).
"""

from __future__ import annotations

import torch
from torch import nn

from services.data.batch import Batch
from services.drafter.modeling import domino
from services.drafter.modeling.attention import make_attention
from services.drafter.modeling.loss import ChunkFns, Fp8Head
from services.drafter.modeling.model import DFlashDrafter
from services.drafter.modeling.precision import apply_precision
from services.drafter.modeling.target_head import TargetHead
from services.drafter.training.train import StepSettings, TrainState, check_batch, make_scheduler, train_step
from services.drafter.training.warmup import warmup
from services.run.config import Config


class DrafterCore:
    def __init__(self, state: TrainState, warmup_ratio: float, min_lr_ratio: float):
        self.state = state
        self.warmup_ratio, self.min_lr_ratio = warmup_ratio, min_lr_ratio  # drafter.*: the lr schedule's shape

    @classmethod
    def build(cls, cfg: Config, model_cfg, head: TargetHead, device, *, total_steps: int, world_size: int = 1):
        """The drafter, its optimizer and a provisional lr schedule over total_steps optimizer steps
        (plan() sets the real one), from the kernels and optimizer sections."""
        k, o, device = cfg.kernels, cfg.optimizer, torch.device(device)
        torch.manual_seed(cfg.run.seed)  # identical init on every rank (DDP also broadcasts rank 0's)
        drafter = DFlashDrafter(model_cfg, attention=make_attention(k.attention, device)).to(device)
        apply_precision(drafter, k.precision, device)  # FP8 linears, before compile wraps them
        if k.compile:
            for layer in drafter.layers:  # one graph, shared by the layers (same code, same shapes)
                layer.compile(dynamic=False)
        model: nn.Module = drafter
        if world_size > 1:
            model = nn.parallel.DistributedDataParallel(drafter, broadcast_buffers=False, gradient_as_bucket_view=True)
        optimizer = torch.optim.AdamW(
            drafter.parameters(), lr=o.lr, weight_decay=o.weight_decay, fused=device.type == "cuda"
        )
        head = head.to(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
        compile_loss = k.compile and device.type == "cuda"  # the loss chunks: inductor pays off on a GPU
        state = TrainState(
            drafter=drafter,
            model=model,
            head=head,
            optimizer=optimizer,
            scheduler=make_scheduler(optimizer, total_steps, o.warmup_ratio, o.min_lr_ratio),
            settings=StepSettings.from_config(cfg, model_cfg),
            device=device,
            chunk_fns=ChunkFns(compile=compile_loss),
            domino_chunk=domino.chunk_function(compile=compile_loss),
            fp8_head=Fp8Head.of(head.lm_head) if k.precision == "fp8" else None,
        )
        return cls(state, o.warmup_ratio, o.min_lr_ratio)

    def check(self, batch: Batch) -> Batch:
        """Shapes, dtypes and (on the CPU) values against the run, before a batch goes to the GPU early."""
        return check_batch(batch, self.state)

    def compile(self, dummy: Batch, with_eval: bool) -> float:
        """Compile the train step (and the eval forward, when the run evaluates) on a made-up batch; seconds."""
        return round(warmup(self.state, dummy, with_eval=with_eval), 3)

    def plan(self, plan) -> None:
        """The lr schedule over the run's plan (schedule.py), known once the targets have said how many
        batches there are."""
        self.state.scheduler = make_scheduler(
            self.state.optimizer, plan.optimizer_steps, self.warmup_ratio, self.min_lr_ratio, plan
        )

    def step(self, batch: Batch) -> dict:
        """Train on one batch (the optimizer steps every grad_accum batches): plain-number metrics."""
        return train_step(self.state, batch)
