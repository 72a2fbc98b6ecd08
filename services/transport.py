"""Batch transport: targets serve batches to drafters that pull them (docs/wire.md, "Streaming").

    drafter DEALER  ->  target ROUTER   request {want: "batch", g, split, incarnation}  |  request {want: "info"}
    target ROUTER   ->  drafter DEALER  info {info}  |  error {g, split, message, incarnation}
                                        batch {g, split, incarnation, digest, stream: [tensor specs]}
                                        chunk {g, split, offset} + <= chunk_bytes of raw bytes  (repeated)
    and verify / verified (services/verify.py): real acceptance, verified by the target itself.

A batch travels as a stream of separate few-MB messages, not one big one: ZMQ moves those
several times faster (docs/benchmarks.md, "Transport"). The drafter checks the announced size against
transport.max_batch_bytes, preallocates one (pinned) buffer, copies each chunk into place and
hands out the Batch as views of that buffer. Anything malformed is counted and dropped.

Provenance: every target process has an incarnation (pid + random nonce, also on its health
status). The drafter asks a target for a batch naming the incarnation it believes it talks to;
the target announces each batch with its own incarnation and the digest of the token ids. A batch
(or error) from an incarnation the drafter did not ask is dropped and counted
("data-incarnation"), a digest that does not match the ids too; what was accepted is handed out
with its provenance, which the drafter writes to its ledger. When a target's incarnation changes,
the drafter reconnect()s: the old connection may lead to whatever process holds it now.

Content: what a sender says about itself can be replayed by any process that took its socket
over, so the drafter also names the digest batch g must have (from its own copy of the data,
source.py) and an announcement with another digest is dropped at once ("data-content", counted
with the incarnation it claimed), before a byte of it is reassembled. Both drops hand the
drafter a "rejected" event, so it asks again on a fresh connection instead of waiting for a
resend.
"""
from __future__ import annotations

import itertools
import logging
import math
import os
import queue
import secrets
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
import zmq

from services import curve, verify, wire
from services.batch import FIELDS, SPLITS, Batch, BatchError, token_digest
from services.config import TransportConfig
from services.health import HealthServer, bind_private, secure_socket

log = logging.getLogger(__name__)

ALIGN = 64                      # byte offset of every tensor in the reassembly buffer
MAX_REQUEST_BYTES = 1 << 20     # a verify prompt's ids at most (int64); ZMQ disconnects a peer sending more
SEND_TIMEOUT_S = 30.0           # longest wait for room in a drafter's queue before giving up
MAX_MESSAGES_PER_POLL = 1024    # a flood cannot keep poll() from returning
MAX_INCARNATION_LEN = 64


@dataclass
class Request:
    client: bytes   # ROUTER identity of the asking drafter
    kind: str       # "batch" | "info"
    g: int          # global batch index (kind == "batch"); -1 for info
    split: str      # "train" | "eval"
    incarnation: str = ""   # the target incarnation the drafter believes it asks ("" if it did not say)
    verify: verify.VerifyRequest | None = None   # kind == "verify"


def new_incarnation() -> str:
    """This process's incarnation: its pid (for people) and a nonce (a reused pid is another one)."""
    return f"{os.getpid()}-{secrets.token_hex(8)}"


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


class _Drops:
    """Counts dropped messages, reports them to health, logs the first of each kind."""

    def __init__(self, health: HealthServer | None):
        self.health = health
        self.counts: Counter[str] = Counter()

    def __call__(self, kind: str, detail: str) -> None:
        self.counts[kind] += 1
        first = self.health.bad_message(kind, detail) if self.health else self.counts[kind] == 1
        if first:
            log.warning("dropped a bad %s message: %s", kind, detail)


def _int_field(header: dict, key: str, low: int) -> int:
    value = header.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise wire.WireError(f"header field {key!r}: expected an int >= {low}, got {value!r}")
    return value


def _split_field(header: dict) -> str:
    split = header.get("split")
    if split not in SPLITS:
        raise wire.WireError(f"header field 'split': expected one of {SPLITS}, got {split!r}")
    return split


def _incarnation_field(header: dict) -> str:
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


def _get_all(q: queue.Queue, timeout_s: float) -> list:
    """Everything in q, waiting up to timeout_s for the first item."""
    try:
        items = [q.get(timeout=timeout_s)]
    except queue.Empty:
        return []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items


