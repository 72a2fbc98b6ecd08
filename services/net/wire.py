"""The wire format: a ZMQ multipart message = one msgpack header frame + one raw frame per tensor.

    frame 0   msgpack map {v, kind, ..., tensors: [{name, dtype, shape, nbytes}, ...]}
    frame i   the C-contiguous bytes of tensor i-1 (bf16 and bool travel as their raw bytes)

Specified in docs/wire.md. Sending makes no copy (tensors are exposed as uint8 views);
receiving makes none either (torch.frombuffer over the received frames). Every way a message
can be bad raises WireError, and everything is checked before anything the size of a tensor
is allocated. Nothing here pickles.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import msgpack
import torch
import zmq

from services.net.message_fields import WireError, is_int
from services.run import dtypes

VERSION = 1
KINDS = frozenset({"request", "info", "batch", "chunk", "error", "verify", "verified"})
DTYPES = dtypes.WIRE
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

MAX_HEADER_BYTES = 64 << 10  # frame 0
MAX_TENSORS = 64  # per message
MAX_DIMS = 8
MAX_DIM_SIZE = (1 << 31) - 1  # any one dimension, even of an empty tensor
MAX_NAME_LEN = 128
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20  # tensor bytes per message; transport.max_message_bytes
_SPEC_KEYS = frozenset({"name", "dtype", "shape", "nbytes"})


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    def to_wire(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "nbytes": self.nbytes}


# --- sending -----------------------------------------------------------------


def byte_view(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor, without a copy when it is already contiguous."""
    if not isinstance(tensor, torch.Tensor):
        raise WireError(f"tensor {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu" or tensor.layout != torch.strided:
        raise WireError(f"tensor {name!r}: only dense CPU tensors travel, got {tensor.device} {tensor.layout}")
    if tensor.dtype not in DTYPE_NAMES:
        raise WireError(f"tensor {name!r}: dtype {tensor.dtype} is not in the wire whitelist")
    # reshape copies what cannot be viewed flat; a flat view it keeps may still step over memory (a
    # strided 1-D slice; zero or one element sliced from a wider tensor, which counts as contiguous yet
    # keeps its parent's stride), and a byte view refuses that: copy it then. The only copy encode makes.
    flat = tensor.detach().reshape(-1)
    if flat.stride(0) != 1:
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    if tensor.dtype not in DTYPE_NAMES:
        raise WireError(f"tensor {name!r}: dtype {tensor.dtype} is not in the wire whitelist")
    return TensorSpec(name, DTYPE_NAMES[tensor.dtype], tuple(tensor.shape), tensor.numel() * tensor.element_size())


def encode(header: dict, tensors: dict[str, torch.Tensor] | None = None) -> list:
    """Build the frames of one message. `header` needs a `kind`; `v` and `tensors` are filled in.

    The tensor frames are memoryviews of the tensors' own memory: do not write into a tensor
    until ZMQ has sent it.
    """
    tensors = tensors or {}
    if "tensors" in header:
        raise WireError("header field 'tensors' is reserved for the tensor table")
    if not _is_kind(header.get("kind")):
        raise WireError(f"header field 'kind' must be one of {sorted(KINDS)}, got {header.get('kind')!r}")
    if len(tensors) > MAX_TENSORS:
        raise WireError(f"{len(tensors)} tensors in one message; at most {MAX_TENSORS}")
    specs, frames = [], []
    for name, tensor in tensors.items():
        frames.append(memoryview(byte_view(name, tensor).numpy()))
        specs.append(spec_of(name, tensor).to_wire())
    try:
        head = msgpack.packb({**header, "v": VERSION, "tensors": specs}, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise WireError(f"header is not plain msgpack data: {exc}") from None
    if len(head) > MAX_HEADER_BYTES:
        raise WireError(f"header is {len(head)} bytes; at most {MAX_HEADER_BYTES}")
    return [head, *frames]


# --- receiving ---------------------------------------------------------------


def _as_view(frame, index: int) -> memoryview:
    if isinstance(frame, zmq.Frame):
        view = frame.buffer
    else:
        try:
            view = memoryview(frame)
        except TypeError:
            raise WireError(f"frame {index}: not a bytes-like object ({type(frame).__name__})") from None
    if not view.c_contiguous:
        raise WireError(f"frame {index}: not a contiguous buffer")
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def _unpack_header(view: memoryview) -> dict:
    try:
        header = msgpack.unpackb(
            view,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=MAX_HEADER_BYTES,
            max_bin_len=MAX_HEADER_BYTES,
            max_array_len=4096,
            max_map_len=1024,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several types for broken input; all mean the same
        raise WireError(f"header: not valid msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(header, dict):
        raise WireError(f"header: expected a map, got {type(header).__name__}")
    return header


def _is_kind(value) -> bool:
    return isinstance(value, str) and value in KINDS


def parse_specs(raw, max_total_bytes: int, field: str = "tensors") -> list[TensorSpec]:
    """Validate a tensor table from a header (names, dtypes, shapes, sizes, total) without allocating."""
    if not isinstance(raw, list):
        raise WireError(f"header field {field!r}: expected a list, got {type(raw).__name__}")
    if len(raw) > MAX_TENSORS:
        raise WireError(f"header field {field!r}: {len(raw)} tensors; at most {MAX_TENSORS}")
    specs, names, total = [], set(), 0
    for i, item in enumerate(raw):
        where = f"{field}[{i}]"
        if not isinstance(item, dict) or set(item) != _SPEC_KEYS:
            raise WireError(f"{where}: expected a map with exactly {sorted(_SPEC_KEYS)}")
        name, dtype, shape, nbytes = item["name"], item["dtype"], item["shape"], item["nbytes"]
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LEN:
            raise WireError(f"{where}.name: expected a string of 1..{MAX_NAME_LEN} characters")
        if name in names:
            raise WireError(f"{where}.name: duplicate tensor name {name!r}")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise WireError(f"{where}.dtype: {dtype!r} is not one of {sorted(DTYPES)}")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_DIMS
            or not all(is_int(d) and 0 <= d <= MAX_DIM_SIZE for d in shape)
        ):
            raise WireError(f"{where}.shape: expected at most {MAX_DIMS} ints in [0, {MAX_DIM_SIZE}], got {shape!r}")
        expected = math.prod(shape) * DTYPES[dtype].itemsize
        if not is_int(nbytes) or nbytes != expected:
            raise WireError(f"{where}.nbytes: {nbytes!r} but shape {shape} of {dtype} needs {expected}")
        total += nbytes
        if total > max_total_bytes:
            raise WireError(f"header field {field!r}: tensors add up to more than the cap of {max_total_bytes} bytes")
        names.add(name)
        specs.append(TensorSpec(name, dtype, tuple(shape), nbytes))
    return specs


def tensor_from(view, spec: TensorSpec) -> torch.Tensor:
    """A tensor over `view` (a uint8 tensor or bytes-like of exactly spec.nbytes), without a copy."""
    dtype = DTYPES[spec.dtype]
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=dtype)  # frombuffer refuses empty buffers
    if isinstance(view, torch.Tensor):
        flat = view.view(dtype)
    else:
        flat = _frombuffer(view, dtype)
        if flat.data_ptr() % dtype.itemsize:
            flat = flat.clone()  # small frames may sit unaligned in ZMQ's receive buffer
    if dtype is torch.bool and bool((flat.view(torch.uint8) > 1).any()):
        raise WireError(f"tensor {spec.name!r}: bool bytes other than 0 and 1")
    return flat.view(spec.shape)


def _frombuffer(view, dtype: torch.dtype) -> torch.Tensor:
    if not getattr(view, "readonly", False):
        return torch.frombuffer(view, dtype=dtype)
    with warnings.catch_warnings():  # bytes frames: decoded tensors are read-only by contract anyway
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(view, dtype=dtype)


def decode(frames, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> tuple[dict, dict[str, torch.Tensor]]:
    """Parse and validate one message; returns (header without 'tensors', {name: tensor}).

    Accepts zmq.Frame (from recv_multipart(copy=False)) or bytes-like frames. The tensors are
    views of the frames' memory. Checks run in the order of docs/wire.md: frame count, header
    size, total size, msgpack, version, kind, tensor table, frame lengths, values.
    """
    frames = list(frames)
    if not frames:
        raise WireError("empty message: no header frame")
    if len(frames) > MAX_TENSORS + 1:
        raise WireError(f"{len(frames)} frames; at most {MAX_TENSORS + 1}")
    views = [_as_view(frame, i) for i, frame in enumerate(frames)]
    if len(views[0]) > MAX_HEADER_BYTES:
        raise WireError(f"header frame is {len(views[0])} bytes; at most {MAX_HEADER_BYTES}")
    body = sum(len(v) for v in views[1:])
    if body > max_message_bytes:
        raise WireError(f"message carries {body} tensor bytes; the cap is {max_message_bytes}")
    header = _unpack_header(views[0])
    version = header.get("v")
    if version != VERSION or not is_int(version):
        raise WireError(f"header field 'v': unsupported protocol version {version!r} (this side speaks {VERSION})")
    if not _is_kind(header.get("kind")):
        raise WireError(f"header field 'kind': {header.get('kind')!r} is not one of {sorted(KINDS)}")
    specs = parse_specs(header.pop("tensors", None), max_message_bytes)
    if len(specs) != len(views) - 1:
        raise WireError(f"header lists {len(specs)} tensors but the message has {len(views) - 1} tensor frames")
    tensors = {}
    for i, (spec, view) in enumerate(zip(specs, views[1:])):
        if len(view) != spec.nbytes:
            raise WireError(f"tensors[{i}] ({spec.name!r}): header says {spec.nbytes} bytes, frame has {len(view)}")
        tensors[spec.name] = tensor_from(view, spec)
    return header, tensors
