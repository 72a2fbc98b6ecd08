"""A target worker in this interpreter: its real shell (services/target/worker.py TargetWorker) and core,
served by a thread on the endpoints its process would bind, with its health socket. Drafter-side code
in the test (ZmqSource, RemoteSpecEval, a DrafterCore) talks to it over real ZMQ, as to a process.

What it leaves out is the process bootstrap (services/process/worker_main.py: signals and exit
codes), which tests/e2e/test_target_worker.py and test_stop_signals.py cover with real processes.
"""

from __future__ import annotations

import argparse
import threading
from pathlib import Path

import torch

from services.net.endpoints import endpoint
from services.net.health_probe import probe
from services.process.health import HealthServer
from services.run.config import load_config
from services.target.worker import TargetWorker


class InProcessTarget:
    """A target worker (rank 0 of 1) on a run dir: start(), status(), stop(); start() again after a stop
    is a restart under a new incarnation on the same sockets."""

    def __init__(self, run_dir: Path, overrides: list[str]):
        self.run_dir, self.overrides = Path(run_dir), overrides
        self.cfg = load_config(None, overrides)
        self.health_ep = endpoint(self.run_dir, self.cfg.transport, "target", 0, "health")
        self.data_ep = endpoint(self.run_dir, self.cfg.transport, "target", 0, "data")
        self.worker: TargetWorker | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> dict:
        """Load the core (on this thread) and serve it on a thread of its own: the status at `ready`."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.health = HealthServer(self.health_ep, "target", 0, "cpu")
        args = argparse.Namespace(run_dir=str(self.run_dir), rank=0, world_size=1)
        self.worker = TargetWorker(args, torch.device("cpu"), self.health)
        self.worker.setup(self.cfg)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.worker.train, args=(self.stopping,), daemon=True)
        self.thread.start()
        return self.health.snapshot()

    @property
    def core(self):
        return self.worker.core

    def status(self) -> dict:
        _, status, _ = probe(self.health_ep, timeout_s=5.0)
        return status

    def stop(self) -> None:
        """The shell's stop (as on SIGTERM): the batches in hand go out, the sockets close."""
        if self.thread is not None:
            self.stopping.set()
            self.thread.join(timeout=60)
            assert not self.thread.is_alive(), "the target's serving thread did not stop"
            self.thread = None
            self.health.close()
