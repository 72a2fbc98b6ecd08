"""The verify messages without processes: a request is checked against the target's limits, an
answer against the client's own call, before anything is kept (services/net/verify.py)."""

import pytest
import torch

from services.net import wire
from services.net.verify import Verified, VerifyLimits, VerifyRequest, reply_messages
from services.net.verify_client import _Assembly

LIMITS = VerifyLimits(max_prompt=16, max_block=4, max_length=40, vocab_size=100, max_rows=3)


def parsed(frames):
    header, tensors = wire.decode(frames, 1 << 20)
    return VerifyRequest.from_wire(header, tensors, LIMITS)


def request_frames(op, call_id, session, incarnation, ids=None, features=True):
    return VerifyRequest(op, call_id, session, ids or [], features, incarnation).to_wire()


def test_a_good_request_parses_and_each_bad_field_is_named():
    r = parsed(request_frames("step", 3, 9, "inc", [1, 2, 3]))
    assert (r.op, r.id, r.session, r.ids, r.features) == ("step", 3, 9, [1, 2, 3], True)
    bad = {
        "ids": request_frames("open", 1, 1, "", list(range(17))),  # longer than max_prompt
        "block": request_frames("step", 1, 1, "", [1] * 5),  # longer than max_block
        "vocab": request_frames("open", 1, 1, "", [1, 100]),
        "op": wire.encode({"kind": "verify", "op": "run", "id": 1, "session": 1}),
        "id": wire.encode({"kind": "verify", "op": "close", "id": True, "session": 1}),
        "features": wire.encode(
            {"kind": "verify", "op": "open", "id": 1, "session": 1, "features": "yes"},
            {"ids": torch.ones(2, dtype=torch.int64)},
        ),
        "dtype": wire.encode(
            {"kind": "verify", "op": "open", "id": 1, "session": 1}, {"ids": torch.ones(2, dtype=torch.int32)}
        ),
    }
    for frames in bad.values():
        with pytest.raises(wire.WireError):
            parsed(frames)
    named = {
        "'op'": wire.encode({"kind": "verify", "op": "run", "id": 1, "session": 1}),
        "'id'": wire.encode({"kind": "verify", "op": "close", "id": True, "session": 1}),
        "'session'": wire.encode({"kind": "verify", "op": "close", "id": 1, "session": -1}),
        "'incarnation'": wire.encode({"kind": "verify", "op": "close", "id": 1, "session": 1, "incarnation": 7}),
        "'features'": wire.encode({"kind": "verify", "op": "close", "id": 1, "session": 1, "features": 1}),
        "'ids'": wire.encode(
            {"kind": "verify", "op": "open", "id": 1, "session": 1}, {"ids": torch.ones(2, dtype=torch.int32)}
        ),
    }
    for field, frames in named.items():
        with pytest.raises(wire.WireError, match=field):
            parsed(frames)
    with pytest.raises(wire.WireError, match="does not serve"):
        header, tensors = wire.decode(request_frames("close", 1, 1, ""), 0)
        VerifyRequest.from_wire(header, tensors, None)


def _answer(op, sent, committed, rows, width=8, chunk_bytes=64):
    request = VerifyRequest(op, 5, 2, [], True)
    n = 1 if op == "open" else sent
    features = torch.arange(rows * width, dtype=torch.float32).reshape(rows, width)
    return reply_messages(
        request,
        "inc",
        committed,
        torch.zeros(n, dtype=torch.int64),
        torch.ones(n),
        torch.zeros(n),
        features,
        chunk_bytes,
    ), features


def _receive(messages, op, sent, width=8):
    assembly = _Assembly(op, sent, width, True)
    done = False
    for frames in messages:
        header, tensors = wire.decode(frames)
        done = assembly.add(Verified.from_wire(header, tensors))
    return done, assembly.reply


def test_a_prompt_answer_in_parts_is_put_back_together():
    messages, features = _answer("open", 10, 10, 10)  # 32 bytes a row, 64-byte parts: 5 parts
    assert len(messages) == 5
    done, reply = _receive(messages, "open", 10)
    assert done and reply.committed == 10 and torch.equal(reply.features, features)


