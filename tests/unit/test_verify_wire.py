"""The verify messages without processes: a request is checked against the target's limits, an
answer against the client's own call, before anything is kept (services/verify.py)."""

import pytest
import torch

from services import wire
from services.verify import Verified, VerifyLimits, VerifyRequest, _Assembly, reply_messages

LIMITS = VerifyLimits(max_prompt=16, max_block=4, max_length=40, vocab_size=100)


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

    from services.drafter.remote_eval import models_in_process

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
        "from services.drafter.remote_eval import RemoteSpecEval, models_in_process\n"
        "import services.drafter.spec_eval, services.drafter.speculative\n"
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
