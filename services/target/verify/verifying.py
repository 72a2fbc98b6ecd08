"""Verify requests on the target worker: decode sessions for real acceptance (services/net/verify.py).

The target that serves batches also runs the eval's target forwards, so no drafter holds a copy
of the target. A session is a DecodeSession (decode.py: one prompt) or a RowSession (row_sessions.py:
the prompts of an evaluation as rows of one KV cache, one forward a step for all) over the worker's
own Target, keyed by (drafter connection, session id): another connection cannot touch it.

Bounds:
  - sessions: at most eval.sessions at once; opening one more closes the least recently
    used (its owner gets "unknown session" and opens it again); a session untouched for
    SESSION_IDLE_S is freed (its drafter died or gave up).
  - time: verify work takes at most eval.target_share of the target's wall time over the
    last SHARE_WINDOW_S while drafters ask for batches (a batch request in that window). Past the
    share, verify requests wait (in arrival order, at most MAX_WAITING) and batch requests go
    first; with no batch asked for in the window they run at once.
Answers carry this process's incarnation and the request id; the drafter checks both.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

from services.net import verify
from services.net.transport import Request
from services.run.config import Config
from services.target.model.hybrid import RECURRENT_TOKENS
from services.target.replies import Dropped, Reply, VerifyReply
from services.target.verify.decode import DecodeSession, check_decodable
from services.target.verify.row_sessions import RowSession

log = logging.getLogger("target")
SESSION_IDLE_S = 120.0
SHARE_WINDOW_S = 10.0
MAX_WAITING = 256


@dataclass(frozen=True)
class VerifySettings:
    """What the verify service reads of the run, built once from the config and the run spec."""

    limits: verify.VerifyLimits  # what a request may ask (the batch server checks it on arrival)
    max_sessions: int  # eval.sessions
    share: float  # eval.target_share
    warm_up: bool  # eval.num_prompts > 0: warm the verify path up before `ready`
    block_size: int
    chunk_bytes: int  # transport.chunk_bytes: an answer's large tensors travel in parts this big

    @classmethod
    def from_config(cls, cfg: Config, spec) -> "VerifySettings":
        """From the run's config and spec (services/run/runspec.py)."""
        return cls(
            limits=verify.VerifyLimits(
                max_prompt=cfg.data.pack_len,
                max_block=spec.block_size,
                max_length=cfg.data.pack_len + cfg.eval.max_new_tokens + spec.block_size,
                vocab_size=spec.target.vocab_size,
                max_rows=max(1, cfg.eval.num_prompts),
            ),
            max_sessions=cfg.eval.sessions,
            share=cfg.eval.target_share,
            warm_up=cfg.eval.num_prompts > 0,
            block_size=spec.block_size,
            chunk_bytes=cfg.transport.chunk_bytes,
        )


# What a real evaluation asks of the Gated DeltaNet kernels, each once: prompts on both sides of
# RECURRENT_TOKENS (the fused recurrent kernel up to it, the chunked one past it), each side at a
# multiple of 16 and not (Triton compiles a kernel per such class of length); blocks of 1 token (the
# plain greedy reference) and of block_size (drafts), rejected (a rollback) and fully accepted.
WARMUP_PROMPTS = (37, RECURRENT_TOKENS, RECURRENT_TOKENS + 37, 2 * RECURRENT_TOKENS)


