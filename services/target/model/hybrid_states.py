"""The Gated DeltaNet layers' state across decoding steps (hybrid.py's PackedGatedDeltaNet in its decode
modes), kept apart from the layer itself, whose packed forward for captures needs none of it:

    DecodeState(rollback)        one prompt (verify/decode.py): every layer's LayerState, its conv tail
                                 and fp32 recurrent state, and the verified block until commit(n) cuts it
    RowStates(rows, layers, ...) many prompts, a row each (verify/slots.py): every layer's states of all
                                 rows, stacked by layer shape (StackedLayers) so that one commit runs
                                 the rule once for all of them; buffers stay put for CUDA graphs

A rejected suffix is undone by the rule, never by copies of the state: "per-token" keeps the state
after each block token, "refeed" re-runs the rule over the committed prefix (DecodeState says which);
rows run the rule again with the tokens past each row's count made no-ops (only_first, conv_after).
The layers a state is given (nn.Module below) are hybrid.PackedGatedDeltaNet's, whose run_rule and
run_rows it calls: this module does not import hybrid.py, which imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from services.decoding.decode_step import ROLLBACKS


@dataclass
class LayerState:
    """One Gated DeltaNet layer's decode state for one sequence, and the verified block not yet committed."""

    conv: torch.Tensor  # [K-1, C] the last K-1 conv inputs (zeros before the first token)
    recurrent: torch.Tensor  # [H, Dk, Dv] fp32, after the committed tokens
    block_conv: torch.Tensor | None = None  # [T, C] the block's conv inputs
    block_states: torch.Tensor | None = None  # per-token: [T, H, Dk, Dv] the state after each block token
    block_inputs: tuple | None = None  # refeed: the block's (q, k, v, g, beta)
    block_final: torch.Tensor | None = None  # refeed: the state after the whole block

    @staticmethod
    def empty(m: nn.Module, x: torch.Tensor) -> "LayerState":
        conv = x.new_zeros(m.conv1d.weight.shape[-1] - 1, m.conv1d.weight.shape[0])
        return LayerState(conv, torch.zeros(m.num_v_heads, m.head_k_dim, m.head_v_dim, device=x.device))

    def commit(self, n: int, layer: nn.Module) -> None:
        """Keep the first n tokens of the verified block: the state after exactly those tokens."""
        window = torch.cat([self.conv, self.block_conv[:n]])
        self.conv = window[window.shape[0] - self.conv.shape[0] :]
        if self.block_states is not None:
            self.recurrent = self.block_states[n - 1]
        elif n == self.block_conv.shape[0]:
            self.recurrent = self.block_final
        else:  # re-feed the committed prefix from the state before the block
            self.recurrent = layer.run_rule(*(t[:n] for t in self.block_inputs), self.recurrent)[1]
        self.block_conv = self.block_states = self.block_inputs = self.block_final = None


class DecodeState:
    """Every Gated DeltaNet layer's state for one decoded sequence (set on the RowSlot per forward).

    verifying False: the tokens fed are committed at once (a prefill); True: they are a block that
    commit(n) then cuts to its first n tokens, by `rollback`:
      - "refeed": the block runs as one sequence (the kernel on CUDA); its delta-rule inputs are kept,
        and commit re-runs the rule over the first n of them from the state before the block
        (the inputs of a committed token do not depend on the tokens after it);
      - "per-token": the rule runs token by token and keeps the state after each; commit picks one.
    """

    def __init__(self, rollback: str = ROLLBACKS[0]):
        if rollback not in ROLLBACKS:
            raise ValueError(f"rollback must be one of {ROLLBACKS}, got {rollback!r}")
        self.rollback, self.verifying = rollback, False
        self.layers: dict[int, LayerState] = {}


def only_first(n: torch.Tensor, q, k, v, g, beta):
    """The rule's inputs [b, T, ...] with every token of row r past its first n[r] made a no-op
    (g = 0, beta = 0: batched_delta_rule), so the final state is the state after those n[r]."""
    keep = (torch.arange(g.shape[1], device=g.device) < n[:, None])[..., None]  # [b, T, 1]
    return q, k, v, g * keep, beta * keep


def conv_after(window: torch.Tensor, n: torch.Tensor, width: int) -> torch.Tensor:
    """The conv state after n[r] tokens: the last `width` inputs of row r's window up to them."""
    index = n[:, None] + torch.arange(width, device=n.device)  # window = [state (width), the T new]
    return window.gather(1, index[..., None].expand(-1, -1, window.shape[-1]))


