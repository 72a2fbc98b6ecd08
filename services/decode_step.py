"""What speculative decoding needs from the target, whichever verifies: a Verifier, one prompt at a time,

    step = verifier.prefill(prompt_ids)      # a new prompt: Step for each prompt position
    step = verifier.verify(block_ids)        # the block at the next positions, on the committed context
    verifier.commit(n)                       # keep the first n >= 1 tokens of the block; the rest rolled back

served by the target workers (services/drafter/remote_eval.py RemoteVerifier) or by a target in this
process (services/eval/verifier.py LocalVerifier, on services/target/decode.py's DecodeSession); the
packed batched forward of services/eval/batched_decode.py returns Steps too.

A Step holds, per position, the target's greedy token (argmax of the logits), the top-1 minus
top-2 logit margin, the rounding tolerance of those logits (services/lossless.py's near-tie rule),
and the captured layers' outputs exactly as the target captures them for training.

ROLLBACKS names how a hybrid target's Gated DeltaNet state drops a rejected suffix
(services/target/hybrid.py implements them; `launcher eval --rollback` picks one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Step:
    greedy: torch.Tensor  # [n] int64, argmax of the logits at each position
    margin: torch.Tensor  # [n] float32, top-1 minus top-2 logit
    tolerance: torch.Tensor  # [n] float32, the logits' rounding (a margin below it is a near-tie)
    features: torch.Tensor  # [n, K*H] the captured layers, in the model's dtype


class Verifier(Protocol):
    def prefill(self, prompt_ids: list[int]) -> Step: ...

    def verify(self, block_ids: list[int]) -> Step: ...

    def commit(self, n: int) -> None: ...


NEAR_TIE_ULPS = 4


def rounding_tolerance(top1: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """NEAR_TIE_ULPS units of rounding of `dtype` at the logits' magnitude (at least 1): a margin
    below it can flip between two forwards that only round differently (docs/operations.md)."""
    return NEAR_TIE_ULPS * torch.finfo(dtype).eps * top1.float().abs().clamp(min=1.0)


ROLLBACKS = ("per-token", "refeed")  # the first is the default (docs/operations.md: measured)
