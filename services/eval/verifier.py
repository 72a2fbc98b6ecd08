"""LocalVerifier: the Verifier of speculative decoding (services/decoding/decode_step.py) with the target in
this process, through the training Target's own DecodeSession (services/target/verify/decode.py); the
verifier served by the target workers (services/drafter/acceptance/remote_eval.py) has the same three calls.
"""

from __future__ import annotations

from services.decoding.decode_step import ROLLBACKS, Step
from services.target.model.model import Target
from services.target.verify.decode import DecodeSession


class LocalVerifier:
    """A DecodeSession per prompt on a Target loaded by services.target.model.model.load_target."""

    def __init__(self, target: Target, rollback: str = ROLLBACKS[0]):
        self.target, self.rollback = target, rollback
        self.session: DecodeSession | None = None

    def prefill(self, prompt_ids: list[int]) -> Step:
        self.session = DecodeSession(self.target, self.rollback)
        return self.session.prefill(prompt_ids)

    def verify(self, block_ids: list[int]) -> Step:
        return self.session.verify(block_ids)

    def commit(self, n: int) -> None:
        self.session.commit(n)
