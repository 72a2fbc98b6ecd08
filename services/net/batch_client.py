"""BatchClient: the drafter's side of the batch transport (the protocol, provenance and content
checks: transport.py)."""

from __future__ import annotations

import queue
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Union

import torch
import zmq

from services.data.batch import SPLITS, Batch, BatchError, token_digest
from services.net import curve, wire
from services.net.batch_stream import Announce, Ask, BufferPool, Chunk, Info, Partial, Refusal, queue_depth
from services.net.health_probe import Drops, Reporter
from services.net.io_thread import MAX_MESSAGES_PER_POLL, IoThread, get_all
from services.net.sockets import secure_socket
from services.run.config import TransportConfig


# What poll() returns: one event per answer the I/O thread finished with, each a small named type.
@dataclass(frozen=True)
class InfoArrived:
    """A target's answer to request_info: the dataset and the shapes it serves (handshake.TargetInfo's wire form)."""

    target: int
    info: dict


@dataclass(frozen=True)
class BatchArrived:
    """Batch g of a split, whole and checked against its announced digest, with where it came from."""

    target: int
    split: str
    batch: Batch
    provenance: dict  # {incarnation, digest}


@dataclass(frozen=True)
class BatchRefused:
    """A target's error answer for g (g < 0: not about one batch)."""

    target: int
    g: int
    message: str
    incarnation: str


@dataclass(frozen=True)
class AnswerRejected:
    """An answer dropped (another incarnation, other content, a batch nobody asked for): what is wanted
    stays wanted, and is best asked again on a fresh connection."""

    target: int
    split: str
    g: int
    why: str


Event = Union[InfoArrived, BatchArrived, BatchRefused, AnswerRejected]


