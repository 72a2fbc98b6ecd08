"""One drafter training step: Batch -> anchors/blocks -> drafter -> chunked loss -> DDP -> AdamW.

Precision: fp32 parameters, bf16 autocast on CUDA (fp32 everywhere on CPU). AdamW then updates
the fp32 parameters directly, so they are the "fp32 master weights" with no second copy to keep
in sync, gradients accumulate in fp32 (exact over grad_accum), and DDP, clipping and the
checkpoint see one set of tensors. The cost is one bf16 cast of each weight per step (autocast
caches it for the backward), small next to Q_LEN-row matmuls, and fp32 gradient all-reduce.
The frozen embedding and lm_head are kept in bf16 only (they never need a master copy).
With kernels.precision = "fp8" the linears' matmuls run in FP8 from the same fp32 weights (precision.py).

Finite or not at all: each step checks its features and loss (isfinite, on the device) and a
batch that fails scales its loss by NaN, so its gradient is NaN and DDP's own all-reduce carries
that to every rank; the optimizer step is skipped when the all-reduced gradient norm is not
finite, on every rank alike (on CUDA inside fused AdamW, from a device flag: no host sync; on
the CPU by a plain test). The flags travel in the step's one host sync, after the update.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from services.data.batch import Batch, BatchError, count_documents
from services.drafter.modeling import domino
from services.drafter.modeling.anchors import DrafterInputs, anchor_generator, build_inputs, loss_gamma
from services.drafter.modeling.attention import check_documents_contiguous
from services.drafter.modeling.loss import ChunkFns, Fp8Head, LossHead, acceptance_metrics, chunked_cross_entropy
from services.drafter.modeling.model import DFlashDrafter, DrafterModelConfig
from services.drafter.modeling.target_head import TargetHead
from services.run.config import Config


@dataclass
class StepSettings:
    """The config a step reads; the model's shape (block size, mask token) is state.drafter.cfg's."""

    num_anchors: int
    gamma: float
    dpace_alpha: float | None  # drafter.position_weights = "dpace": D-PACE's alpha; None: gamma's decay
    domino_curriculum: tuple[float, float]  # drafter.domino_lambda_start, domino_decay_ratio (a Domino drafter)
    labels_from_target: bool
    loss_chunk: int
    grad_accum: int
    grad_clip: float
    seed: int
    pack_len: int

    @classmethod
    def from_config(cls, cfg: Config, model_cfg: DrafterModelConfig) -> "StepSettings":
        return cls(
            num_anchors=cfg.drafter.num_anchors,
            gamma=loss_gamma(model_cfg.block_size, cfg.drafter.gamma),
            dpace_alpha=cfg.drafter.dpace_alpha if cfg.drafter.position_weights == "dpace" else None,
            domino_curriculum=(cfg.drafter.domino_lambda_start, cfg.drafter.domino_decay_ratio),
            labels_from_target=cfg.target.labels_from_target,
            loss_chunk=cfg.kernels.loss_chunk,
            grad_accum=max(1, cfg.optimizer.grad_accum),
            grad_clip=cfg.optimizer.grad_clip,
            seed=cfg.run.seed,
            pack_len=cfg.data.pack_len,
        )


class WarmupCosine:
    """LR multiplier: linear warmup to 1, then cosine down to min_ratio at `total`.

    Its clock counts units (make_scheduler: global batches trained): optimizer step k is at
    first + (k - first_step)·per_step. With the defaults a unit is an optimizer step."""

    def __init__(
        self, warmup: int, total: int, min_ratio: float = 0.0, per_step: int = 1, first_step: int = 0, first: int = 0
    ):
        self.warmup, self.total, self.min_ratio = warmup, max(1, total), min_ratio
        self.per_step, self.first_step, self.first = max(1, per_step), first_step, first

    def __call__(self, step: int) -> float:
        done = self.first + (step - self.first_step) * self.per_step
        if done < self.warmup:
            return min(1.0, (done + self.per_step) / self.warmup)
        progress = min(1.0, (done - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def progress(self, step: int) -> float:
        """The fraction of the run done at optimizer step `step`, in [0, 1]."""
        return min(1.0, max(0.0, (self.first + (step - self.first_step) * self.per_step) / self.total))

    def horizon(self) -> dict:
        """What a resume compares (the clock's origin moves with every resume; the curve does not)."""
        return {"warmup": self.warmup, "total": self.total, "min_ratio": self.min_ratio}


@dataclass
class TrainState:
    """Everything a checkpoint needs, in one place."""

    drafter: DFlashDrafter  # the trainable module (its state_dict is the export)
    model: nn.Module  # drafter, or DDP(drafter) with several ranks
    head: TargetHead  # frozen embedding + lm_head on the device
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    settings: StepSettings
    device: torch.device
    chunk_fns: ChunkFns = field(default_factory=ChunkFns)
    domino_chunk: Callable = domino.domino_chunk  # or its compiled form (domino.chunk_function)
    fp8_head: Fp8Head | None = None  # the lm_head's FP8 form, with kernels.precision = "fp8"
    step: int = 0  # optimizer steps done
    micro_step: int = 0  # batches trained
    samples_done: int = 0  # documents trained
    tokens_done: int = 0  # real (non-padding) context tokens trained

    @property
    def loss_head(self) -> LossHead:
        return self.head.lm_head if self.fp8_head is None else self.fp8_head

    @property
    def autocast_dtype(self):
        return torch.bfloat16 if self.device.type == "cuda" else None

    def counters(self) -> dict:
        return {
            "step": self.step,
            "micro_step": self.micro_step,
            "samples_done": self.samples_done,
            "tokens_done": self.tokens_done,
        }


def make_scheduler(
    optimizer, optimizer_steps: int, warmup_ratio: float, min_lr_ratio: float, plan=None
) -> torch.optim.lr_scheduler.LambdaLR:
    """Warmup + cosine over the run (schedule.py). With the plan, the clock is global batches trained,
    not optimizer steps: a resume on another number of drafters (another batch per step) continues
    the curve where the data is, and it ends with the data (docs/design.md, "Scheduling")."""
    if plan is None:  # one unit per optimizer step (before the plan is known)
        per_step, first_step, first, total = 1, 0, 0, max(1, optimizer_steps)
    else:
        per_step, first_step, first = plan.batches_per_step, plan.first_step, plan.first_g
        total = max(per_step, plan.horizon_batches)
    steps = total // per_step if total % per_step == 0 else total / per_step  # exact for one split
    warmup = math.ceil(warmup_ratio * steps) * per_step
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, WarmupCosine(warmup, total, min_lr_ratio, per_step, first_step, first)
    )


