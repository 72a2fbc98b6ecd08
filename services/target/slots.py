"""Speculative decoding of many prompts at once, each on its own row of one KV cache.

    slots = Slots(target, prompts, room)            # one row per prompt: KV cache + captured features
    outs = decode_slots(slots, propose, max_new_tokens=128)   # every step ONE target forward for all rows

A row holds its prompt's committed tokens at their own positions: row b's token at position p is at
index p of every attention layer's cache, and the captured layers' outputs (the drafter's context)
at index p of `features`. A step feeds each unfinished row its block (last committed token + drafts)
at its next positions, so rows of different lengths run in one forward: the masks (per row: keys up
to the query's position, within the window of a sliding-window layer) keep every row to its own
prefix. Rolling back a rejected suffix is moving the row's length: what lies past it is never read
and is overwritten by the next block. So each step costs O(block) per prompt, not O(length) as the
packed recomputation of batched_decode.py does, and there is no rollback to get wrong.

Attention layers only (full and sliding window, any transformers causal LM the loader takes); a target
with recurrent layers (Gated DeltaNet) keeps batched_decode.py's packed forward, which needs no state.

The decisions (acceptance, stop tokens, limits) are speculative.py's Decoded.accept, so the records
and figures are the same as the one-prompt loop's; logits are computed in fp32 from the final hidden
state, as batched_decode.py does (the near-tie tolerance stays the model dtype's).
"""

from __future__ import annotations

import inspect
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel
from transformers import DynamicCache

from services.decode_step import Decoded, exact_logits, rounding_tolerance
from services.target.decode import ATTENTION_KINDS, DECODE_SDPA
from services.target.model import Target

PREFILL_TOKENS = 1 << 15  # prompt tokens per prefill forward: bounds the padded activations and masks


def slot_decodable(target: Target) -> bool:
    """True when every decoder layer is an attention layer (no recurrent state to keep per row)."""
    types = set(getattr(target.model.config, "layer_types", None) or [])
    return not types - ATTENTION_KINDS and not any(hasattr(layer, "linear_attn") for layer in target.layers)


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
            return keys[:, :, : self.length], values[:, :, : self.length]
        return keys[rows[:, 0], :, : self.length], values[rows[:, 0], :, : self.length]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def keep_rows(self, keep: torch.Tensor) -> None:
        """Drop every row not in `keep` (finished prompts), in that order."""
        for store in (self.keys, self.values):
            for i in store:
                store[i] = store[i][keep]
        self.rows = int(keep.shape[0])


class SlotMasks:
    """The masks of one forward, read by the target's attention function (model.py sdpa_packed):
    query i of row b sits at position positions[b, i] and sees keys 0..positions[b, i] (the last
    `window` of them in a sliding-window layer)."""

    def __init__(self, positions: torch.Tensor, length: int):
        self.query = positions[:, None, :, None]  # [b, 1, q, 1]
        self.key = torch.arange(length, device=positions.device)  # [L]
        self.by_window: dict[tuple, torch.Tensor] = {}  # (window, groups) -> mask

    def mask(self, window: int | None, groups: int = 1) -> torch.Tensor:
        """[b, 1, groups * q, L]: the rows of the q queries, `groups` times over."""
        if (window, groups) not in self.by_window:
            if groups > 1:
                self.by_window[window, groups] = self.mask(window).repeat(1, 1, groups, 1)
            else:
                seen = self.key <= self.query
                self.by_window[window, 1] = seen if window is None else seen & (self.query - self.key < window)
        return self.by_window[window, groups]

    def attend(self, module, query, key, value, window, scaling):
        """HF's attention interface: query [b, Hq, q, D], key/value [b, Hkv, L, D] -> ([b, q, Hq, D], None).
        The Hq / Hkv query heads of one key head go in one row of queries (as transformers' pack_gqa
        does for one token): the cache is read once per key head, never copied per query head."""
        b, heads, q, d = query.shape
        groups = heads // key.shape[1]
        out = F.scaled_dot_product_attention(
            query.reshape(b, key.shape[1], groups * q, d),
            key,
            value,
            attn_mask=self.mask(window, groups),
            scale=scaling,
        )
        return out.reshape(b, heads, q, -1).transpose(1, 2), None


