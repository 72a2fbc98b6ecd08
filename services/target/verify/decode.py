"""Incremental decoding of one prompt on the training Target: what speculative verification runs.

    session = DecodeSession(target)              # the Target of model.py: same model, hooks, packed layers
    step = session.prefill(prompt_ids)           # Step for every prompt position
    step = session.verify(block_ids)             # the block at the next positions, on the committed context
    session.commit(n)                            # keep the block's first n tokens, roll the rest back

A Step (services/decoding/decode_step.py) holds, per position, the target's greedy token, the top-1 minus
top-2 logit margin, the rounding tolerance of those logits, and the captured layers' outputs exactly
as Target.capture makes them for training (layer i = output of decoder layer i, the final norm on the
last layer).

State after commit(n) equals the state after feeding exactly the committed tokens:
  - full-attention layers: an HF DynamicCache, cropped back to the committed length. Only the
    attention layers ever write to it (the recurrent layers keep their own state, below), so a
    crop touches nothing else;
  - Gated DeltaNet layers (Qwen3.5 / Qwen3.6): hybrid.PackedGatedDeltaNet in decode mode; the conv
    tail and the fp32 recurrent state live in this session (hybrid_states.DecodeState). `rollback` picks
    how a rejected suffix is undone: "per-token" (default) keeps the state after each block token,
    "refeed" re-runs the delta rule over the committed prefix from the state before the block.
    docs/guide/acceptance.md says which is faster where, measured by bench/verify_step.py.
Other layer kinds with recurrent state are refused with their name: no silent wrong rollback.
"""

from __future__ import annotations

import inspect

import torch
from torch.nn.attention import sdpa_kernel
from transformers import DynamicCache

from services.decoding.decode_step import ROLLBACKS, Step, rounding_tolerance
from services.target.model import hybrid
from services.target.model.attention import NO_CUDNN_SDPA
from services.target.model.hybrid_states import DecodeState
from services.target.model.model import Target

ATTENTION_KINDS = {"full_attention", "sliding_attention"}
# decoding grows the key length every step: no cuDNN SDPA plan would ever be reused (model.py)
DECODE_SDPA = NO_CUDNN_SDPA


class AttentionCache(DynamicCache):
    """An HF DynamicCache that only the attention layers write (built without the model's config,
    so it holds no linear-attention layers); its length is theirs, whichever layer comes first."""

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max((layer.get_seq_length() for layer in self.layers), default=0)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def keep(self, length: int) -> None:
        """Crop every written layer back to `length` positions."""
        for layer in self.layers:
            remove = layer.get_seq_length() - length
            if remove > 0:
                layer.crop(-remove)


def check_decodable(target: Target) -> None:
    """Raise a one-line ValueError when a layer's state could not be rolled back."""
    types = list(getattr(target.model.config, "layer_types", None) or [])
    for i, kind in enumerate(types):
        if kind not in ATTENTION_KINDS and kind != "linear_attention":
            raise ValueError(
                f"decoding: layer {i} is of type {kind!r}, a recurrent kind whose state this decoder "
                f"cannot roll back (supported: full/sliding attention and Gated DeltaNet)"
            )
    for i, layer in enumerate(target.layers):
        mixer = getattr(layer, "linear_attn", None)
        if mixer is not None and not isinstance(mixer, hybrid.PackedGatedDeltaNet):
            raise ValueError(
                f"decoding: layer {i} ({type(mixer).__name__}) is not on the packed Gated DeltaNet "
                f"path (capture path {target.path!r}); decoding needs it"
            )


class DecodeSession:
    """One prompt's incremental decoding state on `target` (see the top of this file)."""

    def __init__(self, target: Target, rollback: str = ROLLBACKS[0]):
        check_decodable(target)
        self.target = target
        self.fp8 = target.fp8_linears  # the near-tie rounding (rounding_tolerance)
        self.state = DecodeState(rollback)
        self.cache = AttentionCache()
        self.length = 0  # committed tokens
        self.pending = 0  # tokens of the last verified block, until commit
        params = inspect.signature(target.backbone.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x

    def prefill(self, prompt_ids: list[int]) -> Step:
        if self.length or self.pending:
            raise RuntimeError("prefill starts a session: this one already holds tokens")
        if not prompt_ids:
            raise ValueError("prefill needs at least one prompt token")
        step = self._forward(prompt_ids, verifying=False)
        self.length = len(prompt_ids)
        return step

    def verify(self, block_ids: list[int]) -> Step:
        if not self.length:
            raise RuntimeError("verify before prefill")
        if self.pending:
            raise RuntimeError("verify twice without commit: commit(n) the last block first")
        if not block_ids:
            raise ValueError("verify needs at least one token")
        step = self._forward(block_ids, verifying=True)
        self.pending = len(block_ids)
        return step

    def commit(self, n: int) -> None:
        if not 1 <= n <= self.pending:
            raise ValueError(
                f"commit({n}): the last verified block has {self.pending} tokens (commit 1..{self.pending})"
            )
        self.length += n
        self.cache.keep(self.length)
        for index, layer_state in self.state.layers.items():
            layer_state.commit(n, self.target.layers[index].linear_attn)
        self.pending = 0

    @torch.no_grad()
    def _forward(self, ids: list[int], verifying: bool) -> Step:
        t, device = self.target, self.target.device
        n = len(ids)
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        positions = torch.arange(self.length, self.length + n, device=device)[None]
        features = torch.empty(n, t.info.hidden_width, dtype=t.model.dtype, device=device)
        self.state.verifying = verifying
        t.slot.decode = self.state  # the Gated DeltaNet layers continue from it; compiled layers step aside
        try:
            with t.capturing_into(features), sdpa_kernel(DECODE_SDPA):
                out = t.backbone(
                    input_ids=input_ids,
                    position_ids=positions,
                    use_cache=True,
                    doc_spans=[(0, n)],
                    **{self._cache_kwarg: self.cache},
                )
        finally:
            t.slot.decode = None
        logits = t.model.get_output_embeddings()(out.last_hidden_state[0])
        top = logits.topk(2, dim=-1).values.float()
        return Step(
            greedy=logits.argmax(-1),
            margin=top[:, 0] - top[:, 1],
            tolerance=rounding_tolerance(top[:, 0], logits.dtype, self.fp8),
            features=features,
        )
