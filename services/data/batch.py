"""One training batch: a packed sequence of S tokens and the target's hidden states for it.

This is the contract between the roles. The target builds a Batch, the transport carries it,
the drafter trains on it (the synthetic source builds the same thing).

    hidden         [S, K*H]  bfloat16   captured layers concatenated on the feature axis
    input_ids      [S]       int64
    loss_mask      [S]       bool       True where the token is supervised (assistant tokens)
    position_ids   [S]       int64      restarts at 0 for every document
    document_ids   [S]       int64      0, 1, 2 ... per document; -1 marks padding
    target_labels  [S]       int64      optional: target argmax at j (its guess for token j+1)

Global batch index g (docs/design.md, "Scheduling"): every batch carries its g.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields

import torch

from services.run import dtypes, shapes

SPLITS = ("train", "eval")  # which data a batch comes from: training rows or held-out rows

FIELDS = {
    "hidden": dtypes.BY_NAME[shapes.HIDDEN_DTYPE],  # the wire's dtype of the hidden states: read it here
    "input_ids": torch.int64,
    "loss_mask": torch.bool,
    "position_ids": torch.int64,
    "document_ids": torch.int64,
    "target_labels": torch.int64,
}


def token_digest(input_ids: torch.Tensor) -> str:
    """Provenance of a batch's content: blake2b-128 of its token ids as little-endian int64 bytes.

    Recorded in the ledger with the target incarnation that served it, so an audit can rebuild
    batch g from the data and check that what was trained is what the data says."""
    ids = input_ids.detach().to("cpu", torch.int64).contiguous()
    return hashlib.blake2b(ids.numpy().tobytes(), digest_size=16).hexdigest()


def run_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """Bool [S]: True at the first token of each document of a packed row.

    The one reading of a row's document boundaries: a document is a run of one id. Padding (-1) makes
    runs too; callers that count documents leave those out. Any device, no host sync."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[1:] = document_ids[1:] != document_ids[:-1]
    return starts


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """For each position, the index of the first token of its document (run_starts). [S] -> [S] int64."""
    idx = torch.arange(document_ids.shape[0], device=document_ids.device)
    return torch.cummax(torch.where(run_starts(document_ids), idx, 0), dim=0).values


def document_spans(document_ids: torch.Tensor) -> list[tuple[int, int]]:
    """The runs of run_starts as (start, end) on the host (padding, id -1, is one more run). Host sync."""
    ids = document_ids.cpu()
    bounds = [0] + (torch.nonzero(run_starts(ids)[1:]).flatten() + 1).tolist() + [int(ids.shape[0])]
    return list(zip(bounds[:-1], bounds[1:]))


def count_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """Documents in a packed row (runs of a real id, padding left out), a 0-dim int64 tensor on its device."""
    return (run_starts(document_ids) & (document_ids >= 0)).sum()


class BatchError(ValueError):
    """A batch whose fields disagree with each other or with the config; names the field."""


@dataclass
class Batch:
    g: int
    hidden: torch.Tensor
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor
    target_labels: torch.Tensor | None = None

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens."""
        return int((self.document_ids >= 0).sum())

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            f.name: getattr(self, f.name) for f in fields(self) if f.name != "g" and getattr(self, f.name) is not None
        }

    def to(self, device, non_blocking: bool = False) -> "Batch":
        moved = {k: v.to(device, non_blocking=non_blocking) for k, v in self.tensors().items()}
        return Batch(g=self.g, **moved)

    def validate(self, hidden_width: int | None = None) -> "Batch":
        """Check dtypes and shapes; raise BatchError naming the first bad field."""
        s = self.seq_len
        for name, t in self.tensors().items():
            if t.dtype != FIELDS[name]:
                raise BatchError(f"batch g={self.g}: field {name!r} has dtype {t.dtype}, expected {FIELDS[name]}")
            want_dims = 2 if name == "hidden" else 1
            if t.dim() != want_dims or t.shape[0] != s:
                raise BatchError(
                    f"batch g={self.g}: field {name!r} has shape {tuple(t.shape)}, "
                    f"expected first dim {s} and {want_dims} dims"
                )
        if hidden_width is not None and self.hidden.shape[1] != hidden_width:
            raise BatchError(
                f"batch g={self.g}: field 'hidden' has width {self.hidden.shape[1]}, config expects {hidden_width}"
            )
        return self

    @classmethod
    def from_tensors(cls, g: int, tensors: dict[str, torch.Tensor]) -> "Batch":
        unknown = set(tensors) - set(FIELDS)
        if unknown:
            raise BatchError(f"batch g={g}: unknown fields {sorted(unknown)}")
        missing = [n for n in FIELDS if n != "target_labels" and n not in tensors]
        if missing:
            raise BatchError(f"batch g={g}: missing fields {missing}")
        return cls(g=g, **tensors).validate()