def warm_up_verify(target, block_size: int) -> str:
    """Made-up verify sessions before `ready`, so that the first real one does not pay the kernels'
    first calls. flash-linear-attention's Triton kernels compile and autotune on their first call:
    on an H200 the hybrid demo's first verify of a prompt past RECURRENT_TOKENS took over 30 s, past
    the drafter's wait for an answer, and its first evaluation lost 31 of 32 prompts. Returns a line
    for the log."""
    try:
        check_decodable(target)
    except ValueError as exc:  # every verify request will say so; the batches go on
        return f"verify path not warmed up: {exc}"
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    tokens = lambda n: torch.randint(0, target.info.vocab_size, (n,), generator=gen).tolist()  # noqa: E731
    for n in WARMUP_PROMPTS:
        session = DecodeSession(target)
        session.prefill(tokens(n))
        for block, keep in ((1, 1), (block_size, 1), (block_size, block_size)):
            session.verify(tokens(block))
            session.commit(keep)
    try:  # and the rows of an evaluation's prompts together (row_sessions.py), where the target runs them
        rows = RowSession(target, [tokens(n) for n in WARMUP_PROMPTS], 2 * block_size)
        for block in (1, block_size):
            rows.step(rows.rows, [tokens(block) for _ in rows.rows])
    except ValueError:
        pass  # this target verifies prompt by prompt: the drafter learns it at its first evaluation
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)
    return f"warmed up the verify path in {time.perf_counter() - start:.1f} s"


