"""The drafter group's store (services/drafter/group/keystore.py) and the agents' rendezvous over it
(rendezvous.py), attacked in process on loopback: real ZMQ sockets, real CURVE keys, a real gloo
group. Each attack is a handful of messages with a timeout of about a second."""

import pickle
import socket
import threading
import time
from datetime import timedelta

import msgpack
import pytest
import torch.distributed as dist
import zmq
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousTimeoutError

from services.drafter.group.keystore import MAX_VALUE, KeyStore, StoreGone, StoreServer
from services.drafter.group.rendezvous import KeyedRendezvous, MembershipLoop
from services.net.curve import generate_keys


@pytest.fixture
def keys(tmp_path):
    generate_keys(tmp_path / "keys")
    return str(tmp_path / "keys")


@pytest.fixture
def server(keys):
    s = StoreServer("tcp://127.0.0.1:0", keys)
    yield s
    s.close()


def until(condition, timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class Boom:
    """A pickle that would leave a file behind if anything loaded it."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_the_store_does_what_torch_asks_of_one(server, keys):
    s = KeyStore(server.endpoint, keys, timeout_s=1)
    s.set("a", "x")
    assert s.get("a") == b"x" and s.check(["a"]) and not s.check(["a", "b"])
    assert (s.add("n", 2), s.add("n", 3)) == (2, 5)
    assert s.compare_set("a", "x", "y") == b"y" and s.compare_set("a", "x", "z") == b"y"
    assert s.compare_set("new", "", "q") == b"q" and s.compare_set("none", "e", "q") == b"e"
    assert s.num_keys() == 3 and s.delete_key("new") and not s.delete_key("new")
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="wait timeout"):
        s.wait(["never"], timedelta(seconds=0.3))
    assert 0.3 <= time.monotonic() - t0 < 2


def gloo_rank(rank, endpoint, keys, out):
    store = dist.PrefixStore("round/0/workers/", KeyStore(endpoint, keys))
    pg = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=30))
    t = __import__("torch").tensor([rank + 1.0])
    pg.allreduce([t]).wait()
    out[rank] = t.item()


def test_a_gloo_group_meets_in_it(server, keys):
    out = {}
    threads = [threading.Thread(target=gloo_rank, args=(r, server.endpoint, keys, out)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out == {0: 3.0, 1: 3.0}


def plain_request(endpoint: str, op: str, key: bytes, a=None, configure=None) -> bytes | None:
    """One request from a client without the run's keys (or with what `configure` sets): its answer, or None."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if configure:
        configure(sock)
    sock.connect(endpoint)
    try:
        sock.send(msgpack.packb([1, op, key, a, None], use_bin_type=True))
        return sock.recv() if sock.poll(1000) else None
    finally:
        sock.close(linger=0)
        ctx.term()


def test_a_client_without_the_keys_cannot_read_or_write(server, keys, tmp_path):
    KeyStore(server.endpoint, keys).set("rdzv/secret", "1")
    assert plain_request(server.endpoint, "get", b"rdzv/secret") is None  # no CURVE at all
    assert plain_request(server.endpoint, "set", b"rdzv/forged", b"1") is None
    other = tmp_path / "other"  # CURVE, the server's public key, but a client key of its own
    generate_keys(other)

    def wrong_client(sock):
        sock.setsockopt(zmq.CURVE_SERVERKEY, open(f"{keys}/server.public", "rb").read().strip())
        sock.setsockopt(zmq.CURVE_PUBLICKEY, open(other / "client.public", "rb").read().strip())
        sock.setsockopt(zmq.CURVE_SECRETKEY, open(other / "client.secret", "rb").read().strip())

    assert plain_request(server.endpoint, "set", b"rdzv/forged", b"1", wrong_client) is None
    assert b"rdzv/forged" not in server.data and server.served == 1
    assert until(lambda: server.refused >= 3), server.refused  # each handshake refused and counted


def test_a_pickle_is_never_loaded_and_the_store_goes_on(server, keys, tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(Boom(marker))
    host, port = server.endpoint[len("tcp://") :].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=1) as raw:  # no keys, raw bytes
        raw.sendall(payload)
        time.sleep(0.3)
    ctx = zmq.Context()  # with the keys: the pickle as a message, then in a value
    sock = ctx.socket(zmq.DEALER)
    from services.net.curve import apply_client

    apply_client(sock, keys)
    sock.connect(server.endpoint)
    sock.send(payload)
    sock.send(msgpack.packb([1, "set", b"rdzv/x", b"1"], use_bin_type=True))  # wrong arity
    sock.send(msgpack.packb([2, "exec", b"rdzv/x", b"1", None], use_bin_type=True))  # unknown op
    sock.send(msgpack.packb([3, "add", b"rdzv/n", "1", None], use_bin_type=True))  # add of a string
    sock.send(msgpack.packb([4, "set", b"k" * 2000, b"1", None], use_bin_type=True))  # key too long
    sock.send(msgpack.packb([5, "set", b"big", b"x" * (MAX_VALUE + 1), None], use_bin_type=True))  # value too big
    assert until(lambda: server.dropped >= 6), server.dropped
    sock.close(linger=0)
    ctx.term()
    store = KeyStore(server.endpoint, keys, timeout_s=1)
    store.set("rdzv/state", payload)  # a key holder's pickle is kept as bytes and handed back as bytes
    assert store.get("rdzv/state") == payload and not marker.exists()
    assert server.data.keys() == {b"rdzv/state"}


class Recorder:
    """A loopback TCP proxy that keeps what the client sent, to send it again later."""

    def __init__(self, target: tuple[str, int]):
        self.target, self.sent = target, bytearray()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        client, _ = self.listener.accept()
        upstream = socket.create_connection(self.target)

        def pump(src, dst, keep):
            while data := src.recv(65536):
                keep and self.sent.extend(data)
                dst.sendall(data)

        threading.Thread(target=pump, args=(upstream, client, False), daemon=True).start()
        try:
            pump(client, upstream, True)
        except OSError:
            pass


def test_a_replayed_session_is_refused_and_counted(server, keys):
    host, port = server.endpoint[len("tcp://") :].rsplit(":", 1)
    proxy = Recorder((host, int(port)))
    client = KeyStore(f"tcp://127.0.0.1:{proxy.port}", keys, timeout_s=1, answer_s=2)
    client.set("rdzv/round", "7")  # a real key holder's write, through the proxy
    KeyStore(server.endpoint, keys).set("rdzv/round", "8")  # the group moved on
    refused = server.refused
    with socket.create_connection((host, int(port)), timeout=1) as raw:  # the same bytes again
        raw.sendall(bytes(proxy.sent))
        time.sleep(0.5)
    assert server.data[b"rdzv/round"] == b"8"  # CURVE's handshake is fresh each time: a replay gets nowhere
    assert until(lambda: server.refused > refused)


def agents(store_endpoint, keys, n=2, limit=2):
    return [
        KeyedRendezvous(
            KeyStore(store_endpoint, keys, timeout_s=5),
            "run",
            [f"10.0.0.{i}" for i in range(n)],
            i,
            29500,
            join_timeout_s=5,
            max_membership_restarts=limit,
        )
        for i in range(n)
    ]


def meet(handlers) -> list:
    out = [None] * len(handlers)

    def one(i):
        out[i] = handlers[i].next_rendezvous()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out


def background(fn):
    """fn in a thread; what it raises when the test ends it (a closed group) is expected."""

    def quietly():
        try:
            fn()
        except Exception:  # noqa: BLE001
            pass

    threading.Thread(target=quietly, daemon=True).start()


def test_agents_meet_in_rounds_and_a_forged_waiting_host_without_a_heartbeat_restarts_nothing(server, keys):
    a, b = agents(server.endpoint, keys)
    infos = meet([a, b])
    assert [(i.rank, i.world_size) for i in infos] == [(0, 2), (1, 2)] and a.round == b.round == 0
    infos[0].store.set("x", "1")  # the round's store: one for both agents
    assert infos[1].store.get("x") == b"1"
    b._stop.set()  # b's agent is gone: its heartbeat stops
    forger = KeyStore(server.endpoint, keys)  # a key holder writes b into the wait list
    forger.set("rdzv/run/host/1/round", "99")
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        assert a.num_nodes_waiting() == 0  # no restart: no heartbeat behind the entry
        time.sleep(0.25)
    forger.set("rdzv/run/host/1/round", pickle.dumps(Boom("/nonexistent/x")))
    assert a.num_nodes_waiting() == 0 and a.membership_restarts == 0 and a.bad >= 1  # not a number: counted


def test_a_host_that_rejoins_restarts_the_group_and_membership_restarts_are_limited(server, keys):
    a, b = agents(server.endpoint, keys, limit=1)
    meet([a, b])
    background(b.next_rendezvous)  # b left the group and waits in the next round
    assert until(lambda: a.num_nodes_waiting() > 0, 4) and a.membership_restarts == 1  # one restart of a's workers
    assert meet([a])[0] is not None and until(lambda: b.round == 1) and a.round == 1
    background(b.next_rendezvous)  # and again: past the limit
    with pytest.raises(MembershipLoop, match="limit supervise.max_restarts=1"):
        until(lambda: a.num_nodes_waiting() > 0, 4)
    a.shutdown()


def test_an_agent_that_comes_back_waits_in_a_new_round_and_the_others_join_it(server, keys):
    a, b = agents(server.endpoint, keys)
    meet([a, b])
    b._stop.set()  # b's host dies; its launcher comes back with a fresh agent
    b = agents(server.endpoint, keys)[1]
    background(b.next_rendezvous)
    assert until(lambda: a.num_nodes_waiting() > 0, 4)  # a restarts its workers for it
    assert meet([a])[0] is not None and until(lambda: b.round == 1) and a.round == 1


def test_a_closed_group_ends_a_waiting_agent(server, keys):
    a, b = agents(server.endpoint, keys)
    background(lambda: time.sleep(0.5) or b.shutdown())
    t0 = time.monotonic()
    with pytest.raises(RendezvousClosedError):
        a.next_rendezvous()
    assert 0.4 < time.monotonic() - t0 < 2


def test_an_agent_alone_waits_out_the_join_timeout_and_names_the_missing_host(server, keys):
    a = agents(server.endpoint, keys)[0]
    a.join_timeout_s = 0.5
    with pytest.raises(RendezvousTimeoutError, match="round 0: no agent of 10.0.0.1 joined"):
        a.next_rendezvous()


def test_a_value_too_big_is_refused_by_the_client_and_a_gone_store_fails_at_once(keys):
    s = StoreServer("tcp://127.0.0.1:0", keys)
    client = KeyStore(s.endpoint, keys, timeout_s=1, answer_s=0.5)
    with pytest.raises(ValueError, match="values up to"):
        client.set("big", b"x" * (MAX_VALUE + 1))
    s.close()
    with pytest.raises(StoreGone):
        client.check(["a"])
    t0 = time.monotonic()
    with pytest.raises(StoreGone, match="stopped answering"):  # the next call does not wait again
        client.check(["a"])
    assert time.monotonic() - t0 < 0.4  # not answer_s=0.5 again
