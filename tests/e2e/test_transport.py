"""services.net.transport between real processes over real ipc:// and tcp:// sockets.

Each target is `serve()` below, run in its own Python process; the test process is the drafter.
"""

from __future__ import annotations

import itertools
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

from services.data.batch import token_digest
from services.net import wire
from services.net.batch_client import AnswerRejected, BatchArrived, BatchClient, BatchRefused, InfoArrived
from services.net.batch_stream import batch_messages
from services.net.health_probe import probe
from services.net.transport import MAX_REQUEST_BYTES, BatchServer
from services.process.health import HealthServer
from tests.batches import CHUNK, N_BATCHES, SEQ, collect, make_batch, same_batch, transport_cfg
from tests.launching import REPO, child_env

pytestmark = pytest.mark.processes  # target processes; the drafter's side in this process


# --- the target process ----------------------------------------------------------


def serve(endpoint: str, health_endpoint: str, mode: str = "normal") -> None:
    """A target: serves make_batch(g) for g < N_BATCHES, errors beyond, until killed.

    mode "interleave": batches asked for together go out with their chunks interleaved.
    mode "liar":       every batch is preceded by a fixed sequence of bad messages (see LIES).
    mode "die":        the first batch stops after 2 chunks: the process SIGKILLs itself.
    mode "impostor":   answers every request with batch 0 relabelled as the batch asked for.
    """
    health = HealthServer(health_endpoint, role="target", rank=0, gpu="cpu", stall_after_s=60)
    server = BatchServer(endpoint, transport_cfg(), health)
    health.set(state="ready")
    print(server.endpoint, flush=True)
    while True:
        health.progress()
        pending = []
        for request in server.poll(100):
            if request.kind == "info":
                server.send_info(request.client, {"batches": N_BATCHES, "pid": os.getpid()})
            elif request.g >= N_BATCHES:
                server.send_error(request.client, request.g, f"g={request.g} is past the end", request.split)
            else:
                pending.append(request)
        if mode == "die" and pending:
            messages = batch_messages(make_batch(pending[0].g, pending[0].split), pending[0].split, CHUNK)
            for frames in itertools.islice(messages, 3):  # announcement + 2 chunks
                server.send_frames(pending[0].client, frames)
            time.sleep(0.5)  # let ZMQ push them out, then die mid-stream
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "interleave":
            streams = [batch_messages(make_batch(r.g, r.split), r.split, CHUNK) for r in pending]
            for round_robin in itertools.zip_longest(*streams):
                for request, frames in zip(pending, round_robin):
                    if frames is not None:
                        server.send_frames(request.client, frames)
            continue
        for request in pending:
            if mode == "impostor":
                fake = make_batch(0, request.split)
                fake.g = request.g
                server.send_batch(request.client, fake, request.split)
                continue
            if mode == "liar":
                for frames in lies(request.g, request.split):
                    server.send_frames(request.client, frames)
            server.send_batch(request.client, make_batch(request.g, request.split), request.split)


def lies(g: int, split: str) -> list[list]:
    """Bad messages a hostile target sends before each good batch. See EXPECTED_LIES."""
    key = {"g": g, "split": split}
    good = list(batch_messages(make_batch(g, split), split, CHUNK))
    wrong_length = make_batch(g, split)
    wrong_length.input_ids = torch.arange(SEQ + 1)  # fields disagree: BatchError at the end
    return [
        [b"not msgpack \xc1"],  # reply
        [msgpack.packb({"v": 99, "kind": "batch", "tensors": []})],  # reply
        list(batch_messages(make_batch(g + 100), split, CHUNK))[0],  # unrequested
        wire.encode(
            {"kind": "chunk", **key, "offset": 0}, {"bytes": torch.zeros(8, dtype=torch.uint8)}
        ),  # reply: no announcement
        wire.encode(
            {
                "kind": "batch",
                **key,
                "stream": [{"name": "hidden", "dtype": "bf16", "shape": [1_000_000, 4096], "nbytes": 8_192_000_000}],
            }
        ),  # reply: over max_batch_bytes
        wire.encode(
            {"kind": "batch", **key, "stream": [{"name": "evil", "dtype": "uint8", "shape": [4], "nbytes": 4}]}
        ),  # reply: not a batch field
        good[0],
        wire.encode(
            {"kind": "chunk", **key, "offset": 12_345}, {"bytes": torch.zeros(8, dtype=torch.uint8)}
        ),  # reply: out of order
        wire.encode({"kind": "info", "info": {"x": 1}}),  # unrequested
        wire.encode({"kind": "error", "g": g + 200, "split": split, "message": "?"}),  # unrequested
        *batch_messages(wrong_length, split, CHUNK),  # reply (BatchError)
    ]


EXPECTED_LIES = {"data-reply": 7, "data-unrequested": 3}


# --- helpers for the drafter side ---------------------------------------------------


