"""services.net.wire: round trips of every dtype, zero-copy on both sides, and every way a message can lie."""

from __future__ import annotations

import math
import tracemalloc

import msgpack
import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.net import wire
from services.net.wire import WireError, decode, encode

SHAPES = [(), (0,), (3, 0, 2), (7,), (4, 5), (2, 3, 4)]


def random_tensor(dtype: torch.dtype, shape: tuple, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=gen, dtype=torch.int64).to(
        dtype
    )


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (NaN-safe): equal dtype, shape and raw bytes."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and bytes(a.reshape(-1).clone(memory_format=torch.contiguous_format).view(torch.uint8).numpy())
        == bytes(b.reshape(-1).clone(memory_format=torch.contiguous_format).view(torch.uint8).numpy())
    )


def as_bytes(frames) -> list[bytes]:
    return [bytes(f) for f in frames]


def test_dtype_names_are_the_ones_docs_wire_md_lists():
    # one table (services/run/dtypes.py) gives the wire, target.dtype and export --dtype their names
    from services.drafter.checkpoints import export
    from services.run.config import TARGET_DTYPES
    from services.target.model import model

    assert list(wire.DTYPES) == ["bf16", "fp16", "fp32", "fp64", "int8", "int16", "int32", "int64", "uint8", "bool"]
    assert wire.DTYPES["bf16"] is torch.bfloat16 and wire.DTYPE_NAMES[torch.float32] == "fp32"
    assert tuple(model.DTYPES) == TARGET_DTYPES and model.DTYPES["fp16"] is model.DTYPES["float16"] is torch.float16
    assert list(export.DTYPES) == ["bfloat16", "float16", "float32"]


@pytest.mark.parametrize("dtype", list(wire.DTYPES.values()), ids=list(wire.DTYPES))
def test_round_trip_every_dtype_and_shape(dtype):
    tensors = {f"t{i}": random_tensor(dtype, shape, seed=i) for i, shape in enumerate(SHAPES)}
    header, out = decode(as_bytes(encode({"kind": "batch", "g": 7, "note": "x"}, tensors)))
    assert header == {"kind": "batch", "g": 7, "note": "x", "v": wire.VERSION}
    assert list(out) == list(tensors)
    for name, tensor in tensors.items():
        assert same_bits(out[name], tensor), name


def test_non_contiguous_inputs_arrive_contiguous_and_equal():
    base = random_tensor(torch.bfloat16, (6, 8))
    tensors = {
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "expanded": torch.arange(3).expand(4, 3),
        "corner": base[2:, 2:],
        "offset": base[2:],
        # one or no element of a column: "contiguous", yet with the parent's stride (a single row's index)
        "one of a column": torch.arange(4).view(1, 4)[:, 1],
        "none of a column": torch.arange(4).view(1, 4)[:0, 1],
    }
    assert not any(tensors[n].is_contiguous() for n in ("transposed", "strided", "expanded", "corner"))
    _, out = decode(as_bytes(encode({"kind": "info"}, tensors)))
    for name, tensor in tensors.items():
        assert out[name].is_contiguous() and same_bits(out[name], tensor.contiguous()), name


def test_bf16_travels_as_raw_bytes_including_nan_and_inf():
    bits = torch.tensor([0x7FC1, 0x7F80, 0xFF80, 0x0001, 0x8000, 0x3F80], dtype=torch.int32).to(torch.int16)
    tensor = bits.view(torch.bfloat16)
    _, out = decode(as_bytes(encode({"kind": "batch"}, {"h": tensor})))
    assert torch.equal(out["h"].view(torch.int16), bits)


def test_encode_makes_no_copy_of_a_contiguous_tensor():
    tensor = random_tensor(torch.float32, (1000,))
    frames = encode({"kind": "batch"}, {"x": tensor})
    assert np.frombuffer(frames[1], dtype=np.uint8).ctypes.data == tensor.data_ptr()


def test_decode_makes_no_copy_of_received_zmq_frames():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://wire-test")
        b.connect("inproc://wire-test")
        sent = {"hidden": random_tensor(torch.bfloat16, (64, 512)), "ids": torch.arange(64)}
        a.send_multipart(encode({"kind": "batch", "g": 1}, sent), copy=False)
        frames = b.recv_multipart(copy=False)
        header, out = decode(frames)
        assert header["g"] == 1
        assert out["hidden"].data_ptr() == np.frombuffer(frames[1].buffer, dtype=np.uint8).ctypes.data
        assert same_bits(out["hidden"], sent["hidden"]) and torch.equal(out["ids"], sent["ids"])
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()


