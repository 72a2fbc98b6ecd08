"""Batch transport: targets serve batches to drafters that pull them (docs/wire.md, "Streaming").

    drafter DEALER  ->  target ROUTER   request {want: "batch", g, split, incarnation}  |  request {want: "info"}
    target ROUTER   ->  drafter DEALER  info {info}  |  error {g, split, message, incarnation}
                                        batch {g, split, incarnation, digest, stream: [tensor specs]}
                                        chunk {g, split, offset} + <= chunk_bytes of raw bytes  (repeated)
    and verify / verified (services/net/verify.py): real acceptance, verified by the target itself.

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

Here: the target's side, BatchServer. The drafter's side is batch_client.BatchClient; a batch's
messages and their reassembly are batch_stream.py; the I/O thread both sides run, io_thread.py.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import zmq

from services.data.batch import Batch
from services.net import curve, verify, wire
from services.net.batch_stream import Ask, Info, Refusal, batch_messages, queue_depth
from services.net.health_probe import Drops, Reporter
from services.net.io_thread import MAX_MESSAGES_PER_POLL, IoThread, get_all
from services.net.sockets import bind_private, secure_socket
from services.run.config import TransportConfig

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 1 << 20  # a verify prompt's ids at most (int64); ZMQ disconnects a peer sending more
SEND_TIMEOUT_S = 30.0  # longest wait for room in a drafter's queue before giving up


@dataclass
class Request:
    client: bytes  # ROUTER identity of the asking drafter
    kind: str  # "batch" | "info"
    g: int  # global batch index (kind == "batch"); -1 for info
    split: str  # "train" | "eval"
    incarnation: str = ""  # the target incarnation the drafter believes it asks ("" if it did not say)
    verify: verify.VerifyRequest | None = None  # kind == "verify"


def new_incarnation() -> str:
    """This process's incarnation: its pid (for people) and a nonce (a reused pid is another one)."""
    return f"{os.getpid()}-{secrets.token_hex(8)}"


@dataclass
class _Reply:
    """Messages for one drafter, sent in order by the I/O thread."""

    client: bytes
    messages: Iterator[list]
    ready: object = None  # a CUDA event: the bytes are in host memory once it has completed
    release: object = None  # called once ZMQ is done with every frame (the buffer may be reused)
    started: float = 0.0  # when its first message was queued
    trackers: list | None = None  # one per message: done once ZMQ has let go of its bytes
    what: str = "batch"  # for the log: "batch" (asked again), "reply" or "verify answer"