class Target:
    def __init__(self, tmp_path: Path, scheme: str, name: str, mode: str = "normal", endpoint: str | None = None):
        sock_dir = tmp_path / "sock"
        sock_dir.mkdir(mode=0o700, exist_ok=True)
        self.health = f"ipc://{sock_dir}/{name}.health"
        endpoint = endpoint or (f"ipc://{sock_dir}/{name}.data" if scheme == "ipc" else "tcp://127.0.0.1:*")
        code = "import json, sys; from tests.e2e.test_transport import serve; serve(*json.loads(sys.argv[1]))"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, json.dumps([endpoint, self.health, mode])],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        assert ready, "target process did not start within 60 s"
        self.endpoint = self.proc.stdout.readline().strip()
        assert self.endpoint.startswith(scheme), self.endpoint

    def status(self) -> dict:
        code, status, reason = probe(self.health, 5)
        assert code == 0, reason
        return status

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def targets():
    started: list[Target] = []
    yield started
    for target in started:
        target.stop()


def half_received(client: BatchClient) -> list[tuple[int, str, int]]:
    """(target, split, g) of the batches the client has half received right now."""
    with client._lock:
        return sorted(client._partials)


# --- tests -----------------------------------------------------------------------------


@pytest.mark.parametrize("scheme, modes", [("ipc", ["normal", "interleave"]), ("tcp", ["interleave"])])
def test_batches_arrive_complete_and_bit_identical(tmp_path, targets, scheme, modes):
    for i, mode in enumerate(modes):
        targets.append(Target(tmp_path, scheme, f"target-{i}", mode))
    client = BatchClient([t.endpoint for t in targets], transport_cfg())
    try:
        T = len(targets)
        for t in range(T):
            client.request_info(t)
        for g in range(6):  # all six in flight at once
            client.request(g % T, g)
        client.request(1 % T, 1, split="eval")
        client.request(0, 99)  # past the end: an error, not a hang
        events = collect(client, T + 6 + 1 + 1)
        infos = {e.target: e.info for e in events if isinstance(e, InfoArrived)}
        batches = {(e.split, e.batch.g): (e.target, e.batch) for e in events if isinstance(e, BatchArrived)}
        errors = [e for e in events if isinstance(e, BatchRefused)]
        assert sorted(infos) == list(range(T)) and all(i["batches"] == N_BATCHES for i in infos.values())
        assert sorted(batches) == sorted([("train", g) for g in range(6)] + [("eval", 1)])
        for (split, g), (target, batch) in batches.items():
            assert target == g % T
            assert same_batch(batch, make_batch(g, split)), (split, g)
            # views into one reassembly buffer: no copy after reassembly
            assert batch.hidden.untyped_storage().data_ptr() == batch.input_ids.untyped_storage().data_ptr()
        assert [(e.target, e.g, e.message) for e in errors] == [(0, 99, "g=99 is past the end")]
        assert not client.drops.counts
        assert sum(t.status()["bad_messages"] for t in targets) == 0
    finally:
        client.close()


def test_garbage_sent_to_a_target_is_counted_and_dropped(tmp_path, targets):
    target = Target(tmp_path, "ipc", "target-0")
    targets.append(target)
    ctx = zmq.Context()
    hostile = ctx.socket(zmq.DEALER)
    hostile.setsockopt(zmq.LINGER, 0)
    hostile.connect(target.endpoint)
    garbage = [
        [b"\xc1 not msgpack"],
        [msgpack.packb({"v": 2, "kind": "request", "want": "batch", "g": 0, "split": "train", "tensors": []})],
        wire.encode({"kind": "batch", "g": 0, "split": "train"}),  # a target only takes requests
        wire.encode({"kind": "request", "want": "everything"}),
        wire.encode({"kind": "request", "want": "batch", "g": -1, "split": "train"}),
        wire.encode({"kind": "request", "want": "batch", "g": True, "split": "train"}),
        wire.encode({"kind": "request", "want": "batch", "g": 0, "split": "test"}),
        wire.encode({"kind": "request", "want": "batch", "g": 0, "split": "train"}, {"x": torch.zeros(4)}),
        [b"", b"", b""],
    ]
    try:
        for frames in garbage:
            hostile.send_multipart(frames)
        huge = ctx.socket(zmq.DEALER)  # over the target's MAXMSGSIZE: ZMQ drops the peer itself
        huge.setsockopt(zmq.LINGER, 0)
        huge.connect(target.endpoint)
        huge.send(b"\x00" * (MAX_REQUEST_BYTES + 1))
        client = BatchClient([target.endpoint], transport_cfg())
        try:
            client.request(0, 3)
            events = collect(client, 1)
            assert len(events) == 1 and same_batch(events[0].batch, make_batch(3))
        finally:
            client.close()
        status = target.status()
        assert status["bad_messages"] == len(garbage)
        assert status["bad_message_kinds"] == {"data-request": len(garbage)}
        assert target.proc.poll() is None
        huge.close(linger=0)
    finally:
        hostile.close(linger=0)
        ctx.term()


