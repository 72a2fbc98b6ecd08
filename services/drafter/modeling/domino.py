"""Domino's causal correction of a DFlash block (drafter.objective = "domino"; arXiv 2605.29707).

DFlash drafts the B-1 positions of a block in one parallel pass, each blind to the tokens drafted
before it in the same block. Domino keeps that pass and adds a small causal head: a GRU reads the
block's tokens one by one, and a low-rank MLP of [drafter output ; GRU state] adds a correction
to each position's logits:

    g_k      = GRU(embed(t_0), ..., embed(t_{k-1}))        t_0 the anchor, t_j the token at position j
    u_k      = silu(W1 [z_k ; g_k])                        [E]   embed_proj.0, E = drafter.domino_emb_dim
    logits_k = z_k @ lm_head^T  +  u_k @ W2^T              base + correction; embed_proj.2 = W2 [V, E]

Training teacher-forces t_1 .. t_{B-2} with the labels (the target's greedy tokens: the only tokens
an earlier draft can be and still be accepted) and weighs two cross-entropies by a curriculum:

    loss = (1 - lambda) CE(final) + lambda CE(base),   lambda = start * max(0, 1 - progress / decay_ratio)

so the parallel backbone learns first and the head takes over (Domino's base-anchored curriculum;
progress is the lr schedule's, so a resume continues it). Decoding rolls the head out: position k's
token is the argmax of its corrected logits and is fed to the GRU for position k+1, B-1 small steps
after the one parallel pass.

The parameter names (prefix_gru.weight_{ih,hh}_l0, embed_proj.{0,2}.weight) and the config fields
(dflash_config.projector_type "domino", emb_dim, gru_hidden_dim, shift_label false,
pure_draft_prefix_len 0) are those of SpecForge's Domino drafters, which SGLang's DFlash worker
serves; shift_label false is the block layout of every DFlash drafter here (position k predicts a+k).
"""

from __future__ import annotations

import torch
from torch import nn

from services.drafter.modeling.loss import (
    LossHead,
    head_input,
    head_input_grad,
    head_logits,
    normalized,
    row_ce,
    softmax_minus_onehot,
)


def make_head(hidden_size: int, emb_dim: int, gru_dim: int, vocab_size: int) -> tuple[nn.GRU, nn.Sequential]:
    """(prefix_gru, embed_proj), shaped and named as SpecForge's: no biases."""
    gru = nn.GRU(input_size=hidden_size, hidden_size=gru_dim, num_layers=1, batch_first=True, bias=False)
    proj = nn.Sequential(
        nn.Linear(hidden_size + gru_dim, emb_dim, bias=False), nn.SiLU(), nn.Linear(emb_dim, vocab_size, bias=False)
    )
    return gru, proj


def lambda_base(progress: float, start: float, decay_ratio: float) -> float:
    """The base logits' share of the loss at this fraction of the run."""
    return start * max(0.0, 1.0 - progress / decay_ratio)


