"""The drafter worker: one GPU (or CPU slot), one torch.distributed rank among the drafters.

    starting -> loading -> compiling -> ready -> training -> stopped      (or failed)
                                                     \\-> draining (SIGTERM: finish the step, checkpoint, exit 3)

DrafterWorker has the worker shape both roles share (services/process/worker_main.py, which starts it and maps
how it ended to an exit code): setup(cfg) (config and checkpoint errors before any GPU work), train() (the
loop, then finish()), close(). It is the process shell of the drafter's core (core.py: no sockets,
signals or health).
One batch: `batches` (source.py: ZmqSource pulls batch g from target g mod T) -> DrafterCore.step
(train.train_step: anchors -> drafter -> loss -> DDP -> AdamW) -> bookkeeping.Bookkeeping.after_batch (ledger,
metrics, evaluation, checkpoints). What every rank does together is in collectives.py.

--resume continues from the newest good checkpoint in <run_dir>/checkpoints (or starts fresh when
there is none), on any number of drafter ranks: the schedule continues from the batches it had done.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from pathlib import Path

import torch

from services.drafter.books.bookkeeping import Bookkeeping, BookSettings
from services.drafter.checkpoints import checkpoint as ckpt
from services.drafter.checkpoints import checkpoint_share
from services.drafter.group import collectives
from services.drafter.modeling.target_head import model_and_head
from services.drafter.training.core import DrafterCore
from services.drafter.training.pick_source import BatchSource, eval_batches, train_batches
from services.drafter.training.source import SourceSettings
from services.drafter.training.synthetic import SyntheticSource
from services.drafter.training.train import parameter_fingerprint
from services.process import lifecycle
from services.process.compile_setup import RecompileWatch
from services.process.gpu_memory import gpu_memory
from services.process.health import HealthServer
from services.process.log import event
from services.run import runspec
from services.run.config import Config, ConfigError
from services.run.files import cpu_share
from services.run.placement import Placement

log = logging.getLogger("drafter")


def timed(batches):
    """Yield (batch, seconds spent waiting for it). A stop requested while waiting for data
    yields (None, seconds) and ends: the rank still joins the others' stop vote."""
    it = iter(batches)
    while True:
        start = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            return
        except lifecycle.Stopped:
            yield None, time.perf_counter() - start
            return
        yield batch, time.perf_counter() - start


