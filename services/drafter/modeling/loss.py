"""Weighted cross-entropy through the frozen lm_head, in chunks, and the acceptance metrics.

The logits of all trained rows (Q_LEN x vocab, about 20 GB in fp32 at seed shapes) never exist:
rows go through the lm_head `chunk` at a time. Because the loss is the last thing in the step,
each chunk's input gradient is computed right away in the forward pass, while its logits are at
hand (softmax minus one-hot, times the row's weight, back through the lm_head), and stored as a
[rows, H] tensor; backward only scales it. So the lm_head runs twice in all (logits, input grad),
never a third time to recompute logits, and memory holds one chunk of logits at a time.

    loss = sum_r w_r * CE_r / sum_r w_r          (0 when every weight is 0, with zero grads)

The weights w are the block positions' (drafter.position_weights): "decay", known before the loss
(anchors.py: exp(-(k-1)/gamma) on every trained position), or "dpace", D-PACE's (Dynamic
Position-Aware Cross-Entropy, arXiv 2605.18810), which follow from the drafter's own confidence in
each label, q_k = exp(-CE_k): smoothed to (1 - alpha) q_k + alpha, then

    w_j = sum over m >= j of prod over i <= m of q~_i      (detached; trained positions of one block)

the derivative of the expected accepted length sum_m prod_{i<=m} q_i with respect to log q_j: each
position weighs what its acceptance is worth to the block's accepted length now, so the training
signal moves to the positions that currently limit acceptance. Those weights need every row's CE
first: the chunks then compute each row's input gradient for a weight of 1, and the weights scale
the stored gradient rows afterwards (the gradient is linear in a row's weight), so the lm_head still
runs twice, not three times.

With kernels.precision = "fp8" both lm_head GEMMs run in FP8 (`Fp8Head`): the frozen lm_head is
cast to e4m3 once, the chunk's hidden rows to e4m3 and its logit gradients to e5m2 with one scale
per chunk, as torchao's tensorwise recipe does for the drafter's linears (the gradients' scale from
their bound, head_input_grad). The softmax, the loss and the argmax stay in fp32 on the fp32 logits
the GEMM writes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Fp8Head(NamedTuple):
    """The frozen lm_head [V, H] in e4m3 with one scale, kept in the two layouts FP8 GEMMs need:
    [V, H] rows for the logits (h @ W^T) and [H, V] rows for the input grad (g @ W)."""

    weight: torch.Tensor  # [V, H] e4m3
    weight_t: torch.Tensor  # [H, V] e4m3
    scale: torch.Tensor  # fp32 scalar: lm_head ~ weight * scale

    @classmethod
    def of(cls, lm_head: torch.Tensor) -> "Fp8Head | None":
        """None when a dimension is not a multiple of 16 (FP8 GEMMs need that): the loss stays bf16."""
        if not fp8_dims(*lm_head.shape):
            return None
        weight, scale = to_fp8(lm_head, torch.float8_e4m3fn)
        return cls(weight, weight.t().contiguous(), scale)


def fp8_dims(*dims: int) -> bool:
    """Whether FP8 GEMMs take these matrix dimensions (cuBLAS wants multiples of 16)."""
    return all(d % 16 == 0 for d in dims)


LossHead = torch.Tensor | Fp8Head  # what the chunk functions take: the bf16 lm_head, or its FP8 form


def to_fp8(x: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / s in dtype, s) with one scale s that maps x's largest magnitude to dtype's largest; or
    `amax`, a bound on that magnitude known beforehand, which spares a pass over x to find it."""
    top = torch.finfo(dtype).max
    s = (x.abs().amax() if amax is None else amax).float().clamp(min=1e-12) / top
    return (x.float() / s).clamp(-top, top).to(dtype), s


def head_logits(h: torch.Tensor, head: LossHead) -> torch.Tensor:
    """fp32 logits [rows, V] of hidden rows h [rows, H]."""
    if isinstance(head, Fp8Head):
        h8, s = to_fp8(h, torch.float8_e4m3fn)
        # fast accumulation for the output GEMM, not for the gradient's: torchao's tensorwise choice
        return torch._scaled_mm(h8, head.weight.t(), s, head.scale, out_dtype=torch.float32, use_fast_accum=True)
    return (h @ head.t()).float()


