"""What the target core answers (core.py), for its shell (worker.py) to hand to the transport.

The core never touches a socket: it returns these, and the shell sends each one with the batch
server's matching call (transport.BatchServer) or counts it as dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from services.data.batch import Batch


@dataclass(frozen=True)
class InfoReply:
    client: bytes
    info: dict  # handshake.TargetInfo's wire form


@dataclass(frozen=True)
class BatchReply:
    client: bytes
    batch: Batch
    split: str
    ready: object = None  # a CUDA event the send waits for (batches/ring.py), None on the CPU
    release: Callable[[], None] | None = None  # frees the capture's host slot once sent


@dataclass(frozen=True)
class ErrorReply:
    client: bytes
    g: int
    message: str
    split: str


@dataclass(frozen=True)
class VerifyReply:
    client: bytes
    messages: list[list]  # one verify answer, in parts (services/net/verify.py)


@dataclass(frozen=True)
class Dropped:
    """A request not answered as asked: counted by kind in health's bad messages, and logged."""

    kind: str
    text: str


Reply = InfoReply | BatchReply | ErrorReply | VerifyReply | Dropped