class VerifyService:
    """The verify requests of one target: no sockets and no health. Each call returns the replies for the
    shell to send (replies.py); status() is what health shows of it."""

    def __init__(self, target, settings: VerifySettings, incarnation: str):
        self.target, self.incarnation, self.chunk_bytes = target, incarnation, settings.chunk_bytes
        self.limits = settings.limits
        self.max_sessions, self.share = settings.max_sessions, settings.share
        self.sessions: OrderedDict[tuple[bytes, int], tuple[DecodeSession | RowSession, float]] = OrderedDict()
        self.waiting: deque[Request] = deque()
        self.spent: deque[tuple[float, float]] = deque()  # (end time, seconds) of verify work in the window
        self.last_batch_request = float("-inf")
        self.counts = {
            "verify_requests": 0,
            "verify_tokens": 0,
            "verify_deferred": 0,
            "verify_evicted": 0,
            "verify_refused": 0,
        }
        self.seconds = 0.0

    # --- the worker loop's side ---------------------------------------------------------------
    def saw_batch_request(self) -> None:
        self.last_batch_request = time.monotonic()

    def submit(self, request: Request) -> list[Reply]:
        """Answer now if the share allows, else queue behind the other waiting ones."""
        if self.waiting or not self._may_run():
            if len(self.waiting) >= MAX_WAITING:
                return [Dropped("verify-request", f"more than {MAX_WAITING} verify requests waiting; dropped")]
            self.counts["verify_deferred"] += 1
            self.waiting.append(request)
            return []
        return self.answer(request)

    def run_waiting(self) -> list[Reply]:
        """Answer the waiting requests the share allows; free idle sessions."""
        replies = []
        while self.waiting and self._may_run():
            replies += self.answer(self.waiting.popleft())
        now = time.monotonic()
        for key in [k for k, (_, used) in self.sessions.items() if now - used > SESSION_IDLE_S]:
            del self.sessions[key]
            log.info("verify session %d freed after %.0fs idle", key[1], SESSION_IDLE_S)
        return replies

    def status(self) -> dict:
        """What health shows of the verify work."""
        return dict(
            verify_sessions=len(self.sessions),
            verify_s=round(self.seconds, 3),
            verify_waiting=len(self.waiting),
            **self.counts,
        )

    def _may_run(self) -> bool:
        now = time.monotonic()
        while self.spent and self.spent[0][0] < now - SHARE_WINDOW_S:
            self.spent.popleft()
        if now - self.last_batch_request > SHARE_WINDOW_S:
            return True  # nobody is asking for batches
        return sum(s for _, s in self.spent) < self.share * SHARE_WINDOW_S

    # --- one request --------------------------------------------------------------------------
    def answer(self, request: Request) -> list[Reply]:
        start = time.perf_counter()
        r, replies = request.verify, []
        try:
            messages = self._run(request.client, r)
        except verify.SessionLost as exc:
            self.counts["verify_refused"] += 1
            replies.append(Dropped("verify-session", str(exc)))  # counted; answered so the drafter reopens at once
            messages = [verify.error_frames(r, self.incarnation, str(exc), code="session")]
        except (ValueError, RuntimeError) as exc:  # e.g. a session grown past its bound
            self.counts["verify_refused"] += 1
            self.sessions.pop((request.client, r.session), None)
            replies.append(Dropped("verify-request", f"verify {r.op}: {exc}"))
            messages = [verify.error_frames(r, self.incarnation, f"{type(exc).__name__}: {exc}")]
        seconds = time.perf_counter() - start
        self.spent.append((time.monotonic(), seconds))
        self.seconds += seconds
        self.counts["verify_requests"] += 1
        return [*replies, VerifyReply(request.client, messages)]

    def _open(self, key) -> None:
        """Room for one more session: the least recently used ones go."""
        self.sessions.pop(key, None)
        while len(self.sessions) >= self.max_sessions:
            self.sessions.popitem(last=False)
            self.counts["verify_evicted"] += 1

    def _rows(self, key, r: verify.VerifyRequest) -> list[list]:
        """The rows ops: many prompts of one session, one forward a step for all (row_sessions.py)."""
        incarnation, chunk = self.incarnation, self.chunk_bytes
        if r.op == "open-rows":
            self._open(key)
            cut = [0, *itertools.accumulate(r.lengths)]
            prompts = [r.ids[a:b] for a, b in zip(cut, cut[1:])]
            session = RowSession(self.target, prompts, self.limits.max_length - self.limits.max_prompt)
            greedy, margin, tolerance, counts, features = session.first
        else:
            if key not in self.sessions or not isinstance(self.sessions[key][0], RowSession):
                raise verify.SessionLost(f"unknown verify session {r.session}")
            session, _ = self.sessions.pop(key)
            q = r.lengths[0]
            blocks = [r.ids[i * q : (i + 1) * q] for i in range(len(r.lengths))]
            greedy, margin, tolerance, counts, features = session.step(r.rows, blocks)
        self.sessions[key] = (session, time.monotonic())  # most recently used last
        self.counts["verify_tokens"] += len(r.ids)
        features = features if r.features else None
        return verify.reply_messages(
            r, incarnation, int(counts.sum()), greedy, margin, tolerance, features, chunk, counts=counts
        )

    def _run(self, client: bytes, r: verify.VerifyRequest) -> list[list]:
        key, incarnation = (client, r.session), self.incarnation
        if r.op == "close":
            self.sessions.pop(key, None)
            return [verify.closed_frames(r, incarnation)]
        if r.op in verify.ROW_OPS:
            return self._rows(key, r)
        if r.op == "open":
            self._open(key)
            session = DecodeSession(self.target)
            step = session.prefill(r.ids)
            self.sessions[key] = (session, time.monotonic())
            self.counts["verify_tokens"] += len(r.ids)
            return verify.reply_messages(
                r,
                incarnation,
                len(r.ids),
                step.greedy[-1:].cpu(),
                step.margin[-1:].cpu(),
                step.tolerance[-1:].cpu(),
                step.features.cpu() if r.features else None,
                self.chunk_bytes,
            )
        if key not in self.sessions or not isinstance(self.sessions[key][0], DecodeSession):
            raise verify.SessionLost(f"unknown verify session {r.session}")
        session, _ = self.sessions.pop(key)
        if session.length + len(r.ids) > self.limits.max_length:
            raise ValueError(
                f"session {r.session} would hold {session.length + len(r.ids)} tokens; at most "
                f"{self.limits.max_length} (data.pack_len + eval.max_new_tokens + block)"
            )
        step = session.verify(r.ids)
        greedy = step.greedy.cpu()
        drafts = r.ids[1:]
        accepted = next((j for j, d in enumerate(drafts) if d != int(greedy[j])), len(drafts))
        session.commit(accepted + 1)
        self.sessions[key] = (session, time.monotonic())  # most recently used last
        self.counts["verify_tokens"] += len(r.ids)
        features = step.features[: accepted + 1].cpu() if r.features else None
        return verify.reply_messages(
            r,
            incarnation,
            accepted + 1,
            greedy,
            step.margin.cpu(),
            step.tolerance.cpu(),
            features,
            self.chunk_bytes,
        )
