"""Training metrics: averaged over the drafter ranks, written by rank 0 to <run_dir>/metrics.jsonl
(and as TensorBoard scalars under <run_dir>/tensorboard when `tensorboard` is installed, and to
Weights & Biases when log.wandb_project is set: wandb_log.py).

One JSON object per line. Train lines, every log.every optimizer steps (loss, accuracy and τ
averaged over every batch since the previous line, weighted by trained blocks):
    step, loss, accuracy, accuracy_per_position, tau, coverage, sampled_coverage, lr, grad_norm,
    tokens_per_s, window_tokens, window_s, samples_done, tokens_done, data_wait_frac, time_data_s,
    time_compute_s, time_other_s (per batch, mean of ranks), time (unix seconds); a Domino drafter's
    also base_tau (τ of its backbone's logits alone) and lambda_base (the base loss's share now)
window_tokens: tokens all ranks trained since the line before; window_s: that window's wall time
(mean of ranks); tokens_per_s = window_tokens / window_s, so a rate over several lines is
sum(window_tokens) / sum(window_s) (what `launcher report` prints).
coverage: the share of supervised tokens that some valid anchor reaches as its block's first
prediction (what the anchor rule lets train at all); sampled_coverage: the share that this
window's sampled blocks did train at k = 1 (bounded by drafter.num_anchors). Both over all ranks.
Eval lines ("eval": true), every eval.every steps:
    step, loss, accuracy, accuracy_per_position, tau, batches, blocks
Real-acceptance lines ("spec": true), after each evaluation and every eval.every_s seconds of training
("periodic": true): the lines of acceptance.jsonl (bookkeeping.py), their cost among them (cost_frac).
On resume from step s, lines with step > s are dropped first, so the curve continues without
repeats (the ledger does the same for batch indices).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from services.drafter.books.ledger import truncate_jsonl
from services.drafter.group.collectives import all_reduce_sum

METRICS_FILE = "metrics.jsonl"


class StepTimes:
    """Per-rank time accounting between two log points: data wait, train step, everything else."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.start = time.perf_counter()
        self.data = self.compute = 0.0
        self.tokens = self.steps = 0

    def add(self, data_s: float, compute_s: float, tokens: int) -> None:
        self.data += data_s
        self.compute += compute_s
        self.tokens += tokens
        self.steps += 1


def reduce_train_metrics(m: dict, times: StepTimes, counters: dict, device: torch.device, world_size: int) -> dict:
    """This step's metrics of every rank combined (weighted by trained blocks), the run's counters
    summed over ranks, and the time split per step since the last log (mean over ranks)."""
    w = float(m["trained_blocks"])
    wall = time.perf_counter() - times.start
    local = [
        m["loss"] * w,
        m["accuracy"] * w,
        m["tau"] * w,
        w,
        times.tokens,
        times.data,
        times.compute,
        wall,
        counters["samples_done"],
        counters["tokens_done"],
        m["supervised"],
        m["reachable"],
        m["sampled"],
        *[a * w for a in m["accuracy_per_position"]],
    ]
    positions = len(m["accuracy_per_position"])
    if "base_tau" in m:  # a Domino drafter (services/drafter/modeling/domino.py)
        local.append(m["base_tau"] * w)
    s = all_reduce_sum(local, device)
    blocks, per_step = max(s[3], 1e-9), world_size * max(times.steps, 1)
    data_s, compute_s, wall_s = s[5] / per_step, s[6] / per_step, s[7] / per_step
    r = lambda x: round(x, 6)
    supervised = max(s[10], 1.0)
    return {
        "loss": r(s[0] / blocks),
        "accuracy": r(s[1] / blocks),
        "tau": r(s[2] / blocks),
        "accuracy_per_position": [round(a / blocks, 4) for a in s[13 : 13 + positions]],
        "coverage": round(s[11] / supervised, 4),
        "sampled_coverage": round(s[12] / supervised, 4),
        "tokens_per_s": round(s[4] / max(s[7] / world_size, 1e-9), 1),
        "window_tokens": int(s[4]),
        "window_s": r(s[7] / world_size),
        "samples_done": int(s[8]),
        "tokens_done": int(s[9]),
        "data_wait_frac": r(data_s / max(wall_s, 1e-9)),
        "time_data_s": r(data_s),
        "time_compute_s": r(compute_s),
        "time_other_s": r(max(0.0, wall_s - data_s - compute_s)),
        **({"base_tau": r(s[-1] / blocks), "lambda_base": m["lambda_base"]} if "base_tau" in m else {}),
    }


