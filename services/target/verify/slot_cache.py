"""The KV cache of slots.py's rows and the attention a decoding step runs on it.

    cache = SlotCache(rows, capacity)        # every attention layer's keys and values, a row per prompt
    masks = SlotMasks(positions, length)     # one forward's masks: row b's queries see its own prefix
    per_row = row_bytes(text_config, itemsize, capacity, feature_width)    # what a row takes
    rows = rows_that_fit(model, device, capacity, most)                    # how many half the free memory holds

Keys and values are written at each row's own positions and read up to the longest row of the
forward; the target's attention function (model/attention.py, sdpa_packed) hands a forward of many
rows to SlotMasks.attend: SDPA with the masks as an additive bias, or on CUDA in bf16/fp16 for a few
rows two batched GEMMs around an fp32 softmax (gemm_attention). Out of slots.py, which keeps the
rows' decoding (Slots: prefill, step, commit) and the loop over it (decode_slots).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache


def row_bytes(cfg, itemsize: int, capacity: int, feature_width: int = 0) -> int:
    """What one row of `capacity` tokens takes: the keys and values of every attention layer (a Gated
    DeltaNet layer keeps none), the drafter's features (feature_width: the captured layers' width; 0
    without a drafter), the fp32 logits with their top-2 and softmax, and each Gated DeltaNet layer's
    fp32 state (twice: its copy while a block commits) and conv window. cfg: the text config."""
    kinds = getattr(cfg, "layer_types", None) or []
    recurrent = sum(kind == "linear_attention" for kind in kinds)
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = (cfg.num_hidden_layers - recurrent) * 2 * heads * head_dim + feature_width
    total = capacity * per_token * itemsize + 3 * cfg.vocab_size * 4
    if recurrent:
        v_heads, k, v = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        conv_channels = 2 * cfg.linear_num_key_heads * k + v_heads * v
        window = (cfg.linear_conv_kernel_dim - 1) * conv_channels * itemsize
        total += recurrent * (2 * v_heads * k * v * 4 + window)
    return total


def rows_that_fit(model, device, capacity: int, most: int, feature_width: int = 0) -> int:
    """Rows of `capacity` tokens (row_bytes) that half the free memory of a CUDA device holds, at most
    `most`: the rows of one batch when the user leaves the choice to us."""
    per_row = row_bytes(model.config.get_text_config(), model.dtype.itemsize, capacity, feature_width)
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return max(1, min(most, int(free * 0.5 // per_row)))


class SlotCache(DynamicCache):
    """Every attention layer's keys and values, [rows, kv_heads, capacity, head_dim], written at each
    row's own positions (`where`) and read up to `length` (the longest row of the forward in flight).
    Never-written entries are zeros, so a masked key never brings a NaN into the weighted sum."""

    def __init__(self, rows: int, capacity: int):
        super().__init__()
        self.rows, self.capacity = rows, capacity
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.where: tuple[torch.Tensor, torch.Tensor] | None = None  # (row ids [b, 1], positions [b, q])
        self.in_order = True  # the forward in flight holds every row, in row order (else: `where`'s rows)
        self.length = 0

    @torch.compiler.disable  # writes the rows in place: kept out of compiled layers (compiled.compile_steps)
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # the extras vary by version
        if layer_idx not in self.keys:
            b, h, _, d = key_states.shape
            shape = (self.rows, h, self.capacity, d)
            self.keys[layer_idx] = key_states.new_zeros(shape)
            self.values[layer_idx] = value_states.new_zeros(shape)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        rows, positions = self.where
        keys[rows, :, positions] = key_states.transpose(1, 2)  # [b, q, h, d] at (row, position)
        values[rows, :, positions] = value_states.transpose(1, 2)
        if self.in_order:  # every row, in row order: a view, no copy
            return keys[: self.rows, :, : self.length], values[: self.rows, :, : self.length]
        return keys[rows[:, 0], :, : self.length], values[rows[:, 0], :, : self.length]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def keep_rows(self, keep: torch.Tensor) -> None:
        """Only the rows `keep` (ascending) from now on, moved to the front in place: the storage
        stays where it is, so CUDA graphs captured on it stay valid (step_graphs.py)."""
        for store in (self.keys, self.values):
            for t in store.values():
                t[: len(keep)] = t[keep]
        self.rows = int(keep.shape[0])


class SlotMasks:
    """The masks of one forward, read by the target's attention function (model.py sdpa_packed):
    query i of row b sits at position positions[b, i] and sees keys 0..positions[b, i] (the last
    `window` of them in a sliding-window layer)."""

    def __init__(self, positions: torch.Tensor, length: int, gemm: bool = False):
        """gemm: a bf16 GEMM can write fp32 on this device (decode_step.mm_writes_fp32; torch >= 2.8 on
        CUDA), found once per Slots, outside the compiled layers and the CUDA graphs that read it."""
        self.gemm = gemm
        self.query = positions[:, None, :, None]  # [b, 1, q, 1]
        self.key = torch.arange(length, device=positions.device)  # [L]
        self.by_window: dict[tuple, torch.Tensor] = {}  # (window, groups, dtype) -> bias

    def mask(self, window: int | None) -> torch.Tensor:
        """[b, 1, q, L] bool: True where the query sees the key."""
        seen = self.key <= self.query
        return seen if window is None else seen & (self.query - self.key < window)

    def bias(self, window: int | None, groups: int, dtype: torch.dtype) -> torch.Tensor:
        """[b, 1, groups * q, L]: the mask as the additive bias SDPA adds (0 or -inf) in the queries'
        dtype, the rows of the q queries `groups` times over. Made once a forward for all layers: a
        bool mask would be converted in every layer's SDPA call."""
        if (window, groups, dtype) not in self.by_window:
            seen = self.mask(window)
            bias = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, float("-inf"))
            self.by_window[window, groups, dtype] = bias.repeat(1, 1, groups, 1) if groups > 1 else bias
        return self.by_window[window, groups, dtype]

    def attend(self, module, query, key, value, window, scaling):
        """HF's attention interface: query [b, Hq, q, D], key/value [b, Hkv, L, D] -> ([b, q, Hq, D], None).
        The Hq / Hkv query heads of one key head go in one row of queries (as transformers' pack_gqa
        does for one token): the cache is read once per key head, never copied per query head."""
        b, heads, q, d = query.shape
        groups = heads // key.shape[1]
        rows, bias = query.reshape(b, key.shape[1], groups * q, d), self.bias(window, groups, query.dtype)
        if self.gemm and gemm_attention_applies(rows):
            out = gemm_attention(rows, key, value, bias, scaling)
        else:
            out = F.scaled_dot_product_attention(rows, key, value, attn_mask=bias, scale=scaling)
        return out.reshape(b, heads, q, -1).transpose(1, 2), None