def check_batch(batch: Batch, state: TrainState) -> Batch:
    """Shapes and dtypes against the config; values too when the batch is still on the CPU."""
    s = state.settings
    batch.validate(hidden_width=state.drafter.cfg.hidden_width)
    if batch.seq_len != s.pack_len:
        raise BatchError(
            f"batch g={batch.g}: field 'input_ids' has {batch.seq_len} tokens, data.pack_len is {s.pack_len}"
        )
    if s.labels_from_target and batch.target_labels is None:
        raise BatchError(f"batch g={batch.g}: field 'target_labels' is missing but target.labels_from_target is set")
    if batch.input_ids.device.type == "cpu":
        vocab = state.drafter.cfg.vocab_size
        for name in ("input_ids", "target_labels"):
            t = getattr(batch, name)
            if t is not None and t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
                raise BatchError(f"batch g={batch.g}: field {name!r} has ids outside [0, {vocab})")
        try:
            check_documents_contiguous(batch.document_ids, f"batch g={batch.g}: field 'document_ids'")
        except ValueError as exc:
            raise BatchError(str(exc)) from None
    return batch


class Forward(NamedTuple):
    loss: torch.Tensor
    inputs: DrafterInputs
    preds: torch.Tensor  # [N, B-1] argmax of each trained position's logits
    base_preds: torch.Tensor | None = None  # a Domino drafter's: the same before its correction
    lambda_base: float = 0.0  # ... and the base loss's share (domino.py)


