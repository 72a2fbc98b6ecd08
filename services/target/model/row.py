"""What the target's layers read about the row in flight, set by Target before each forward.

The row's document boundaries change from row to row; the tensors' shapes do not (every row has
pack_len tokens). So the boundaries never travel as arguments of a decoder layer: the attention
function and the Gated DeltaNet kernels read them here, inside functions the compiler does not
trace (compiled.py), and one compiled graph per layer kind serves every row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowLayout:
    """Where the documents of the row in flight begin."""

    positions: torch.Tensor  # [S] int64, restarts at 0 per document
    cu_seqlens: torch.Tensor  # [N+1] int32 document boundaries (padding is one more document)
    spans: list[tuple[int, int]]  # the same boundaries as (start, end) on the host
    varlen: bool = False  # attention: one varlen flash-attention call (else SDPA per document)

    @property
    def longest(self) -> int:
        return max(b - a for a, b in self.spans)

    @staticmethod
    def one_document(s: int, device) -> "RowLayout":
        return RowLayout(
            torch.arange(s, device=device), torch.tensor([0, s], dtype=torch.int32, device=device), [(0, s)]
        )


class RowSlot:
    """What every layer of one model reads: layout, the packed row of a capture; decode, a
    hybrid_states.DecodeState while verify/decode.py runs a decoding forward (it takes precedence); slots, the
    per-row masks while services/target/verify/slots.py decodes many prompts at once."""

    def __init__(self):
        # Instance attributes from the start: the compiled graphs guard on this object's __dict__,
        # and a key that appeared later (the first decode setting `decode`) recompiled every layer.
        self.layout: RowLayout | None = None
        self.decode = None
        self.slots = None  # services/target/verify/slots.py: the masks of a forward of many prompts on their KV cache
        self.rows = None  # verify/slots.py on a hybrid: its rows' Gated DeltaNet states (hybrid_states.RowStates)
        self.compiled = False  # captures run the compiled layers (compiled.py)
        self.compiled_steps = False  # verify/slots.py's decoding steps run the step-compiled layers (compiled.py)
