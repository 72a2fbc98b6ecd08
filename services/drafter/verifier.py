"""What speculative decoding needs from the target: a Verifier (one prompt at a time).

    step = verifier.prefill(prompt_ids)      # a new prompt: Step for each prompt position
    step = verifier.verify(block_ids)        # the block at the next positions, on the committed context
    verifier.commit(n)                       # keep the first n >= 1 tokens of the block; the rest rolled back

Step (services/target/decode.py): greedy [n] int64, margin [n] and tolerance [n] float32, features
[n, K*H] of the captured layers. LocalVerifier runs the target in this process, through the
training Target's own DecodeSession (services/target/decode.py); a verifier served by the target
workers has the same three calls.
"""
from __future__ import annotations

from typing import Protocol

from services.target.decode import DecodeSession, Step
from services.target.model import Target


class Verifier(Protocol):
    def prefill(self, prompt_ids: list[int]) -> Step: ...

    def verify(self, block_ids: list[int]) -> Step: ...

    def commit(self, n: int) -> None: ...


class LocalVerifier:
    """A DecodeSession per prompt on a Target loaded by services.target.model.load_target."""

    def __init__(self, target: Target, rollback: str = "refeed"):
        self.target, self.rollback = target, rollback
        self.session: DecodeSession | None = None

    def prefill(self, prompt_ids: list[int]) -> Step:
        self.session = DecodeSession(self.target, self.rollback)
        return self.session.prefill(prompt_ids)

    def verify(self, block_ids: list[int]) -> Step:
        return self.session.verify(block_ids)

    def commit(self, n: int) -> None:
        self.session.commit(n)