class _IoThread:
    """Sockets owned by one background thread (ZMQ sockets are not thread-safe): other threads
    hand it work through queues and wake it through an inproc pair; close() stops and joins it."""

    def _start_io(self, name: str) -> None:
        self._wake_in = self._ctx.socket(zmq.PAIR)
        self._wake_in.bind(f"inproc://wake-{id(self)}")
        self._wake_out = self._ctx.socket(zmq.PAIR)
        self._wake_out.connect(f"inproc://wake-{id(self)}")
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._io_loop, name=name, daemon=True)
        self._thread.start()

    def _wake(self) -> None:
        self._wake_out.send(b"", zmq.NOBLOCK)

    def _woken(self) -> None:
        while self._wake_in.poll(0):
            self._wake_in.recv()

    def _io_loop(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._closing.set()
        self._wake()
        self._thread.join(timeout=10)
        self._wake_out.close(linger=0)
        self._ctx.term()


@dataclass
class _Reply:
    """Messages for one drafter, sent in order by the I/O thread."""
    client: bytes
    messages: Iterator[list]
    ready: object = None            # a CUDA event: the bytes are in host memory once it has completed
    release: object = None          # called once ZMQ is done with every frame (the buffer may be reused)
    started: float = 0.0            # when its first message was queued
    trackers: list | None = None    # one per message: done once ZMQ has let go of its bytes


class BatchServer(_IoThread):
    """Target side: a ROUTER on the data endpoint, owned by one I/O thread (vLLM's engine-core pattern).

    The main loop takes requests with poll() and hands replies over with send_*(); the I/O thread
    receives, validates and queues requests, and streams replies to each drafter without blocking:
    a drafter whose queue is full is skipped while the others are served, and given up after
    SEND_TIMEOUT_S (it will ask again). So neither the GPU loop nor the other drafters wait on it.
    """

    def __init__(self, endpoint: str, transport: TransportConfig, health: HealthServer | None = None,
                 verify_limits: verify.VerifyLimits | None = None):
        self.transport = transport
        self.verify_limits = verify_limits       # None: verify requests are refused (counted and dropped)
        self.drops = _Drops(health)
        self._health = health
        self.incarnation = new_incarnation()
        if health:
            health.set(incarnation=self.incarnation)     # drafters learn it here, before they ask
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        secure_socket(self._sock, MAX_REQUEST_BYTES)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # an unknown drafter is an error, not a silent drop
        self._sock.setsockopt(zmq.SNDHWM, queue_depth(transport))
        self._sock.setsockopt(zmq.RCVHWM, 1000)
        if keys := curve.keys_for(transport):   # tcp with transport.curve_keys_dir: encrypted, client key checked
            curve.apply_server(self._sock, keys)
        bind_private(self._sock, endpoint)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)   # resolves tcp port '*'
        self._requests: queue.Queue[Request] = queue.Queue()
        self._outbox: queue.Queue[_Reply] = queue.Queue()
        self._unsent = 0                         # replies handed over and not yet fully queued in ZMQ
        self._unsent_lock = threading.Lock()
        self._start_io("target-io")

    # --- main-thread side ---------------------------------------------------------------------
    def poll(self, timeout_ms: int) -> list[Request]:
        """Valid requests in arrival order, waiting up to timeout_ms for the first."""
        return _get_all(self._requests, timeout_ms / 1000)

    def send_batch(self, client: bytes, batch: Batch, split: str = "train", ready=None, release=None) -> None:
        """Stream one batch to a drafter (no copy: leave its tensors alone until `release` is called).

        `ready` (a CUDA event) is waited for before the first byte goes out; `release` is called
        once ZMQ no longer needs the batch's memory, also when the drafter is gone.
        """
        self._hand_over(_Reply(client, batch_messages(batch, split, self.transport.chunk_bytes, self.incarnation),
                               ready, release))

    def send_info(self, client: bytes, info: dict) -> None:
        self.send_frames(client, wire.encode({"kind": "info", "info": info}))

    def send_error(self, client: bytes, g: int, message: str, split: str = "train") -> None:
        self.send_frames(client, wire.encode({"kind": "error", "g": g, "split": split, "message": message[:1000],
                                              "incarnation": self.incarnation}))

    def send_frames(self, client: bytes, frames: list) -> None:
        """One raw message, in order with everything else for this drafter."""
        self._hand_over(_Reply(client, iter([frames])))

    def send_messages(self, client: bytes, messages: list[list]) -> None:
        """Several raw messages, in this order (a verify answer in parts)."""
        self._hand_over(_Reply(client, iter(messages)))

    def _hand_over(self, reply: _Reply) -> None:
        with self._unsent_lock:
            self._unsent += 1
        self._outbox.put(reply)
        self._wake()

    def flush(self, timeout_s: float) -> bool:
        """Wait until every reply handed over is queued in ZMQ (or given up); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._unsent_lock:
                if self._unsent == 0:
                    return True
            time.sleep(0.01)
        return False

    # --- I/O thread -----------------------------------------------------------------------------
    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        streams: dict[bytes, list[_Reply]] = {}      # per drafter, in order
        in_flight: list[_Reply] = []                   # fully queued; waiting for ZMQ to let go of the bytes
        try:
            while not self._closing.is_set():
                progressed = bool(streams) and self._send_some(streams, in_flight)
                # a reply finished: look again at once; full queues or copies running: shortly; idle: until woken
                timeout = 0 if progressed else (2 if streams or in_flight else 1000)
                for sock, _ in poller.poll(timeout):
                    if sock is self._wake_in:
                        self._woken()
                    else:
                        self._receive()
                while True:
                    try:
                        reply = self._outbox.get_nowait()
                    except queue.Empty:
                        break
                    streams.setdefault(reply.client, []).append(reply)
                in_flight[:] = [r for r in in_flight if not self._released_if_done(r)]
        finally:
            for reply in [r for rs in streams.values() for r in rs] + in_flight:
                if reply.release:
                    reply.release()
            self._sock.close(linger=0)
            self._wake_in.close(linger=0)

    def _receive(self) -> None:
        for _ in range(MAX_MESSAGES_PER_POLL):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._requests.put(self._parse_request(frames))
            except wire.WireError as exc:
                self.drops("data-request", str(exc))

    def _parse_request(self, frames) -> Request:
        client = frames[0].bytes
        header, tensors = wire.decode(frames[1:], max_message_bytes=MAX_REQUEST_BYTES)
        if header["kind"] == "verify":
            return Request(client, "verify", -1, "train", _incarnation_field(header),
                           verify.parse_verify(header, tensors, self.verify_limits))
        if header["kind"] != "request":
            raise wire.WireError(f"header field 'kind': a target only takes requests and verify, got {header['kind']!r}")
        if tensors:
            raise wire.WireError("a request carries no tensors")
        want = header.get("want")
        if want == "info":
            return Request(client, "info", -1, "train")
        if want == "batch":
            return Request(client, "batch", _int_field(header, "g", 0), _split_field(header), _incarnation_field(header))
        raise wire.WireError(f"header field 'want': expected 'batch' or 'info', got {want!r}")

    def _send_some(self, streams: dict[bytes, list[_Reply]], in_flight: list[_Reply]) -> bool:
        """Advance each drafter's current reply until its queue is full; True if any reply finished."""
        finished_any = False
        for client in list(streams):
            replies = streams[client]
            reply = replies[0]
            if reply.ready is not None and not reply.ready.query():
                continue                       # its copy to host memory is still running on the GPU
            if not reply.started:
                reply.started, reply.trackers = time.monotonic(), []
            outcome = self._stream(reply)
            if outcome == "full":
                if time.monotonic() - reply.started <= SEND_TIMEOUT_S:
                    continue
                self._give_up(f"drafter queue full for {SEND_TIMEOUT_S:.0f}s; batch abandoned")
            finished = list(replies) if outcome == "gone" else [reply]   # gone: nothing more reaches it
            in_flight.extend(finished)
            del replies[:len(finished)]
            if not replies:
                del streams[client]
            with self._unsent_lock:
                self._unsent -= len(finished)
            finished_any = True
        return finished_any

    def _stream(self, reply: _Reply) -> str:
        """Queue the reply's messages in ZMQ: "done", "full" (try again later) or "gone"."""
        for frames in reply.messages:
            try:
                reply.trackers.append(self._sock.send_multipart([reply.client, *frames], zmq.NOBLOCK, copy=False,
                                                                track=True))
            except zmq.Again:   # this drafter's queue is full: keep the message for the next round
                reply.messages = itertools.chain([frames], reply.messages)
                return "full"
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                self._give_up("drafter disconnected; batch abandoned (it will ask again)")
                return "gone"
        return "done"


    @staticmethod
    def _released_if_done(reply: _Reply) -> bool:
        if any(not t.done for t in reply.trackers or []):
            return False
        if reply.release:
            reply.release()
        return True

    def _give_up(self, text: str) -> None:
        log.warning("%s", text)
        if self._health:
            self._health.error(text)


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


