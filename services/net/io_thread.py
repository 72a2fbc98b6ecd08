"""IoThread: ZMQ sockets owned by one background thread, fed through queues (both ends of the transport)."""

from __future__ import annotations

import queue
import threading

import zmq

MAX_MESSAGES_PER_POLL = 1024  # a flood cannot keep poll() from returning


def get_all(q: queue.Queue, timeout_s: float) -> list:
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


class IoThread:
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
        try:
            self._wake_out.send(b"", zmq.NOBLOCK)
        except zmq.Again:  # no room or no peer: a wake is pending, or the thread has ended (close() raced it)
            pass

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
