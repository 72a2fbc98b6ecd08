"""A drafter's batches pulled from the targets over ZMQ: ZmqSource, one split's requests, their checks
and their staging on the GPU (pick_source.py picks it, or synthetic.py's made-up batches, for a run).
One piece: the requests in flight, the re-asks, the incarnations and the staging share one state
(pending, arrived, retry_at, staged), which every rule below reads and changes.

Scheduling (docs/design.md, "Scheduling"): at micro-step m, drafter d of D trains global batch
g = g0 + (m - m0)·D + d (plan.Plan.g_of: g = m·D + d from the start, g0 = the batches a resumed
checkpoint had done), which target g mod T builds. Each drafter keeps `transport.credits` requests
in flight, so memory in flight is bounded and the next batch is usually there before it is needed.
Batch g is a pure function of (dataset, config, seed, g), so after a target restarts the drafter
simply asks again.

How many batches each rank trains is the run's plan (schedule.py). Past the last batch of the run
(total batches not divisible by D, or by the last optimizer step's micro-batches), a rank trains an
empty batch, which has zero loss weight, so DDP stays in lockstep without repeating a sample.

Provenance (transport.py): each request names the target incarnation learned from its health
socket, and only that incarnation's answer is taken. A request for a target whose incarnation is
not known yet (still loading) waits until it is. When a target's incarnation changes (it was
restarted), the connection to it is dropped and made afresh before anything is asked again.

Content: what a target says about itself can be replayed by a process that took its socket over,
so each request also names the token digest batch g must have, read from this host's copy of the
packed data (or its published digests, packing.py); the transport drops any other content
("data-content") and any other incarnation ("data-incarnation") and says so at once, and the
request is asked again on a fresh connection REASK_AFTER_S later (whoever holds the socket by then).
An error for a batch the handshake says exists is no real target's either: it is dropped the same
way ("data-error-claim"); an error for a batch out of range stops the drafter (SourceError). A batch
nobody asked for ("data-unrequested") is treated alike: whoever holds the connection is not
answering what was asked.

No request waits long: besides the re-asks above, each pass over the held-out split starts by
looking up every target's incarnation (a target restarted while the evaluation was idle gets a
fresh connection before anything is asked), and a request unanswered for transport.resend_after_s
is asked again; its default (0) is derived from what answers take: 4x the slowest answer seen,
within [RESEND_MIN_S, RESEND_MAX_S], RESEND_MAX_S until the first answer (a target's first batch
may wait for its compile).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from services.data.batch import FIELDS, Batch
from services.data.packed_data import PackedData, PublishedDigests, RowOrder, digests_path
from services.net import curve
from services.net.batch_client import AnswerRejected, BatchArrived, BatchClient, BatchRefused, Event, InfoArrived
from services.net.endpoints import endpoint
from services.net.handshake import TargetInfo
from services.net.health_probe import probe
from services.net.wire import WireError
from services.process import lifecycle
from services.process.health import HealthServer
from services.run.config import Config, TransportConfig
from services.run.files import write_json_atomic
from services.run.placement import Placement
from services.run.runspec import RunSpec
from services.run.schedule import Plan, make_plan

CHECK_TARGETS_EVERY_S = 2.0
REASK_AFTER_S = 0.5  # after a dropped answer: ask again on a fresh connection this much later
RESEND_MIN_S, RESEND_MAX_S = 10.0, 120.0  # bounds of the derived resend wait (transport.resend_after_s = 0)

log = logging.getLogger("drafter")


class SourceError(RuntimeError):
    pass


def resend_wait(configured: float, slowest_answer_s: float) -> float:
    """How long a request waits before it is asked again: transport.resend_after_s when set, else
    4x the slowest answer so far within [RESEND_MIN_S, RESEND_MAX_S] (RESEND_MAX_S before any)."""
    if configured > 0:
        return configured
    if not slowest_answer_s:
        return RESEND_MAX_S
    return min(RESEND_MAX_S, max(RESEND_MIN_S, 4 * slowest_answer_s))


def batch_content(
    order: RowOrder, run_dir: str | Path, data_key: str
) -> tuple[PackedData | PublishedDigests | None, str]:
    """What tells this host which token ids batch g has: (its .digest(g, split), how)."""
    cache = Path(run_dir) / "data-cache" / f"{data_key}.safetensors"
    if data_key and cache.is_file():
        return PackedData(cache, order), "packed data"
    if data_key and digests_path(cache).is_file():
        return PublishedDigests(digests_path(cache), order), "published digests"
    return None, "off"


@dataclass(frozen=True)
class SourceSettings:
    """What the batch sources read of the run, built once from the config (as train.StepSettings is):
    where the targets listen, how many drafters share them, the plan's inputs, what a batch looks like."""

    at: Placement  # this drafter's run folder, rank, world size and targets
    transport: TransportConfig
    epochs: int
    grad_accum: int
    labels_from_target: bool
    pack_len: int
    seed: int
    evaluate: bool  # eval.every > 0: a held-out source is wanted
    content: Callable[[str], tuple] = field(repr=False, compare=False)  # data key -> batch_content(...)

    @classmethod
    def from_config(cls, cfg: Config, at: Placement) -> "SourceSettings":
        return cls(
            at=at,
            transport=cfg.transport,
            epochs=cfg.run.epochs,
            grad_accum=max(1, cfg.optimizer.grad_accum),
            labels_from_target=cfg.target.labels_from_target,
            pack_len=cfg.data.pack_len,
            seed=cfg.run.seed,
            evaluate=cfg.eval.every > 0,
            content=functools.partial(batch_content, RowOrder.from_config(cfg), at.run_dir),
        )