def forward_loss(state: TrainState, batch: Batch) -> Forward:
    """Forward of one batch (on the device): the loss, the drafter's inputs and its predictions."""
    s, m = state.settings, state.drafter.cfg
    inputs = build_inputs(
        batch,
        num_anchors=s.num_anchors,
        block_size=m.block_size,
        mask_token_id=m.mask_token_id,
        gamma=s.gamma,
        labels_from_target=s.labels_from_target,
        generator=anchor_generator(s.seed, batch.g, state.device),
    )
    masks = state.drafter.build_masks(inputs.anchors, inputs.context_starts, inputs.context_len)
    compute_dtype = state.autocast_dtype or torch.float32
    autocast = torch.autocast("cuda", dtype=state.autocast_dtype) if state.autocast_dtype else contextlib.nullcontext()
    with autocast:
        embeds = state.head.embed_tokens(inputs.block_ids.flatten())
        out = state.model(
            inputs.hidden.to(compute_dtype), embeds, inputs.context_positions, inputs.block_positions.flatten(), masks
        )
    n, b = inputs.block_ids.shape
    trained_rows = out.view(n, b, -1)[:, 1:].reshape(n * (b - 1), -1)  # position 0 is not trained
    if m.domino:
        return domino_forward(state, inputs, trained_rows, autocast)
    loss, preds = chunked_cross_entropy(
        trained_rows,
        state.loss_head,
        inputs.labels.flatten(),
        inputs.weights,
        s.loss_chunk,
        state.chunk_fns,
        s.dpace_alpha,
    )
    return Forward(loss, inputs, preds.view(n, b - 1))


def domino_forward(state: TrainState, inputs: DrafterInputs, trained_rows: torch.Tensor, autocast) -> Forward:
    """The loss of a Domino drafter (domino.py): its head on the trained rows, teacher-forced."""
    drafter, s = state.drafter, state.settings
    n, positions = inputs.labels.shape
    lam = domino.lambda_base(state.scheduler.lr_lambdas[0].progress(state.step), *s.domino_curriculum)
    states = domino.teacher_states(drafter, state.head.embed_tokens, inputs.block_ids[:, 0], inputs.labels)
    with autocast:
        u = domino.low_rank(drafter, trained_rows, states.reshape(n * positions, -1))
    loss, preds, base_preds = domino.domino_cross_entropy(
        trained_rows,
        u,
        drafter.embed_proj[2].weight,
        state.loss_head,
        inputs.labels.flatten(),
        inputs.weights,
        lam,
        s.loss_chunk,
        state.domino_chunk,
    )
    return Forward(loss, inputs, preds.view(n, positions), base_preds.view(n, positions), lam)


