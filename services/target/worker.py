"""The target worker: one process per target GPU, serving batches of captured hidden states.

    python -m services.target --config FILE --run-dir DIR --rank T --world-size NT [--device cpu|cuda] [k=v ...]

States (health): starting -> loading (model + data index) -> ready -> training (serving) ->
draining (SIGTERM: finish the batch in hand) -> stopped; failed on an error (exit codes: services/process/exits.py).
Requests are served in arrival order: "info" -> the dict below; "batch" g -> build row g,
queue its capture on the GPU, hand it to the transport's I/O thread; "verify" -> a step of the
drafters' real-acceptance eval on this process's own target (verify/verifying.py, which bounds its share
of the target's time). Any rank can build any batch; the rank only decides which requests arrive here.

The work is the core's (core.py: TargetCore.answer(request) -> replies, no sockets); this file is its
process shell: the batch server, health, the stop signal. Nothing in this loop waits for the GPU or
the network (batches/ring.py, transport.BatchServer): while the
GPU runs one forward, this thread builds the next row and queues the next forward; a side stream
copies finished captures into pinned host slots, and the I/O thread streams them to the drafters
once copied. The number of slots (transport.credits + 2) bounds the host memory in flight.
"""

from __future__ import annotations

import argparse
import threading
from pathlib import Path

import torch

from services.net.endpoints import endpoint
from services.net.transport import BatchServer, new_incarnation
from services.process.compile_setup import RecompileWatch, setup_environment
from services.process.gpu_memory import gpu_memory
from services.process.health import HealthServer
from services.process.log import event
from services.process.worker_main import Role, workers_on_node
from services.process.worker_main import main as worker_main
from services.run import runspec
from services.run.config import Config
from services.target.core import TargetCore
from services.target.replies import BatchReply, Dropped, ErrorReply, InfoReply, Reply, VerifyReply

POLL_MS = 100


class TargetWorker:
    """The target's process shell around its core (core.py), in the worker shape both roles share
    (services/process/worker_main.py): setup(cfg) loads up to `ready`, train(stop) serves until a stop
    request (a target has no end of its own) and finishes, close(). Only this class touches the
    batch server and health; the core answers."""

    def __init__(self, args: argparse.Namespace, device: torch.device, health: HealthServer):
        self.device, self.health = device, health
        self.run_dir, self.rank = Path(args.run_dir), args.rank
        self.server: BatchServer | None = None

    def setup(self, cfg: Config) -> None:
        health = self.health
        health.set(state="loading")
        spec = runspec.for_worker(cfg, self.run_dir)  # runspec.json, or resolved here the same way
        incarnation = new_incarnation()
        self.core = core = TargetCore.load(cfg, spec, self.run_dir, self.device, incarnation)
        if core.warning:
            health.set(warning=core.warning)
        self.recompiles = RecompileWatch()  # a graph compiled from here on is a recompile (should stay 0)
        self.server = BatchServer(
            endpoint(self.run_dir, cfg.transport, "target", self.rank, "data"),
            cfg.transport,
            health,
            verify_limits=core.verify.limits,
            incarnation=incarnation,
        )
        health.set(state="ready", compile_s=round(core.compile_s, 1), compiled=bool(core.target.compiled), **core.info)
        event("ready", rank=self.rank, **{k: v for k, v in core.info.items() if k != "model_path"})

    def train(self, stop: threading.Event) -> bool:
        """Serve until a stop request, then finish: True (a stop is a target's end: exit 0)."""
        self.serve(stop)
        self.finish()
        return True

    def serve(self, stop: threading.Event) -> None:
        while not stop.is_set():
            for request in self.server.poll(5 if self.core.waiting else POLL_MS):
                self.send(self.core.answer(request))
                if stop.is_set():
                    break  # SIGTERM: the batch in hand is done; the rest will be asked again
            self.send(self.core.run_waiting())
            self.health.progress()  # the loop is alive even when nobody asks

    def send(self, replies: list[Reply]) -> None:
        server = self.server
        for reply in replies:
            match reply:
                case InfoReply(client, info):
                    server.send_info(client, info)
                case ErrorReply(client, g, message, split):
                    server.send_error(client, g, message, split)
                case Dropped(kind, text):
                    server.drops(kind, text)
                case VerifyReply(client, messages):
                    # health first: a drafter that has the answer reads a status that counts it
                    self.health.set(**self.core.verify.status())
                    server.send_messages(client, messages)
                case BatchReply(client, batch, split, ready, release):
                    server.send_batch(client, batch, split, ready=ready, release=release)
                    self.health.progress(
                        state="training",
                        **self.core.progress(),
                        recompiles=self.recompiles.count,
                        **gpu_memory(self.device),
                    )

    def finish(self) -> None:
        self.health.set(state="draining")
        self.server.flush(timeout_s=10)  # the batches in hand go out
        self.server.close()
        self.health.set(state="stopped")
        event("stopped", rank=self.rank, batches_served=self.core.batches_served)

    def close(self) -> None:
        """Nothing left to free: finish() closes the batch server; after a crash the process ends."""


def prepare(args: argparse.Namespace, cfg: Config) -> None:
    if cfg.target.compile != "off":  # the run's compile cache, this process's share of the cores
        setup_environment(args.run_dir, workers_on_node=workers_on_node(args))


ROLE = Role(name="target", usage=__doc__.split("\n")[0], make_worker=TargetWorker, prepare=prepare)


def main(argv=None) -> int:
    return worker_main(ROLE, argv)