GEMM_ATTENTION_ROWS = 256  # query rows per key head (query heads per key head x tokens): a decoding step's
GEMM_ATTENTION_HEADS = 64  # rows x key heads: while SDPA's blocks (one per key head and 32 query rows) are few


def gemm_attention_applies(rows: torch.Tensor) -> bool:
    """A decoding step on CUDA in bf16/fp16 with few rows: there SDPA's memory-efficient kernel (the one
    that takes the mask as a bias) runs one block per key head and 32 query rows, a dozen blocks on an
    H200's 132 SMs for one row of a 27B (docs/benchmarks.md), where two GEMMs spread the keys over them.
    Decided by the rows and heads alone, so a step of 1 token and one of a 16-token block on the same
    rows take the same path. As rows finish and leave, a pass can change path midway: the two agree to
    the rounding of their bf16 outputs, as GEMMs of different token counts do, which the lossless
    rule's tolerance covers."""
    b, kv_heads, n, _ = rows.shape
    return (
        rows.is_cuda
        and rows.dtype in (torch.bfloat16, torch.float16)
        and n <= GEMM_ATTENTION_ROWS
        and b * kv_heads <= GEMM_ATTENTION_HEADS
    )


def gemm_attention(rows, key, value, bias, scale):
    """softmax(rows key^T * scale + bias) value as two batched GEMMs around an fp32 softmax: rows [b, h, n, D],
    key/value [b, h, L, D], bias [b, 1, n, L] (0 or -inf) -> [b, h, n, Dv] in rows' dtype. The scores are
    written in fp32 (a bf16 GEMM's out_dtype on CUDA: exact products, fp32 sums, as SDPA keeps them)."""
    b, h, n, d = rows.shape
    length = key.shape[2]
    q, k = rows.reshape(b * h, n, d), key.reshape(b * h, length, d).transpose(1, 2)
    scores = torch.bmm(q, k, out_dtype=torch.float32) if q.dtype != torch.float32 else torch.bmm(q, k)
    probs = (scores.view(b, h, n, length) * scale + bias).softmax(-1).to(value.dtype)
    return torch.bmm(probs.view(b * h, n, length), value.reshape(b * h, length, -1)).view(b, h, n, -1)
