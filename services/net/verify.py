"""Verification by the target workers: the messages and the drafter's client (docs/wire.md, "Verify").

    drafter DEALER -> target ROUTER   verify {op: "open", id, session, incarnation, features} + ids (the prompt)
                                      verify {op: "step", id, session, incarnation, features}
                                        + ids (last token + drafts)
                                      verify {op: "close", id, session, incarnation}
    target ROUTER -> drafter DEALER   verified {op, id, session, incarnation, committed, part, parts, row}
                                        + greedy, margin, tolerance (part 0) + features rows (every part)
                                      verified {op, id, session, incarnation, error, code}

A step is one round trip: the target verifies the block, accepts the longest prefix of the drafts
equal to its own greedy tokens, commits accepted + 1 tokens itself and answers with its greedy
tokens for the whole block, how many it committed and the captured features of those. A 1-token
block is a plain greedy step (the reference decoding). The features of a long prompt can exceed
one message; they travel as parts of at most transport.chunk_bytes of rows each, in order.

Many prompts at once (a session of rows, each prompt a row of the target's KV cache: one forward a
step for all of them):

    verify {op: "open-rows", ...} + ids (the prompts, one after another) + lengths (each prompt's)
    verify {op: "step-rows", ...} + ids (each row's block, one after another) + lengths (each
                                    block's, all equal) + rows (which prompts, by their index at
                                    open-rows, ascending; a prompt left out is closed for good)
    verified {..., committed: the feature rows} + greedy, margin, tolerance (a position a prompt
                                    at open-rows, every block position at step-rows) + counts (the
                                    tokens each row committed) + features (theirs, row by row)

Everything is validated before anything the size of a tensor is allocated: the target checks each
request against VerifyLimits (from the run's config) on its I/O thread; the client checks each
reply against what it asked (sizes it knows from its own request). A reply from an incarnation the
client did not ask is dropped and counted, and the call fails at once with TargetRestarted: the
session lived in the old process.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

import torch
import zmq

from services.net import curve, wire
from services.net.batch_stream import INCARNATION
from services.net.health_probe import probe
from services.net.message_fields import read_fields, rule
from services.net.sockets import secure_socket
from services.run.config import TransportConfig

OPS = ("open", "step", "close", "open-rows", "step-rows")
ROW_OPS = ("open-rows", "step-rows")
TENSORS = {"open": ["ids"], "step": ["ids"], "open-rows": ["ids", "lengths"], "step-rows": ["ids", "lengths", "rows"]}
MAX_ID = (1 << 63) - 1
CALL_TIMEOUT_S = 30.0  # one call: a verify step is milliseconds, a prefill at most seconds
FEATURE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class VerifyError(RuntimeError):
    """A verify call failed (the target refused it, or its answer was broken); the prompt is given up."""


class SessionLost(VerifyError):
    """The target no longer holds the session (restarted, evicted or timed out)."""


class TargetRestarted(SessionLost):
    """The answer came from another incarnation than the one asked: a new process, without the session."""


class TargetUnavailable(VerifyError):
    """The target is not serving (loading, restarting, gone) or did not answer in time."""


# --- requests (target side parses, drafter side builds) -----------------------------------------------


@dataclass(frozen=True)
class VerifyLimits:
    max_prompt: int  # prompt tokens (data.pack_len)
    max_block: int  # tokens per step (drafter.block_size)
    max_length: int  # a session's committed tokens at most (prompt + new tokens + a block)
    vocab_size: int
    max_rows: int = 1  # prompts of one session of rows (eval.num_prompts)


def _head(kind: str, message) -> dict:
    """The header fields of every verify call and answer: which call of which session, to whom."""
    return {
        "kind": kind,
        "op": message.op,
        "id": message.id,
        "session": message.session,
        "incarnation": message.incarnation,
    }


OP = rule(choices=OPS)
NUMBER = rule(low=0, high=MAX_ID)  # a call's id, a session, a part, a count


@dataclass
class VerifyRequest:
    """verify {op, id, session, incarnation, features} + ids: one call of a drafter (close: no ids)."""

    op: str = field(metadata=OP)
    id: int = field(metadata=NUMBER)
    session: int = field(metadata=NUMBER)
    ids: list[int]  # a tensor on the wire
    features: bool = field(default=True, metadata=rule(absent=True))  # send the committed tokens' features back
    incarnation: str = field(default="", metadata=INCARNATION)  # the target incarnation the drafter believes it asks
    lengths: list[int] = field(default_factory=list)  # the rows ops: each prompt's or block's tokens in ids
    rows: list[int] = field(default_factory=list)  # step-rows: the prompts stepped, by their index at open-rows

    def to_wire(self) -> list:
        header = {**_head("verify", self), "features": self.features}
        tensors = {"ids": torch.tensor(self.ids, dtype=torch.int64)} if self.op != "close" else {}
        if self.op in ROW_OPS:
            tensors["lengths"] = torch.tensor(self.lengths, dtype=torch.int64)
        if self.op == "step-rows":
            tensors["rows"] = torch.tensor(self.rows, dtype=torch.int64)
        return wire.encode(header, tensors)

    @classmethod
    def from_wire(cls, header: dict, tensors: dict, limits: VerifyLimits | None) -> "VerifyRequest":
        """Checked against the limits (WireError naming the field); limits None: this target does not verify."""
        if limits is None:
            raise wire.WireError("verify: this target does not serve verify requests")
        fields = ("op", "id", "session", "features", "incarnation")
        request = cls(**read_fields(cls, header, "verify", names=fields), ids=[])
        op = request.op
        if op == "close":
            if tensors:
                raise wire.WireError("verify close carries no tensors")
            return request
        expected = TENSORS[op]
        if sorted(tensors) != sorted(expected) or any(t.dtype != torch.int64 or t.dim() != 1 for t in tensors.values()):
            raise wire.WireError(
                f"verify {op}: expected the 1-d int64 tensors {expected}, got "
                f"{[(n, str(t.dtype), list(t.shape)) for n, t in tensors.items()]}"
            )
        ids = tensors["ids"]
        if op in ROW_OPS:
            request.lengths, request.rows = _row_sizes(op, ids, tensors, limits), tensors.get("rows", ids[:0]).tolist()
        else:
            most = limits.max_prompt if op == "open" else limits.max_block
            if not 1 <= ids.numel() <= most:
                raise wire.WireError(
                    f"verify {op}: {ids.numel()} ids; expected 1..{most} "
                    f"({'data.pack_len' if op == 'open' else 'drafter.block_size'})"
                )
        if int(ids.min()) < 0 or int(ids.max()) >= limits.vocab_size:
            raise wire.WireError(f"verify {op}: a token id outside [0, {limits.vocab_size})")
        request.ids = ids.tolist()
        return request


def _row_sizes(op: str, ids: torch.Tensor, tensors: dict, limits: VerifyLimits) -> list[int]:
    """A rows request's lengths, checked: 1..max_rows prompts (blocks) of 1..max_prompt (max_block)
    tokens each, adding up to the ids sent; a step's blocks all of one length, its rows ascending."""
    lengths = tensors["lengths"]
    most, key = (limits.max_prompt, "data.pack_len") if op == "open-rows" else (limits.max_block, "drafter.block_size")
    if not 1 <= lengths.numel() <= limits.max_rows:
        raise wire.WireError(
            f"verify {op} 'lengths': {lengths.numel()} rows; expected 1..{limits.max_rows} (eval.num_prompts)"
        )
    if int(lengths.min()) < 1 or int(lengths.max()) > most or int(lengths.sum()) != ids.numel():
        raise wire.WireError(f"verify {op} 'lengths': each 1..{most} ({key}), adding up to the {ids.numel()} ids sent")
    if op == "step-rows":
        rows = tensors["rows"]
        if int(lengths.min()) != int(lengths.max()):
            raise wire.WireError(f"verify {op} 'lengths': the blocks of one step have one length")
        if rows.numel() != lengths.numel() or int(rows.min()) < 0 or bool((rows[1:] <= rows[:-1]).any()):
            raise wire.WireError(f"verify {op} 'rows': one per block, ascending, from 0")
    return lengths.tolist()