class BatchServer(IoThread):
    """Target side: a ROUTER on the data endpoint, owned by one I/O thread (vLLM's engine-core pattern).

    The main loop takes requests with poll() and hands replies over with send_*(); the I/O thread
    receives, validates and queues requests, and streams replies to each drafter without blocking:
    a drafter whose queue is full is skipped while the others are served, and given up after
    SEND_TIMEOUT_S (it will ask again). So neither the GPU loop nor the other drafters wait on it.
    """

    def __init__(
        self,
        endpoint: str,
        transport: TransportConfig,
        health: Reporter | None = None,
        verify_limits: verify.VerifyLimits | None = None,
        incarnation: str = "",
    ):
        self.transport = transport
        self.verify_limits = verify_limits  # None: verify requests are refused (counted and dropped)
        self.drops = Drops(health)
        self._health = health
        self.incarnation = incarnation or new_incarnation()  # the shell's, which its core's answers carry
        if health:
            health.set(incarnation=self.incarnation)  # drafters learn it here, before they ask
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        secure_socket(self._sock, MAX_REQUEST_BYTES)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown drafter is an error, not a silent drop
        self._sock.setsockopt(zmq.SNDHWM, queue_depth(transport))
        self._sock.setsockopt(zmq.RCVHWM, 1000)
        if keys := curve.keys_for(transport):  # tcp with transport.curve_keys_dir: encrypted, client key checked
            curve.apply_server(self._sock, keys)
        bind_private(self._sock, endpoint)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)  # resolves tcp port '*'
        self._requests: queue.Queue[Request] = queue.Queue()
        self._outbox: queue.Queue[_Reply] = queue.Queue()
        self._unsent = 0  # replies handed over and not yet fully queued in ZMQ
        self._unsent_lock = threading.Lock()
        self._start_io("target-io")

    # --- main-thread side ---------------------------------------------------------------------
    def poll(self, timeout_ms: int) -> list[Request]:
        """Valid requests in arrival order, waiting up to timeout_ms for the first."""
        return get_all(self._requests, timeout_ms / 1000)

    def send_batch(self, client: bytes, batch: Batch, split: str = "train", ready=None, release=None) -> None:
        """Stream one batch to a drafter (no copy: leave its tensors alone until `release` is called).

        `ready` (a CUDA event) is waited for before the first byte goes out; `release` is called
        once ZMQ no longer needs the batch's memory, also when the drafter is gone.
        """
        self._hand_over(
            _Reply(client, batch_messages(batch, split, self.transport.chunk_bytes, self.incarnation), ready, release)
        )

    def send_info(self, client: bytes, info: dict) -> None:
        self.send_frames(client, Info(info).to_wire())

    def send_error(self, client: bytes, g: int, message: str, split: str = "train") -> None:
        self.send_frames(client, Refusal(g, split, message, self.incarnation).to_wire())

    def send_frames(self, client: bytes, frames: list) -> None:
        """One raw message, in order with everything else for this drafter."""
        self._hand_over(_Reply(client, iter([frames]), what="reply"))

    def send_messages(self, client: bytes, messages: list[list]) -> None:
        """Several raw messages, in this order (a verify answer in parts)."""
        self._hand_over(_Reply(client, iter(messages), what="verify answer"))

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
        streams: dict[bytes, list[_Reply]] = {}  # per drafter, in order
        in_flight: list[_Reply] = []  # fully queued; waiting for ZMQ to let go of the bytes
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
        kind = header["kind"]
        if kind == "verify":
            asked = verify.VerifyRequest.from_wire(header, tensors, self.verify_limits)
            return Request(client, "verify", -1, "train", asked.incarnation, asked)
        if kind != "request":
            raise wire.WireError(f"header field 'kind': a target only takes requests and verify, got {kind!r}")
        ask = Ask.from_wire(header, tensors)
        return Request(client, ask.want, ask.g, ask.split, ask.incarnation)

    def _send_some(self, streams: dict[bytes, list[_Reply]], in_flight: list[_Reply]) -> bool:
        """Advance each drafter's current reply until its queue is full; True if any reply finished."""
        finished_any = False
        for client in list(streams):
            replies = streams[client]
            reply = replies[0]
            if reply.ready is not None and not reply.ready.query():
                continue  # its copy to host memory is still running on the GPU
            if not reply.started:
                reply.started, reply.trackers = time.monotonic(), []
            outcome = self._stream(reply)
            if outcome == "full":
                if time.monotonic() - reply.started <= SEND_TIMEOUT_S:
                    continue
                self._give_up(f"drafter queue full for {SEND_TIMEOUT_S:.0f}s; {reply.what} abandoned")
            finished = list(replies) if outcome == "gone" else [reply]  # gone: nothing more reaches it
            in_flight.extend(finished)
            del replies[: len(finished)]
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
                reply.trackers.append(
                    self._sock.send_multipart([reply.client, *frames], zmq.NOBLOCK, copy=False, track=True)
                )
            except zmq.Again:  # this drafter's queue is full: keep the message for the next round
                reply.messages = itertools.chain([frames], reply.messages)
                return "full"
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                # e.g. a verify answer that came after the drafter stopped waiting and closed its socket
                self._give_up(
                    f"drafter disconnected; {reply.what} dropped"
                    + (" (it will ask again)" if reply.what == "batch" else "")
                )
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
