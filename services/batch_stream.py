"""One batch as a stream of messages: what a target sends and how a drafter puts it back together.

    batch {g, split, incarnation, digest, stream: [tensor specs]}   the announcement
    chunk {g, split, offset} + <= chunk_bytes of raw bytes         repeated, in order

batch_messages() makes the messages; Partial copies each chunk into place in one buffer from a
BufferPool, after checking the announced size against transport.max_batch_bytes; the *_field
functions check the header fields every message of the transport carries (docs/wire.md).
"""
from __future__ import annotations

import math
import threading
import weakref
from typing import Iterator

import numpy as np
import torch

from services import wire
from services.batch import SPLITS, Batch, token_digest
from services.config import TransportConfig

ALIGN = 64                      # byte offset of every tensor in the reassembly buffer
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


def int_field(header: dict, key: str, low: int) -> int:
    value = header.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise wire.WireError(f"header field {key!r}: expected an int >= {low}, got {value!r}")
    return value


def split_field(header: dict) -> str:
    split = header.get("split")
    if split not in SPLITS:
        raise wire.WireError(f"header field 'split': expected one of {SPLITS}, got {split!r}")
    return split


def incarnation_field(header: dict) -> str:
    value = header.get("incarnation", "")
    if not isinstance(value, str) or len(value) > MAX_INCARNATION_LEN:
        raise wire.WireError(f"header field 'incarnation': expected a string of at most {MAX_INCARNATION_LEN} "
                             f"characters, got {str(value)[:80]!r}")
    return value


def batch_messages(batch: Batch, split: str, chunk_bytes: int, incarnation: str = "") -> Iterator[list]:
    """The messages that carry one batch: its announcement (with its provenance), then its bytes
    in chunks, in order."""
    tensors = batch.tensors()
    specs = [wire.spec_of(name, t) for name, t in tensors.items()]
    key = {"g": batch.g, "split": split}
    yield wire.encode({"kind": "batch", **key, "incarnation": incarnation, "digest": token_digest(batch.input_ids),
                       "stream": [spec.to_wire() for spec in specs]})
    offsets, _ = layout(specs)
    for (name, tensor), offset in zip(tensors.items(), offsets):
        flat = wire.byte_view(name, tensor)
        for start in range(0, flat.numel(), chunk_bytes):
            yield wire.encode({"kind": "chunk", **key, "offset": offset + start},
                              {"bytes": flat[start:start + chunk_bytes]})


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
        self._lock = threading.Lock()    # get() runs on the I/O thread, _give_back wherever a tensor dies

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
        self.index, self.filled = 0, 0    # tensor being filled, bytes of it received
        self.provenance: dict = {}        # incarnation and digest, from the announcement
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
            raise wire.WireError(f"chunk at offset {offset} with {data.numel()} bytes; expected offset {expected}, at most {room} bytes")
        # numpy's copy is one plain memcpy on this thread; torch's copy_ would wake its
        # intra-op thread pool, which then spins against ZMQ's I/O thread on few cores
        self.buffer.numpy()[offset:offset + data.numel()] = data.numpy()
        self.filled += data.numel()
        self._skip_empty()

    def tensors(self) -> dict[str, torch.Tensor]:
        return {spec.name: wire.tensor_from(self.buffer[off:off + spec.nbytes], spec)
                for spec, off in zip(self.specs, self.offsets)}