@pytest.mark.parametrize(
    "header, tensors, words",
    [
        ({"kind": "nope"}, {}, "kind"),
        ({"kind": ["batch"]}, {}, "kind"),
        ({"kind": "batch", "tensors": []}, {}, "reserved"),
        ({"kind": "batch", "x": object()}, {}, "msgpack"),
        ({"kind": "batch"}, {"c": torch.zeros(2, dtype=torch.complex64)}, "whitelist"),
        ({"kind": "batch"}, {"s": torch.zeros(3).to_sparse()}, "dense CPU"),
        ({"kind": "batch"}, {"n": [1, 2]}, "torch.Tensor"),
        ({"kind": "batch", "big": "x" * (wire.MAX_HEADER_BYTES + 1)}, {}, "header is"),
    ],
)
def test_encode_refuses_what_cannot_travel(header, tensors, words):
    with pytest.raises(WireError, match=words):
        encode(header, tensors)


def good_message() -> tuple[dict, list[bytes]]:
    """A valid message as (its header map, its frames) for the liars below to bend."""
    frames = as_bytes(
        encode(
            {"kind": "batch", "g": 3},
            {"a": torch.arange(6, dtype=torch.int32).view(2, 3), "m": torch.tensor([True, False])},
        )
    )
    return msgpack.unpackb(frames[0]), frames


def repack(mutate) -> list[bytes]:
    header, frames = good_message()
    mutate(header)
    return [msgpack.packb(header), *frames[1:]]