def head_input_grad(g: torch.Tensor, head: LossHead, dtype: torch.dtype, bound: torch.Tensor) -> torch.Tensor:
    """d loss / d h [rows, H] from the logits' gradient g [rows, V] (fp32), whose magnitude is at most
    `bound`: the largest row weight, since each entry is a weight times softmax minus one-hot, in [-1, 1].
    The FP8 head scales g by it instead of by g's own amax, one pass over the vocabulary-wide rows
    fewer; e5m2's relative precision is the same across its range, so that costs no precision unless
    g is far below its bound (then its smallest entries underflow sooner)."""
    if isinstance(head, Fp8Head):
        g8, s = to_fp8(g, torch.float8_e5m2, bound)  # gradients in e5m2: more range, as torchao's recipe
        return torch._scaled_mm(g8, head.weight_t.t(), s, head.scale, out_dtype=dtype)
    return g.to(dtype) @ head


def row_ce(logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor):
    """(CE of each row of fp32 logits where scale > 0, else 0; each row's logsumexp)."""
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, labels[:, None])[:, 0]
    return torch.where(scale > 0, lse - picked, 0.0), lse


def softmax_minus_onehot(logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """d CE / d logits of each row (a new tensor), the same values either way: compiled, one elementwise
    expression, which inductor fuses with what uses it (the row weights, the FP8 cast) instead of
    writing the vocabulary-wide softmax out for a scatter and reading it back; eager, the softmax with
    1 taken off in place at each label, which makes no other vocabulary-wide tensor."""
    probs = torch.exp(logits - lse[:, None])
    if torch.compiler.is_compiling():
        is_label = torch.arange(logits.shape[1], device=logits.device) == labels[:, None]
        return torch.where(is_label, probs - 1, probs)
    return probs.scatter_add_(1, labels[:, None], torch.full_like(lse[:, None], -1.0))


def ce_chunk_loss(h: torch.Tensor, lm_head: LossHead, labels: torch.Tensor, scale: torch.Tensor):
    """One chunk, no grad: (CE of each row where scale > 0, else 0; argmax predictions)."""
    logits = head_logits(h, lm_head)
    return row_ce(logits, labels, scale)[0], logits.argmax(-1)


def ce_chunk_loss_and_grad(h: torch.Tensor, lm_head: LossHead, labels: torch.Tensor, scale: torch.Tensor):
    """One chunk: (CE of each row where scale > 0, else 0; argmax predictions; d (sum scale * CE) / d h)."""
    logits = head_logits(h, lm_head)
    loss, lse = row_ce(logits, labels, scale)
    grad_logits = softmax_minus_onehot(logits, lse, labels) * scale[:, None]
    return loss, logits.argmax(-1), head_input_grad(grad_logits, lm_head, h.dtype, scale.max())


class ChunkFns:
    """The two chunk functions, eager or torch.compile'd (fuses softmax/grad passes on GPU)."""

    def __init__(self, compile: bool = False):
        self.loss_only, self.loss_and_grad = ce_chunk_loss, ce_chunk_loss_and_grad
        if compile:
            self.loss_only = torch.compile(ce_chunk_loss, dynamic=False)
            self.loss_and_grad = torch.compile(ce_chunk_loss_and_grad, dynamic=False)


_EAGER = ChunkFns(compile=False)


class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, lm_head, labels, scale, chunk, fns, reweigh):
        """reweigh: None (scale is the rows' final weights), or a function of the rows' CE giving
        them (D-PACE): the chunks then run with scale as it is (1 on trained rows) and the rows'
        gradients are scaled by the weights afterwards."""
        rows = hidden.shape[0]
        ce = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        preds = torch.empty(rows, dtype=torch.long, device=hidden.device)
        want_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(hidden) if want_grad else None
        for start in range(0, rows, chunk):
            end = min(start + chunk, rows)
            args = (hidden[start:end], lm_head, labels[start:end], scale[start:end])
            if want_grad:
                ce[start:end], preds[start:end], grad[start:end] = fns.loss_and_grad(*args)
            else:
                ce[start:end], preds[start:end] = fns.loss_only(*args)
        if reweigh is not None:
            scale = reweigh(ce)
            if want_grad:
                grad.mul_(scale.to(grad.dtype)[:, None])
        loss = (ce * scale).sum()
        ctx.mark_non_differentiable(preds)
        ctx.save_for_backward(grad if want_grad else hidden.new_empty(0))
        return loss, preds

    @staticmethod
    def backward(ctx, grad_loss, _grad_preds):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    lm_head: LossHead,
    labels: torch.Tensor,
    weights: torch.Tensor,
    chunk: int = 2048,
    fns: ChunkFns | None = None,
    dpace_alpha: float | None = None,
):
    """hidden [R, H], lm_head [V, H] (frozen, or its Fp8Head), labels [R], weights [N, B-1] (R = N x
    (B-1), block by block) -> (loss, predictions [R]).

    loss = sum(w * CE) / sum(w); 0 with zero gradients when all weights are 0. dpace_alpha set: w are
    D-PACE's weights (dpace_weights), `weights` only saying which positions are trained (> 0).
    """
    if chunk < 1:
        raise ValueError(f"kernels.loss_chunk must be >= 1, got {chunk}")
    if dpace_alpha is None:
        scale, reweigh = normalized(weights.float().flatten()), None
    else:  # the chunks run with weight 1 on every trained row; the weights follow from their CE
        trained = weights > 0
        scale = trained.float().flatten()

        def reweigh(ce: torch.Tensor) -> torch.Tensor:
            return normalized(dpace_weights(ce.view(trained.shape), trained, dpace_alpha).flatten())

    return _ChunkedCE.apply(head_input(hidden, lm_head), lm_head, labels, scale, chunk, fns or _EAGER, reweigh)


