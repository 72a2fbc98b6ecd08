"""Held-out evaluation: loss, per-position accuracy and simulated acceptance length tau.

Every rank evaluates its share of the eval split (batch i*D + d, like training), forward only.
The numbers are kept as sums (weighted loss, correct and trained positions, accepted tokens,
blocks), all-reduced, and only then divided, so the result is exact over the whole split and
the same on every rank. Definitions as in loss.acceptance_metrics. A stop requested while a rank
waits for eval data ends its pass early; the result then says complete=False on every rank.
A batch whose hidden states or loss are not finite counts for nothing (and in "nonfinite").
"""

from __future__ import annotations

import torch

from services.drafter.group.collectives import all_reduce_sum
from services.drafter.training.train import TrainState, check_batch, forward_loss
from services.process import lifecycle


@torch.no_grad()
def evaluate(state: TrainState, batches) -> dict:
    positions = state.drafter.cfg.block_size - 1
    loss_sum = weight_sum = accepted = blocks = 0.0
    correct = torch.zeros(positions, dtype=torch.float64, device=state.device)
    trained = torch.zeros(positions, dtype=torch.float64, device=state.device)
    count, stopped, nonfinite = 0, 0, 0
    it = iter(batches)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            break
        except lifecycle.Stopped:  # a stop while waiting for data: still join the sum
            stopped = 1
            break
        batch = check_batch(batch, state).to(state.device, non_blocking=True)
        loss, inputs, preds = forward_loss(state, batch)[:3]
        ok = torch.isfinite(batch.hidden).all() & torch.isfinite(loss)
        weights = inputs.weights * ok
        loss = torch.where(ok, loss, 0.0)
        nonfinite += int(not ok)  # the sync below (int(w_sum > 0)) is there already
        w_sum = weights.float().sum()
        is_trained = weights > 0
        is_correct = (preds == inputs.labels) & is_trained
        loss_sum = loss_sum + loss.double() * w_sum.double()
        weight_sum = weight_sum + w_sum.double()
        correct += is_correct.sum(0).double()
        trained += is_trained.sum(0).double()
        in_block = is_trained.any(1)
        accepted = accepted + (torch.cumprod(is_correct.long(), dim=1).sum(1) * in_block).sum().double()
        blocks = blocks + in_block.sum().double()
        count += int(w_sum > 0)  # real batches (not the split's padding)
    local = torch.stack(
        [
            torch.as_tensor(x, dtype=torch.float64, device=state.device)
            for x in (loss_sum, weight_sum, accepted, blocks, count, stopped, nonfinite)
        ]
    )
    s = all_reduce_sum(torch.cat([local, correct, trained]).tolist(), state.device)
    loss_total, w_total, acc_total, block_total, batches_total, stops, bad_total = s[:7]
    c, t = s[7 : 7 + positions], s[7 + positions :]
    return {
        "loss": loss_total / max(w_total, 1e-12),
        "accuracy": sum(c) / max(sum(t), 1.0),
        "accuracy_per_position": [round(ci / max(ti, 1.0), 4) for ci, ti in zip(c, t)],
        "tau": 1.0 + acc_total / max(block_total, 1.0),
        "batches": int(batches_total),
        "blocks": int(block_total),
        "nonfinite": int(bad_total),
        "complete": stops == 0,
    }