class _Partial:
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


class BatchClient(_IoThread):
    """Drafter side: one DEALER per target, owned by an I/O thread that receives and reassembles.

    request() asks, poll() returns what completed. Chunks are copied into place on the I/O thread
    while the training step runs, so a batch that has arrived is whole when the loop asks for it.
    """

    def __init__(self, endpoints: list[str], transport: TransportConfig, health: HealthServer | None = None,
                 pin_memory: bool = False):
        self.transport = transport
        self.drops = _Drops(health)
        self.pool = BufferPool(pin_memory and torch.cuda.is_available(), keep=transport.credits + 2)
        self._ctx = zmq.Context()
        self._endpoints = list(endpoints)
        self._socks = [self._connect(endpoint) for endpoint in self._endpoints]
        self._target_of = {sock: i for i, sock in enumerate(self._socks)}
        self._lock = threading.Lock()                              # guards the three below
        # (target, split, g) asked, not yet delivered -> (the incarnation asked, the digest its ids
        # must have); None: any
        self._wanted: dict[tuple[int, str, int], tuple[str | None, str | None]] = {}
        self._info_wanted: Counter[int] = Counter()
        self._partials: dict[tuple[int, str, int], _Partial] = {}
        self._events: queue.Queue[tuple] = queue.Queue()
        self._outbox: queue.Queue[tuple[int, list | None]] = queue.Queue()    # frames None: reconnect
        self._start_io("drafter-io")

    def _connect(self, endpoint: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        secure_socket(sock, self.transport.max_message_bytes)   # per frame: the largest is a chunk's data
        sock.setsockopt(zmq.RCVHWM, queue_depth(self.transport))
        if keys := curve.keys_for(self.transport):
            curve.apply_client(sock, keys)
        sock.connect(endpoint)
        return sock

    def request(self, target: int, g: int, split: str = "train", incarnation: str | None = None,
                digest: str | None = None) -> None:
        """Ask for batch g; with `incarnation`, only that target incarnation's answer is taken; with
        `digest`, only a batch whose token ids have that digest (services.batch.token_digest)."""
        if split not in SPLITS or g < 0 or not 0 <= target < len(self._socks):
            raise ValueError(f"request: bad target={target}, g={g} or split={split!r}")
        with self._lock:
            self._wanted[(target, split, g)] = (incarnation, digest)
        header = {"kind": "request", "want": "batch", "g": g, "split": split}
        self._send(target, {**header, "incarnation": incarnation} if incarnation else header)

    def reconnect(self, target: int) -> None:
        """Close the connection to this target and connect afresh (its process was replaced: the
        old connection may lead to whatever now holds it). Requests sent before are void."""
        self.forget(target)
        self._outbox.put((target, None))
        self._wake()

    def request_info(self, target: int) -> None:
        with self._lock:
            self._info_wanted[target] += 1
        self._send(target, {"kind": "request", "want": "info"})

    def _send(self, target: int, header: dict) -> None:
        self._outbox.put((target, wire.encode(header)))
        self._wake()

    @property
    def in_progress(self) -> list[tuple[int, str, int]]:
        """(target, split, g) of the batches half received right now."""
        with self._lock:
            return sorted(self._partials)

    def forget(self, target: int) -> None:
        """Drop half-received batches from this target (it restarted); the caller asks again."""
        with self._lock:
            for key in [k for k in self._partials if k[0] == target]:
                del self._partials[key]

    def poll(self, timeout_ms: int) -> list[tuple]:
        """Wait up to timeout_ms for at least one event; return all events ready by then.

        ("batch", target, split, Batch, {incarnation, digest}) | ("info", target, dict) | ("error", target, g, message, incarnation)
        | ("rejected", target, split, g, why): an answer to a request was dropped (another incarnation,
        other content); the request stays wanted, and is best asked again on a fresh connection
        """
        return _get_all(self._events, timeout_ms / 1000)

    # --- I/O thread -----------------------------------------------------------------------------
    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_in, zmq.POLLIN)
        for sock in self._socks:
            poller.register(sock, zmq.POLLIN)
        unsent: list[tuple[int, list]] = []         # requests that met a full queue: tried again
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

    def _handle(self, target: int, frames, events: list) -> None:
        header, tensors = wire.decode(frames, self.transport.max_message_bytes)
        kind = header["kind"]
        if kind == "info":
            if not self._info_wanted[target]:
                return self.drops("data-unrequested", f"target {target}: info nobody asked for")
            if not isinstance(header.get("info"), dict):
                raise wire.WireError("header field 'info': expected a map")
            self._info_wanted[target] -= 1
            events.append(("info", target, header["info"]))
            return
        g = _int_field(header, "g", -1)
        if kind == "error":
            message = str(header.get("message", ""))[:1000]
            key = (target, _split_field(header), g)
            if g >= 0 and key not in self._wanted:
                return self.drops("data-unrequested", f"target {target}: error for g={g} nobody asked for")
            if g >= 0 and not self._from_asked(key, _incarnation_field(header), events):
                return
            self._wanted.pop(key, None)
            self._partials.pop(key, None)
            events.append(("error", target, g, message, _incarnation_field(header)))
            return
        key = (target, _split_field(header), g)
        if key not in self._wanted:   # never asked, or already delivered
            return self.drops("data-unrequested", f"target {target}: {kind} for g={g} not requested")
        if kind == "batch":
            if not self._from_asked(key, _incarnation_field(header), events) or \
                    not self._has_content(key, header, events):
                self._partials.pop(key, None)
                return
            self._start(key, header, tensors)
        elif kind == "chunk":
            self._add_chunk(key, header, tensors)
        else:
            raise wire.WireError(f"header field 'kind': a drafter does not take {kind!r}")
        partial = self._partials.get(key)
        if partial is not None and partial.complete:
            del self._partials[key]
            batch = Batch.from_tensors(key[2], partial.tensors())   # BatchError: dropped, still wanted
            if token_digest(batch.input_ids) != partial.provenance["digest"]:
                raise wire.WireError(f"batch g={key[2]}: token ids do not match the announced digest")
            del self._wanted[key]
            events.append(("batch", target, key[1], batch, partial.provenance))

    def _from_asked(self, key, incarnation: str, events: list) -> bool:
        """Is this answer from the incarnation the request named? Else it is dropped and counted."""
        asked = self._wanted[key][0]
        if asked is None or incarnation == asked:
            return True
        why = f"target {key[0]}: g={key[2]} from incarnation {incarnation!r}, asked {asked!r}"
        self.drops("data-incarnation", why)
        events.append(("rejected", key[0], key[1], key[2], why))
        return False

    def _has_content(self, key, header: dict, events: list) -> bool:
        """Does the announced digest name the content the request asked for? (The ids are checked
        against the announced digest once they are in.) Else it is dropped and counted."""
        expected, announced = self._wanted[key][1], header.get("digest")
        if expected is None or announced == expected:
            return True
        why = (f"target {key[0]}: {key[1]} g={key[2]} has token digest {str(announced)[:40]!r}, the data says "
               f"{expected!r} (sent as incarnation {_incarnation_field(header)!r})")
        self.drops("data-content", why)
        events.append(("rejected", key[0], key[1], key[2], why))
        return False

    def _start(self, key, header: dict, tensors: dict) -> None:
        if tensors:
            raise wire.WireError("a batch announcement carries no tensor frames")
        self._partials.pop(key, None)   # a re-sent batch starts over
        digest = header.get("digest")
        if not isinstance(digest, str) or len(digest) != 32:
            raise wire.WireError(f"header field 'digest': expected 32 hex characters, got {str(digest)[:80]!r}")
        specs = wire.parse_specs(header.get("stream"), self.transport.max_batch_bytes, field="stream")
        for spec in specs:
            if spec.name not in FIELDS or wire.DTYPES[spec.dtype] != FIELDS[spec.name]:
                raise wire.WireError(f"stream: {spec.name!r} of {spec.dtype} is not a batch field")
        partial = _Partial(specs, self.transport.max_batch_bytes, self.pool)
        partial.provenance = {"incarnation": _incarnation_field(header), "digest": digest}
        self._partials[key] = partial

    def _add_chunk(self, key, header: dict, tensors: dict) -> None:
        partial = self._partials.get(key)
        if partial is None:
            raise wire.WireError(f"chunk for g={key[2]} without its batch announcement")
        data = tensors.get("bytes")
        if len(tensors) != 1 or data is None or data.dtype != torch.uint8 or data.dim() != 1:
            raise wire.WireError("a chunk carries exactly one 1-d uint8 tensor named 'bytes'")
        try:
            partial.add(_int_field(header, "offset", 0), data)
        except wire.WireError:
            del self._partials[key]   # the stream is broken; it restarts when the batch is asked again
            raise