# --- replies (target side builds, drafter side parses) ------------------------------------------------


@dataclass
class Verified:
    """verified {op, id, session, incarnation, committed, part, parts, row} + tensors: one part of an answer;
    verified {op: "close", id, session, incarnation, committed: 0}: a closed session (no parts);
    verified {op, id, session, incarnation, error, code}: a refusal (code "session": the session is unknown)."""

    op: str = field(metadata=OP)
    id: int = field(metadata=NUMBER)
    session: int = field(metadata=NUMBER)
    incarnation: str = field(metadata=INCARNATION)
    committed: int = field(default=0, metadata=NUMBER)
    part: int | None = field(default=None, metadata=NUMBER)  # None: the answer to a close, or a refusal
    parts: int = field(default=1, metadata=NUMBER)
    row: int = field(default=0, metadata=NUMBER)  # the first feature row this part carries
    error: str | None = None
    code: str = "refused"
    tensors: dict = field(default_factory=dict)

    def to_wire(self) -> list:
        head = _head("verified", self)
        if self.error is not None:
            return wire.encode({**head, "error": self.error[:1000], "code": self.code})
        head["committed"] = self.committed
        if self.part is not None:
            head.update(part=self.part, parts=self.parts, row=self.row)
        return wire.encode(head, self.tensors)

    @classmethod
    def from_wire(cls, header: dict, tensors: dict) -> "Verified":
        """Each field's type and range; what it must be for the call asked is _Assembly's check."""
        head = read_fields(cls, header, "verified", names=("op", "id", "session", "incarnation"))
        if "error" in header:
            return cls(**head, error=str(header["error"])[:1000], code=str(header.get("code"))[:40])
        if head["op"] == "close":
            return cls(**head, tensors=tensors)
        part = read_fields(cls, header, "verified", names=("committed", "part", "parts", "row"))
        return cls(**head, **part, tensors=tensors)


