"""The two cores in one interpreter: the target's (services/target/core.py) answers requests with no
socket, and a drafter's (services/drafter/training/core.py) trains on what a target core serves over real ZMQ
(tests/inprocess.py: the target's real shell and core on a thread). And a batch-protocol scenario of
the integrity checks: an `error` claimed for a batch that exists is dropped and asked again.
The same protocol between real processes: tests/e2e/test_target_worker.py, test_drafter_zmq.py and
test_integrity.py (a same-uid takeover, a target with inf weights)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from services.data.batch import token_digest
from services.data.packed_data import PackedData, RowOrder
from services.drafter.modeling.target_head import model_and_head
from services.drafter.training.core import DrafterCore
from services.drafter.training.source import SourceError, SourceSettings, ZmqSource
from services.drafter.training.train import parameter_fingerprint
from services.net.transport import BatchServer, Request
from services.net.verify import VerifyRequest
from services.run import runspec
from services.run.config import load_config
from services.run.placement import Placement
from services.target.core import TargetCore
from services.target.replies import BatchReply, Dropped, ErrorReply, InfoReply, VerifyReply
from tests.assets import random_demo
from tests.inprocess import InProcessTarget
from tests.verify_targets import verify_overrides

SMALL = ["eval.num_prompts=0", "drafter.num_anchors=16", "transport.credits=1"]


def packed(run_dir, cfg) -> PackedData:
    (cache,) = [p for p in (run_dir / "data-cache").glob("*.safetensors") if ".digests." not in p.name]
    return PackedData(cache, RowOrder.from_config(cfg))


def test_the_target_core_answers_requests_with_no_socket(tmp_path):
    """info, a batch (its tokens the packed data's row g, captured), an error for a g out of range, and
    verify calls: an answer with the core's incarnation, an unknown session dropped and answered."""
    demo = random_demo()
    cfg = load_config(None, verify_overrides(demo, demo["model_path"]))
    spec = runspec.for_worker(cfg, tmp_path)
    core = TargetCore.load(cfg, spec, tmp_path, torch.device("cpu"), incarnation="inc-1")
    (info,) = core.answer(Request(b"d0", "info", -1, "train"))
    assert isinstance(info, InfoReply) and info.client == b"d0" and info.info["num_batches"] > 1
    (reply,) = core.answer(Request(b"d0", "batch", 1, "train"))
    assert isinstance(reply, BatchReply) and reply.batch.g == 1 and reply.ready is None
    row = packed(tmp_path, cfg).batch(1)
    assert token_digest(reply.batch.input_ids) == token_digest(row["input_ids"])
    assert reply.batch.hidden.shape == (cfg.data.pack_len, spec.target.hidden_size * len(spec.target.layer_ids))
    assert core.progress()["batches_served"] == 1 and core.progress()["samples_done"] > 0
    beyond = info.info["num_batches"] * cfg.run.epochs
    (error,) = core.answer(Request(b"d1", "batch", beyond, "train"))
    assert isinstance(error, ErrorReply) and error.client == b"d1" and f"{beyond}" in error.message
    opened = core.answer(Request(b"d0", "verify", -1, "train", verify=VerifyRequest("open", 1, 7, [5, 6, 7])))
    assert [type(r) for r in opened] == [VerifyReply] and opened[0].messages
    assert b"inc-1" in b"".join(bytes(f) for f in opened[0].messages[0])  # the core's incarnation
    lost = core.answer(Request(b"d1", "verify", -1, "train", verify=VerifyRequest("step", 2, 7, [5, 6])))
    assert [type(r) for r in lost] == [Dropped, VerifyReply] and lost[0].kind == "verify-session"
    assert core.verify.status()["verify_sessions"] == 1  # d1 cannot touch d0's session 7
    assert core.verify.status()["verify_refused"] == 1 and core.verify.status()["verify_requests"] == 2


def test_with_target_labels_a_batch_carries_the_stock_models_greedy_token_of_each_document(tmp_path):
    from transformers import AutoModelForCausalLM

    demo = random_demo()
    cfg = load_config(None, demo["overrides"] + ["target.labels_from_target=true", "data.pack_len=128"])
    core = TargetCore.load(cfg, runspec.for_worker(cfg, tmp_path), tmp_path, torch.device("cpu"), incarnation="i")
    (reply,) = core.answer(Request(b"d0", "batch", 3, "train"))
    batch = reply.batch
    assert batch.target_labels is not None and batch.target_labels.dtype == torch.int64
    model = AutoModelForCausalLM.from_pretrained(demo["model_path"], dtype=torch.float32).eval()
    start = 0
    for d in range(int(batch.document_ids.max()) + 1):  # each document alone through the stock HF model
        n = int((batch.document_ids == d).sum())
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids[start : start + n][None]).logits[0]
        assert torch.equal(batch.target_labels[start : start + n], logits.argmax(-1))
        start += n
    assert start == int((batch.document_ids >= 0).sum())


