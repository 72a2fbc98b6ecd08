"""The target worker: one process per target GPU, serving batches of captured hidden states.

    python -m services.target --config FILE --run-dir DIR --rank T --world-size NT [--device cpu|cuda] [k=v ...]

States (health): starting -> loading (model + data index) -> ready -> training (serving) ->
draining (SIGTERM: finish the batch in hand) -> stopped; failed on an error (exit codes: services/exits.py).
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
import os
import threading
import time
from pathlib import Path

import torch

from services import exits, lifecycle, runspec
from services.batch import Batch
from services.config import Config, ConfigError, load_config
from services.endpoints import endpoint
from services import curve
from services.handshake import TargetInfo
from services.health import HealthServer
from services.log import event, setup_logging
from services.compile import RecompileWatch, setup_environment
from services.target.compiled import compile_and_warm_up
from services.target.model import load_target
from services.target.ring import CaptureRing
from services.target.verifying import VerifyService, VerifySettings, verify_limits, warm_up_verify
from services.target.packing import open_or_build
from services.transport import BatchServer, Request
from services.gpu_memory import gpu_memory

log = logging.getLogger("target")
POLL_MS = 100


class TargetWorker:
    def __init__(self, cfg: Config, run_dir: Path, rank: int, device: torch.device, health: HealthServer):
        from transformers import AutoTokenizer
        self.cfg, self.device, self.health = cfg, device, health
        health.set(state="loading")
        spec = runspec.for_worker(cfg, run_dir)          # runspec.json, or resolved here the same way
        self.target = load_target(spec.target_config(cfg), device)
        spec.check_loaded(self.target.info)             # what this process loaded is what the spec says
        tokenizer = AutoTokenizer.from_pretrained(cfg.target.model_path)
        self.data = open_or_build(cfg, run_dir, tokenizer, spec.target.vocab_size)
        info = self.target.info
        self.info = TargetInfo.of(
            info, num_batches=self.data.num_batches("train"), num_eval_batches=self.data.num_batches("eval"),
            seq_len=self.data.pack_len,
            mask_token_id=tokenizer.mask_token_id if tokenizer.mask_token_id is not None else -1,
            labels_from_target=cfg.target.labels_from_target, config_digest=spec.config_digest,
            model_path=str(cfg.target.model_path), capture_path=self.target.path,
            bad_samples=self.data.bad_samples, data_key=self.data.key).to_wire()
        log.info("capture path: %s", self.target.path)
        if self.target.warning:
            log.warning("%s", self.target.warning)
            health.set(warning=self.target.warning)
        self.compile_s = compile_and_warm_up(self.target, cfg.target.compile, self.data.pack_len,
                                             cfg.target.labels_from_target)
        if cfg.run.spec_eval_prompts:            # the first real-acceptance eval must not wait for first calls
            log.info("%s", warm_up_verify(self.target, spec.block_size))
        self.recompiles = RecompileWatch()       # a graph compiled from here on is a recompile (should stay 0)
        # one slot per credit of a drafter that is slow to drain, one being sent, one being filled
        self.ring = CaptureRing(self.target, self.data.pack_len, cfg.transport.credits + 2, cfg.target.labels_from_target)
        self.server = BatchServer(endpoint(run_dir, cfg.transport, "target", rank, "data"), cfg.transport, health,
                                  verify_limits=verify_limits(cfg, spec))
        self.verify = VerifyService(self.target, self.server, VerifySettings.from_config(cfg, spec), health)
        self.batches_served = self.samples_done = 0
        self.tokens_per_s = 0.0
        self.last_answer = time.perf_counter()
        health.set(state="ready", compile_s=round(self.compile_s, 1), compiled=bool(self.target.compiled), **self.info)

    def serve(self, stop: threading.Event) -> None:
        while not stop.is_set():
            for request in self.server.poll(5 if self.verify.waiting else POLL_MS):
                self.answer(request)
                if stop.is_set():
                    break          # SIGTERM: the batch in hand is done; the rest will be asked again
            self.verify.run_waiting()
            self.health.progress()   # the loop is alive even when nobody asks
        self.health.set(state="draining")
        self.server.flush(timeout_s=10)   # the batches in hand go out
        self.server.close()

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
        self.samples_done += int(batch.document_ids.max()) + 1
        rate = batch.num_tokens / max(seconds, 1e-9)
        self.tokens_per_s = rate if self.batches_served == 1 else 0.9 * self.tokens_per_s + 0.1 * rate
        self.health.progress(state="training", step=self.batches_served, batches_served=self.batches_served,
                             samples_done=self.samples_done, tokens_per_s=round(self.tokens_per_s, 1),
                             recompiles=self.recompiles.count, **gpu_memory(self.device))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.target", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=False, default=None, help="TOML (or resolved JSON) config file")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    p.add_argument("overrides", nargs="*", help="section.key=value")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_logging("target", args.rank)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:                    # bad config: one clear line, no traceback
        return exits.exit_code(exc)
    device = torch.device("cuda:0" if (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda" else "cpu")
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0") if device.type == "cuda" else "cpu"
    run_dir = Path(args.run_dir)
    if cfg.target.compile != "off":            # the run's compile cache, this process's share of the cores
        setup_environment(run_dir, workers_on_node=int(os.environ.get("LOCAL_WORLD_SIZE", args.world_size)))
    health = HealthServer(endpoint(run_dir, cfg.transport, "target", args.rank, "health"), "target", args.rank,
                          gpu, stall_after_s=cfg.run.stall_after_s,
                          startup_stall_after_s=cfg.run.startup_stall_after_s,
                          keys_dir=curve.keys_for(cfg.transport))
    stop = lifecycle.install(grace_s=cfg.run.stop_timeout_s)
    try:
        worker = TargetWorker(cfg, run_dir, args.rank, device, health)
        event("ready", rank=args.rank, **{k: v for k, v in worker.info.items() if k != "model_path"})
        worker.serve(stop)
        health.set(state="stopped")
        event("stopped", rank=args.rank, batches_served=worker.batches_served)
        return exits.OK
    except Exception as exc:                      # a config error, or a crash
        return exits.exit_code(exc, health)
    finally:
        health.close()
