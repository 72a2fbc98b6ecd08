"""What a target tells a drafter when it connects, and the drafter's check of it (no torch here).

The target answers an "info" request with TargetInfo.to_wire(); the drafter parses it with
from_wire() (every field's type checked; a bad one is a WireError naming it) and then
check()s it against its run spec (services/run/runspec.py: RunSpec.expected_of_target) before
training on a single batch. Like vLLM's EngineCoreReadyResponse, the answer carries a digest of
the config that decides what a batch contains, so a target and a drafter started from different
configs refuse each other at once instead of training on mismatched data.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from services.net.message_fields import read_fields
from services.run.config import ConfigError
from services.run.shapes import CapturedWidth, CaptureShape


class HandshakeError(ConfigError):
    """The target and this drafter disagree; the message names the field and both values."""


@dataclass(frozen=True)
class TargetInfo(CapturedWidth):
    """What a target answers to "info": its CaptureShape and its data."""

    num_batches: int  # training rows per epoch
    num_eval_batches: int  # held-out rows
    seq_len: int  # data.pack_len
    hidden_size: int  # the target's width H
    layer_ids: list[int]  # captured layers, ascending: the feature order of `hidden`
    vocab_size: int
    mask_token_id: int  # the tokenizer's, or -1
    labels_from_target: bool
    config_digest: str  # RunSpec.config_digest of the target's run
    model_path: str
    capture_path: str  # packed | packed-varlen | packed-reference | per-document
    bad_samples: int  # data lines skipped under data.on_bad_sample = "skip"
    data_key: str = ""  # the packed-data cache key: drafters check batch content against it
    num_layers: int = 0  # the target's decoder layers

    @classmethod
    def of(cls, shape: CaptureShape, **rest) -> "TargetInfo":
        return cls(
            **{
                **rest,
                "hidden_size": shape.hidden_size,
                "layer_ids": list(shape.layer_ids),
                "vocab_size": shape.vocab_size,
                "num_layers": shape.num_layers,
            }
        )

    def to_wire(self) -> dict:
        return {**dataclasses.asdict(self), "hidden_width": self.hidden_width}

    @classmethod
    def from_wire(cls, data) -> "TargetInfo":
        return cls(**read_fields(cls, data, "info"))

    def check(self, **expected) -> None:
        """Raise HandshakeError unless this target says what the drafter's run spec expects
        (RunSpec.expected_of_target: num_layers, hidden_size, vocab_size, layer_ids, seq_len,
        labels_from_target, config_digest)."""
        wrong = [
            f"{k}: target {getattr(self, k)!r}, drafter {v!r}" for k, v in expected.items() if getattr(self, k) != v
        ]
        if wrong:
            raise HandshakeError(
                f"target {self.model_path} and this drafter disagree on "
                + "; ".join(wrong)
                + " (were they started from the same config and model?)"
            )
