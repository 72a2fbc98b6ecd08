"""The target's work with no sockets, signals or health: TargetCore.answer(request) -> replies.

    core = TargetCore.load(cfg, spec, run_dir, device, incarnation)   # model, data, compile, ring
    for request in requests:
        replies = core.answer(request)        # replies.py: info, a batch, an error, a verify answer
    replies = core.run_waiting()              # verify requests the target's share held back

The shell (worker.py) owns the batch server, health and the stop signal, and is the only code that
calls these; a test runs the same core in its own interpreter (tests/inprocess.py). A batch reply's
capture may still be running on the GPU: its `ready` event says when, `release` frees its slot.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from services.data.batch import Batch, count_documents
from services.net.handshake import TargetInfo
from services.net.transport import Request
from services.run import runspec
from services.run.config import Config
from services.target.batches.packing import Packing, open_or_build
from services.target.batches.ring import CaptureRing
from services.target.model.compiled import compile_and_warm_up
from services.target.model.model import load_target
from services.target.replies import BatchReply, ErrorReply, InfoReply, Reply
from services.target.verify.verifying import VerifyService, VerifySettings, warm_up_verify

log = logging.getLogger("target")


@dataclass(frozen=True)
class TargetSettings:
    """What the target core reads of the run, built once from the config and the run spec."""

    ring_slots: int  # one per credit of a drafter that is slow to drain, one being sent, one filled
    labels_from_target: bool
    compile: str  # target.compile
    model_path: str
    verify: VerifySettings

    @classmethod
    def from_config(cls, cfg: Config, spec: runspec.RunSpec) -> "TargetSettings":
        return cls(
            ring_slots=cfg.transport.credits + 2,
            labels_from_target=cfg.target.labels_from_target,
            compile=cfg.target.compile,
            model_path=str(cfg.target.model_path),
            verify=VerifySettings.from_config(cfg, spec),
        )


class TargetCore:
    def __init__(self, target, data, info: dict, ring: CaptureRing, verify: VerifyService):
        self.target, self.data, self.info, self.ring, self.verify = target, data, info, ring, verify
        self.batches_served = self.samples_done = 0
        self.tokens_per_s = 0.0
        self.last_answer = time.perf_counter()
        self.compile_s, self.warning = 0.0, ""

    @classmethod
    def load(cls, cfg: Config, spec: runspec.RunSpec, run_dir: Path, device: torch.device, incarnation: str):
        """The model (checked against the run spec), the packed data, the compiled capture and the
        warmed-up verify path: everything up to `ready`."""
        from transformers import AutoTokenizer

        settings = TargetSettings.from_config(cfg, spec)
        target = load_target(spec.target_config(cfg), device)
        if device.type == "cuda":  # what sharing a GPU must leave room for (docs/guide/sizing.md)
            held, peak = torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
            log.info("model loaded on %s: %.1f GiB held, %.1f GiB at its peak", device, held / 2**30, peak / 2**30)
        spec.check_loaded(target.info)  # what this process loaded is what the spec says
        tokenizer = AutoTokenizer.from_pretrained(cfg.target.model_path)
        data = open_or_build(Packing.from_config(cfg), run_dir, tokenizer, spec.target.vocab_size)
        info = TargetInfo.of(
            target.info,
            num_batches=data.num_batches("train"),
            num_eval_batches=data.num_batches("eval"),
            seq_len=data.pack_len,
            mask_token_id=tokenizer.mask_token_id if tokenizer.mask_token_id is not None else -1,
            labels_from_target=settings.labels_from_target,
            config_digest=spec.config_digest,
            model_path=settings.model_path,
            capture_path=target.path,
            bad_samples=data.bad_samples,
            data_key=data.key,
        ).to_wire()
        log.info("capture path: %s", target.path)
        if target.warning:
            log.warning("%s", target.warning)
        compile_s = compile_and_warm_up(target, settings.compile, data.pack_len, settings.labels_from_target)
        if settings.verify.warm_up:  # the first real-acceptance eval must not wait for first calls
            log.info("%s", warm_up_verify(target, settings.verify.block_size))
        ring = CaptureRing(target, data.pack_len, settings.ring_slots, settings.labels_from_target)
        core = cls(target, data, info, ring, VerifyService(target, settings.verify, incarnation))
        core.compile_s, core.warning = compile_s, target.warning or ""
        return core

    @property
    def waiting(self) -> bool:
        """Verify requests wait for the target's share: the shell polls more often meanwhile."""
        return bool(self.verify.waiting)

    def answer(self, request: Request) -> list[Reply]:
        if request.kind == "info":
            return [InfoReply(request.client, self.info)]
        if request.kind == "verify":
            return self.verify.submit(request)
        self.verify.saw_batch_request()
        try:
            parts = self.data.batch(request.g, request.split)
        except IndexError as exc:
            return [ErrorReply(request.client, request.g, str(exc), request.split)]
        hidden, labels, ready, release = self.ring.capture(parts)
        batch = Batch(g=request.g, hidden=hidden, target_labels=labels, **parts)
        self._count(batch)
        return [BatchReply(request.client, batch, request.split, ready, release)]

    def run_waiting(self) -> list[Reply]:
        return self.verify.run_waiting()

    def _count(self, batch: Batch) -> None:
        """The rate is tokens per second between answers (the GPU's pace once the pipeline is full,
        since capture() waits only when every slot is still in flight)."""
        now = time.perf_counter()
        seconds, self.last_answer = now - self.last_answer, now
        self.batches_served += 1
        self.samples_done += int(count_documents(batch.document_ids))
        rate = batch.num_tokens / max(seconds, 1e-9)
        self.tokens_per_s = rate if self.batches_served == 1 else 0.9 * self.tokens_per_s + 0.1 * rate

    def progress(self) -> dict:
        """What health shows of the batches served."""
        return dict(
            step=self.batches_served,
            batches_served=self.batches_served,
            samples_done=self.samples_done,
            tokens_per_s=round(self.tokens_per_s, 1),
        )
