"""services.net.transport in this process: the I/O thread, buffers, CURVE, and the drafter's checks on
what arrives. Between real processes: tests/e2e/test_transport.py."""

from __future__ import annotations

import threading
import time

import msgpack
import torch
import zmq

from services.data.batch import token_digest
from services.net import curve, wire
from services.net.batch_client import AnswerRejected, BatchArrived, BatchClient
from services.net.batch_stream import BufferPool, batch_messages, layout
from services.net.transport import BatchServer
from services.process.health import HealthServer
from tests.batches import CHUNK, collect, make_batch, same_batch, transport_cfg


def test_a_batch_for_a_drafter_that_is_gone_is_released(tmp_path):
    """And the log says what was dropped: a batch (its drafter will ask again), or a verify answer
    (its drafter stopped waiting and closed the socket)."""
    health = HealthServer(f"ipc://{tmp_path}/health", role="target", rank=0, gpu="cpu", stall_after_s=60)
    server = BatchServer("tcp://127.0.0.1:*", transport_cfg(), health)
    released = threading.Event()
    try:
        server.send_batch(b"no-such-drafter", make_batch(0), release=released.set)
        assert released.wait(5), "the batch's memory was never handed back"
        server.send_messages(b"gone-verifier", [wire.encode({"kind": "verify"})])
        assert server.flush(5)
        assert health.snapshot()["errors"] == [
            "drafter disconnected; batch dropped (it will ask again)",
            "drafter disconnected; verify answer dropped",
        ]
    finally:
        server.close()
        health.close()


def test_a_drafter_that_does_not_read_holds_up_nobody_else():
    """One drafter never reads: its queue fills. Another drafter still gets its batch at once."""
    cfg = transport_cfg(credits=1, max_batch_bytes=1 << 20)  # a short queue per drafter
    server = BatchServer("tcp://127.0.0.1:*", cfg)
    ctx = zmq.Context()
    stuck = ctx.socket(zmq.DEALER)
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.setsockopt(zmq.RCVBUF, 4096)
    stuck.connect(server.endpoint)
    reader = BatchClient([server.endpoint], cfg)
    try:
        stuck.send_multipart(wire.encode({"kind": "request", "want": "batch", "g": 0, "split": "train"}))
        reader.request(0, 7)
        clients = {}
        while len(clients) < 2:
            for request in server.poll(1000):
                clients[request.g] = request.client
        for g in range(40):  # far more than the stuck queue holds
            server.send_batch(clients[0], make_batch(g))
        start = time.monotonic()
        server.send_batch(clients[7], make_batch(7))
        events = []
        while not events and time.monotonic() - start < 10:
            events = reader.poll(100)
        assert events and same_batch(events[0].batch, make_batch(7))
        assert time.monotonic() - start < 5, "the reader waited on the stuck drafter"
    finally:
        reader.close()
        stuck.close(linger=0)
        ctx.term()
        server.close()


def test_close_after_the_io_thread_has_ended_is_clean():
    """close() may find the I/O thread already gone (it saw the closing flag first): waking it must not raise."""
    server = BatchServer("tcp://127.0.0.1:*", transport_cfg())
    server._closing.set()  # what close() does first; the thread may end before close() wakes it
    server._thread.join(timeout=5)
    assert not server._thread.is_alive()
    time.sleep(0.5)  # let ZMQ finish tearing down the closed end of the wake pipe
    server.close()


def test_layout_aligns_every_tensor():
    specs = [wire.spec_of(n, t) for n, t in make_batch(0).tensors().items()]
    offsets, total = layout(specs)
    assert all(o % 64 == 0 for o in offsets) and total >= sum(s.nbytes for s in specs)
    assert all(offsets[i] + specs[i].nbytes <= offsets[i + 1] for i in range(len(specs) - 1))


def test_buffer_pool_reuses_a_buffer_only_after_its_tensors_are_gone():
    pool = BufferPool(pin=False, keep=2)
    first = pool.get(4096)
    address, view = first.data_ptr(), first[100:200].view(torch.int32)
    del first
    second = pool.get(4096)
    assert second.data_ptr() != address  # a view of the first is still alive
    del view
    third = pool.get(4096)
    assert third.data_ptr() == address  # now it is free again
    assert pool.get(8192).data_ptr() not in (address, second.data_ptr())


def test_tcp_with_curve_keys_serves_key_holders_only(tmp_path):
    """With transport.curve_keys_dir set, tcp traffic is CURVE-encrypted and a drafter without the keys gets nothing."""
    keys = tmp_path / "keys"
    curve.generate_keys(keys)
    secure = transport_cfg(scheme="tcp", curve_keys_dir=str(keys))
    server = BatchServer("tcp://127.0.0.1:*", secure)
    good = BatchClient([server.endpoint], secure)
    stranger = BatchClient([server.endpoint], transport_cfg(scheme="tcp"))
    try:
        stranger.request(0, 1)
        good.request(0, 2)
        events, deadline = [], time.monotonic() + 20
        while not events and time.monotonic() < deadline:
            for request in server.poll(100):
                assert request.g == 2, "a request from a client without the key got through"
                server.send_batch(request.client, make_batch(request.g))
            events = good.poll(50)
        assert len(events) == 1 and same_batch(events[0].batch, make_batch(2))
        assert server.poll(500) == [] and stranger.poll(100) == []
    finally:
        good.close()
        stranger.close()
        server.close()


def test_a_batch_whose_ids_do_not_match_its_digest_is_dropped(tmp_path):
    """The digest is checked on arrival: a batch whose token ids changed on the way is not taken."""
    endpoint = f"ipc://{tmp_path}/t.data"
    server = BatchServer(endpoint, transport_cfg())
    client = BatchClient([endpoint], transport_cfg())
    try:
        client.request(0, 1)
        request = None
        while request is None:
            request = next(iter(server.poll(100)), None)
        messages = list(batch_messages(make_batch(1), "train", CHUNK, server.incarnation))
        header = msgpack.unpackb(messages[0][0])
        header["digest"] = token_digest(make_batch(2).input_ids)
        del header["v"], header["tensors"]
        server.send_frames(request.client, wire.encode(header))
        for frames in messages[1:]:
            server.send_frames(request.client, frames)
        assert collect(client, 1, timeout_s=3) == []
        assert client.drops.counts["data-reply"] == 1
    finally:
        client.close()
        server.close()


def test_a_batch_with_other_content_than_the_data_says_is_dropped_and_handed_on(tmp_path):
    """The request names the digest batch g must have: batch 0 relabelled as 1 (self-consistent, from
    the incarnation asked) is dropped as data-content, and the drafter is told at once."""
    endpoint = f"ipc://{tmp_path}/t.data"
    server = BatchServer(endpoint, transport_cfg())
    client = BatchClient([endpoint], transport_cfg())
    try:
        client.request(0, 1, incarnation=server.incarnation, digest=token_digest(make_batch(1).input_ids))
        request = None
        while request is None:
            request = next(iter(server.poll(100)), None)
        fake = make_batch(0)
        fake.g = 1
        server.send_batch(request.client, fake)
        server.send_batch(request.client, make_batch(1))
        events = collect(client, 2, timeout_s=5)
        assert [type(e) for e in events] == [AnswerRejected, BatchArrived], events
        rejected, arrived = events
        assert (rejected.target, rejected.split, rejected.g) == (0, "train", 1) and server.incarnation in rejected.why
        assert same_batch(arrived.batch, make_batch(1)) and client.drops.counts["data-content"] == 1
    finally:
        client.close()
        server.close()