def train_step(state: TrainState, batch: Batch, *, dry_run: bool = False) -> dict:
    """Train on one batch; steps the optimizer every grad_accum batches. Returns plain-number metrics.

    dry_run: forward + backward only (compile warmup); parameters, optimizer, scheduler and
    counters stay untouched and the gradients are dropped.
    """
    s = state.settings
    batch = check_batch(batch, state)
    documents, tokens = count_documents(batch.document_ids), (batch.document_ids >= 0).sum()
    batch = batch.to(state.device, non_blocking=True)
    accumulate = dry_run or (state.micro_step + 1) % s.grad_accum != 0
    no_sync = getattr(state.model, "no_sync", None)
    with no_sync() if (accumulate and not dry_run and no_sync) else contextlib.nullcontext():
        loss, inputs, preds, base_preds, lam = forward_loss(state, batch)
        features_ok = torch.isfinite(inputs.hidden).all()
        batch_ok = features_ok & torch.isfinite(loss)
        # a bad batch makes its whole gradient NaN: the all-reduce tells every rank (NaN * 0 is NaN too)
        poison = torch.where(batch_ok, 1.0, float("nan")).to(loss.dtype)
        (loss * poison / s.grad_accum).backward()
    if dry_run:
        state.optimizer.zero_grad(set_to_none=True)
        return {}

    grad_norm = torch.zeros((), device=state.device)
    step_ok = torch.ones((), dtype=torch.bool, device=state.device)
    lr = state.optimizer.param_groups[0]["lr"]
    if not accumulate:
        max_norm = s.grad_clip if s.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(state.drafter.parameters(), max_norm)
        step_ok = torch.isfinite(grad_norm)  # the same on every rank: the gradients are all-reduced
        if state.optimizer.defaults.get("fused"):
            state.optimizer.found_inf = (~step_ok).float()  # fused AdamW skips the update on the device
            state.optimizer.step()
        elif bool(step_ok):  # CPU (not fused): nothing queued, nothing to wait for
            state.optimizer.step()
        state.scheduler.step()
        state.optimizer.zero_grad(set_to_none=True)
        state.step += 1
    state.micro_step += 1
    m = acceptance_metrics(preds, inputs.labels, inputs.weights)
    sampled = (inputs.anchors >= 0).sum()  # each sampled block trains one distinct k = 1 token
    scalars = torch.stack(
        [
            loss.detach().float(),
            m["accuracy"],
            m["tau"],
            grad_norm.float(),
            m["trained_blocks"].float(),
            documents.float().to(state.device),
            tokens.float().to(state.device),
            inputs.supervised.float(),
            inputs.reachable.float(),
            sampled.float(),
            features_ok.float(),
            batch_ok.float(),
            step_ok.float(),
        ]
    )
    if base_preds is not None:  # a Domino drafter's: what its backbone alone would get accepted
        scalars = torch.cat([scalars, acceptance_metrics(base_preds, inputs.labels, inputs.weights)["tau"][None]])
    values = torch.cat([scalars, m["accuracy_per_position"]]).tolist()  # the step's one host sync
    loss_v, accuracy, tau, grad_norm_v, blocks, documents_v, tokens_v, supervised, reachable, sampled_v = values[:10]
    features_fine, batch_fine, step_fine = (v == 1.0 for v in values[10:13])
    out = {
        "step": state.step,
        "g": batch.g,
        "loss": loss_v,
        "accuracy": accuracy,
        "tau": tau,
        "grad_norm": grad_norm_v,
        "trained_blocks": int(blocks),
        "lr": lr,
        "tokens": int(tokens_v),
        "documents": int(documents_v),
        "supervised": int(supervised),
        "reachable": int(reachable),
        "sampled": int(sampled_v),
        "coverage": reachable / max(supervised, 1.0),
        "accuracy_per_position": [round(x, 4) for x in values[len(scalars) :]],
        "skipped_step": not step_fine,
    }
    if base_preds is not None:
        out.update(base_tau=values[13] if batch_fine else 1.0, lambda_base=round(lam, 6))
    if not batch_fine:  # not trained: nothing of it in the counters or the metrics, and why
        out.update(
            loss=0.0,
            accuracy=0.0,
            tau=1.0,
            trained_blocks=0,
            tokens=0,
            documents=0,
            supervised=0,
            reachable=0,
            sampled=0,
            coverage=0.0,
            accuracy_per_position=[0.0] * len(out["accuracy_per_position"]),
            nonfinite=nonfinite_reason(batch, state) if not features_fine else "non-finite loss",
        )
    if not step_fine:
        out["grad_norm"] = 0.0
    state.samples_done += out["documents"]
    state.tokens_done += out["tokens"]
    return out


def nonfinite_reason(batch: Batch, state: TrainState) -> str:
    """Which captured layers of a batch's hidden states are not finite (run only when one is)."""
    ids = state.drafter.cfg.target_layer_ids
    per_layer = torch.isfinite(batch.hidden.reshape(batch.hidden.shape[0], len(ids), -1)).all(-1).all(0).tolist()
    bad = [layer for layer, fine in zip(ids, per_layer) if not fine]
    return f"non-finite hidden states of captured layer{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))}"


@torch.no_grad()
def parameter_fingerprint(module: nn.Module) -> str:
    """A digest of every parameter's exact float64 sum and sum of squares: equal on ranks in lockstep."""
    import hashlib

    sums = torch.stack([torch.stack([p.double().sum(), p.double().pow(2).sum()]) for p in module.parameters()])
    return hashlib.sha256(sums.cpu().numpy().tobytes()).hexdigest()[:16]
