"""Batches for the transport tests: deterministic content per (g, split), compared bit for bit."""

import time

import torch

from services.data.batch import Batch
from services.net.batch_client import BatchClient
from services.run.config import TransportConfig

SEQ, WIDTH, N_BATCHES = 300, 640, 8

CHUNK = 64 << 10  # hidden is 300 x 640 bf16 = 375 KiB: 6 chunks


def transport_cfg(**overrides) -> TransportConfig:
    return TransportConfig(chunk_bytes=CHUNK, **overrides)


def make_batch(g: int, split: str = "train") -> Batch:
    """Deterministic content per (g, split), so both processes can build the same batch."""
    gen = torch.Generator().manual_seed(g + (1000 if split == "eval" else 0))
    docs = torch.arange(SEQ) // 100
    return Batch(
        g=g,
        hidden=torch.randn(SEQ, WIDTH, generator=gen).to(torch.bfloat16),
        input_ids=torch.randint(0, 50_000, (SEQ,), generator=gen),
        loss_mask=torch.rand(SEQ, generator=gen) > 0.3,
        position_ids=torch.arange(SEQ) % 100,
        document_ids=torch.where(torch.arange(SEQ) < SEQ - 20, docs, -1),
        target_labels=torch.randint(0, 50_000, (SEQ,), generator=gen) if g % 2 == 0 else None,
    )


def same_batch(a: Batch, b: Batch) -> bool:
    """Same g, same fields, bit-identical tensors."""

    def raw(t: torch.Tensor) -> bytes:
        return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())

    ta, tb = a.tensors(), b.tensors()
    return (
        a.g == b.g
        and ta.keys() == tb.keys()
        and all(ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape and raw(ta[k]) == raw(tb[k]) for k in ta)
    )


def collect(client: BatchClient, want: int, timeout_s: float = 30) -> list[tuple]:
    events, deadline = [], time.monotonic() + timeout_s
    while len(events) < want and time.monotonic() < deadline:
        events += client.poll(200)
    return events
