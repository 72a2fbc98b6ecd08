"""One batch as a stream of messages: what a target sends and how a drafter puts it back together.

    batch {g, split, incarnation, digest, stream: [tensor specs]}   the announcement
    chunk {g, split, offset} + <= chunk_bytes of raw bytes         repeated, in order

Each kind of message of the transport is one class here (Ask, Info, Refusal, Announce, Chunk):
the sender builds it and calls to_wire(); the receiver calls from_wire() on the decoded header and
tensors, which checks every field (a WireError names it) before anything the size of a tensor is
allocated (docs/wire.md). batch_messages() makes the messages of one batch; Partial copies each
chunk into place in one buffer from a BufferPool, after checking the announced size against
transport.max_batch_bytes.
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from services.data.batch import FIELDS, SPLITS, Batch, token_digest
from services.net import wire
from services.net.message_fields import read_fields, rule
from services.run.config import TransportConfig

ALIGN = 64  # byte offset of every tensor in the reassembly buffer
MAX_INCARNATION_LEN = 64


def queue_depth(transport: TransportConfig) -> int:
    """HWM in messages: room for `credits` whole batches, so a ROUTER never has to wait or drop."""
    per_batch = math.ceil(transport.max_batch_bytes / transport.chunk_bytes) + wire.MAX_TENSORS + 1
    return transport.credits * per_batch + 16


def layout(specs: list[wire.TensorSpec]) -> tuple[list[int], int]:
    """Offsets of each tensor in the reassembly buffer (ALIGN-aligned) and its total size."""
    offsets, total = [], 0
    for spec in specs:
        offsets.append(total)
        total += -(-spec.nbytes // ALIGN) * ALIGN
    return offsets, total


# the fields' rules on the wire (message_fields.read_fields checks every message's fields by them)
SPLIT = rule(choices=SPLITS)
INCARNATION = rule(max_len=MAX_INCARNATION_LEN, absent="")  # "": the sender did not say
BATCH_INDEX = rule(low=-1)  # -1: not a batch


@dataclass(frozen=True)
class Ask:
    """request {want: "batch", g, split, incarnation} | request {want: "info"}: a drafter asks a target."""

    want: str = field(metadata=rule(choices=("batch", "info")))
    g: int = field(default=-1, metadata=rule(low=0))  # want == "batch": the global batch index
    split: str = field(default="train", metadata=SPLIT)
    incarnation: str = field(default="", metadata=INCARNATION)  # the target incarnation the drafter believes it asks

    def to_wire(self) -> list:
        if self.want == "info":
            return wire.encode({"kind": "request", "want": "info"})
        header = {"kind": "request", "want": "batch", "g": self.g, "split": self.split}
        return wire.encode({**header, "incarnation": self.incarnation} if self.incarnation else header)

    @classmethod
    def from_wire(cls, header: dict, tensors: dict) -> "Ask":
        if tensors:
            raise wire.WireError("a request carries no tensors")
        if read_fields(cls, header, "header", names=("want",))["want"] == "info":
            return cls("info")
        return cls(**read_fields(cls, header, "header"))


@dataclass(frozen=True)
class Info:
    """info {info}: a target's answer to an info request (the map is services.net.handshake.TargetInfo's)."""

    info: dict

    def to_wire(self) -> list:
        return wire.encode({"kind": "info", "info": self.info})

    @classmethod
    def from_wire(cls, header: dict, tensors: dict) -> "Info":
        return cls(**read_fields(cls, header, "header"))


@dataclass(frozen=True)
class Refusal:
    """error {g, split, message, incarnation}: a target could not serve batch g (g -1: not a batch)."""

    g: int = field(metadata=BATCH_INDEX)
    split: str = field(metadata=SPLIT)
    message: str = field(metadata=rule(absent=""))
    incarnation: str = field(default="", metadata=INCARNATION)

    def to_wire(self) -> list:
        return wire.encode(
            {
                "kind": "error",
                "g": self.g,
                "split": self.split,
                "message": self.message[:1000],
                "incarnation": self.incarnation,
            }
        )

    @classmethod
    def from_wire(cls, header: dict, tensors: dict) -> "Refusal":
        values = read_fields(cls, header, "header")
        return cls(**{**values, "message": values["message"][:1000]})


@dataclass(frozen=True)
class Announce:
    """batch {g, split, incarnation, digest, stream: [tensor specs]}: a batch's provenance and tensor table."""

    g: int = field(metadata=BATCH_INDEX)
    split: str = field(metadata=SPLIT)
    incarnation: str = field(metadata=INCARNATION)
    digest: str = field(metadata=rule(length=32))  # services.data.batch.token_digest of its input_ids
    stream: list[wire.TensorSpec]  # the batch's tensors, in the order their bytes follow

    def to_wire(self) -> list:
        return wire.encode(
            {
                "kind": "batch",
                "g": self.g,
                "split": self.split,
                "incarnation": self.incarnation,
                "digest": self.digest,
                "stream": [spec.to_wire() for spec in self.stream],
            }
        )

    @classmethod
    def from_wire(cls, header: dict, tensors: dict, max_batch_bytes: int) -> "Announce":
        """Checked field by field; the tensor table against max_batch_bytes and the batch's fields."""
        values = read_fields(cls, header, "header", names=("g", "split", "incarnation", "digest"))
        if tensors:
            raise wire.WireError("a batch announcement carries no tensor frames")
        specs = wire.parse_specs(header.get("stream"), max_batch_bytes, field="stream")
        for spec in specs:
            if spec.name not in FIELDS or wire.DTYPES[spec.dtype] != FIELDS[spec.name]:
                raise wire.WireError(f"stream: {spec.name!r} of {spec.dtype} is not a batch field")
        return cls(**values, stream=specs)