def test_a_lying_target_is_counted_and_dropped_by_the_drafter(tmp_path, targets):
    targets.append(Target(tmp_path, "ipc", "liar", mode="liar"))
    health = HealthServer(f"ipc://{tmp_path}/sock/drafter.health", role="drafter", rank=0, gpu="cpu")
    client = BatchClient([targets[0].endpoint], transport_cfg(), health)
    try:
        client.request(0, 2)
        client.request(0, 5, split="eval")
        events = collect(client, 4)  # two batches, and a "rejected" per unrequested batch
        time.sleep(0.3)
        events += client.poll(0)  # nothing more may come
        batches = [e for e in events if isinstance(e, BatchArrived)]
        assert sorted((e.split, e.batch.g) for e in batches) == [("eval", 5), ("train", 2)]
        assert all(same_batch(e.batch, make_batch(e.batch.g, e.split)) for e in batches)
        # a batch nobody asked for says whoever answers may not be the target: the source asks afresh
        rejected = sorted((e.split, e.g) for e in events if isinstance(e, AnswerRejected))
        assert rejected == [("eval", 105), ("train", 102)]
        assert len(events) == 4
        expected = {kind: 2 * n for kind, n in EXPECTED_LIES.items()}  # two batches, two rounds of lies
        assert dict(client.drops.counts) == expected
        assert health.snapshot()["bad_message_kinds"] == expected
    finally:
        client.close()
        health.close()


@pytest.mark.parametrize("scheme", ["ipc", "tcp"])
def test_target_killed_mid_stream_and_restarted(tmp_path, targets, scheme):
    first = Target(tmp_path, scheme, "target-0", mode="die")
    targets.append(first)
    client = BatchClient([first.endpoint], transport_cfg())
    try:
        client.request(0, 4)
        assert first.proc.wait(30) == -signal.SIGKILL
        assert client.poll(300) == []  # two chunks came; no batch
        assert half_received(client) == [(0, "train", 4)]
        second = Target(tmp_path, scheme, "target-0", endpoint=first.endpoint)
        targets.append(second)
        client.forget(0)
        assert half_received(client) == []
        client.request(0, 4)
        events = collect(client, 1)
        (arrived,) = events
        assert isinstance(arrived, BatchArrived) and (arrived.target, arrived.split) == (0, "train")
        assert same_batch(arrived.batch, make_batch(4))
        assert not client.drops.counts
    finally:
        client.close()


# --- in-process pieces ---------------------------------------------------------------------


def test_a_replaced_target_is_noticed_and_its_impostor_ignored(tmp_path, targets):
    """Issue 19, 1: a local process kills the target and binds its ipc path at once. Its batches
    (relabelled copies of batch 0) carry another incarnation than the one asked for: dropped and
    counted. When the real target is back, the drafter connects afresh and gets the real batch."""
    real = Target(tmp_path, "ipc", "target-0")
    targets.append(real)
    client = BatchClient([real.endpoint], transport_cfg())
    try:
        first = real.status()["incarnation"]
        assert first.startswith(f"{real.proc.pid}-")
        client.request(0, 0, incarnation=first)
        (event,) = collect(client, 1)
        assert same_batch(event.batch, make_batch(0))
        assert event.provenance == {"incarnation": first, "digest": token_digest(make_batch(0).input_ids)}

        real.proc.kill()
        real.proc.wait(10)
        impostor = Target(tmp_path, "ipc", "target-0", mode="impostor", endpoint=real.endpoint)
        targets.append(impostor)
        client.request(0, 3, incarnation=first)  # the drafter still believes in the first target
        deadline, rejected = time.monotonic() + 20, []
        while not client.drops.counts["data-incarnation"] and time.monotonic() < deadline:
            events = client.poll(200)
            assert all(isinstance(e, AnswerRejected) for e in events), "a batch from the impostor was taken"
            rejected += events
        assert client.drops.counts["data-incarnation"] >= 1
        rejected += client.poll(200)  # the drop is handed on, so the drafter asks again at once
        assert rejected and rejected[0] == AnswerRejected(0, "train", 3, rejected[0].why), rejected

        back = Target(tmp_path, "ipc", "target-0", endpoint=real.endpoint)  # the supervisor's restart
        targets.append(back)
        second = back.status()["incarnation"]
        assert second != first and impostor.proc.poll() is None  # the impostor still holds the old connection
        client.reconnect(0)
        client.request(0, 3, incarnation=second)
        events = collect(client, 1)
        assert len(events) == 1 and same_batch(events[0].batch, make_batch(3)), events
        assert events[0].provenance["incarnation"] == second
    finally:
        client.close()