def test_answers_that_disagree_with_the_call_are_refused():
    messages, _ = _answer("open", 10, 10, 10)
    with pytest.raises(wire.WireError, match="part"):
        _receive([messages[0], messages[2]], "open", 10)  # a part missing
    with pytest.raises(wire.WireError, match="committed"):
        _receive(_answer("step", 4, 5, 5)[0], "step", 4)  # committed more than was sent
    with pytest.raises(wire.WireError, match="committed"):
        _receive(_answer("open", 10, 9, 9)[0], "open", 10)  # a prefill commits the whole prompt
    with pytest.raises(wire.WireError, match="width"):
        _receive(_answer("step", 4, 2, 2)[0], "step", 4, width=16)
    with pytest.raises(wire.WireError, match="rows"):
        _receive(_answer("step", 4, 2, 3)[0], "step", 4)  # more feature rows than committed tokens


def test_counting_models_in_the_process_survives_dead_weak_proxies():
    """torch.compile on CUDA leaves weakref proxies whose objects are gone; isinstance on one raises
    ReferenceError, which once crashed drafter rank 0's eval (the same error twice: the run failed)."""
    import gc
    import weakref

    from services.drafter.acceptance.remote_eval import models_in_process

    class Thing:
        pass

    gc.collect()
    alive = models_in_process()  # models other tests of this session still hold
    thing = Thing()
    holder = [weakref.proxy(thing)]
    del thing
    with pytest.raises(ReferenceError):
        isinstance(holder[0], int)
    assert models_in_process() == alive


@pytest.mark.processes
def test_the_drafters_evaluation_registers_no_pytree_class_after_its_worker_is_imported():
    """Every graph the drafter compiled guards on the number of classes registered with torch's
    pytree; an import at the first evaluation that registered one recompiled flex attention (on CUDA,
    after the first two evaluations). A fresh process, as the drafter worker is."""
    import subprocess
    import sys

    code = (
        "import sys, torch.utils._pytree as pytree\n"
        "import services.drafter.worker\n"
        "before = set(pytree.SUPPORTED_NODES)\n"
        "from services.drafter.acceptance.remote_eval import RemoteSpecEval, models_in_process\n"
        "import services.drafter.acceptance.spec_eval, services.drafter.acceptance.speculative\n"
        "print(models_in_process(), len(set(pytree.SUPPORTED_NODES) - before),\n"
        "      'transformers.modeling_utils' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0", "0", "False"]


def test_the_verify_messages_round_trip_and_each_bad_answer_field_is_named():
    request = VerifyRequest("step", 3, 9, [4, 5], False, "inc")
    assert parsed(request.to_wire()) == request
    assert parsed(VerifyRequest("close", 3, 9, [], True, "inc").to_wire()).ids == []
    messages, _ = _answer("step", 4, 2, 2)
    header, tensors = wire.decode(messages[0])
    reply = Verified.from_wire(header, tensors)
    assert (
        reply.op,
        reply.id,
        reply.session,
        reply.incarnation,
        reply.committed,
        reply.part,
        reply.parts,
        reply.row,
    ) == ("step", 5, 2, "inc", 2, 0, 1, 0)
    frames = Verified("open", 5, 2, "inc", error="x" * 2000, code="session").to_wire()
    refusal = Verified.from_wire(*wire.decode(frames))
    assert (refusal.error, refusal.code) == ("x" * 1000, "session")
    good = {
        "kind": "verified",
        "op": "step",
        "id": 5,
        "session": 2,
        "incarnation": "inc",
        "committed": 2,
        "part": 0,
        "parts": 1,
        "row": 0,
    }
    for name, value in [
        ("op", "run"),
        ("id", "5"),
        ("session", None),
        ("incarnation", 1),
        ("committed", -1),
        ("part", 1.0),
        ("parts", True),
        ("row", -2),
    ]:
        with pytest.raises(wire.WireError, match=f"'{name}'"):
            Verified.from_wire(*wire.decode(wire.encode({**good, name: value})))


def rows_frames(op, ids, lengths, rows=(), call_id=4, session=2):
    return VerifyRequest(op, call_id, session, ids, True, "inc", list(lengths), list(rows)).to_wire()


