"""Real acceptance verified by a target worker served in this interpreter (tests/inprocess.py: its real
shell and core on the endpoints its process would bind; services/net/verify.py, target/verifying.py,
drafter/acceptance/remote_eval.py), on a tiny dense Qwen3 and a tiny Qwen3.5 hybrid (Gated DeltaNet + full
attention), random weights, fp32 on CPU.

Speculative decoding through the worker must equal plain greedy decoding (through the same worker)
on every prompt, for a random drafter (most drafts rejected: the rollback case) and a drafter that
is mostly right; the figures equal those of the same loop on the target loaded in this process.
Hostile verify messages are counted and dropped while the worker keeps serving batches. A target
process killed and restarted mid-eval: tests/e2e/test_verify.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

from services.drafter.modeling.target_head import from_target
from services.eval.local_spec_eval import LocalSpecEval
from services.net import wire
from services.net.batch_client import BatchArrived, BatchClient
from services.net.verify import VerifyError
from services.net.verify_client import VerifyClient
from services.run import runspec
from tests.assets import random_demo
from tests.inprocess import InProcessTarget
from tests.verify_targets import NEW, PROMPTS, MostlyRight, hybrid_model, remote_spec_eval, verify_overrides

pytestmark = pytest.mark.xdist_group("verify_inprocess")  # one pytest worker loads the two targets, once


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return random_demo()


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def worker(request, demo, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    path = demo["model_path"] if request.param == "dense" else hybrid_model(demo, root / "model")
    w = InProcessTarget(root / "run", verify_overrides(demo, path))
    w.start()
    yield w
    w.stop()


def test_speculative_decoding_through_the_worker_equals_greedy(worker):
    cfg = worker.cfg
    model_cfg, head = from_target(runspec.resolve(cfg))
    spec_eval = remote_spec_eval(cfg, worker.run_dir, 1, head, model_cfg, prompts=PROMPTS, max_new_tokens=NEW)
    try:
        assert len(spec_eval.prompts) == PROMPTS
        torch.manual_seed(0)
        random = spec_eval.run(spec_eval.proposer(None, model_cfg))  # random drafter: most drafts rejected
        assert spec_eval.rows  # every prompt on one session of rows: the target took them
        assert random["prompts"] == PROMPTS and random["skipped"] == 0
        assert random["lossless"] == PROMPTS and random["differences"] == [], random["differences"]
        assert random["acceptance_per_step"] < 1.5
        right = spec_eval.run(MostlyRight(spec_eval, model_cfg.block_size))
        assert right["lossless"] == PROMPTS and right["differences"] == []
        assert spec_eval.rows  # still on rows: no reply failed (one row's one-token block once did, on the wire)
        assert right["acceptance_per_step"] > 2.0  # B-1 = 3 per step but at the end
        # the references really are the target's greedy output: the same loop on the target loaded here
        local = LocalSpecEval(cfg, "cpu", prompts=PROMPTS, max_new_tokens=NEW)
        local_refs = local.references(PROMPTS)
        assert [r.tokens for r in local_refs] == [spec_eval._refs[i].tokens for i in range(PROMPTS)]
        torch.manual_seed(0)
        local_random = local.run(local.proposer(None, model_cfg))
        assert local_random["acceptance_per_step"] == pytest.approx(random["acceptance_per_step"])
        # and batched: every prompt at once, one packed target forward per step (services/eval/batched_decode.py)
        batched = LocalSpecEval(
            cfg,
            "cpu",
            prompts=PROMPTS,
            max_new_tokens=NEW,
            batch=PROMPTS,
            target=local.target,
            tokenizer=local.tokenizer,
        )
        assert [r.tokens for r in batched.references(PROMPTS)] == [r.tokens for r in local_refs]
        torch.manual_seed(0)
        batched_random = batched.evaluate(None, model_cfg, controls=True)
        assert batched_random["lossless"] == PROMPTS and batched_random["steps"] == local_random["steps"]
        assert batched_random["acceptance_per_step"] == pytest.approx(random["acceptance_per_step"])
        assert batched_random["repeat_last"]["lossless"] == PROMPTS
        # prompt by prompt (a target that cannot run rows): the same records, many more round trips
        before = worker.status()["verify_requests"]
        one_by_one = remote_spec_eval(cfg, worker.run_dir, 1, head, model_cfg, prompts=PROMPTS, max_new_tokens=NEW)
        one_by_one.rows = False
        try:
            torch.manual_seed(0)
            slow = one_by_one.run(one_by_one.proposer(None, model_cfg))
            assert [one_by_one._refs[i].tokens for i in range(PROMPTS)] == [r.tokens for r in local_refs]
        finally:
            one_by_one.close()
        assert (slow["steps"], slow["tokens"], slow["lossless"]) == (random["steps"], random["tokens"], PROMPTS)
        assert worker.status()["verify_requests"] - before > 2 * random["steps"] / PROMPTS
        status = worker.status()
        assert status["verify_requests"] > 0 and status["verify_sessions"] == 0  # every session closed
        assert status["bad_messages"] == 0
    finally:
        spec_eval.close()


def _send(sock, header: dict, tensors: dict | None = None) -> None:
    sock.send_multipart(wire.encode(header, tensors))


def test_hostile_verify_messages_are_counted_and_dropped(worker):
    cfg, before = worker.cfg, worker.status()["bad_message_kinds"]
    rogue = zmq.Context.instance().socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(worker.data_ep)
    head = {"kind": "verify", "id": 1, "session": 7, "incarnation": ""}
    ids = lambda n, dtype=torch.int64: {"ids": torch.ones(n, dtype=dtype)}
    hostile = [
        ({**head, "op": "explode"}, ids(3)),  # unknown op
        ({**head, "op": "open"}, ids(3, torch.float32)),  # wrong dtype
        ({**head, "op": "open"}, ids(cfg.data.pack_len + 1)),  # prompt longer than data.pack_len
        ({**head, "op": "open"}, {"ids": torch.tensor([1, 10**6])}),  # a token outside the vocabulary
        ({**head, "op": "open", "id": -1}, ids(3)),  # a bad id
        ({**head, "op": "open", "session": "x"}, ids(3)),  # a session that is no int
        ({**head, "op": "open", "features": 1}, ids(3)),  # features not a bool
        ({**head, "op": "open"}, {"ids": torch.ones(2, 2, dtype=torch.int64)}),  # not 1-d
        ({**head, "op": "close"}, ids(1)),  # close with tensors
        ({**head, "op": "open-rows"}, {**ids(3), "lengths": torch.tensor([1, 1])}),  # lengths not adding up
        ({**head, "op": "open-rows"}, {**ids(3), "lengths": torch.ones(3, 1, dtype=torch.int64)}),  # not 1-d
    ]
    for header, tensors in hostile:
        _send(rogue, header, tensors)
    rogue.send_multipart([msgpack.packb({"kind": "verify", "v": 1, "tensors": [], "op": "step"}), b"x"])
    # a well-formed step for a session nobody opened: counted, and answered (the drafter reopens at once)
    _send(rogue, {**head, "op": "step"}, ids(2))
    assert rogue.poll(20000), "no answer to a step on an unknown session"
    answer, _ = wire.decode(rogue.recv_multipart())
    assert answer["kind"] == "verified" and answer["code"] == "session" and answer["id"] == 1
    # a block longer than drafter.block_size on a real session
    client = VerifyClient([worker.data_ep], [worker.health_ep], cfg.transport, width=0, timeout_s=5)
    client.open(0, 1, [5, 6, 7], features=False)
    with pytest.raises(VerifyError):  # dropped: no answer, the call times out
        client.step(0, 1, [5] * (cfg.drafter.block_size + 1), features=False)
    client.close_session(0, 1)
    after = worker.status()["bad_message_kinds"]
    assert after.get("data-request", 0) - before.get("data-request", 0) == len(hostile) + 2
    assert after.get("verify-session", 0) - before.get("verify-session", 0) == 1
    # the worker keeps serving: batches and a fresh session
    batches = BatchClient([worker.data_ep], cfg.transport)
    try:
        batches.request(0, 0, incarnation=worker.status()["incarnation"])
        deadline, got = time.monotonic() + 60, []
        while not got and time.monotonic() < deadline:
            got = [e for e in batches.poll(200) if isinstance(e, BatchArrived)]
        assert got and got[0].batch.g == 0
    finally:
        batches.close()
    reply = client.open(0, 2, [5, 6, 7], features=False)
    assert reply.committed == 3 and len(reply.greedy) == 1
    client.close_session(0, 2)
    client.close()
    rogue.close()


def test_controls_decode_exactly_the_prompts_the_drafter_decoded(worker):
    """A second target that is not serving: its prompts (1, 3) are skipped; the controls run on
    prompts 0 and 2, the ones the drafter decoded, not on the first two (0 and a skipped 1)."""
    cfg = worker.cfg
    model_cfg, head = from_target(runspec.resolve(cfg))
    spec_eval = remote_spec_eval(cfg, worker.run_dir, 2, head, model_cfg, prompts=4, max_new_tokens=6)
    try:
        assert len(spec_eval.prompts) == 4
        result = spec_eval.evaluate(None, model_cfg, controls=True)
        assert result["prompts"] == 2 and result["skipped"] == 2 and result["indices"] == [0, 2]
        for name in ("repeat_last", "random"):
            control = result[name]
            assert control["skipped"] == 0 and control["indices"] == [0, 2], (name, control)
            assert control["prompts"] == 2 and control["lossless"] == 2
    finally:
        spec_eval.close()


def test_prompt_sets_of_run_eval_prompts_are_decoded_per_set(worker, tmp_path):
    """eval.prompts: two prompt files (chat lines, plain prompts) interleaved, figures per set;
    the worker decodes the very tokens the local eval renders, lossless on each set."""
    import dataclasses
    import json

    chats = [json.loads(line) for line in Path(worker.cfg.data.path).read_text().splitlines()[:4]]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": c["messages"]}) + "\n" for c in chats[:2]))
    (tmp_path / "plain.jsonl").write_text(
        "".join(json.dumps({"prompt": c["messages"][0]["content"]}) + "\n" for c in chats[2:])
    )
    files = [str(tmp_path / "chat.jsonl"), str(tmp_path / "plain.jsonl")]
    cfg = dataclasses.replace(worker.cfg, eval=dataclasses.replace(worker.cfg.eval, prompts=files))
    model_cfg, head = from_target(runspec.resolve(cfg))
    spec_eval = remote_spec_eval(cfg, worker.run_dir, 1, head, model_cfg, prompts=PROMPTS, max_new_tokens=NEW)
    try:
        assert spec_eval.names == ["chat", "plain", "chat", "plain"]
        local = LocalSpecEval(cfg, "cpu", prompts=PROMPTS, max_new_tokens=NEW, files=files)
        assert local.prompts == spec_eval.prompts and local.names == spec_eval.names
        assert spec_eval.prompts[0] != spec_eval.prompts[1]
        result = spec_eval.evaluate(None, model_cfg, controls=True)
        assert result["prompts"] == 4 and result["skipped"] == 0 and result["lossless"] == 4
        assert {name: r["prompts"] for name, r in result["sets"].items()} == {"chat": 2, "plain": 2}
        assert all(r["lossless"] == 2 for r in result["sets"].values())
        assert set(result["repeat_last"]["sets"]) == {"chat", "plain"} and result["held_out"] is None
    finally:
        spec_eval.close()


def test_launcher_eval_serves_a_checkpoint_reading_other_target_layers(worker):
    """A recipe variant with fewer draft layers reads fewer target layers than the run's config
    names: `launcher eval` of it beside the run's own checkpoints (one target, several checkpoints)
    captures what each reads, and a layer the target lacks is named (it stopped the whole evaluation
    of seven checkpoints on the GPU, results of five lost with it)."""
    import dataclasses

    cfg = worker.cfg
    model_cfg, _ = from_target(runspec.resolve(cfg))
    local = LocalSpecEval(cfg, "cpu", prompts=2, max_new_tokens=NEW, batch=2)
    layers = local.target.info.num_layers
    run_ids = list(local.target.info.layer_ids)
    other = dataclasses.replace(model_cfg, target_layer_ids=[0, layers - 1], num_target_layers=layers)
    assert other.target_layer_ids != run_ids
    torch.manual_seed(0)
    mine = local.evaluate(None, model_cfg)
    torch.manual_seed(0)
    theirs = local.evaluate(None, other)
    assert local.target.info.layer_ids == [0, layers - 1]
    assert theirs["prompts"] == 2 and theirs["lossless"] == 2 and mine["lossless"] == 2
    torch.manual_seed(0)
    again = local.evaluate(None, model_cfg)  # and back to the run's layers
    assert local.target.info.layer_ids == run_ids and again["steps"] == mine["steps"]
    with pytest.raises(ValueError, match=rf"reads target layers \[0, {layers}\].*{layers} layers"):
        local.evaluate(None, dataclasses.replace(other, target_layer_ids=[0, layers]))


def test_one_row_stepped_alone_is_answered(worker):
    """The last prompt still decoding steps alone: its reply's per-row tensors hold one element sliced
    from wider ones, which must still travel (the hybrid demo once fell back to prompt by prompt here)."""
    cfg = worker.cfg
    client = VerifyClient([worker.data_ep], [worker.health_ep], cfg.transport, width=0, timeout_s=20)
    bad_before = worker.status()["bad_messages"]  # (the hostile test's, on the same worker)
    try:
        opened = client.open_rows(0, 7, [[5, 6, 7], [8, 9, 10, 11], [12, 13]], features=False)
        assert len(opened.greedy) == 3
        for block in ([int(opened.greedy[1])], [int(opened.greedy[1]), 3]):  # one row, blocks of 1 and 2
            reply = client.step_rows(0, 7, [1], [block], features=False)
            assert len(reply.greedy) == len(block) and 1 <= int(reply.counts[0]) <= len(block)
    finally:
        client.close_session(0, 7)
    assert worker.status()["bad_messages"] == bad_before
