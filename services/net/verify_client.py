"""The drafter's side of verification: VerifyClient sends verify requests to a target worker and
assembles each answer (services/net/verify.py holds the messages and their checks; docs/wire.md, "Verify").

Every part of an answer is checked against what was asked before it is kept (_Assembly): its order,
its row, its sizes, which the client knows from its own request. A reply from an incarnation the client
did not ask is dropped and counted, and the call fails at once with TargetRestarted.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch
import zmq

from services.net import curve, wire
from services.net.health_probe import probe
from services.net.sockets import secure_socket
from services.net.verify import (
    CALL_TIMEOUT_S,
    FEATURE_DTYPES,
    ROW_OPS,
    SessionLost,
    TargetRestarted,
    TargetUnavailable,
    Verified,
    VerifyError,
    VerifyRequest,
)
from services.run.config import TransportConfig


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