def head_input(hidden: torch.Tensor, lm_head: LossHead) -> torch.Tensor:
    """The hidden states as the loss's head takes them: in a frozen lm_head's dtype (bf16 GEMMs);
    an Fp8Head quantizes them itself."""
    return hidden.to(lm_head.dtype) if isinstance(lm_head, torch.Tensor) else hidden


def normalized(weights: torch.Tensor) -> torch.Tensor:
    return weights / weights.sum().clamp(min=torch.finfo(torch.float32).tiny)


@torch.no_grad()
def dpace_weights(ce: torch.Tensor, trained: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE's position weights [N, B-1] from the rows' CE [N, B-1] (module docstring): a position
    not trained is one the drafter cannot get accepted (confidence 0, as acceptance_metrics counts it)
    and gets no weight."""
    q = torch.where(trained, torch.exp(-ce.float()), 0.0)
    reach = torch.cumprod((1 - alpha) * q + alpha, dim=1) * trained  # prod_{i<=m} q~_i, where trained
    return torch.flip(torch.cumsum(torch.flip(reach, [1]), 1), [1]) * trained  # sum over m >= j


@torch.no_grad()
def acceptance_metrics(preds: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> dict:
    """preds/labels/weights [N, B-1] (block positions 1..B-1). Tensors, no host sync.

    accuracy_k: top-1 accuracy at block position k over positions with weight > 0.
    tau: simulated acceptance length, 1 + mean over trained blocks of the number of consecutive
    correct predictions from k = 1 (an untrained position ends the run, as a wrong one would).
    """
    trained = weights > 0
    correct = (preds == labels) & trained
    per_pos = correct.sum(0).float() / trained.sum(0).clamp(min=1).float()
    blocks = trained.any(1)
    accepted = torch.cumprod(correct.long(), dim=1).sum(1).float()
    num_blocks = blocks.sum()
    tau = 1.0 + (accepted * blocks).sum() / num_blocks.clamp(min=1)
    accuracy = correct.sum().float() / trained.sum().clamp(min=1).float()
    return {"accuracy": accuracy, "accuracy_per_position": per_pos, "tau": tau, "trained_blocks": num_blocks}