class ZmqSource:
    def __init__(
        self,
        settings: SourceSettings,
        health: HealthServer | None,
        max_steps: int = 0,
        start_step: int = 0,
        split: str = "train",
        device: torch.device | None = None,
        check=None,
        first_g: int | None = None,
    ):
        """max_steps: optimizer steps at most (train only; 0: the whole data). start_step, first_g: a
        resume's micro-step and the batches its checkpoint had done (schedule.py; None: start_step·D, one
        split from the start). device: a CUDA device
        gets the next batch copied to it on a side stream while the current step runs.
        Nothing is asked here: connect() waits for target 0's handshake and makes the plan."""
        self.settings, self.split, self.health = settings, split, health
        self.rank, self.world = settings.at.rank, settings.at.world_size
        self.max_steps, self.start_step = max_steps, start_step
        self.first_g = start_step * settings.at.world_size if first_g is None else first_g
        self.copy_stream = torch.cuda.Stream(device) if device is not None and device.type == "cuda" else None
        self.check = check or (lambda batch: batch)
        self.staged: dict[int, tuple[Batch, torch.cuda.Event]] = {}  # g -> (batch on the device, copy done)
        t, at = settings.transport, settings.at
        self.data_eps = [endpoint(at.run_dir, t, "target", i, "data") for i in range(at.num_targets)]
        self.health_eps = [endpoint(at.run_dir, t, "target", i, "health") for i in range(at.num_targets)]
        self.client: BatchClient | None = None
        self.incarnations: list[str | None] = [None] * at.num_targets  # learned from health
        self.pending: dict[int, float] = {}  # g -> time requested
        self.deferred: set[int] = set()  # pending, not asked yet: its target's incarnation is unknown
        self.arrived: dict[int, Batch] = {}
        self.provenance: dict[int, dict] = {}  # g -> {incarnation, digest} of the batch that arrived
        self.wait_s = 0.0  # time spent waiting for data (data-wait fraction)
        self.slowest_answer_s = 0.0  # the longest a request took to be answered (resend_after)
        self.retry_at: dict[int, float] = {}  # target -> when to ask it again on a fresh connection

    def connect(self) -> Plan:
        """Connect to the targets and wait for target 0's handshake (it may still be loading); the plan
        of this split follows from it. Rank 0's training source writes it to schedule.json."""
        settings, split = self.settings, self.split
        self.client = BatchClient(self.data_eps, settings.transport, self.health, pin_memory=torch.cuda.is_available())
        self.info = self._ask_info()
        self.content, how = settings.content(self.info.data_key)
        if self.health:
            self.health.set(content_check=how)
        if self.content is None and split == "train":
            log.warning(
                "batch content is not checked: neither the packed data nor its digests (%s) are on this "
                "host; only the provenance a target claims is",
                digests_path(settings.at.run_dir / "data-cache" / f"{self.info.data_key or '<key>'}.safetensors"),
            )
        if split == "eval":
            self.plan = make_plan(self.info.num_eval_batches, epochs=1, drafters=settings.at.world_size)
        else:
            accum = settings.grad_accum
            self.plan = make_plan(
                self.info.num_batches,
                settings.epochs,
                settings.at.world_size,
                accum,
                self.max_steps,
                first_step=self.start_step // accum,
                first_g=self.first_g,
            )
        self.total_batches = self.plan.total_batches
        if settings.at.rank == 0 and split == "train":  # for `launcher status`, reports and the exactly-once check
            write_json_atomic(
                settings.at.run_dir / "schedule.json", {**self.plan.to_dict(), "targets": settings.at.num_targets}
            )
        return self.plan

    @property
    def num_targets(self) -> int:
        return len(self.data_eps)

    def g_of(self, step: int) -> int:
        return self.plan.g_of(step, self.rank)

    def target_of(self, g: int) -> int:
        return g % self.num_targets

    def check_targets(self, spec: RunSpec) -> None:
        """The targets' handshake: what target 0 says it loaded, against this drafter's run spec."""
        self.info.check(**spec.expected_of_target())

    def __iter__(self):
        if self.split == "eval":  # idle since the last evaluation: targets may have restarted
            self._refresh_connections()
        for step in range(self.start_step, self.plan.micro_batches):
            self._top_up(step)
            batch = self._take(self.g_of(step))
            self._stage(self.g_of(step + 1))
            yield batch

    def _stage(self, g: int) -> None:
        """If batch g has arrived, start its copy to the GPU now, on the side stream."""
        if self.copy_stream is None:
            return
        for event in self.client.poll(0):
            self._handle(event)
        if g in self.arrived and g not in self.staged:
            with torch.cuda.stream(self.copy_stream):
                moved = self.check(self.arrived.pop(g)).to(self.copy_stream.device, non_blocking=True)
                self.staged[g] = (moved, self.copy_stream.record_event())

    def _from_stage(self, g: int) -> Batch:
        """The staged batch, safe to use on the compute stream."""
        batch, copied = self.staged.pop(g)
        compute = torch.cuda.current_stream()
        compute.wait_event(copied)
        for tensor in batch.tensors().values():
            tensor.record_stream(compute)  # made on the side stream, used and freed on this one
        return batch

    # --- requests ----------------------------------------------------------
    def _top_up(self, step: int) -> None:
        for s in range(step, min(step + self.settings.transport.credits, self.plan.micro_batches)):
            g = self.g_of(s)
            if g < self.total_batches and g not in self.pending and g not in self.arrived:
                self.pending[g] = time.monotonic()
                self._ask(g)

    def _ask(self, g: int) -> None:
        """Request g from the incarnation of its target we know; defer it while we know none."""
        t = self.target_of(g)
        if self.incarnations[t] is None:
            self._learn_incarnation(t)
        if self.incarnations[t] is None:
            self.deferred.add(g)
            return
        self.deferred.discard(g)
        digest = self.content.digest(g, self.split) if self.content is not None else None
        self.client.request(t, g, self.split, incarnation=self.incarnations[t], digest=digest)
        self.pending[g] = time.monotonic()

    def provenance_of(self, g: int) -> dict:
        """{incarnation, digest} of batch g as it arrived (for the ledger); {} for an empty batch."""
        return self.provenance.pop(g, {})

    def _take(self, g: int) -> Batch:
        if g >= self.total_batches:
            return self.empty_batch(g)
        if g in self.staged:
            return self._from_stage(g)
        start = last_check = time.monotonic()
        if self.deferred:
            last_check = 0.0  # look for the targets we could not ask at once
        while g not in self.arrived:
            lifecycle.check()
            for event in self.client.poll(200):
                self._handle(event)
            now = time.monotonic()
            self._reask_dropped(now)
            if now - last_check > CHECK_TARGETS_EVERY_S:
                last_check = now
                self._resend_to_restarted_targets()
                for deferred in sorted(self.deferred):
                    self._ask(deferred)
                self._resend_overdue(now)
            if self.health:
                self.health.progress(state="training", waiting_for_g=g)  # waiting is not a stall
        self.wait_s += time.monotonic() - start
        return self.arrived.pop(g)

    def _handle(self, event: Event) -> None:
        if isinstance(event, BatchArrived):
            batch = event.batch
            if batch.g in self.pending:
                self.slowest_answer_s = max(self.slowest_answer_s, time.monotonic() - self.pending.pop(batch.g))
                self.arrived[batch.g] = batch
                if self.split == "train":  # the ledger's; evaluation keeps none
                    self.provenance[batch.g] = event.provenance
        elif isinstance(event, AnswerRejected):
            self.retry_at.setdefault(event.target, time.monotonic() + REASK_AFTER_S)
        elif isinstance(event, BatchRefused):
            target, g, message, incarnation = event.target, event.g, event.message, event.incarnation
            if 0 <= g < self._num_batches():  # a real target has it: whoever said otherwise is not one
                self.client.drops(
                    "data-error-claim",
                    f"target {target}: an error for {self.split} g={g}, which "
                    f"the data has (sent as incarnation {incarnation!r}): {message[:200]}",
                )
                self.retry_at.setdefault(target, time.monotonic() + REASK_AFTER_S)
                return
            raise SourceError(f"target-{target} refused batch g={g}: {message}")

    def _num_batches(self) -> int:
        """Batches of this split that exist (the handshake's): train g < num_batches · run.epochs."""
        if self.split == "eval":
            return self.info.num_eval_batches
        return self.info.num_batches * self.settings.epochs

    def _reask_dropped(self, now: float) -> None:
        """A target's answer was dropped: whoever answered holds a connection the real target may
        not; connect afresh and ask again for everything pending there (its incarnation looked up again)."""
        for t, due in list(self.retry_at.items()):
            if now < due:
                continue
            del self.retry_at[t]
            self._learn_incarnation(t)
            self.client.reconnect(t)
            for g in sorted(g for g in self.pending if self.target_of(g) == t):
                self._ask(g)

    def _resend_to_restarted_targets(self) -> None:
        """A new incarnation of a target knows nothing of what the old one owed us: once it is
        ready (its data socket bound), drop the connection (it may lead to whatever process took
        the old socket over), connect afresh and ask the new incarnation for everything pending.
        Requests sent while no target was listening are lost, so asking before it is ready does not do."""
        for t in {self.target_of(g) for g in self.pending if g not in self.deferred}:
            if self._reconnect_if_restarted(t):
                for g in sorted(g for g in self.pending if self.target_of(g) == t):
                    self._ask(g)

    def _refresh_connections(self) -> None:
        """Every target whose incarnation changed since we last looked gets a fresh connection."""
        for t in range(self.num_targets):
            self._reconnect_if_restarted(t)

    def _reconnect_if_restarted(self, t: int) -> bool:
        """Look target t's incarnation up again; a new one (a restart) gets a fresh connection: True."""
        known = self.incarnations[t]
        self._learn_incarnation(t)
        if known is not None and self.incarnations[t] != known:
            self.client.reconnect(t)
            return True
        return False

    def _learn_incarnation(self, t: int) -> None:
        """Remember target t's incarnation once it is ready (data socket bound); else keep the last known."""
        _, status, _ = probe(self.health_eps[t], timeout_s=0.5, keys_dir=curve.keys_for(self.settings.transport))
        if status and status.get("state") in ("ready", "training") and status.get("incarnation"):
            self.incarnations[t] = str(status["incarnation"])

    def _resend_overdue(self, now: float) -> None:
        """A stream that broke while its target stayed up (a tcp reconnect, a send that gave up)
        never completes: ask again. A late duplicate is dropped by the client."""
        wait = resend_wait(self.settings.transport.resend_after_s, self.slowest_answer_s)
        for g, asked in list(self.pending.items()):
            if g not in self.deferred and now - asked > wait:
                self._ask(g)

    def _ask_info(self) -> TargetInfo:
        """Ask target 0 about the dataset; it may still be loading its model, so wait for it."""
        self.client.request_info(0)
        asked = time.monotonic()
        while True:
            lifecycle.check()
            for event in self.client.poll(500):
                if isinstance(event, InfoArrived):
                    try:
                        return TargetInfo.from_wire(event.info)
                    except WireError as exc:  # counted and dropped; asked again below
                        self.client.drops("data-reply", f"target 0: {exc}")
                        asked = 0.0
            if self.health:
                self.health.progress(state="starting", waiting_for="target info")
            if time.monotonic() - asked > 30:  # the request may have gone to a dead socket
                self.client.forget(0)
                self.client.request_info(0)
                asked = time.monotonic()

    def empty_batch(self, g: int) -> Batch:
        """Zero loss weight; target labels too when the run trains on them (check_batch wants them)."""
        s, width = self.info.seq_len, self.info.hidden_width
        labels = torch.zeros(s, dtype=torch.int64) if self.settings.labels_from_target else None
        return Batch(
            g=g,
            hidden=torch.zeros(s, width, dtype=FIELDS["hidden"]),
            input_ids=torch.zeros(s, dtype=torch.int64),
            loss_mask=torch.zeros(s, dtype=torch.bool),
            position_ids=torch.arange(s, dtype=torch.int64),
            document_ids=torch.full((s,), -1, dtype=torch.int64),
            target_labels=labels,
        )

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