def test_a_rows_request_parses_and_each_bad_size_is_named():
    """Many prompts in one session: the prompts' (blocks') lengths add up to the ids, at most
    max_rows of them; a step's blocks are of one length, its rows ascending."""
    r = parsed(rows_frames("open-rows", [1, 2, 3, 4, 5], [2, 3]))
    assert (r.op, r.ids, r.lengths, r.rows) == ("open-rows", [1, 2, 3, 4, 5], [2, 3], [])
    r = parsed(rows_frames("step-rows", [1, 2, 3, 4], [2, 2], [0, 2]))
    assert (r.lengths, r.rows) == ([2, 2], [0, 2]) and parsed(r.to_wire()) == r
    bad = {
        "'lengths'.*1..3": rows_frames("open-rows", [1] * 4, [1, 1, 1, 1]),  # more rows than max_rows
        "adding up": rows_frames("open-rows", [1, 2, 3], [1, 1]),
        "each 1..16": rows_frames("open-rows", [1] * 17, [17]),  # a prompt past max_prompt
        "each 1..4": rows_frames("step-rows", [1] * 5, [5], [0]),  # a block past max_block
        "one length": rows_frames("step-rows", [1, 2, 3], [1, 2], [0, 1]),
        "ascending": rows_frames("step-rows", [1, 2], [1, 1], [1, 0]),
        "'rows'": rows_frames("step-rows", [1, 2], [1, 1], [0]),  # a row per block
        "outside": rows_frames("open-rows", [1, 100], [2]),  # a token outside the vocabulary
        "tensors": wire.encode(  # a rows op without its lengths
            {"kind": "verify", "op": "open-rows", "id": 1, "session": 1}, {"ids": torch.ones(2, dtype=torch.int64)}
        ),
    }
    for match, frames in bad.items():
        with pytest.raises(wire.WireError, match=match):
            parsed(frames)


def _rows_answer(op, lengths, counts, q=1, width=4):
    """An answer to a rows call: a greedy token per prompt (open-rows) or per block position."""
    n = len(lengths) if op == "open-rows" else len(lengths) * q
    features = torch.arange(sum(counts) * width, dtype=torch.float32).reshape(-1, width)
    request = VerifyRequest(op, 5, 2, [], True, "inc", list(lengths))
    tensors = torch.zeros(n, dtype=torch.int64), torch.ones(n), torch.zeros(n)
    counts = torch.tensor(counts, dtype=torch.int64)
    return reply_messages(request, "inc", int(counts.sum()), *tensors, features, 32, counts=counts), features


def _receive_rows(messages, op, lengths, width=4):
    assembly = _Assembly(op, sum(lengths), width, True, list(lengths))
    done = False
    for frames in messages:
        done = assembly.add(Verified.from_wire(*wire.decode(frames)))
    return done, assembly.reply


def test_a_rows_answer_is_put_back_together_and_checked_against_the_call():
    messages, features = _rows_answer("open-rows", [2, 3], [2, 3])
    done, reply = _receive_rows(messages, "open-rows", [2, 3])
    assert done and reply.counts == [2, 3] and reply.committed == 5 and torch.equal(reply.features, features)
    messages, features = _rows_answer("step-rows", [4, 4], [1, 4], q=4)
    done, reply = _receive_rows(messages, "step-rows", [4, 4])
    assert done and reply.counts == [1, 4] and len(reply.greedy) == 8 and torch.equal(reply.features, features)
    with pytest.raises(wire.WireError, match="counts"):  # a prefill commits each prompt whole
        _receive_rows(_rows_answer("open-rows", [2, 3], [3, 2])[0], "open-rows", [2, 3])
    with pytest.raises(wire.WireError, match="counts"):  # a row committed more than its block
        _receive_rows(_rows_answer("step-rows", [2, 2], [3, 1], q=2)[0], "step-rows", [2, 2])
    with pytest.raises(wire.WireError, match="counts"):  # counts of another call's rows
        _receive_rows(_rows_answer("step-rows", [2, 2, 2], [1, 1, 1], q=2)[0], "step-rows", [2, 2])