class DrafterWorker:
    """The drafter's process shell around its core (core.py: DrafterCore.step(batch) -> metrics): the data
    source, health, the stop vote, the bookkeeping. setup(cfg) builds them from the config; none of
    them, nor this class, keeps the whole config."""

    def __init__(self, args: argparse.Namespace, device: torch.device, health: HealthServer, workers_on_node: int):
        self.args, self.device, self.health = args, device, health
        self.run_dir, self.rank, self.world_size = Path(args.run_dir), args.rank, args.world_size
        self.workers_on_node = workers_on_node
        self.batches: BatchSource | None = None
        self.bookkeeping = None
        self.compile_s, self.recompiles = 0.0, None
        self.train_s = 0.0  # seconds in batches (data wait + step), not in evals or checkpoints: the ETA's clock

    # --- loading -> compiling -> ready ---------------------------------------------------------
    def setup(self, cfg: Config) -> None:
        args, device, health, rank = self.args, self.device, self.health, self.rank
        health.set(state="loading")
        max_steps = args.max_steps if args.max_steps is not None else cfg.run.max_steps
        self.log_every = max(1, cfg.log.every)
        # a fair share of the cores: several workers oversubscribing them slows every one of them down
        torch.set_num_threads(cpu_share(self.workers_on_node))
        self.spec = runspec.for_worker(cfg, self.run_dir, synthetic=args.synthetic)  # runspec.json, or resolved here
        model_cfg, head = model_and_head(self.spec, cfg.run.seed)
        found = self.find_checkpoint(model_cfg, cfg)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda but CUDA is not available")
        collectives.join(
            cfg.transport.dist_port, rank, self.world_size, device, args.dist_backend, run_dir=self.run_dir
        )
        if args.resume:  # rank 0's checkpoint, sent to ranks on hosts without it (a group across hosts)
            found = checkpoint_share.share(found, self.run_dir, rank, tick=health.progress)
        if not collectives.same_everywhere(found.micro_step if found else -1, device):
            raise RuntimeError("drafter ranks picked different checkpoints to resume from (is checkpoints/ shared?)")
        self.core = core = DrafterCore.build(
            cfg, model_cfg, head, device, world_size=self.world_size, total_steps=max(1, max_steps)
        )
        self.state = state = core.state
        self.compile_s = self.compile(model_cfg, cfg)  # before asking for batches: the targets load meanwhile
        at = Placement(self.run_dir, "drafter", rank, self.world_size, 0 if args.synthetic else args.num_targets)
        sources = SourceSettings.from_config(cfg, at)
        self.batches, plan = train_batches(
            sources,
            model_cfg,
            health,
            device,
            synthetic=args.synthetic,
            max_steps=max_steps,
            start_step=found.micro_step if found else 0,
            first_g=found.batches_done if found else 0,
            check=core.check,  # values too, before a batch goes to the GPU early
        )
        self.batches.check_targets(self.spec)  # the targets' handshake, against this drafter's run spec
        held_out = eval_batches(sources, model_cfg, health, device, synthetic=args.synthetic, check=core.check)
        core.plan(plan)  # the lr schedule's real horizon, now known
        if found:
            for note in ckpt.restore(state, found, rank):
                log.warning("%s", note)
            # skipped: the launcher says why a newer checkpoint was passed over, not only this log
            event("resumed", rank=rank, checkpoint=str(found.path), skipped=found.skipped, **state.counters())
        self.bookkeeping = Bookkeeping(BookSettings.from_config(cfg, at), state, health, found, held_out, plan=plan)
        health.set(
            state="ready",
            compile_s=self.compile_s,
            total_steps=plan.optimizer_steps,
            step=state.step,
            samples_done=state.samples_done,
        )  # set(): under systemd this also sends READY=1
        health.progress()
        event(
            "ready",
            rank=rank,
            compile_s=self.compile_s,
            params=state.drafter.num_parameters(),
            plan=plan.describe(),
            objective=cfg.drafter.objective,  # the log says what trains
            precision=cfg.kernels.precision,
        )

    def find_checkpoint(self, model_cfg, cfg: Config) -> ckpt.Found | None:
        """--resume: the newest good checkpoint (None: start fresh). Without --resume, refuse a run dir
        that has checkpoints (a fresh run there would mix two runs' checkpoints, ledger and metrics)."""
        if not self.args.resume:
            if ckpt.list_checkpoints(ckpt.checkpoints_dir(self.run_dir)):
                raise ConfigError(
                    f"{ckpt.checkpoints_dir(self.run_dir)} has checkpoints: pass --resume to continue "
                    "from them, or use another --run-dir"
                )
            return None
        return ckpt.find_resume_point(
            self.run_dir, model_cfg, cfg.to_dict(), self.world_size, log.warning, tick=self.health.progress
        )

    def compile(self, model_cfg, cfg: Config) -> float:
        """Compile the train step (and the eval forward) on a made-up batch; seconds it took."""
        self.health.set(state="compiling")
        self.health.progress()  # compiling is progress too (until the warmup returns)
        dummy = SyntheticSource(
            model_cfg,
            cfg.data.pack_len,
            seed=cfg.run.seed + 1,
            device=self.device,
            with_target_labels=cfg.target.labels_from_target,
        ).batch(0)
        seconds = self.core.compile(dummy, with_eval=cfg.eval.every > 0)
        self.recompiles = RecompileWatch()  # any graph compiled from here on is a recompile
        return seconds

    # --- training ------------------------------------------------------------------------------
    def train(self, stop: threading.Event) -> bool:
        """Train until the plan is done or a stop is asked on any rank, then finish. True: the plan is done."""
        self.health.set(state="training")
        last, interrupted = time.perf_counter(), False
        for batch, waited in timed(self.batches):
            if collectives.stop_everywhere(stop.is_set() or batch is None, self.device):
                interrupted = True  # the checkpoint is the last optimizer step's state
                break
            start = time.perf_counter()
            m = self.core.step(batch)
            now = time.perf_counter()
            self.after_step(batch.g, m, waited_s=waited, compute_s=now - start, elapsed_s=now - last)
            last = now
        self.finish(completed=not interrupted)
        return not interrupted

    def after_step(self, g: int, m: dict, waited_s: float, compute_s: float, elapsed_s: float) -> None:
        # loss, τ and tokens/s reach health with each metrics line (bookkeeping), not per step: one
        # definition of each figure for metrics.jsonl, the launcher's line and `launcher status`
        state = self.state
        self.train_s += waited_s + compute_s
        stamp = dict(
            step=state.step,
            samples_done=state.samples_done,
            recompiles=self.recompiles.count,
            train_s=round(self.train_s, 3),
            compile_s=self.compile_s,
            **gpu_memory(self.device),
        )
        self.health.progress(**stamp)
        provenance, target = self.batches.provenance_of(g), self.batches.target_of(g)
        if m.get("nonfinite") and target is not None:
            m["nonfinite"] += f" from target-{target}"
        self.bookkeeping.after_batch(g, m, waited_s, compute_s, provenance)  # ledger, metrics, eval, checkpoint
        if state.micro_step % self.log_every == 0:  # this rank's own step, in its log
            event(
                "step",
                **{
                    "rank": self.rank,
                    **m,
                    **stamp,
                    "step_tokens_per_s": round(m["tokens"] / elapsed_s, 1),
                    "step_s": round(elapsed_s, 4),
                },
            )

    def finish(self, completed: bool) -> None:
        if not completed:
            self.health.set(state="draining")
        self.bookkeeping.finish(completed=completed)  # final checkpoint; export when completed
        event(
            "stopped",
            rank=self.rank,
            signal=not completed,
            **self.state.counters(),
            recompiles=self.recompiles.count,
            params_digest=parameter_fingerprint(self.state.drafter),
            # what real acceptance during training cost this process (rank 0's passes), stopped or done
            real_acceptance=self.bookkeeping.cadence.figures(time.perf_counter()),
        )
        self.health.set(state="stopped")

    def close(self) -> None:
        if self.bookkeeping is not None:
            self.bookkeeping.close()
        if self.batches is not None:
            self.batches.close()
        collectives.leave()
