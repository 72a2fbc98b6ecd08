"""Verification by the target workers: the messages, their limits and errors (docs/wire.md, "Verify");
the drafter's client that sends them is services/net/verify_client.py.

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

import math
from dataclasses import dataclass, field

import torch

from services.net import wire
from services.net.batch_stream import INCARNATION
from services.net.message_fields import read_fields, rule

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