def reply_messages(
    request: VerifyRequest,
    incarnation: str,
    committed: int,
    greedy: torch.Tensor,
    margin: torch.Tensor,
    tolerance: torch.Tensor,
    features: torch.Tensor | None,
    chunk_bytes: int,
    counts: torch.Tensor | None = None,
) -> list[list]:
    """The messages of one answer: part 0 with the per-position tensors (and a rows answer's
    counts: the tokens each row committed), the features in row parts."""
    rows = 0 if features is None else features.shape[0]
    per_part = max(1, chunk_bytes // max(1, features[0].numel() * features.element_size())) if rows else 1
    parts = max(1, math.ceil(rows / per_part))
    messages = []
    for part in range(parts):
        tensors = {"greedy": greedy, "margin": margin, "tolerance": tolerance} if part == 0 else {}
        if part == 0 and counts is not None:
            tensors["counts"] = counts
        if features is not None:
            tensors["features"] = features[part * per_part : (part + 1) * per_part]
        messages.append(
            Verified(
                request.op,
                request.id,
                request.session,
                incarnation,
                committed,
                part,
                parts,
                part * per_part,
                tensors=tensors,
            ).to_wire()
        )
    return messages


def closed_frames(request: VerifyRequest, incarnation: str) -> list:
    return Verified("close", request.id, request.session, incarnation).to_wire()


def error_frames(request: VerifyRequest, incarnation: str, message: str, code: str = "refused") -> list:
    """code "session": the session is unknown here (the client opens a new one); else "refused"."""
    return Verified(request.op, request.id, request.session, incarnation, error=message, code=code).to_wire()


@dataclass
class Reply:
    greedy: list[int]  # [n] the target's greedy token after each position (open: after the prompt)
    margin: list[float]  # [n] top-1 minus top-2 logit there
    tolerance: list[float]  # [n] the logits' rounding there (a smaller margin is a near-tie)
    committed: int  # tokens the target committed (open: the prompt's length; rows: all rows' together)
    features: torch.Tensor | None  # [committed, width] the captured features of the committed tokens
    counts: list[int] | None = None  # rows ops: the tokens each row committed (its features, in row order)


class _Assembly:
    """One answer being received: every part checked against what was asked before it is kept."""

    def __init__(self, op: str, sent: int, width: int, features: bool, lengths: list[int] | None = None):
        self.op, self.sent, self.width, self.want_features = op, sent, width, features
        self.lengths = lengths or []  # a rows call's: each prompt's or block's tokens
        self.reply: Reply | None = None
        self.next_part, self.parts, self.filled = 0, 0, 0

    def add(self, reply: Verified) -> bool:
        """Take one part; True when the answer is complete."""
        part, parts, row = reply.part, reply.parts, reply.row
        if part != self.next_part or (part and parts != self.parts) or row != self.filled:
            raise wire.WireError(
                f"verified part {part}/{parts} at row {row}; expected part {self.next_part} at row {self.filled}"
            )
        if part == 0:
            self._first(reply)
        rows = reply.tensors.get("features")
        if self.want_features:
            expected = self.reply.committed
            if (
                rows is None
                or rows.dtype not in FEATURE_DTYPES
                or rows.dim() != 2
                or rows.shape[1] != self.width
                or self.filled + rows.shape[0] > expected
            ):
                raise wire.WireError(
                    f"verified features: expected rows of width {self.width} ({expected} in all), "
                    f"got {None if rows is None else (str(rows.dtype), list(rows.shape))}"
                )
            if self.reply.features is None:
                self.reply.features = torch.empty(expected, self.width, dtype=rows.dtype)  # sized by our request
            self.reply.features[self.filled : self.filled + rows.shape[0]] = rows
            self.filled += rows.shape[0]
        elif rows is not None:
            raise wire.WireError("verified: features nobody asked for")
        self.next_part += 1
        if self.next_part < self.parts:
            return False
        if self.want_features and self.filled != self.reply.committed:
            raise wire.WireError(f"verified: {self.filled} feature rows for {self.reply.committed} committed tokens")
        return True

    def _first(self, reply: Verified) -> None:
        parts, tensors = reply.parts, reply.tensors
        if not 1 <= parts <= self.sent:  # every part carries at least one row
            raise wire.WireError(f"verified field 'parts': {parts}, expected 1..{self.sent}")
        n = {"open": 1, "open-rows": len(self.lengths)}.get(self.op, self.sent)
        committed = reply.committed
        if not 1 <= committed <= self.sent or (self.op in ("open", "open-rows") and committed != self.sent):
            raise wire.WireError(f"verified field 'committed': {committed} for {self.sent} tokens sent")
        counts = self._counts(tensors.get("counts"), committed) if self.op in ROW_OPS else None
        checks = {"greedy": torch.int64, "margin": torch.float32, "tolerance": torch.float32}
        for name, dtype in checks.items():
            t = tensors.get(name)
            if t is None or t.dtype != dtype or list(t.shape) != [n]:
                raise wire.WireError(
                    f"verified {name!r}: expected {dtype} of shape [{n}], got "
                    f"{None if t is None else (str(t.dtype), list(t.shape))}"
                )
        self.parts = parts
        self.reply = Reply(
            tensors["greedy"].tolist(),
            tensors["margin"].tolist(),
            tensors["tolerance"].tolist(),
            committed,
            None,
            counts,
        )

    def _counts(self, counts, committed: int) -> list[int]:
        """A rows answer's tokens committed per row: a prefill commits each prompt whole; a step
        1..block tokens of each row's block; together `committed`."""
        if counts is None or counts.dtype != torch.int64 or list(counts.shape) != [len(self.lengths)]:
            raise wire.WireError(
                f"verified 'counts': expected int64 of shape [{len(self.lengths)}], got "
                f"{None if counts is None else (str(counts.dtype), list(counts.shape))}"
            )
        said, sent = counts.tolist(), self.lengths
        fits = said == sent if self.op == "open-rows" else all(1 <= c <= n for c, n in zip(said, sent))
        if not fits or sum(said) != committed:
            raise wire.WireError(f"verified 'counts': {said} for blocks of {sent} tokens, {committed} committed")
        return said


class VerifyClient:
    """Drafter side: one DEALER per target, used by the thread that evaluates (calls are synchronous).

    Each call names the target incarnation learned from its health socket; a call to a target that
    is not serving fails at once (TargetUnavailable), one that gets no answer in CALL_TIMEOUT_S too.
    """

    def __init__(
        self,
        data_eps: list[str],
        health_eps: list[str],
        transport: TransportConfig,
        width: int,
        drops=None,
        timeout_s: float = CALL_TIMEOUT_S,
    ):
        self.data_eps, self.health_eps, self.transport, self.width = data_eps, health_eps, transport, width
        self.drops = drops or (lambda kind, detail: None)
        self.timeout_s = timeout_s
        self._ctx = zmq.Context()
        self._socks: dict[int, zmq.Socket] = {}
        self.incarnations: dict[int, str] = {}
        self._ids = itertools.count(1)

    @property
    def num_targets(self) -> int:
        return len(self.data_eps)

    def refresh(self, target: int) -> str:
        """The target's incarnation now (reconnecting when it changed); TargetUnavailable when not serving."""
        _, status, why = probe(self.health_eps[target], timeout_s=2.0, keys_dir=curve.keys_for(self.transport))
        if not status or status.get("state") not in ("ready", "training") or not status.get("incarnation"):
            raise TargetUnavailable(f"target {target} is not serving ({status.get('state') if status else why})")
        incarnation = str(status["incarnation"])
        if self.incarnations.get(target) not in (None, incarnation):
            self._reconnect(target)  # the old connection may lead to whatever holds the socket now
        self.incarnations[target] = incarnation
        return incarnation

    def open(self, target: int, session: int, prompt: list[int], features: bool = True) -> Reply:
        self.refresh(target)
        return self._call(target, "open", session, prompt, features)

    def step(self, target: int, session: int, block: list[int], features: bool = True) -> Reply:
        return self._call(target, "step", session, block, features)

    def open_rows(self, target: int, session: int, prompts: list[list[int]], features: bool = True) -> Reply:
        """Every prompt a row of one session: a Reply with a greedy token per prompt, counts = the
        prompts' lengths and their features one prompt after another."""
        self.refresh(target)
        ids = [t for p in prompts for t in p]
        return self._call(target, "open-rows", session, ids, features, lengths=[len(p) for p in prompts])

    def step_rows(
        self, target: int, session: int, rows: list[int], blocks: list[list[int]], features: bool = True
    ) -> Reply:
        """Each of `rows` (prompt indices at open_rows, ascending) fed its block: greedy, margin and
        tolerance per block position, one block after another; counts = the tokens each row committed."""
        ids = [t for b in blocks for t in b]
        return self._call(target, "step-rows", session, ids, features, lengths=[len(b) for b in blocks], rows=rows)

    def close_session(self, target: int, session: int) -> None:
        """Free the session on the target; best effort (an answer is waited for, briefly)."""
        try:
            self._call(target, "close", session, None, False, timeout_s=min(self.timeout_s, 5.0))
        except VerifyError:
            pass

    def _socket(self, target: int) -> zmq.Socket:
        if target not in self._socks:
            sock = self._ctx.socket(zmq.DEALER)
            secure_socket(sock, self.transport.max_message_bytes)
            if keys := curve.keys_for(self.transport):
                curve.apply_client(sock, keys)
            sock.connect(self.data_eps[target])
            self._socks[target] = sock
        return self._socks[target]

    def _reconnect(self, target: int) -> None:
        sock = self._socks.pop(target, None)
        if sock is not None:
            sock.close(linger=0)

    def _call(
        self,
        target: int,
        op: str,
        session: int,
        ids,
        features: bool,
        timeout_s: float | None = None,
        lengths: list[int] | None = None,
        rows: list[int] | None = None,
    ):
        incarnation = self.incarnations.get(target) or self.refresh(target)
        call_id = next(self._ids)
        sock = self._socket(target)
        request = VerifyRequest(op, call_id, session, list(ids or ()), features, incarnation, lengths or [], rows or [])
        sock.send_multipart(request.to_wire())
        assembly = _Assembly(op, len(ids or ()), self.width, features, lengths)
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                self._reconnect(target)  # a late answer must not be read as the next call's
                raise TargetUnavailable(
                    f"target {target}: no answer to verify {op} within {timeout_s or self.timeout_s:g}s"
                )
            frames = sock.recv_multipart(copy=False)
            try:
                header, tensors = wire.decode(frames, self.transport.max_message_bytes)
                if header["kind"] != "verified":
                    raise wire.WireError(f"header field 'kind': expected 'verified', got {header['kind']!r}")
                reply = Verified.from_wire(header, tensors)
                if reply.id != call_id:
                    self.drops("data-unrequested", f"target {target}: verify answer to id {reply.id}")
                    continue
                if reply.incarnation != incarnation:
                    self.drops(
                        "data-incarnation",
                        f"target {target}: verify answer from incarnation {reply.incarnation!r}, asked {incarnation!r}",
                    )
                    self.incarnations.pop(target, None)
                    self._reconnect(target)
                    raise TargetRestarted(f"target {target} was restarted; session {session} is gone")
                if reply.error is not None:
                    raise (SessionLost if reply.code == "session" else VerifyError)(
                        f"target {target}: verify {op}: {reply.error}"
                    )
                if op == "close" or assembly.add(reply):
                    return assembly.reply
            except wire.WireError as exc:
                self.drops("data-reply", f"target {target}: {exc}")
                self._reconnect(target)
                raise VerifyError(f"target {target}: broken verify answer: {exc}") from None

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(linger=0)
        self._socks.clear()
        self._ctx.term()