@dataclass(frozen=True)
class Chunk:
    """chunk {g, split, offset} + bytes: at most transport.chunk_bytes of a batch, at `offset` in its buffer."""

    g: int = field(metadata=BATCH_INDEX)
    split: str = field(metadata=SPLIT)
    offset: int = field(metadata=rule(low=0))
    data: torch.Tensor  # 1-d uint8

    def to_wire(self) -> list:
        return wire.encode(
            {"kind": "chunk", "g": self.g, "split": self.split, "offset": self.offset}, {"bytes": self.data}
        )

    @classmethod
    def from_wire(cls, header: dict, tensors: dict) -> "Chunk":
        values = read_fields(cls, header, "header", names=("g", "split", "offset"))
        data = tensors.get("bytes")
        if len(tensors) != 1 or data is None or data.dtype != torch.uint8 or data.dim() != 1:
            raise wire.WireError("a chunk carries exactly one 1-d uint8 tensor named 'bytes'")
        return cls(**values, data=data)


def batch_messages(batch: Batch, split: str, chunk_bytes: int, incarnation: str = "") -> Iterator[list]:
    """The messages that carry one batch: its announcement (with its provenance), then its bytes
    in chunks, in order."""
    tensors = batch.tensors()
    specs = [wire.spec_of(name, t) for name, t in tensors.items()]
    yield Announce(batch.g, split, incarnation, token_digest(batch.input_ids), specs).to_wire()
    offsets, _ = layout(specs)
    for (name, tensor), offset in zip(tensors.items(), offsets):
        flat = wire.byte_view(name, tensor)
        for start in range(0, flat.numel(), chunk_bytes):
            yield Chunk(batch.g, split, offset + start, flat[start : start + chunk_bytes]).to_wire()


class BufferPool:
    """Reassembly buffers, reused once no tensor made from them is alive.

    Fresh memory page-faults on first touch: copying into a new buffer ran ~5x slower than into
    a reused one on the 2-core dev box. Each CPU buffer is lent as a numpy view wrapped by
    torch.from_numpy; every tensor made from it keeps that view alive, and when the last one
    dies a weakref finalizer puts the memory back. Pinned buffers come from torch's caching
    host allocator, which already recycles freed blocks.
    """

    def __init__(self, pin: bool, keep: int):
        self.pin, self.keep = pin, keep
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()  # get() runs on the I/O thread, _give_back wherever a tensor dies

    def get(self, nbytes: int) -> torch.Tensor:
        if self.pin:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        with self._lock:
            same_size = [i for i, array in enumerate(self._free) if array.nbytes == nbytes]
            array = self._free.pop(same_size[0]) if same_size else None
        if array is None:
            array = np.empty(nbytes, dtype=np.uint8)
        lease = array[:]
        weakref.finalize(lease, self._give_back, array).atexit = False
        return torch.from_numpy(lease)

    def _give_back(self, array: np.ndarray) -> None:
        with self._lock:
            self._free.append(array)
            if len(self._free) > self.keep:
                self._free.pop(0)


class Partial:
    """A batch being put back together: its tensor table, buffer and where the next chunk goes."""

    def __init__(self, specs: list[wire.TensorSpec], max_batch_bytes: int, pool: BufferPool):
        self.specs = specs
        self.offsets, total = layout(specs)
        if total > max_batch_bytes:
            raise wire.WireError(f"batch of {total} bytes exceeds transport.max_batch_bytes={max_batch_bytes}")
        self.buffer = pool.get(total)
        self.index, self.filled = 0, 0  # tensor being filled, bytes of it received
        self.provenance: dict = {}  # incarnation and digest, from the announcement
        self._skip_empty()

    def _skip_empty(self) -> None:
        while self.index < len(self.specs) and self.filled == self.specs[self.index].nbytes:
            self.index, self.filled = self.index + 1, 0

    @property
    def complete(self) -> bool:
        return self.index == len(self.specs)

    def add(self, offset: int, data: torch.Tensor) -> None:
        """Copy one chunk into place; chunks must arrive in order, within one tensor."""
        if self.complete:
            raise wire.WireError("chunk after the batch was complete")
        expected = self.offsets[self.index] + self.filled
        room = self.specs[self.index].nbytes - self.filled
        if offset != expected or not 0 < data.numel() <= room:
            raise wire.WireError(
                f"chunk at offset {offset} with {data.numel()} bytes; expected offset {expected}, at most {room} bytes"
            )
        # numpy's copy is one plain memcpy on this thread; torch's copy_ would wake its
        # intra-op thread pool, which then spins against ZMQ's I/O thread on few cores
        self.buffer.numpy()[offset : offset + data.numel()] = data.numpy()
        self.filled += data.numel()
        self._skip_empty()

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            spec.name: wire.tensor_from(self.buffer[off : off + spec.nbytes], spec)
            for spec, off in zip(self.specs, self.offsets)
        }