def test_a_drafter_core_trains_on_batches_a_target_core_serves_in_one_interpreter(tmp_path):
    """Batches 0..5 in order, each the packed data's row, trained with finite metrics, one optimizer step
    each, under the plan's lr schedule (warmup, then down to 0 at the plan's end); a stop leaves the
    target's status `stopped`."""
    demo = random_demo()
    target = InProcessTarget(tmp_path / "run", verify_overrides(demo, demo["model_path"]) + SMALL)
    target.start()
    cfg = target.cfg
    spec = runspec.for_worker(cfg, target.run_dir)
    model_cfg, head = model_and_head(spec, cfg.run.seed)
    core = DrafterCore.build(cfg, model_cfg, head, torch.device("cpu"), world_size=1, total_steps=6)
    source = ZmqSource(
        SourceSettings.from_config(cfg, Placement(target.run_dir, "drafter")), None, max_steps=6, check=core.check
    )
    try:
        plan = source.connect()
        source.check_targets(spec)
        core.plan(plan)
        rows = packed(target.run_dir, cfg)
        trained, lrs, weights = [], [], parameter_fingerprint(core.state.drafter)
        for batch in source:
            assert token_digest(batch.input_ids) == token_digest(rows.batch(batch.g)["input_ids"])
            m = core.step(batch)
            lrs.append(m["lr"])
            assert all(torch.isfinite(torch.tensor(m[k])) for k in ("loss", "tau", "grad_norm")), m
            assert m["tokens"] == int((batch.document_ids >= 0).sum()) and not m["skipped_step"]
            trained.append((batch.g, m["step"]))
        assert trained == [(g, g + 1) for g in range(6)]
        assert core.state.step == 6 and source.provenance_of(0)["incarnation"] == target.status()["incarnation"]
        assert parameter_fingerprint(core.state.drafter) != weights
        assert lrs[0] == max(lrs) == cfg.optimizer.lr and lrs == sorted(lrs, reverse=True) and lrs[-1] < lrs[0] / 2
        assert core.state.scheduler.get_last_lr()[0] == pytest.approx(0.0, abs=1e-12)  # the plan's end
        assert target.status()["batches_served"] == 6
    finally:
        source.close()
        target.stop()
    assert target.health.snapshot()["state"] == "stopped"


def test_an_error_for_a_batch_that_exists_is_dropped_and_asked_again(tmp_path):
    """A server that took target-0's socket over under its incarnation answers every request with an
    `error`: for a g the handshake says exists that is no real target's answer, so the drafter's source
    counts it (data-error-claim), asks again and trains the real batch once the target is back; an
    error for a g out of range still stops it."""
    demo = random_demo()
    w = InProcessTarget(tmp_path / "run", verify_overrides(demo, demo["model_path"]) + ["transport.credits=1"])
    first = w.start()
    source = ZmqSource(SourceSettings.from_config(w.cfg, Placement(w.run_dir, "drafter")), None)
    source.connect()
    claimed: list[int] = []

    def impostor_then_target_back():
        server = BatchServer(w.data_ep, w.cfg.transport, incarnation=first["incarnation"])  # the stopped target's
        while len(claimed) < 3:
            for request in server.poll(100):
                if request.kind == "batch":
                    server.send_error(request.client, request.g, f"batch g={request.g} out of range", request.split)
                    claimed.append(request.g)
        server.close()
        w.start()  # the real target again, on the same socket

    try:
        batches = iter(source)
        assert next(batches).g == 0  # from the real target: its incarnation is known
        assert source.total_batches > 1
        w.stop()
        thread = threading.Thread(target=impostor_then_target_back, daemon=True)
        thread.start()
        batch = next(batches)  # asked of the impostor first
        thread.join(timeout=180)
        assert set(claimed) == {1}, claimed
        drops = source.client.drops.counts["data-error-claim"]
        assert 1 <= drops <= len(claimed), (drops, claimed)
        assert batch.g == 1 and token_digest(batch.input_ids) == token_digest(
            packed(w.run_dir, w.cfg).batch(1)["input_ids"]
        )
        # a g out of range: the real target's error, which stops the source as before
        beyond = source.info.num_batches * w.cfg.run.epochs
        source.pending[beyond] = time.monotonic()
        source.client.request(0, beyond, incarnation=source.incarnations[0])
        with pytest.raises(SourceError, match=f"g={beyond}"):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                for event in source.client.poll(200):
                    source._handle(event)
        assert source.client.drops.counts["data-error-claim"] == drops
    finally:
        source.close()
        w.stop()