class BatchClient(IoThread):
    """Drafter side: one DEALER per target, owned by an I/O thread that receives and reassembles.

    request() asks, poll() returns what completed. Chunks are copied into place on the I/O thread
    while the training step runs, so a batch that has arrived is whole when the loop asks for it.
    """

    def __init__(
        self,
        endpoints: list[str],
        transport: TransportConfig,
        health: Reporter | None = None,
        pin_memory: bool = False,
    ):
        self.transport = transport
        self.drops = Drops(health)
        self.pool = BufferPool(pin_memory and torch.cuda.is_available(), keep=transport.credits + 2)
        self._ctx = zmq.Context()
        self._endpoints = list(endpoints)
        self._socks = [self._connect(endpoint) for endpoint in self._endpoints]
        self._target_of = {sock: i for i, sock in enumerate(self._socks)}
        self._lock = threading.Lock()  # guards the three below
        # (target, split, g) asked, not yet delivered -> (the incarnation asked, the digest its ids
        # must have); None: any
        self._wanted: dict[tuple[int, str, int], tuple[str | None, str | None]] = {}
        self._info_wanted: Counter[int] = Counter()
        self._partials: dict[tuple[int, str, int], Partial] = {}
        self._events: queue.Queue[Event] = queue.Queue()
        self._outbox: queue.Queue[tuple[int, list | None]] = queue.Queue()  # frames None: reconnect
        self._start_io("drafter-io")

    def _connect(self, endpoint: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        secure_socket(sock, self.transport.max_message_bytes)  # per frame: the largest is a chunk's data
        sock.setsockopt(zmq.RCVHWM, queue_depth(self.transport))
        if keys := curve.keys_for(self.transport):
            curve.apply_client(sock, keys)
        sock.connect(endpoint)
        return sock

    def request(
        self, target: int, g: int, split: str = "train", incarnation: str | None = None, digest: str | None = None
    ) -> None:
        """Ask for batch g; with `incarnation`, only that target incarnation's answer is taken; with
        `digest`, only a batch whose token ids have that digest (services.data.batch.token_digest)."""
        if split not in SPLITS or g < 0 or not 0 <= target < len(self._socks):
            raise ValueError(f"request: bad target={target}, g={g} or split={split!r}")
        with self._lock:
            self._wanted[(target, split, g)] = (incarnation, digest)
        self._send(target, Ask("batch", g, split, incarnation or ""))

    def reconnect(self, target: int) -> None:
        """Close the connection to this target and connect afresh (its process was replaced: the
        old connection may lead to whatever now holds it). Requests sent before are void."""
        self.forget(target)
        self._outbox.put((target, None))
        self._wake()

    def request_info(self, target: int) -> None:
        with self._lock:
            self._info_wanted[target] += 1
        self._send(target, Ask("info"))

    def _send(self, target: int, ask: Ask) -> None:
        self._outbox.put((target, ask.to_wire()))
        self._wake()

    def forget(self, target: int) -> None:
        """Drop half-received batches from this target (it restarted); the caller asks again."""
        with self._lock:
            for key in [k for k in self._partials if k[0] == target]:
                del self._partials[key]

    def poll(self, timeout_ms: int) -> list[Event]:
        """Wait up to timeout_ms for at least one event; return all events ready by then: InfoArrived,
        BatchArrived, BatchRefused or AnswerRejected (above)."""
        return get_all(self._events, timeout_ms / 1000)

    # --- I/O thread -----------------------------------------------------------------------------
    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_in, zmq.POLLIN)
        for sock in self._socks:
            poller.register(sock, zmq.POLLIN)
        unsent: list[tuple[int, list]] = []  # requests that met a full queue: tried again
        try:
            while not self._closing.is_set():
                for sock, _ in poller.poll(10 if unsent else 1000):
                    if sock is self._wake_in:
                        self._woken()
                    else:
                        self._drain(sock)
                while True:
                    try:
                        target, frames = self._outbox.get_nowait()
                    except queue.Empty:
                        break
                    if frames is None:
                        unsent = [(t, f) for t, f in unsent if t != target]
                        self._reconnect(target, poller)
                    else:
                        unsent.append((target, frames))
                unsent = [(t, frames) for t, frames in unsent if not self._try_send(t, frames)]
        finally:
            for sock in self._socks:
                sock.close(linger=0)
            self._wake_in.close(linger=0)

    def _reconnect(self, target: int, poller: zmq.Poller) -> None:
        old = self._socks[target]
        poller.unregister(old)
        old.close(linger=0)
        self._socks[target] = self._connect(self._endpoints[target])
        self._target_of = {sock: i for i, sock in enumerate(self._socks)}
        poller.register(self._socks[target], zmq.POLLIN)

    def _try_send(self, target: int, frames: list) -> bool:
        try:
            self._socks[target].send_multipart(frames, zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def _drain(self, sock: zmq.Socket) -> None:
        target = self._target_of[sock]
        for _ in range(MAX_MESSAGES_PER_POLL):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            events: list = []
            try:
                with self._lock:
                    self._handle(target, frames, events)
            except (wire.WireError, BatchError) as exc:
                self.drops("data-reply", f"target {target}: {exc}")
            for event in events:
                self._events.put(event)

    def _handle(self, target: int, frames, events: list[Event]) -> None:
        header, tensors = wire.decode(frames, self.transport.max_message_bytes)
        kind = header["kind"]
        if kind == "info":
            info = Info.from_wire(header, tensors)
            if not self._info_wanted[target]:
                return self.drops("data-unrequested", f"target {target}: info nobody asked for")
            self._info_wanted[target] -= 1
            events.append(InfoArrived(target, info.info))
            return
        if kind == "error":
            refusal = Refusal.from_wire(header, tensors)
            g, key = refusal.g, (target, refusal.split, refusal.g)
            if g >= 0 and key not in self._wanted:
                return self.drops("data-unrequested", f"target {target}: error for g={g} nobody asked for")
            if g >= 0 and not self._from_asked(key, refusal.incarnation, events):
                return
            self._wanted.pop(key, None)
            self._partials.pop(key, None)
            events.append(BatchRefused(target, g, refusal.message, refusal.incarnation))
            return
        if kind == "batch":
            message = Announce.from_wire(header, tensors, self.transport.max_batch_bytes)
        elif kind == "chunk":
            message = Chunk.from_wire(header, tensors)
        else:
            raise wire.WireError(f"header field 'kind': a drafter does not take {kind!r}")
        g = message.g
        key = (target, message.split, g)
        if key not in self._wanted:  # never asked, or already delivered
            why = f"target {target}: {kind} for g={g} not requested"
            if kind == "batch":  # whoever answers there may not be the target: ask afresh (source.py)
                events.append(AnswerRejected(target, message.split, g, why))
            return self.drops("data-unrequested", why)
        if kind == "batch":
            if not self._from_asked(key, message.incarnation, events) or not self._has_content(key, message, events):
                self._partials.pop(key, None)
                return
            self._start(key, message)
        else:
            self._add_chunk(key, message)
        partial = self._partials.get(key)
        if partial is not None and partial.complete:
            del self._partials[key]
            batch = Batch.from_tensors(key[2], partial.tensors())  # BatchError: dropped, still wanted
            if token_digest(batch.input_ids) != partial.provenance["digest"]:
                raise wire.WireError(f"batch g={key[2]}: token ids do not match the announced digest")
            del self._wanted[key]
            events.append(BatchArrived(target, key[1], batch, partial.provenance))

    def _from_asked(self, key, incarnation: str, events: list) -> bool:
        """Is this answer from the incarnation the request named? Else it is dropped and counted."""
        asked = self._wanted[key][0]
        if asked is None or incarnation == asked:
            return True
        why = f"target {key[0]}: g={key[2]} from incarnation {incarnation!r}, asked {asked!r}"
        self.drops("data-incarnation", why)
        events.append(AnswerRejected(key[0], key[1], key[2], why))
        return False

    def _has_content(self, key, announce: Announce, events: list) -> bool:
        """Does the announced digest name the content the request asked for? (The ids are checked
        against the announced digest once they are in.) Else it is dropped and counted."""
        expected = self._wanted[key][1]
        if expected is None or announce.digest == expected:
            return True
        why = (
            f"target {key[0]}: {key[1]} g={key[2]} has token digest {announce.digest[:40]!r}, the data says "
            f"{expected!r} (sent as incarnation {announce.incarnation!r})"
        )
        self.drops("data-content", why)
        events.append(AnswerRejected(key[0], key[1], key[2], why))
        return False

    def _start(self, key, announce: Announce) -> None:
        self._partials.pop(key, None)  # a re-sent batch starts over
        partial = Partial(announce.stream, self.transport.max_batch_bytes, self.pool)
        partial.provenance = {"incarnation": announce.incarnation, "digest": announce.digest}
        self._partials[key] = partial

    def _add_chunk(self, key, chunk: Chunk) -> None:
        partial = self._partials.get(key)
        if partial is None:
            raise wire.WireError(f"chunk for g={key[2]} without its batch announcement")
        try:
            partial.add(chunk.offset, chunk.data)
        except wire.WireError:
            del self._partials[key]  # the stream is broken; it restarts when the batch is asked again
            raise
