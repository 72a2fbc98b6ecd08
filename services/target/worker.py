"""The target worker: one process per target GPU, serving batches of captured hidden states.

    python -m services.target --config FILE --run-dir DIR --rank T --world-size NT [--device cpu|cuda] [k=v ...]

States (health): starting -> loading (model + data index) -> ready -> training (serving) ->
draining (SIGTERM: finish the batch in hand) -> stopped; failed on an error (exit codes: services/process/exits.py).
Requests are served in arrival order: "info" -> the dict below; "batch" g -> build row g,
queue its capture on the GPU, hand it to the transport's I/O thread; "verify" -> a step of the
drafters' real-acceptance eval on this process's own target (verifying.py, which bounds its share
of the target's time). Any rank can build any batch; the rank only decides which requests arrive here.

Nothing in this loop waits for the GPU or the network (ring.py, transport.BatchServer): while the
GPU runs one forward, this thread builds the next row and queues the next forward; a side stream
copies finished captures into pinned host slots, and the I/O thread streams them to the drafters
once copied. The number of slots (transport.credits + 2) bounds the host memory in flight.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from services.data.batch import Batch, count_documents
from services.net.endpoints import endpoint
from services.net.handshake import TargetInfo
from services.net.transport import BatchServer, Request
from services.process.compile_setup import RecompileWatch, setup_environment
from services.process.gpu_memory import gpu_memory
from services.process.health import HealthServer
from services.process.log import event
from services.process.worker_main import Role, workers_on_node
from services.process.worker_main import main as worker_main
from services.run import runspec
from services.run.config import Config, TransportConfig
from services.target.compiled import compile_and_warm_up
from services.target.model import load_target
from services.target.packing import open_or_build
from services.target.ring import CaptureRing
from services.target.verifying import VerifyService, VerifySettings, warm_up_verify

log = logging.getLogger("target")
POLL_MS = 100


@dataclass(frozen=True)
class ServeSettings:
    """What the target worker reads of the run to serve batches, built once from the config and the run
    spec (as the drafter's train.StepSettings is): where the batch server listens, the transport, the
    capture ring's slots, and the verify service's settings."""

    endpoint: str  # the data socket
    transport: TransportConfig
    ring_slots: int  # one per credit of a drafter that is slow to drain, one being sent, one filled
    labels_from_target: bool
    compile: str  # target.compile
    model_path: str
    verify: VerifySettings

    @classmethod
    def from_config(cls, cfg: Config, spec: runspec.RunSpec, run_dir: Path, rank: int) -> "ServeSettings":
        return cls(
            endpoint=endpoint(run_dir, cfg.transport, "target", rank, "data"),
            transport=cfg.transport,
            ring_slots=cfg.transport.credits + 2,
            labels_from_target=cfg.target.labels_from_target,
            compile=cfg.target.compile,
            model_path=str(cfg.target.model_path),
            verify=VerifySettings.from_config(cfg, spec),
        )


class TargetWorker:
    """The worker shape both roles share (services/process/worker_main.py): setup() loads up to `ready`,
    train(stop) serves until a stop request (a target has no end of its own) and finishes, close()."""

    def __init__(self, args: argparse.Namespace, cfg: Config, device: torch.device, health: HealthServer):
        self.cfg, self.device, self.health = cfg, device, health
        self.run_dir, self.rank = Path(args.run_dir), args.rank
        self.batches_served = self.samples_done = 0
        self.tokens_per_s = 0.0

    def setup(self) -> None:
        from transformers import AutoTokenizer

        cfg, health = self.cfg, self.health
        health.set(state="loading")
        spec = runspec.for_worker(cfg, self.run_dir)  # runspec.json, or resolved here the same way
        self.settings = settings = ServeSettings.from_config(cfg, spec, self.run_dir, self.rank)
        self.target = load_target(spec.target_config(cfg), self.device)
        spec.check_loaded(self.target.info)  # what this process loaded is what the spec says
        tokenizer = AutoTokenizer.from_pretrained(cfg.target.model_path)
        self.data = open_or_build(cfg, self.run_dir, tokenizer, spec.target.vocab_size)
        info = self.target.info
        self.info = TargetInfo.of(
            info,
            num_batches=self.data.num_batches("train"),
            num_eval_batches=self.data.num_batches("eval"),
            seq_len=self.data.pack_len,
            mask_token_id=tokenizer.mask_token_id if tokenizer.mask_token_id is not None else -1,
            labels_from_target=settings.labels_from_target,
            config_digest=spec.config_digest,
            model_path=settings.model_path,
            capture_path=self.target.path,
            bad_samples=self.data.bad_samples,
            data_key=self.data.key,
        ).to_wire()
        log.info("capture path: %s", self.target.path)
        if self.target.warning:
            log.warning("%s", self.target.warning)
            health.set(warning=self.target.warning)
        self.compile_s = compile_and_warm_up(
            self.target, settings.compile, self.data.pack_len, settings.labels_from_target
        )
        if settings.verify.warm_up:  # the first real-acceptance eval must not wait for first calls
            log.info("%s", warm_up_verify(self.target, settings.verify.block_size))
        self.recompiles = RecompileWatch()  # a graph compiled from here on is a recompile (should stay 0)
        self.ring = CaptureRing(self.target, self.data.pack_len, settings.ring_slots, settings.labels_from_target)
        self.server = BatchServer(settings.endpoint, settings.transport, health, verify_limits=settings.verify.limits)
        self.verify = VerifyService(self.target, self.server, settings.verify, health)
        self.last_answer = time.perf_counter()
        health.set(state="ready", compile_s=round(self.compile_s, 1), compiled=bool(self.target.compiled), **self.info)
        event("ready", rank=self.rank, **{k: v for k, v in self.info.items() if k != "model_path"})

    def train(self, stop: threading.Event) -> bool:
        """Serve until a stop request, then finish: True (a stop is a target's end: exit 0)."""
        self.serve(stop)
        self.finish()
        return True

    def serve(self, stop: threading.Event) -> None:
        while not stop.is_set():
            for request in self.server.poll(5 if self.verify.waiting else POLL_MS):
                self.answer(request)
                if stop.is_set():
                    break  # SIGTERM: the batch in hand is done; the rest will be asked again
            self.verify.run_waiting()
            self.health.progress()  # the loop is alive even when nobody asks

    def answer(self, request: Request) -> None:
        if request.kind == "info":
            self.server.send_info(request.client, self.info)
            return
        if request.kind == "verify":
            self.verify.submit(request)
            return
        self.verify.saw_batch_request()
        try:
            parts = self.data.batch(request.g, request.split)
        except IndexError as exc:
            self.server.send_error(request.client, request.g, str(exc), request.split)
            return
        hidden, labels, ready, release = self.ring.capture(parts)
        batch = Batch(g=request.g, hidden=hidden, target_labels=labels, **parts)
        self.server.send_batch(request.client, batch, request.split, ready=ready, release=release)
        self.stamp(batch)

    def stamp(self, batch: Batch) -> None:
        """Progress for health: the rate is tokens per second between answers (the GPU's pace once
        the pipeline is full, since capture() waits only when every slot is still in flight)."""
        now = time.perf_counter()
        seconds, self.last_answer = now - self.last_answer, now
        self.batches_served += 1
        self.samples_done += int(count_documents(batch.document_ids))
        rate = batch.num_tokens / max(seconds, 1e-9)
        self.tokens_per_s = rate if self.batches_served == 1 else 0.9 * self.tokens_per_s + 0.1 * rate
        self.health.progress(
            state="training",
            step=self.batches_served,
            batches_served=self.batches_served,
            samples_done=self.samples_done,
            tokens_per_s=round(self.tokens_per_s, 1),
            recompiles=self.recompiles.count,
            **gpu_memory(self.device),
        )

    def finish(self) -> None:
        self.health.set(state="draining")
        self.server.flush(timeout_s=10)  # the batches in hand go out
        self.server.close()
        self.health.set(state="stopped")
        event("stopped", rank=self.rank, batches_served=self.batches_served)

    def close(self) -> None:
        """Nothing left to free: finish() closes the batch server; after a crash the process ends."""


def prepare(args: argparse.Namespace, cfg: Config) -> None:
    if cfg.target.compile != "off":  # the run's compile cache, this process's share of the cores
        setup_environment(args.run_dir, workers_on_node=workers_on_node(args))


ROLE = Role(name="target", usage=__doc__.split("\n")[0], make_worker=TargetWorker, prepare=prepare)


def main(argv=None) -> int:
    return worker_main(ROLE, argv)