class StackedLayers:
    """Gated DeltaNet layers of one shape, their rows' states in one tensor each, row-major
    ([rows, layers, ...]: rows 0..b-1 of every layer are one contiguous block), so that a commit
    runs the rule once for all of them: b x layers sequences in one kernel call, not one call a
    layer (48 on the 27B hybrid, most of a commit's time when each call is a few microseconds)."""

    def __init__(self, layers: list[nn.Module], rows: int, dtype: torch.dtype, device):
        m, n = layers[0].layer, len(layers)
        self.layers = layers
        self.conv = torch.zeros(
            rows, n, m.conv1d.weight.shape[-1] - 1, m.conv1d.weight.shape[0], dtype=dtype, device=device
        )
        self.recurrent = torch.zeros(rows, n, m.num_v_heads, m.head_k_dim, m.head_v_dim, device=device)
        self.blocks: list[torch.Tensor] = []  # [window, k, v, g, beta] of every row and layer: the block fed last

    @staticmethod
    def shape_of(layer: nn.Module) -> tuple:
        m = layer.layer
        return (*m.conv1d.weight.shape, m.num_v_heads, m.head_k_dim, m.head_v_dim)

    def keep_block(self, k: int, window: torch.Tensor, inputs: list[torch.Tensor]) -> None:
        """Layer k's block of rows 0..b-1 (blocks are fed to every row in order) into the buffers."""
        b, (_, key, value, g, beta) = window.shape[0], inputs  # q is not kept: the commit reads no output
        tensors = [window, key, value, g, beta]
        if not self.blocks or self.blocks[0].shape[2:] != window.shape[1:]:
            rows, n = self.conv.shape[:2]
            self.blocks = [x.new_empty(rows, n, *x.shape[1:]) for x in tensors]
        for buffer, x in zip(self.blocks, tensors):
            buffer[:b, k].copy_(x)

    def committed(self, n: torch.Tensor) -> list[torch.Tensor]:
        """The recurrent [b, layers, H, Dk, Dv] and conv states of rows 0..b-1 after n[r] tokens."""
        b, layers = n.shape[0], len(self.layers)
        window, key, value, g, beta = (x[:b].flatten(0, 1) for x in self.blocks)  # [b x layers, ...]
        each = n[:, None].expand(b, layers).flatten()
        # every layer's parameters are already in its inputs: the rule is the same for all of them
        _, final = self.layers[0].run_rows(
            *only_first(each, key, key, value, g, beta), self.recurrent[:b].flatten(0, 1)
        )
        conv = conv_after(window, each, self.conv.shape[2])
        return [final.unflatten(0, (b, layers)), conv.unflatten(0, (b, layers))]


class RowStates:
    """Every Gated DeltaNet layer's state for every row of verify/slots.py's KV cache, and the block each
    layer saw last (its conv window and rule inputs, in buffers that stay put: CUDA graphs replay
    into them). A step that feeds blocks leaves the states as they were; commit(n) then moves
    row r past the first n[r] tokens of its block: the rule run again from the state before the
    block with the tokens past n[r] made no-ops, for all layers of a shape at once (StackedLayers).
    A prefill (lengths set) commits at once."""

    def __init__(self, rows: int, layers: list[nn.Module], dtype: torch.dtype, device):
        self.rows = rows
        shapes: dict[tuple, list[nn.Module]] = {}
        for layer in layers:
            shapes.setdefault(StackedLayers.shape_of(layer), []).append(layer)
        self.stacks = [StackedLayers(group, rows, dtype, device) for group in shapes.values()]
        self.place: dict[int, tuple[StackedLayers, int]] = {}  # layer index -> its stack and place in it
        self.conv: dict[int, torch.Tensor] = {}  # layer -> [rows, K-1, C] (a view of its stack)
        self.recurrent: dict[int, torch.Tensor] = {}  # layer -> [rows, H, Dk, Dv] fp32 (a view)
        for stack in self.stacks:
            for k, layer in enumerate(stack.layers):
                self.place[layer.index] = stack, k
                self.conv[layer.index], self.recurrent[layer.index] = stack.conv[:, k], stack.recurrent[:, k]
        self.where: torch.Tensor | None = None  # the rows of the forward in flight [b]
        self.lengths: torch.Tensor | None = None  # a prefill's tokens per row [b]; None: a block

    def keep_block(self, i: int, window: torch.Tensor, inputs: list[torch.Tensor]) -> None:
        stack, k = self.place[i]
        stack.keep_block(k, window, inputs)

    def commit(self, n: torch.Tensor) -> None:
        """Rows 0..len(n)-1 past the first n[r] tokens of the block each layer saw last."""
        self.store(*self.committed(n))

    def committed(self, n: torch.Tensor) -> list[torch.Tensor]:
        """What commit(n) stores, changing nothing: each stack's recurrent and conv states of rows
        0..len(n)-1 after the first n[r] tokens of the block. Kept apart from store() so that each
        half, run twice, does what it does once (a CUDA graph's first use runs it, then replays it)."""
        return [state for stack in self.stacks if stack.blocks for state in stack.committed(n)]

    def store(self, *new: torch.Tensor) -> None:
        """committed()'s states into rows 0..b-1 of every stack."""
        stacks = [stack for stack in self.stacks if stack.blocks]
        for stack, recurrent, conv in zip(stacks, new[::2], new[1::2]):
            stack.recurrent[: recurrent.shape[0]].copy_(recurrent)
            stack.conv[: conv.shape[0]].copy_(conv)

    def clear(self, rows: torch.Tensor) -> None:
        """Rows `rows` back to the state before any token (a row that takes another prompt), in place."""
        for stack in self.stacks:
            stack.conv[rows] = 0
            stack.recurrent[rows] = 0

    def keep_rows(self, keep: torch.Tensor) -> None:
        """Only the rows `keep` (ascending) from now on, moved to the front in place."""
        for stack in self.stacks:
            for t in (stack.conv, stack.recurrent):
                t[: len(keep)] = t[keep]
        self.rows = int(keep.shape[0])
