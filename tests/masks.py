"""The DFlash block mask as a dense bool tensor, with its inputs checked: the reference tests and the
bench smoke tests compare against (the drafter's own dense backend is attention.DenseAttention)."""

import torch

from services.drafter.modeling.attention import (
    anchor_context_starts,
    check_documents_contiguous,
    check_window,
    visibility,
)


def check_anchors(anchors: torch.Tensor, block_size: int, context_len: int, document_ids=None) -> None:
    if anchors.dim() != 1 or anchors.dtype != torch.int64:
        raise ValueError(f"anchor_positions must be a 1-D int64 tensor, got {anchors.dtype} {tuple(anchors.shape)}")
    if anchors.numel() == 0:
        raise ValueError("anchor_positions is empty")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    limit = context_len if document_ids is None else document_ids.shape[0]
    if bool((anchors >= limit).any()) or bool((anchors < -1).any()):
        raise ValueError(
            f"anchor_positions must be -1 or in [0, {limit}), got min {int(anchors.min())} max {int(anchors.max())}"
        )
    if document_ids is not None:
        if document_ids.dim() != 1 or document_ids.shape[0] > context_len:
            raise ValueError(
                f"document_ids must be 1-D with at most context_len={context_len} entries, "
                f"got {tuple(document_ids.shape)}"
            )
        check_documents_contiguous(document_ids)
        real = anchors[anchors >= 0]
        if bool((document_ids[real] < 0).any()):
            raise ValueError("an anchor lies on padding (document id -1)")


def dense_block_mask(
    anchor_positions: torch.Tensor,
    block_size: int,
    context_len: int,
    document_ids: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Bool [num_anchors*block_size, context_len + num_anchors*block_size]; True = may attend.

    anchor_positions: 1-D int64, -1 marks an empty block. document_ids: 1-D over the context
    (may be shorter than context_len: the rest is padding), contiguous documents. window: see visibility.
    """
    check_anchors(anchor_positions, block_size, context_len, document_ids)
    check_window(window)
    starts = anchor_context_starts(anchor_positions, document_ids)
    q_len = anchor_positions.shape[0] * block_size
    device = anchor_positions.device
    q_idx = torch.arange(q_len, device=device)[:, None]
    kv_idx = torch.arange(context_len + q_len, device=device)[None, :]
    return visibility(anchor_positions, starts, block_size, context_len, window)(q_idx, kv_idx)