class Slots:
    """Many prompts on one target: row b is prompt b, with room for `room` tokens after it."""

    def __init__(self, target: Target, prompts: list[list[int]], room: int, features: bool = True):
        if not slot_decodable(target):
            raise ValueError("slot decoding takes attention layers only (a hybrid target decodes packed)")
        if not prompts or not all(prompts):
            raise ValueError("slot decoding needs at least one prompt, each of at least one token")
        self.target, self.device, self.dtype = target, target.device, target.model.dtype
        self.capacity = max(len(p) for p in prompts) + room
        self.cache = SlotCache(len(prompts), self.capacity)
        width = target.info.hidden_width
        self.features = (
            torch.zeros(len(prompts), self.capacity, width, dtype=self.dtype, device=self.device) if features else None
        )
        self.lm_head = target.model.get_output_embeddings().weight.detach().float()
        self.index = list(range(len(prompts)))  # row -> prompt
        params = inspect.signature(target.backbone.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x

    @torch.no_grad()
    def forward(
        self, ids: torch.Tensor, starts: torch.Tensor, take: torch.Tensor, rows=None, temperature=0.0, generator=None
    ):
        """ids [b, q] at positions starts[b] + 0..q-1 of `rows` (default: every row), all host
        tensors; the captured layers go to `features`. Returns (tokens, margin, tolerance) [b, t] on
        the host at the block indices `take` [b, t]: the greedy token (or one sampled at
        `temperature` > 0), its top-1 minus top-2 logit and the rounding tolerance."""
        t, dev = self.target, self.device
        b, q = ids.shape
        self.cache.in_order = rows is None
        rows = torch.arange(self.cache.rows) if rows is None else rows
        positions = (starts[:, None] + torch.arange(q)).to(dev)
        row_ids = rows.to(dev)[:, None]
        self.cache.where, self.cache.length = (row_ids, positions), int(starts.max()) + q
        masks = SlotMasks(positions, self.cache.length)
        captured = torch.empty(b * q, t.info.hidden_width, dtype=self.dtype, device=dev)
        t.slot.slots = masks
        try:
            with t.capturing_into(captured), sdpa_kernel(DECODE_SDPA):
                out = t.backbone(
                    input_ids=ids.to(dev),
                    position_ids=positions,
                    attention_mask=masks.mask(None),  # 4D: transformers builds no mask of its own
                    use_cache=True,
                    **{self._cache_kwarg: self.cache},
                )
        finally:
            t.slot.slots = None
        if self.features is not None:
            self.features[row_ids, positions] = captured.view(b, q, -1)
        take = take.to(dev)
        hidden = out.last_hidden_state.gather(1, take[..., None].expand(-1, -1, out.last_hidden_state.shape[-1]))
        logits = exact_logits(hidden, self.lm_head, self.dtype)  # [b, t, vocab] in fp32
        top = logits.topk(2, dim=-1)
        tokens = top.indices[..., 0]
        if temperature > 0:
            probs = torch.softmax(logits.flatten(0, 1) / temperature, -1)
            tokens = torch.multinomial(probs, 1, generator=generator).view(tokens.shape)
        margin = top.values[..., 0] - top.values[..., 1]
        tolerance = rounding_tolerance(top.values[..., 0], self.dtype)
        host = torch.stack([tokens.double(), margin.double(), tolerance.double()]).cpu()  # one sync
        return host[0].long(), host[1].float(), host[2].float()

    def prefill(self, prompts: list[list[int]], **sample) -> list[Decoded]:
        """Every prompt through the target (rows of similar length together, at most PREFILL_TOKENS
        padded tokens a forward): a Decoded per prompt holding its first new token."""
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        outs: list[Decoded | None] = [None] * len(prompts)
        first = 0
        while first < len(order):
            last = first + 1
            while last < len(order) and (last + 1 - first) * len(prompts[order[last]]) <= PREFILL_TOKENS:
                last += 1
            chunk = order[first:last]
            width = len(prompts[chunk[-1]])
            ids = torch.zeros(len(chunk), width, dtype=torch.long)  # padding: read by no real token
            for r, i in enumerate(chunk):
                ids[r, : len(prompts[i])] = torch.tensor(prompts[i])
            take = torch.tensor([[len(prompts[i]) - 1] for i in chunk])
            tokens, margin, tolerance = self.forward(
                ids, torch.zeros(len(chunk), dtype=torch.long), take, rows=torch.tensor(chunk), **sample
            )
            for r, i in enumerate(chunk):
                outs[i] = Decoded([int(tokens[r, 0])], [], 1, [float(margin[r, 0])], [float(tolerance[r, 0])])
            first = last
        return outs

    def keep_rows(self, keep: list[int]) -> None:
        """Only these rows from now on (the others' prompts are done)."""
        index = torch.tensor(keep)
        self.cache.keep_rows(index.to(self.device))
        if self.features is not None:
            self.features = self.features[index.to(self.device)]
        self.index = [self.index[r] for r in keep]


@torch.no_grad()
def decode_slots(
    target: Target,
    propose,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    stop_ids=(),
    on_step=None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[Decoded]:
    """speculative_generate for all `prompts` at once (propose None: plain greedy, one token per
    forward: the reference; temperature > 0 samples instead, for regeneration). propose.padded drafts
    every row's block in one call. on_step(new tokens) after every forward."""
    stop, began = set(stop_ids), time.perf_counter()
    draft_len = 0 if propose is None else propose.block_size - 1
    sample = dict(temperature=temperature, generator=generator)
    slots = Slots(target, prompts, max_new_tokens + draft_len + 1, features=propose is not None)
    outs = slots.prefill(prompts, **sample)
    starts = torch.tensor([len(p) for p in prompts])  # each row's next position (its last token's)
    if on_step:
        on_step(len(prompts))
    live = [not o.done(max_new_tokens, stop) for o in outs]
    take = torch.arange(draft_len + 1)[None]
    while any(live[i] for i in slots.index):
        if sum(live[i] for i in slots.index) <= len(slots.index) * 7 // 8:  # finished rows leave in bulk
            keep = [r for r, i in enumerate(slots.index) if live[i]]
            starts = starts[torch.tensor(keep)]
            slots.keep_rows(keep)
        last = torch.tensor([outs[i].tokens[-1] for i in slots.index])
        drafts = (
            propose.padded(slots.features, starts, last) if draft_len else torch.empty(len(last), 0, dtype=torch.long)
        )
        ids = torch.cat([last[:, None], drafts], 1)
        tokens, margin, tolerance = slots.forward(ids, starts, take.expand(len(last), -1), **sample)
        drafts, tokens, margin, tolerance = drafts.tolist(), tokens.tolist(), margin.tolist(), tolerance.tolist()
        new = 0
        for r, i in enumerate(slots.index):
            if not live[i]:  # a finished row still in the batch: its result is dropped
                continue
            before = len(outs[i].tokens)
            accepted = outs[i].accept(drafts[r], tokens[r], margin[r], tolerance[r], max_new_tokens, stop)
            starts[r] += accepted + 1
            new += len(outs[i].tokens) - before
            live[i] = not outs[i].done(max_new_tokens, stop)
        if on_step:
            on_step(new)
    seconds = (time.perf_counter() - began) / len(prompts)  # the batch's wall time, shared out
    for out in outs:
        out.seconds = seconds
    return outs
