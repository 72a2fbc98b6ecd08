"""The drafter group's key-value store, behind the run's keys (docs/elastic.md, "Who may join").

torch's TCPStore authenticates nobody, and its DynamicRendezvous unpickles the state it reads from
the store. This store replaces both stores of a group across hosts: drafter rank 0's host agent
serves it on a ZMQ ROUTER socket, a CURVE server that admits only the run's client key
(services/net/curve.py) over tcp, or an ipc socket in the run's 0700 socket folder on one host. The
agents' rendezvous (rendezvous.py) and the workers' process group (collectives.join) are clients.

    request  msgpack [id, op, key, a, b]    op: set get add cas del check num
    reply    msgpack [id, ok, value]

Every field is type- and size-checked before anything is kept; a bad message is counted and
dropped, and the server goes on. Nothing is unpickled. A blocking get/wait is the client polling.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import msgpack
import torch.distributed as dist
import zmq
from zmq.utils.monitor import recv_monitor_message

from services.net import curve

MAX_KEY = 1024  # bytes; torch's keys are short paths
MAX_VALUE = 1 << 20  # gloo's addresses and the rendezvous' numbers are far smaller
MAX_KEYS = 1 << 16
MAX_BYTES = 64 << 20  # everything the store holds
MAX_REQUEST = MAX_KEY + 2 * MAX_VALUE + 64  # one set/cas with room for msgpack's headers
OPS = frozenset({"set", "get", "add", "cas", "del", "check", "num"})
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class StoreGone(RuntimeError):
    """The store's server did not answer in time (drafter rank 0's host or its agent is gone)."""


class BadRequest(ValueError):
    pass


def _as_bytes(x, what: str, limit: int) -> bytes:
    if not isinstance(x, bytes) or len(x) > limit:
        raise BadRequest(f"{what}: expected at most {limit} bytes")
    return x


class StoreServer:
    """The store, served by a thread on `endpoint` (tcp with CURVE when keys_dir, else ipc/tcp plain).

    `dropped` counts malformed requests, `refused` handshakes that failed (no or wrong keys, a replay)."""

    def __init__(self, endpoint: str, keys_dir: str = ""):
        self.data: dict[bytes, bytes] = {}
        self.size = 0
        self.served = self.dropped = self.refused = 0
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST)  # libzmq drops a bigger one before it is read
        if keys_dir:
            curve.apply_server(self.sock, keys_dir)
        self.monitor = self.sock.get_monitor_socket(HANDSHAKE_FAILED)
        if endpoint.startswith("ipc://"):
            from services.net.sockets import bind_private

            bind_private(self.sock, endpoint)
        else:
            self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="keystore", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(200):
                    if sock is self.monitor:
                        recv_monitor_message(self.monitor)
                        self.refused += 1
                        continue
                    frames = self.sock.recv_multipart()
                    reply = self.answer(frames[-1]) if len(frames) == 2 else None
                    if reply is None:
                        self.dropped += 1
                    else:
                        self.sock.send_multipart([frames[0], reply])
        finally:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
            self.sock.close(linger=0)
            self.ctx.term()

    def answer(self, raw: bytes) -> bytes | None:
        """The reply to one request, or None for a malformed one (counted by the caller)."""
        try:
            req = msgpack.unpackb(raw, raw=True, use_list=True, strict_map_key=True, max_bin_len=MAX_VALUE)
            if not isinstance(req, list) or len(req) != 5 or not isinstance(req[0], int):
                raise BadRequest("a request is [id, op, key, a, b]")
            rid, op, key, a, b = req
            op = op.decode() if isinstance(op, bytes) else ""
            if op not in OPS:
                raise BadRequest("unknown op")
            value = self._do(op, key, a, b)
        except (BadRequest, ValueError, TypeError, msgpack.UnpackException):
            return None
        self.served += 1
        return msgpack.packb([rid, True, value], use_bin_type=True)

    def _put(self, key: bytes, value: bytes) -> None:
        old = self.data.get(key)
        grow = len(value) - (len(old) + len(key) if old is not None else -len(key))
        if old is None and len(self.data) >= MAX_KEYS or self.size + grow > MAX_BYTES:
            raise BadRequest("the store is full")
        self.data[key] = value
        self.size += grow

    def _do(self, op: str, key, a, b):
        if op == "num":
            return len(self.data)
        if op == "check":
            if not isinstance(key, list) or len(key) > 1024:
                raise BadRequest("check takes a list of keys")
            return all(_as_bytes(k, "key", MAX_KEY) in self.data for k in key)
        key = _as_bytes(key, "key", MAX_KEY)
        if op == "set":
            self._put(key, _as_bytes(a, "value", MAX_VALUE))
            return None
        if op == "get":
            return self.data.get(key)
        if op == "add":
            if not isinstance(a, int) or abs(a) > 1 << 62:
                raise BadRequest("add takes an integer")
            total = int(self.data.get(key, b"0")) + a  # ValueError for a non-number: dropped
            self._put(key, str(total).encode())
            return total
        if op == "cas":  # torch's compare_set: set when the value is `a` (b"" = absent); the value after
            expected, desired = _as_bytes(a, "expected", MAX_VALUE), _as_bytes(b, "desired", MAX_VALUE)
            current = self.data.get(key)
            if (current is None and expected == b"") or current == expected:
                self._put(key, desired)
                return desired
            return expected if current is None else current
        # del
        old = self.data.pop(key, None)
        if old is not None:
            self.size -= len(key) + len(old)
        return old is not None


class KeyStore(dist.Store):
    """A torch.distributed.Store client of a StoreServer (gloo's init works over it). Thread-safe."""

    # A PrefixStore or gloo holds only the C++ side of a Python store: without a Python reference
    # this object would be collected under them ("Not implemented" from torch). Kept until close().
    _alive: set[KeyStore] = set()

    def __init__(self, endpoint: str, keys_dir: str = "", timeout_s: float = 300.0, answer_s: float = 10.0):
        super().__init__()
        self.endpoint, self.answer_s = endpoint, answer_s
        self.set_timeout(timedelta(seconds=timeout_s))  # torch's own (PrefixStore.set_timeout reaches it)
        self.gone = False  # a request went unanswered: the server is gone, later calls fail at once
        self._lock = threading.Lock()
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST)
        if keys_dir:
            curve.apply_client(self._sock, keys_dir)
        self._sock.connect(endpoint)
        self._next = 0
        self._keys_dir = keys_dir
        KeyStore._alive.add(self)

    def _call(self, op: str, key=b"", a=None, b=None):
        for x in (key, a, b):  # the server drops what is too big without an answer: say it here
            if isinstance(x, bytes) and len(x) > MAX_VALUE:
                raise ValueError(f"the drafter group's store takes values up to {MAX_VALUE} bytes, not {len(x)}")
        with self._lock:
            if self.gone:
                raise StoreGone(f"the drafter group's store at {self.endpoint} stopped answering")
            self._next += 1
            rid = self._next
            self._sock.send(msgpack.packb([rid, op, key, a, b], use_bin_type=True))
            deadline = time.monotonic() + self.answer_s
            while (left := deadline - time.monotonic()) > 0:
                if not self._sock.poll(int(left * 1000) + 1):
                    break
                try:
                    reply = msgpack.unpackb(self._sock.recv(), raw=True, max_bin_len=MAX_VALUE)
                except (ValueError, msgpack.UnpackException):
                    continue
                if isinstance(reply, list) and len(reply) == 3 and reply[0] == rid:  # an older one: late
                    return reply[2]
            self.gone = True
            raise StoreGone(f"the drafter group's store at {self.endpoint} did not answer within {self.answer_s:.0f}s")

    # torch.distributed.Store
    def clone(self) -> KeyStore:  # gloo asks for one (a client of its own)
        return KeyStore(self.endpoint, self._keys_dir, self.timeout.total_seconds(), self.answer_s)

    def set(self, key: str, value) -> None:
        self._call("set", _key(key), _value(value))

    def get(self, key: str) -> bytes:
        k = _key(key)
        return self._block_until(lambda: self._call("get", k), key)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", _key(key), int(amount))

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._call("cas", _key(key), _value(expected), _value(desired))

    def delete_key(self, key: str) -> bool:
        return bool(self._call("del", _key(key)))

    def num_keys(self) -> int:
        return self._call("num")

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", [_key(k) for k in keys]))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        ks = [_key(k) for k in keys]
        self._block_until(lambda: self._call("check", ks), ", ".join(keys), timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: list) -> None:
        for k, v in zip(keys, values):
            self.set(k, v)

    def _block_until(self, ready, what: str, timeout: timedelta | None = None):
        """ready()'s first answer that is not None or False, polled until the store's timeout."""
        limit = (timeout or self.timeout).total_seconds()
        deadline, pause = time.monotonic() + limit, 0.001
        while (got := ready()) is None or got is False:
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"wait timeout after {limit * 1000:.0f}ms, keys: {what}")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        return got

    def close(self) -> None:
        KeyStore._alive.discard(self)
        self._sock.close(linger=0)


def _key(key) -> bytes:
    return key.encode() if isinstance(key, str) else bytes(key)


def _value(value) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)  # torch passes bytes or a list of ints