def teacher_states(drafter, embed_tokens, first_tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """GRU states [N, B-1, G] of training's blocks: position k reads t_0 (the block's first token) and
    the labels of positions 1 .. k-1. torch's GRU (cuDNN's on a GPU) on the fp32 master weights,
    outside autocast: it is small, and fp32 keeps these states and decoding's step-by-step ones alike."""
    tokens = torch.cat([first_tokens[:, None], labels[:, :-1]], dim=1)
    embeds = embed_tokens(tokens)
    with torch.autocast(embeds.device.type, enabled=False):
        return drafter.prefix_gru(embeds.to(drafter.prefix_gru.weight_ih_l0.dtype))[0]


def low_rank(drafter, z: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """u = silu(W1 [z ; g]) [..., E], in z's dtype."""
    return drafter.embed_proj[1](drafter.embed_proj[0](torch.cat([z, g.to(z.dtype)], dim=-1)))


def gru_step(w_ih: torch.Tensor, w_hh: torch.Tensor, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """One step of torch's GRU without biases (gates r, z, n in its weights' order), in the weights'
    dtype: decoding runs it in fp32 whatever the drafter's dtype, as training's GRU runs."""
    r_i, z_i, n_i = (x.to(w_ih.dtype) @ w_ih.t()).chunk(3, dim=-1)
    r_h, z_h, n_h = (h @ w_hh.t()).chunk(3, dim=-1)
    r, z = torch.sigmoid(r_i + r_h), torch.sigmoid(z_i + z_h)
    return (1 - z) * torch.tanh(n_i + r * n_h) + z * h


@torch.no_grad()
def rollout(drafter, embed_tokens, lm_head: torch.Tensor, z: torch.Tensor, first_tokens: torch.Tensor) -> torch.Tensor:
    """Greedy drafts [N, B-1] of blocks whose drafter outputs are z [N, B-1, H] (positions 1..B-1)
    and whose first tokens are first_tokens [N]: one GEMM for the base logits, then B-1 GRU steps."""
    base = z @ lm_head.t()  # [N, B-1, V]
    gru, w2 = drafter.prefix_gru, drafter.embed_proj[2].weight
    w_ih, w_hh = gru.weight_ih_l0.float(), gru.weight_hh_l0.float()
    token, drafts = first_tokens, []
    h = torch.zeros(z.shape[0], gru.hidden_size, dtype=torch.float32, device=z.device)
    for k in range(z.shape[1]):
        h = gru_step(w_ih, w_hh, embed_tokens(token), h)
        token = (base[:, k] + low_rank(drafter, z[:, k], h) @ w2.t()).argmax(-1)
        drafts.append(token)
    return torch.stack(drafts, dim=1)


def domino_chunk(h, uc, w2, lm_head: LossHead, labels, scale, lam: torch.Tensor, want_grad: bool, with_base: bool):
    """One chunk of rows: (its share of the loss, final predictions, base predictions, and with want_grad
    the share's gradients for h, u and W2). lam is a 0-d fp32 tensor, so a compiled chunk is not
    recompiled as the curriculum moves. with_base (lam > 0) adds the base CE and its gradient; at
    lam = 0 (the second half of a run by default) they are skipped, which leaves the same loss and
    gradients with one softmax pass over the vocabulary fewer (only the base argmax remains).
    lm_head: the frozen bf16 one, or its Fp8Head with kernels.precision = "fp8" (its two GEMMs in FP8,
    as DFlash's loss; the head's W2 stays bf16)."""
    base = head_logits(h, lm_head)
    final = base + (uc @ w2.t()).float()
    ce, lse = row_ce(final, labels, scale)
    loss = ((1 - lam) * scale * ce).sum()
    if with_base:
        ce_base, lse_base = row_ce(base, labels, scale)
        loss = loss + (lam * scale * ce_base).sum()
    preds, base_preds = final.argmax(-1), base.argmax(-1)
    if not want_grad:
        return loss, preds, base_preds, None, None, None
    g_final = softmax_minus_onehot(final, lse, labels) * ((1 - lam) * scale)[:, None]
    g_logits = g_final
    if with_base:  # at lam = 0 the base CE's gradient is 0: skip its softmax pass
        g_logits = g_final + softmax_minus_onehot(base, lse_base, labels) * (lam * scale)[:, None]
    grad_h = head_input_grad(g_logits, lm_head, h.dtype, scale.max())  # |g| <= (1 - lam) s + lam s
    g_final = g_final.to(h.dtype)
    return loss, preds, base_preds, grad_h, g_final @ w2, g_final.t() @ uc


def chunk_function(compile: bool):
    """domino_chunk, or its torch.compile'd form (fuses the softmax and gradient passes on a GPU)."""
    return torch.compile(domino_chunk, dynamic=False) if compile else domino_chunk


class _DominoCE(torch.autograd.Function):
    """The chunked loss of module docstring, its gradients computed in the forward pass while each
    chunk's logits are at hand (as loss.py's _ChunkedCE): hidden [R, H], u [R, E], the trainable W2
    [V, E], the frozen lm_head [V, H] or its Fp8Head. Returns (loss, final predictions, base predictions)."""

    @staticmethod
    def forward(ctx, hidden, u, w2, lm_head, labels, scale, lam: float, chunk: int, fn):
        rows, dtype, with_base = hidden.shape[0], hidden.dtype, lam > 0
        want_grad = any(ctx.needs_input_grad[:3])
        w2c = w2.to(dtype)
        lam_t = torch.full((), lam, dtype=torch.float32, device=hidden.device)  # a fill: no host sync, as a copy has
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        preds = torch.empty(rows, dtype=torch.long, device=hidden.device)
        base_preds = torch.empty_like(preds)
        grad_h = torch.empty_like(hidden) if want_grad else None
        grad_u = torch.empty_like(u) if want_grad else None
        grad_w2 = torch.zeros(w2.shape, dtype=torch.float32, device=w2.device) if want_grad else None
        for start in range(0, rows, chunk):
            end = min(start + chunk, rows)
            args = hidden[start:end], u[start:end].to(dtype), w2c, lm_head, labels[start:end], scale[start:end]
            part, preds[start:end], base_preds[start:end], g_h, g_u, g_w2 = fn(*args, lam_t, want_grad, with_base)
            loss += part
            if want_grad:
                grad_h[start:end], grad_u[start:end] = g_h, g_u  # (g_u cast to u's dtype on assignment)
                grad_w2 += g_w2.float()
        ctx.mark_non_differentiable(preds, base_preds)
        if want_grad:
            ctx.save_for_backward(grad_h, grad_u, grad_w2)
        return loss, preds, base_preds

    @staticmethod
    def backward(ctx, grad_loss, _grad_preds, _grad_base_preds):
        grad_h, grad_u, grad_w2 = ctx.saved_tensors
        g = grad_loss.float()
        return grad_h * g.to(grad_h.dtype), grad_u * g.to(grad_u.dtype), grad_w2 * g, None, None, None, None, None, None


def domino_cross_entropy(
    hidden, u, w2, lm_head: LossHead, labels, weights, lam: float, chunk: int = 2048, fn=domino_chunk
):
    """hidden [R, H] (positions 1..B-1, block by block), u [R, E], W2 [V, E], lm_head [V, H] (or its
    Fp8Head), labels [R], weights [N, B-1] -> (loss, predictions [R], base predictions [R]); the
    weights are normalized to sum 1.
    fn: domino_chunk or its compiled form (chunk_function)."""
    if chunk < 1:
        raise ValueError(f"kernels.loss_chunk must be >= 1, got {chunk}")
    scale = normalized(weights.float().flatten())
    return _DominoCE.apply(head_input(hidden, lm_head), u, w2, lm_head, labels, scale, float(lam), chunk, fn)
