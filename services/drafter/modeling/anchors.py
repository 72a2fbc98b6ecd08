"""From a packed Batch to the drafter's inputs: anchors, blocks, positions, labels, loss weights.

Rules (docs/dflash.md, "Anchors, blocks, loss", which names the upstream sources):
  - an anchor a is valid when it is supervised and so is the next token of its document
    (loss_mask[a] and loss_mask[a+1], a+1 in a's document). Its block may run past the end of
    the document (or of the packed row): those positions carry no loss weight, and the block
    still sees context of its own document only (the mask does not change). Requiring the whole
    block to fit in the document left the last B-1 tokens of every document, and every reply
    shorter than B, without a first prediction;
  - num_anchors are drawn uniformly without replacement among valid positions and sorted;
    with fewer valid positions we keep them all and the remaining slots are empty blocks (-1);
  - block i = [token a_i, mask, mask, ...] at positions pos(a_i) + k;
  - block position k in 1..B-1 predicts the data token at a+k (or the target's argmax at a+k-1);
  - weight w_k = exp(-(k-1)/gamma) * loss_mask[a+k] * [a+k in a's document] * block valid;
    position 0 is not trained.

Coverage (a metric): the share of supervised tokens that some valid anchor can reach as its
block's first prediction (k = 1), i.e. that the sampler can ever train at k = 1.

Everything here runs on the batch's device with fixed shapes and no host sync, so the step's
GPU work is queued without stalls. Padding: the number of anchor slots is rounded up so that
Q_LEN is a multiple of 128, and the context is padded to a multiple of 128 (zero features,
position 0, outside every document); padded slots are empty blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.data.batch import run_starts
from services.drafter.modeling.attention import TILE, anchor_context_starts

# γ for B = 16 when drafter.gamma = 0: 4 beat the released 7 by held-out real acceptance on a real
# target (SmolLM2-135M-Instruct, 8M tokens: HumanEval 1.98 against 1.85 per prompt; docs/benchmarks.md)
DEFAULT_GAMMA_B16 = 4.0


def loss_gamma(block_size: int, configured: float = 0.0) -> float:
    """The decay constant: configured if > 0, else DEFAULT_GAMMA_B16 scaled with the block size
    (the released DFlash recipe's 7 / 5 / 4 for B = 16 / 10 / 8 are drafter.gamma = 7, 5, 4)."""
    if configured > 0:
        return float(configured)
    return DEFAULT_GAMMA_B16 * block_size / 16


def padded_anchor_count(num_anchors: int, block_size: int, tile: int = TILE) -> int:
    """Smallest count >= num_anchors whose blocks fill whole 128-row query tiles."""
    step = tile // math.gcd(block_size, tile)
    return -(-num_anchors // step) * step


def padded_context_len(seq_len: int, tile: int = TILE) -> int:
    return -(-seq_len // tile) * tile


@dataclass
class DrafterInputs:
    hidden: torch.Tensor  # [C, K*H]  context features, zero rows past seq_len
    context_positions: torch.Tensor  # [C]
    block_ids: torch.Tensor  # [N, B]    anchor token then mask tokens
    block_positions: torch.Tensor  # [N, B]
    anchors: torch.Tensor  # [N]       sorted; -1 = empty block (at the end)
    context_starts: torch.Tensor  # [N]       first context index each block may see
    labels: torch.Tensor  # [N, B-1]  targets of block positions 1..B-1
    weights: torch.Tensor  # [N, B-1]  fp32 loss weights (0 = not trained)
    supervised: torch.Tensor  # []        supervised tokens in the batch
    reachable: torch.Tensor  # []        of those, first predictions of some valid anchor
    seq_len: int  # S before padding
    context_len: int  # C, padded


def valid_anchor_mask(loss_mask: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """Bool [S]: positions that may anchor a block: supervised, and so is the next token of the
    same document. The block size plays no part: a block may run past its document's end."""
    valid = torch.zeros_like(loss_mask)
    same_doc = ~run_starts(document_ids)[1:] & (document_ids[:-1] >= 0)
    valid[:-1] = loss_mask[:-1] & loss_mask[1:] & same_doc
    return valid


def reachable_tokens(loss_mask: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Bool [S]: supervised tokens that are the first prediction (k = 1) of some valid anchor."""
    reachable = torch.zeros_like(loss_mask)
    reachable[1:] = valid[:-1] & loss_mask[1:]
    return reachable


def sample_anchors(valid: torch.Tensor, num_anchors: int, generator: torch.Generator | None) -> torch.Tensor:
    """Uniform sample without replacement of up to num_anchors valid positions, sorted, -1 padded.

    Random keys ranked with topk: the same distribution as a random permutation, but fixed
    shapes and no host sync (the number of valid positions never reaches the CPU).
    """
    s = valid.shape[0]
    if num_anchors > s:
        raise ValueError(f"num_anchors={num_anchors} is larger than the sequence ({s} tokens)")
    keys = torch.rand(s, device=valid.device, generator=generator)
    keys = torch.where(valid, keys, 2.0)
    picked = torch.topk(keys, num_anchors, largest=False, sorted=False).indices
    picked = torch.where(valid[picked], picked, s)  # invalid picks sort to the end
    picked = torch.sort(picked).values
    return torch.where(picked < s, picked, -1)


def anchor_generator(seed: int, g: int, device: torch.device) -> torch.Generator:
    """Anchors depend only on (seed, g): a batch re-trained after a restart gets the same blocks."""
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + g) % (2**63 - 1))
    return gen


def build_inputs(
    batch,
    *,
    num_anchors: int,
    block_size: int,
    mask_token_id: int,
    gamma: float,
    labels_from_target: bool = False,
    generator: torch.Generator | None = None,
    tile: int = TILE,
) -> DrafterInputs:
    """Batch (already on its device) -> DrafterInputs with padded, fixed shapes."""
    s = batch.seq_len
    if num_anchors > s:
        raise ValueError(f"drafter.num_anchors={num_anchors} is larger than the packed sequence ({s} tokens)")
    if labels_from_target and batch.target_labels is None:
        raise ValueError(f"batch g={batch.g}: target.labels_from_target is set but the batch has no target_labels")
    device = batch.input_ids.device
    B = block_size
    k = torch.arange(B, device=device)

    valid = valid_anchor_mask(batch.loss_mask, batch.document_ids)
    anchors = sample_anchors(valid, num_anchors, generator)
    slots = padded_anchor_count(num_anchors, B, tile)
    anchors = F.pad(anchors, (0, slots - num_anchors), value=-1)
    real = anchors >= 0
    a = anchors.clamp(min=0)

    block_ids = torch.full((slots, B), mask_token_id, dtype=torch.long, device=device)
    block_ids[:, 0] = torch.where(real, batch.input_ids[a], mask_token_id)
    block_positions = batch.position_ids[a][:, None] + k[None, :]

    label_at = a[:, None] + k[None, 1:]  # [N, B-1]: a+1 .. a+B-1
    # a block may run past its document (and the row): those positions are not trained
    in_doc = (label_at < s) & (batch.document_ids[label_at.clamp(max=s - 1)] == batch.document_ids[a][:, None])
    label_at = label_at.clamp(max=s - 1)
    if labels_from_target:
        labels = batch.target_labels[label_at - 1]  # target's guess for a+k, made at a+k-1
    else:
        labels = batch.input_ids[label_at]
    decay = torch.exp(-(k[1:].float() - 1) / gamma)
    weights = decay[None, :] * (batch.loss_mask[label_at] & in_doc & real[:, None]).float()

    context_len = padded_context_len(s, tile)
    pad = context_len - s
    return DrafterInputs(
        hidden=F.pad(batch.hidden, (0, 0, 0, pad)),
        context_positions=F.pad(batch.position_ids, (0, pad)),
        block_ids=block_ids,
        block_positions=block_positions,
        anchors=anchors,
        context_starts=anchor_context_starts(anchors, batch.document_ids),
        labels=labels,
        weights=weights,
        supervised=batch.loss_mask.sum(),
        reachable=reachable_tokens(batch.loss_mask, valid).sum(),
        seq_len=s,
        context_len=context_len,
    )