CASES = {
    "empty message": ([], "empty"),
    "header not msgpack": ([b"\xc1\x00"], "msgpack"),
    "trailing bytes": ([msgpack.packb({"v": 1}) + b"\x00"], "msgpack"),
    "header is a list": ([msgpack.packb([1, 2])], "map"),
    "ext type": ([msgpack.packb({"v": msgpack.ExtType(5, b"x")})], "msgpack"),
    "int map key": ([msgpack.packb({1: 2})], "msgpack"),
    "huge array claim": ([b"\xdd\xff\xff\xff\xff"], "msgpack"),
    "missing v": (repack(lambda h: h.pop("v")), "'v'"),
    "wrong v": (repack(lambda h: h.update(v=2)), "'v'"),
    "bool v": (repack(lambda h: h.update(v=True)), "'v'"),
    "unknown kind": (repack(lambda h: h.update(kind="pickle")), "kind"),
    "no tensor table": (repack(lambda h: h.pop("tensors")), "tensors"),
    "unknown dtype": (repack(lambda h: h["tensors"][0].update(dtype="object")), "dtype"),
    "dtype is a list": (repack(lambda h: h["tensors"][0].update(dtype=["int32"])), "dtype"),
    "negative dim": (repack(lambda h: h["tensors"][0].update(shape=[-2, -3])), "shape"),
    "bool dim": (repack(lambda h: h["tensors"][0].update(shape=[True, 6])), "shape"),
    "too many dims": (repack(lambda h: h["tensors"][0].update(shape=[1] * 9)), "shape"),
    "huge dim of empty": (repack(lambda h: h["tensors"][0].update(shape=[0, 2**62], nbytes=0)), "shape"),
    "shape lies": (repack(lambda h: h["tensors"][0].update(shape=[3, 3])), "nbytes"),
    "nbytes lies": (repack(lambda h: h["tensors"][0].update(shape=[4, 3], nbytes=48)), "frame has"),
    "dtype lies": (repack(lambda h: h["tensors"][0].update(dtype="int64")), "nbytes"),
    "extra spec key": (repack(lambda h: h["tensors"][0].update(extra=1)), "exactly"),
    "duplicate name": (
        repack(lambda h: h["tensors"][1].update(name="a", dtype="int32", shape=[1], nbytes=4)),
        "duplicate",
    ),
    "empty name": (repack(lambda h: h["tensors"][0].update(name="")), "name"),
    "bool bytes": (repack(lambda h: None)[:2] + [b"\x02\x00"], "bool"),
    "missing frame": (repack(lambda h: None)[:2], "tensor frames"),
    "extra frame": (repack(lambda h: None) + [b""], "tensor frames"),
    "too many frames": ([msgpack.packb({"v": 1})] + [b""] * (wire.MAX_TENSORS + 1), "frames"),
    "header too big": ([b"\x00" * (wire.MAX_HEADER_BYTES + 1)], "header frame"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_malformed_message_raises_wire_error_naming_the_problem(name):
    frames, words = CASES[name]
    with pytest.raises(WireError, match=words):
        decode(frames)


def test_frames_may_be_any_contiguous_buffer_but_not_a_strided_one():
    frames = encode({"kind": "batch"}, {"x": torch.arange(4, dtype=torch.int32)})
    as_arrays = [np.frombuffer(bytes(f), dtype=np.uint8) for f in frames]
    as_arrays[1] = np.frombuffer(bytes(frames[1]), dtype=np.int32)  # format 'i', not 'B'
    assert torch.equal(decode(as_arrays)[1]["x"], torch.arange(4, dtype=torch.int32))
    strided = memoryview(bytes(frames[1]) * 2)[::2]
    with pytest.raises(WireError, match="contiguous"):
        decode([frames[0], strided])
    with pytest.raises(WireError, match="bytes-like"):
        decode([frames[0], 12345])


def test_message_size_cap_is_checked_before_parsing():
    _, frames = good_message()
    with pytest.raises(WireError, match="cap"):
        decode(frames, max_message_bytes=10)
    decode(frames, max_message_bytes=26)  # exactly the 24 + 2 tensor bytes fits


def test_a_wire_error_is_a_value_error_for_callers_that_catch_broadly():
    assert issubclass(WireError, ValueError)


# --- property tests: nothing but WireError, and nothing big allocated -----------------


def traced_decode(frames) -> tuple[int, dict | None, dict | None]:
    """(peak bytes traced while decode ran, header, tensors); header None where it raised WireError."""
    tracemalloc.start()
    try:
        header, tensors = decode(frames)
    except WireError:
        header, tensors = None, None
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak, header, tensors


def decode_bounded(frames) -> None:
    """decode must raise WireError (or succeed consistently) and allocate ~nothing on the way."""
    size = sum(len(f) for f in frames)
    bound = (1 << 20) + 4 * size
    # tracemalloc counts every thread's allocations, and another test's daemon thread may still run:
    # a peak over the bound is measured again (decode's own allocations are the same every time)
    for _ in range(3):
        peak, header, tensors = traced_decode(frames)
        if peak < bound:
            break
    assert peak < bound, f"decode allocated {peak} bytes for a {size}-byte message (3 tries)"
    if header is not None:  # a mutation may happen to be valid; then it must be self-consistent
        assert sum(t.numel() * t.element_size() for t in tensors.values()) == size - len(frames[0])


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(st.lists(st.binary(max_size=300), min_size=1, max_size=5))
def test_random_bytes_always_raise_wire_error(frames):
    with pytest.raises(WireError):
        decode(frames)
    decode_bounded(frames)


@FAST
@given(st.data())
def test_truncated_frames_always_raise_wire_error(data):
    _, frames = good_message()
    index = data.draw(st.sampled_from([i for i, f in enumerate(frames) if f]))
    cut = data.draw(st.integers(min_value=0, max_value=len(frames[index]) - 1))
    frames[index] = frames[index][:cut]
    if data.draw(st.booleans()):
        frames = frames[: data.draw(st.integers(min_value=0, max_value=len(frames)))] or frames
    with pytest.raises(WireError):
        decode(frames)


def honest(field: str, value) -> bool:
    """Whether `value` is a true statement for the first tensor (2x3 int32, 24 bytes) or the header."""

    def is_int(x):
        return type(x) is int

    if field == "v":
        return is_int(value) and value == 1
    if field == "kind":
        return isinstance(value, str) and value in wire.KINDS
    if field == "nbytes":
        return is_int(value) and value == 24
    if field == "dtype":
        return value in ("int32", "fp32")
    if field == "shape":
        return (
            isinstance(value, list)
            and len(value) <= wire.MAX_DIMS
            and all(is_int(d) and 0 <= d <= wire.MAX_DIM_SIZE for d in value)
            and math.prod(value) == 6
        )
    return False


wide_ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)
LIES = {
    "v": msgpack_values,
    "kind": st.sampled_from(["Batch", "pickle", ""]) | msgpack_values,
    "nbytes": wide_ints | msgpack_values,
    "shape": st.lists(wide_ints, max_size=10) | st.lists(st.integers(0, 7), max_size=4) | msgpack_values,
    "dtype": st.sampled_from(["int64", "int16", "bf16", "bool", "uint8", "fp64", "float32"]) | msgpack_values,
    "tensors": msgpack_values,
}


@FAST
@given(st.sampled_from(sorted(LIES)), st.data())
def test_lying_headers_always_raise_wire_error(field, data):
    """The first tensor is 2x3 int32 (24 bytes): any other v/kind/nbytes/shape/dtype is a lie."""
    lie = data.draw(LIES[field].filter(lambda value: not honest(field, value)))

    def mutate(header):
        target = header if field in ("v", "kind", "tensors") else header["tensors"][0]
        target[field] = lie

    frames = repack(mutate)
    with pytest.raises(WireError):
        decode(frames)
    decode_bounded(frames)


@FAST
@given(st.data())
def test_any_mutated_header_gives_wire_error_or_a_consistent_message(data):
    header, frames = good_message()
    path = data.draw(st.sampled_from(["top", "spec0", "spec1"]))
    target = header if path == "top" else header["tensors"][int(path[-1])]
    key = data.draw(st.sampled_from(sorted(target) + ["extra"]))
    if data.draw(st.booleans()):
        target[key] = data.draw(msgpack_values)
    else:
        target.pop(key, None)
    decode_bounded([msgpack.packb(header), *frames[1:]])


@FAST
@given(st.integers(min_value=1, max_value=2**64 - 1), st.integers(min_value=0, max_value=8), st.booleans())
def test_huge_announced_sizes_never_allocate(size, ndims, consistent_nbytes):
    """A header claiming a huge tensor over a 16-byte frame fails on a size check, never in malloc."""
    shape = [size] + [2] * ndims
    nbytes = min(4 * math.prod(shape), 2**64 - 1) if consistent_nbytes else 16
    frames = [
        msgpack.packb(
            {"v": 1, "kind": "batch", "tensors": [{"name": "h", "dtype": "fp32", "shape": shape, "nbytes": nbytes}]}
        ),
        b"\x00" * 16,
    ]
    if shape in ([4], [2, 2], [1, 2, 2]) and nbytes == 16:
        return  # the honest cases
    with pytest.raises(WireError):
        decode(frames)
    decode_bounded(frames)


# --- the transport's messages (services/net/batch_stream.py) ---------------------------------------


def test_each_transport_message_round_trips_and_names_a_bad_field():
    from services.net.batch_stream import Announce, Ask, Chunk, Info, Refusal

    def back(cls, message, *rest):
        header, tensors = decode(message.to_wire())
        return cls.from_wire(header, tensors, *rest)

    spec = wire.TensorSpec("input_ids", "int64", (4,), 32)
    messages = [
        (Ask, Ask("batch", 3, "eval", "inc"), ()),
        (Ask, Ask("info"), ()),
        (Info, Info({"a": 1}), ()),
        (Refusal, Refusal(3, "train", "past the end", "inc"), ()),
        (Announce, Announce(3, "train", "inc", "0" * 32, [spec]), (1 << 20,)),
    ]
    for cls, message, rest in messages:
        assert back(cls, message, *rest) == message
    chunk = back(Chunk, Chunk(3, "train", 64, torch.arange(8, dtype=torch.uint8)))
    assert (chunk.g, chunk.split, chunk.offset, chunk.data.tolist()) == (3, "train", 64, list(range(8)))

    stream = [spec.to_wire()]
    bad = [
        (Ask, {"kind": "request", "want": "all"}, {}, "'want'"),
        (Ask, {"kind": "request", "want": "batch", "g": -1, "split": "train"}, {}, "'g'"),
        (Ask, {"kind": "request", "want": "batch", "g": 1, "split": "test"}, {}, "'split'"),
        (
            Ask,
            {"kind": "request", "want": "batch", "g": 1, "split": "train", "incarnation": "x" * 65},
            {},
            "'incarnation'",
        ),
        (Ask, {"kind": "request", "want": "info"}, {"x": torch.zeros(1)}, "no tensors"),
        (Info, {"kind": "info", "info": [1]}, {}, "'info'"),
        (Refusal, {"kind": "error", "g": "1", "split": "train"}, {}, "'g'"),
        (Refusal, {"kind": "error", "g": 1, "split": None}, {}, "'split'"),
        (Announce, {"kind": "batch", "g": 1.5, "split": "train"}, {}, "'g'"),
        (Announce, {"kind": "batch", "g": 1, "split": "train", "digest": "ab", "stream": stream}, {}, "'digest'"),
        (Announce, {"kind": "batch", "g": 1, "split": "train", "digest": "0" * 32, "stream": {}}, {}, "'stream'"),
        (
            Announce,
            {"kind": "batch", "g": 1, "split": "train", "digest": "0" * 32, "stream": [{**stream[0], "name": "evil"}]},
            {},
            "not a batch field",
        ),
        (
            Announce,
            {
                "kind": "batch",
                "g": 1,
                "split": "train",
                "digest": "0" * 32,
                "stream": [{**stream[0], "shape": [1 << 30], "nbytes": 8 << 30}],
            },
            {},
            "cap",
        ),
        (
            Chunk,
            {"kind": "chunk", "g": 1, "split": "train", "offset": -1},
            {"bytes": torch.zeros(2, dtype=torch.uint8)},
            "'offset'",
        ),
        (Chunk, {"kind": "chunk", "g": 1, "split": "train", "offset": 0}, {"bytes": torch.zeros(2)}, "'bytes'"),
    ]
    for cls, header, tensors, words in bad:
        frames = encode(header, tensors)
        rest = (1 << 20,) if cls is Announce else ()
        with pytest.raises(WireError, match=words):
            cls.from_wire(*decode(frames), *rest)


def test_read_fields_checks_each_field_by_its_annotation_and_rule_and_names_it():
    """The messages' one validator: types from the annotations, bounds and absence from message_fields.rule."""
    from dataclasses import dataclass, field

    from services.net.message_fields import read_fields, rule

    @dataclass
    class Message:
        g: int = field(metadata=rule(low=-1))
        split: str = field(metadata=rule(choices=("train", "eval")))
        tag: str = field(metadata=rule(max_len=4, absent=""))
        digest: str = field(metadata=rule(length=2, absent="ab"))
        ids: list[int] = field(metadata=rule(absent=[]))
        ok: bool = field(metadata=rule(absent=True))
        rate: float = field(metadata=rule(absent=0.0))
        part: int | None = field(metadata=rule(low=0, high=9, absent=None))

    good = {"g": 3, "split": "eval", "ids": [1, 2], "ok": False, "rate": 2, "part": 9}
    assert read_fields(Message, good, "m") == {**good, "tag": "", "digest": "ab"}
    assert read_fields(Message, {"g": -1}, "m", names=("g",)) == {"g": -1}
    bad = [
        ({"split": "train"}, "m field 'g': expected int >= -1, got nothing"),  # absent, no absent value
        ({"g": True, "split": "train"}, "m field 'g': expected int >= -1, got 'True'"),  # a bool is no int
        ({"g": -2, "split": "train"}, "'g'"),
        ({"g": 1, "split": "test"}, r"m field 'split': expected one of \('train', 'eval'\)"),
        ({"g": 1, "split": "train", "tag": "x" * 5}, "'tag': expected str of at most 4 characters"),
        ({"g": 1, "split": "train", "digest": "abc"}, "'digest': expected str of 2 characters"),
        ({"g": 1, "split": "train", "ids": [1, "2"]}, "'ids'"),
        ({"g": 1, "split": "train", "ok": 1}, "'ok': expected bool"),
        ({"g": 1, "split": "train", "rate": "1"}, "'rate': expected float"),
        ({"g": 1, "split": "train", "part": 10}, r"'part': expected int in \[0, 9\] or nil"),
    ]
    for header, message in bad:
        with pytest.raises(wire.WireError, match=message):
            read_fields(Message, header, "m")
    assert read_fields(Message, {"g": 0, "split": "train", "part": None}, "m")["part"] is None
    with pytest.raises(wire.WireError, match="m: expected a map, got list"):
        read_fields(Message, [1], "m")
    with pytest.raises(TypeError, match="unknown bounds"):
        rule(minimum=1)