def scalars(prefix: str, record: dict) -> dict[str, float]:
    """The plottable figures of a metrics or acceptance line, as TensorBoard / W&B tags: numbers only,
    not the step, the clock or flags; accuracy per position as accuracy_pos1…; the controls of a final
    acceptance line as spec/random/… and spec/repeat_last/…; lossless also as a share of the prompts."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(scalars(f"{prefix}/{key}", value))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("step", "time"):
            out[f"{prefix}/{key}"] = value
    for k, a in enumerate(record.get("accuracy_per_position", []), start=1):
        out[f"{prefix}/accuracy_pos{k}"] = a
    if "lossless" in record and record.get("prompts"):
        out[f"{prefix}/lossless_frac"] = record["lossless"] / record["prompts"]
    return out


class MetricsLog:
    """Rank 0's metrics.jsonl, plus TensorBoard (when installed) and W&B (when log.wandb_project is
    set): the same figures, train/… and eval/… from metrics.jsonl, spec/… from the real-acceptance lines
    (acceptance.jsonl's; those of training in metrics.jsonl too), at the optimizer step, with the line's
    `time` as the wall time. Other ranks get an instance that writes nothing."""

    def __init__(
        self, run_dir: str | Path, resume_step: int, enabled: bool, wandb_project: str = "", config: dict | None = None
    ):
        self.enabled = enabled
        self.path = Path(run_dir) / METRICS_FILE
        self.tb = self.wandb = None
        if not enabled:
            return
        if wandb_project:  # first: a missing package stops the start before any file is touched
            from services.drafter.books.wandb_log import WandbLog

            self.wandb = WandbLog(run_dir, wandb_project, config or {})
        truncate_jsonl(self.path, resume_step)
        self.file = open(self.path, "a")
        try:
            import tensorboard  # noqa: F401  (optional extra; torch's writer needs it)
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=resume_step + 1)
        except ImportError:
            self.tb = None

    def write(self, record: dict) -> None:
        """A metrics.jsonl line (train, eval with "eval": true, real acceptance with "spec": true)."""
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        self.plot("eval" if record.get("eval") else "spec" if record.get("spec") else "train", record)

    def plot(self, prefix: str, record: dict) -> None:
        """The line's figures to TensorBoard and W&B (the caller writes the line's file)."""
        if not self.enabled:
            return
        values, step = scalars(prefix, record), record["step"]
        if self.tb is not None:
            for tag, value in values.items():
                self.tb.add_scalar(tag, value, step, walltime=record.get("time"))
        if self.wandb is not None:
            self.wandb.log(values, step)

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.tb is not None:
                self.tb.close()
            if self.wandb is not None:
                self.wandb.close()


class MetricsWindow:
    """Loss, accuracy and τ averaged over every batch since the last metrics line (weighted by
    trained blocks), so a line every `log_every` steps describes all of them, not just the last;
    the coverage counts (supervised, reachable, sampled tokens) summed over the same batches."""

    KEYS = ("loss", "accuracy", "tau")
    COUNTS = ("supervised", "reachable", "sampled")

    def __init__(self):
        self.blocks = 0.0
        self.sums = dict.fromkeys(self.KEYS, 0.0)
        self.counts = dict.fromkeys(self.COUNTS, 0)
        self.per_position: list[float] = []

    def add(self, m: dict) -> None:
        w = float(m["trained_blocks"])
        self.blocks += w
        for key in self.KEYS:
            self.sums[key] += m[key] * w
        for key in self.COUNTS:
            self.counts[key] += m[key]
        pos = m["accuracy_per_position"]
        self.per_position = [a + b * w for a, b in zip(self.per_position or [0.0] * len(pos), pos)]

    def mean(self, last: dict) -> dict:
        """`last` with its averaged fields replaced by the window's means, its counts by the window's sums."""
        if self.blocks <= 0:
            return dict(last, **self.counts) if self.counts["supervised"] else last
        out = dict(
            last, trained_blocks=self.blocks, **{k: v / self.blocks for k, v in self.sums.items()}, **self.counts
        )
        out["accuracy_per_position"] = [a / self.blocks for a in self.per_position]
        return out
