"""The DFlash block mask, and two attention backends that apply it.

Layout. Queries are the blocks: Q_LEN = num_anchors * block_size, block i holds rows
[i*B, (i+1)*B). Keys are [context ; blocks]: KV_LEN = context_len + Q_LEN.

Mask (docs/dflash.md). A query in block i, anchor a_i, may attend
  - context key j when doc_start(a_i) <= j < a_i  (strictly before the anchor, same document),
  - every key of its own block,
and nothing else. An empty block (anchor -1) attends nothing.

Sliding window W (a `sliding_attention` layer; docs/dflash.md "Sliding-window layers"): the query at
block offset k sits at position a_i + k and sees only keys within W positions of itself, counting
itself: context j >= a_i + k - (W - 1), and block offsets o >= k - (W - 1). Nothing bounds it on the
right: the whole block stays visible (SpecForge's training mask; with W >= B, as in every published
config, only the context bound bites). A block that runs past its
document's end needs nothing more: its keys are its own anchor and mask tokens and context of its
own document before the anchor, so nothing outside the document is visible (its positions past
the end carry no loss weight: anchors.py).

`visibility()` is the one definition: the dense mask evaluates it over index grids, flex's
mask_mod calls it per (q_idx, kv_idx). Documents are contiguous runs of one id (packing makes
them so; `check_documents_contiguous` checks it; services/data/batch.py reads the runs), so "same
document and before the anchor" is exactly "at or after the document's first token and before
the anchor".

The flex BlockMask is built directly from the anchors (no create_block_mask, no compile, no
dense mask): every anchor's visible keys are two intervals, the context prefix and its own
block (per row with a window: the lower bounds grow by one per block offset); a 128x128 tile is
touched when some row's interval reaches into it and full when every row of the tile covers it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from services.data.batch import document_starts, run_starts

TILE = 128  # flex_attention's sparse block size; Q and KV are padded to multiples of it


def check_documents_contiguous(document_ids: torch.Tensor, what: str = "document_ids") -> None:
    """Every real document id must form one contiguous run (padding -1 may recur). Host sync."""
    ids = document_ids.cpu()
    if ids.numel() == 0:
        return
    starts = ids[run_starts(ids)]
    real = starts[starts >= 0]
    if real.unique().numel() != real.numel():
        values, counts = real.unique(return_counts=True)
        raise ValueError(
            f"{what}: document id {int(values[counts > 1][0])} appears in more than one run; "
            "documents must be contiguous"
        )


def anchor_context_starts(anchors: torch.Tensor, document_ids: torch.Tensor | None) -> torch.Tensor:
    """First visible context index of each anchor's block (its document's start; 0 without documents)."""
    if document_ids is None:
        return torch.zeros_like(anchors)
    starts = document_starts(document_ids)
    return torch.where(anchors >= 0, starts[anchors.clamp(min=0)], 0)


def check_window(window) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding window must be None or an int >= 1, got {window!r}")


def visibility(
    anchors: torch.Tensor, context_starts: torch.Tensor, block_size: int, context_len: int, window: int | None = None
):
    """The DFlash mask as a function of (q_idx, kv_idx) tensors (any broadcastable shapes).
    window: None (full attention) or W (sliding: keys within W positions of the query, itself included)."""
    num_blocks = anchors.shape[0]

    def visible(q_idx, kv_idx):
        block = q_idx // block_size
        safe = block.clamp(max=num_blocks - 1)
        anchor = anchors[safe]
        valid = (block < num_blocks) & (anchor >= 0)
        in_context = (kv_idx < context_len) & (kv_idx >= context_starts[safe]) & (kv_idx < anchor)
        in_own_block = (kv_idx >= context_len) & ((kv_idx - context_len) // block_size == block)
        if window is not None:
            offset = q_idx % block_size  # the query sits at position anchor + offset
            in_context = in_context & (kv_idx >= anchor + offset - (window - 1))
            in_own_block = in_own_block & ((kv_idx - context_len) % block_size >= offset - (window - 1))
        return valid & (in_context | in_own_block)

    return visible


def padded_mask(anchors: torch.Tensor, block_size: int, context_len: int, window: int | None = None) -> torch.Tensor:
    """visibility() for a batch of padded rows, one block each (decoding many prompts at once):
    row b's context is its first anchors[b] keys (the rest padding), its block the last block_size
    keys. Returns [B, 1, block_size, context_len + block_size] bool."""
    check_window(window)
    offset = torch.arange(block_size, device=anchors.device)[:, None]  # the query sits at anchor + offset
    key = torch.arange(context_len + block_size, device=anchors.device)[None, :]
    anchor = anchors[:, None, None, None]
    in_context = (key < context_len) & (key < anchor)
    in_block = key >= context_len
    if window is not None:
        in_context = in_context & (key >= anchor + offset - (window - 1))
        in_block = in_block & (key - context_len >= offset - (window - 1))
    return in_context | in_block


def flex_mask_mod(anchors, context_starts, block_size: int, context_len: int, window: int | None = None):
    visible = visibility(anchors, context_starts, block_size, context_len, window)

    def dflash_mask_mod(b, h, q_idx, kv_idx):
        return visible(q_idx, kv_idx)

    return dflash_mask_mod


def _ceil_div(x, d):
    return (x + d - 1) // d


def block_tiles(
    anchors: torch.Tensor,
    context_starts: torch.Tensor,
    block_size: int,
    context_len: int,
    tile: int = TILE,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tile-level view of the mask: (touched, full) bool [Q_LEN/tile, KV_LEN/tile], no host sync."""
    n = anchors.shape[0]
    q_len = n * block_size
    kv_len = context_len + q_len
    if q_len % tile or context_len % tile:
        raise ValueError(
            f"pad first: num_anchors*block_size={q_len} and context_len={context_len} must be multiples of {tile}"
        )
    check_window(window)
    nq, nkv = q_len // tile, kv_len // tile
    device = anchors.device
    i = torch.arange(n, device=device)
    valid = anchors >= 0
    zero = torch.zeros_like(anchors)
    own_lo = context_len + i * block_size
    hi = torch.stack([torch.where(valid, anchors, zero), torch.where(valid, own_lo + block_size, zero)], 1)

    def lower_bounds(k):
        """Each anchor's two key intervals start here for its row at block offset k (see visibility)."""
        if window is None:
            ctx, own = context_starts, own_lo
        else:
            ctx = torch.maximum(context_starts, anchors + k - (window - 1))
            own = own_lo + (k - (window - 1)).clamp(min=0)
        return torch.stack([torch.where(valid, ctx, zero), torch.where(valid, own, zero)], 1)

    # difference arrays over kv tiles, one row per q tile; +1 at an interval's start, -1 past its end
    touch = torch.zeros(nq * (nkv + 1), dtype=torch.int32, device=device)
    cover = torch.zeros_like(touch)
    rows_anchors = torch.zeros(nq, dtype=torch.int32, device=device)
    rows_valid = torch.zeros_like(rows_anchors)
    first_q, last_q = (i * block_size) // tile, ((i + 1) * block_size - 1) // tile
    for t in range((block_size - 1) // tile + 2):  # q tiles one anchor's rows can span
        q_tile = first_q + t
        inside = q_tile <= last_q
        q_tile = q_tile.clamp(max=nq - 1)
        # the anchor's rows in this q tile are block offsets k_first..k_last; a window's lower bound
        # grows with k, so the first row sees the most (touched) and the last the least (full)
        k_first = (q_tile * tile - i * block_size).clamp(min=0)
        k_last = ((q_tile + 1) * tile - 1 - i * block_size).clamp(max=block_size - 1)
        lo_any, lo_all = lower_bounds(k_first), lower_bounds(k_last)
        nonempty, has_full = hi > lo_any, hi > lo_all
        touch_lo, touch_hi = lo_any // tile, _ceil_div(hi, tile)
        full_lo, full_hi = _ceil_div(lo_all, tile), hi // tile
        has_full = has_full & (full_hi > full_lo)
        rows_anchors.index_add_(0, q_tile, inside.int())
        rows_valid.index_add_(0, q_tile, (inside & valid).int())
        base = (q_tile * (nkv + 1))[:, None]
        on = (inside[:, None] & nonempty).int().flatten()
        touch.index_add_(0, (base + touch_lo).flatten(), on)
        touch.index_add_(0, (base + touch_hi).flatten(), -on)
        on_full = (inside[:, None] & has_full).int().flatten()
        full_lo, full_hi = torch.where(has_full, full_lo, 0), torch.where(has_full, full_hi, 0)
        cover.index_add_(0, (base + full_lo).flatten(), on_full)
        cover.index_add_(0, (base + full_hi).flatten(), -on_full)
    touched = touch.view(nq, nkv + 1).cumsum(-1)[:, :nkv] > 0
    covered = cover.view(nq, nkv + 1).cumsum(-1)[:, :nkv]
    # full: every row of the q tile is a real row, and every anchor in it covers the whole kv tile
    full = touched & (covered == rows_anchors[:, None]) & (rows_valid == rows_anchors)[:, None]
    return touched, full


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiles [nq, nkv] -> (counts [1,1,nq], indices [1,1,nq,nkv]) int32, same order as create_block_mask."""
    t = tiles.to(torch.int32)
    counts = t.sum(-1).to(torch.int32)
    indices = torch.argsort(t, dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[None, None].contiguous(), indices[None, None].contiguous()


def flex_block_mask(
    anchors: torch.Tensor,
    context_starts: torch.Tensor,
    block_size: int,
    context_len: int,
    tile: int = TILE,
    window: int | None = None,
):
    """The flex BlockMask for sorted-or-not anchors, built from tiles (see block_tiles)."""
    touched, full = block_tiles(anchors, context_starts, block_size, context_len, tile, window)
    kv_num, kv_idx = _ordered(touched & ~full)
    full_num, full_idx = _ordered(full)
    q_len = anchors.shape[0] * block_size
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=tile,
        mask_mod=flex_mask_mod(anchors, context_starts, block_size, context_len, window),
        seq_lengths=(q_len, context_len + q_len),
    )


class DenseAttention:
    """SDPA with the boolean mask. CPU runs and the reference for flex. Memory O(Q*KV)."""

    name = "dense"

    def build_mask(
        self, anchors, context_starts, block_size: int, context_len: int, window: int | None = None
    ) -> torch.Tensor:
        check_window(window)
        q_len = anchors.shape[0] * block_size
        q_idx = torch.arange(q_len, device=anchors.device)[:, None]
        kv_idx = torch.arange(context_len + q_len, device=anchors.device)[None, :]
        return visibility(anchors, context_starts, block_size, context_len, window)(q_idx, kv_idx)

    def __call__(self, q, k, v, mask):
        # rows that attend nothing (empty blocks) must give 0, not NaN: let them attend
        # everything, then zero their output (which also zeroes their gradient)
        attends = mask.any(-1, keepdim=True)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~attends, enable_gqa=q.shape[1] != k.shape[1])
        return out * attends.to(out.dtype)


_compiled_flex = None


def compiled_flex_attention():
    """torch.compile(flex_attention), created once per process (never shared across threads)."""
    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


class FlexAttention:
    """Block-sparse flex_attention, compiled in this process. GPU training; CPU forward only."""

    name = "flex"

    def __init__(self, kernel_options: dict | None = None):
        self.kernel_options = kernel_options

    def build_mask(self, anchors, context_starts, block_size: int, context_len: int, window: int | None = None):
        return flex_block_mask(anchors, context_starts, block_size, context_len, window=window)

    def __call__(self, q, k, v, mask):
        # inside a compiled layer dynamo captures flex_attention itself; eager calls need the
        # compiled wrapper (uncompiled flex_attention would materialise the dense scores)
        fn = flex_attention if torch.compiler.is_compiling() else compiled_flex_attention()
        return fn(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1], kernel_options=self.kernel_options)


def make_attention(kind: str, device: torch.device | str):
    """'flex' | 'dense' | 'auto' (flex on cuda, dense elsewhere: flex has no CPU backward)."""
    device = torch.device(device)
    if kind == "auto":
        kind = "flex" if device.type == "cuda" else "dense"
    if kind == "flex":
        return FlexAttention()
    if kind == "dense":
        return DenseAttention()
    raise ValueError(f"kernels.attention must be auto|flex|dense, got {kind!r}")
