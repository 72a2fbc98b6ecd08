"""Everything around the train steps of one drafter rank: ledger, metrics, evaluation,
checkpoints, the export at the end.

Every decision that involves a collective (log, evaluate, checkpoint) depends only on state all
ranks share (step counters, all-reduced results), so the ranks always call the same collectives.
Rank 0 alone writes shared files; a failed checkpoint write is all-reduced as a flag, so every rank
agrees on what was saved.

One piece on purpose (about 530 lines): the order of those decisions after each batch (after_batch:
finite check, metrics line, evaluation, real acceptance, checkpoint) is the ranks' contract, and it
reads in one place; the parts that stand alone are their own modules beside it (ledger.py,
metrics.py with MetricsWindow, cadence.py, wandb_log.py, and checkpoints/ for the files).
"""

from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

# imported with the worker, before it compiles: an import at the first evaluation registered a class
# with torch's pytree, which fails a guard of every compiled graph (flex attention recompiled)
from services.drafter.acceptance.remote_eval import RemoteEvalSettings, RemoteSpecEval, models_in_process
from services.drafter.books.cadence import Cadence, every_s_for
from services.drafter.books.ledger import Ledger, truncate_jsonl
from services.drafter.books.metrics import MetricsLog, MetricsWindow, StepTimes, reduce_train_metrics
from services.drafter.checkpoints import checkpoint as ckpt
from services.drafter.checkpoints.checkpoint_space import checkpoint_bytes, space_warning
from services.drafter.checkpoints.checkpoint_writer import BackgroundWriter
from services.drafter.group.collectives import gather_rng_states
from services.drafter.training.evaluate import evaluate
from services.drafter.training.train import TrainState
from services.process import exits
from services.process.health import HealthServer
from services.process.log import event
from services.run.config import Config
from services.run.placement import Placement
from services.run.runspec import HeldOut

# Real acceptance (speculative.py), rank 0, after each evaluation, every eval.every_s seconds of training
# ("periodic": true) and at the end of a completed run (that one with "final": true and the repeat_last
# and random controls): step, prompts, steps, tokens, acceptance_per_step, acceptance_per_prompt,
# tokens_per_forward, lossless, seconds, indices (of the prompts decoded; the controls decode exactly
# those), time; and the cost (cadence.py): pass_s (not the final's), passes, spent_s, wall_s, cost_frac.
# The lines of passes during training also go to metrics.jsonl.
ACCEPTANCE_FILE = "acceptance.jsonl"


log = logging.getLogger("drafter")


class NonFiniteError(exits.FinalError):
    """Too many optimizer steps in a row were skipped for non-finite data or gradients: a restart
    would train the same batches from the same checkpoint and skip them again."""


@dataclass(frozen=True)
class BookSettings:
    """What the bookkeeping reads of the run, built once from the config (as train.StepSettings is)."""

    at: Placement  # num_targets: the target workers that verify real acceptance (0: a local target, synthetic)
    log_every: int
    eval_every: int
    checkpoint_every: int
    keep_checkpoints: int
    max_nonfinite_steps: int
    export_at_end: bool
    wandb_project: str
    target_path: str  # target.model_path: the export names it; no path, no real acceptance
    seed: int
    spec_eval_prompts: int
    spec_eval_max_new_tokens: int
    spec_eval_budget_s: float
    spec_every_s: float  # eval.every_s as set (-1: by device, cadence.every_s_for)
    held_out_prompts: bool  # eval.prompts' files or a held-out split: what a periodic pass decodes
    config: dict = field(repr=False, compare=False)  # the run's whole config, as checkpoints and W&B record it
    # (head, model_cfg, health, prompts=, max_new_tokens=) -> RemoteSpecEval: the targets verify
    open_spec_eval: Callable = field(repr=False, compare=False)

    @classmethod
    def from_config(cls, cfg: Config, at: Placement) -> "BookSettings":
        return cls(
            at=at,
            log_every=cfg.log.every,
            eval_every=cfg.eval.every,
            checkpoint_every=cfg.checkpoint.every,
            keep_checkpoints=cfg.checkpoint.keep,
            max_nonfinite_steps=cfg.optimizer.max_nonfinite_steps,
            export_at_end=cfg.checkpoint.export_at_end,
            wandb_project=cfg.log.wandb_project,
            target_path=cfg.target.model_path,
            seed=cfg.run.seed,
            spec_eval_prompts=cfg.eval.num_prompts,
            spec_eval_max_new_tokens=cfg.eval.max_new_tokens,
            spec_eval_budget_s=cfg.eval.budget_s,
            spec_every_s=cfg.eval.every_s,
            held_out_prompts=bool(cfg.eval.prompts) or HeldOut.of(cfg).exists,
            config=cfg.to_dict(),
            open_spec_eval=functools.partial(RemoteSpecEval, RemoteEvalSettings.from_config(cfg, at)),
        )


class Bookkeeping:
    def __init__(
        self,
        settings: BookSettings,
        state: TrainState,
        health: HealthServer,
        resumed: ckpt.Found | None,
        eval_batches=None,
        plan=None,
    ):
        """plan: the run's (schedule.py), for the batches a checkpoint has done; None: one split from the start."""
        self.settings = settings
        self.run_dir, self.rank, self.world_size = settings.at.run_dir, settings.at.rank, settings.at.world_size
        self.plan = plan
        self.state, self.health, self.eval_batches = state, health, eval_batches
        self.num_targets = settings.at.num_targets  # the target workers that verify the real-acceptance eval
        self.root = ckpt.checkpoints_dir(self.run_dir)
        self.writer = BackgroundWriter(self.root, settings.keep_checkpoints, state.device)
        self.first_step = state.step
        self.ledger = Ledger(self.run_dir, self.rank, start_step=state.micro_step, world_size=self.world_size)
        self.metrics = MetricsLog(
            self.run_dir,
            resume_step=state.step,
            enabled=self.rank == 0,
            wandb_project=settings.wandb_project,
            config=settings.config,
        )
        self.times = StepTimes()
        self.window = MetricsWindow()
        self.saved_step = state.step if resumed else None
        self.best_tau = resumed.meta.get("best_tau") if resumed else None
        self.last_eval: dict | None = None
        self.last_metrics: dict | None = None  # the last optimizer step's metrics (for the final line)
        self.boundary = state.counters()  # counters at the last optimizer step: what a checkpoint saves
        self.logged_step = state.step
        self._spec_eval = None  # SpecEval once loaded; False when unavailable
        self.models_in_process = None  # HF models in this process, counted at the first real eval
        self.acceptance = self.run_dir / ACCEPTANCE_FILE
        self.cadence = Cadence(every_s_for(settings.spec_every_s, state.device.type), settings.spec_eval_budget_s)
        if self.rank == 0:
            truncate_jsonl(self.acceptance, state.step)  # a resume continues the curve, as metrics.jsonl does
            self.check_periodic()
        self.closed = False
        # non-finite batches (this rank's) and skipped optimizer steps (every rank's alike): health "integrity"
        self.integrity = {"nonfinite_batches": 0, "skipped_steps": 0, "last_nonfinite": ""}
        self.skipped_in_a_row = 0

    # --- per batch ---------------------------------------------------------------------------
    def after_batch(self, g: int, m: dict, data_s: float, compute_s: float, provenance: dict | None = None) -> None:
        """Ledger for every batch; on an optimizer step also metrics, evaluation and checkpoint."""
        if m.get("nonfinite"):
            provenance = {**(provenance or {}), "skipped": m["nonfinite"]}
        self.cadence.begin(time.perf_counter())
        self.ledger.record(self.state.micro_step - 1, g, m["tokens"], provenance)
        self.times.add(data_s, compute_s, m["tokens"])
        self.window.add(m)
        self.check_finite(g, m)
        if self.state.micro_step % self.state.settings.grad_accum:
            return
        step, run = self.state.step, self.settings
        if self.rank == 0:
            self.report_checkpoint(self.writer.done())
            if step == self.first_step + 1:  # the optimizer has its state now: size the buffers
                self.writer.prepare(self.state.drafter.state_dict(), self.state.optimizer.state_dict())
        self.last_metrics, self.boundary = m, self.state.counters()
        if step % max(1, run.log_every) == 0:
            self.log_metrics(self.window.mean(m))
        new_best = False
        if run.eval_every > 0 and step % run.eval_every == 0 and self.eval_batches is not None:
            new_best = self.run_eval()
        if (run.checkpoint_every > 0 and step % run.checkpoint_every == 0) or new_best:
            self.checkpoint(set_best=new_best)
        # rank 0 alone, by its own clock: the pass has no collective, so the other ranks need no say;
        # they go on and wait at the next step's all-reduce (the pass's budget bounds that wait)
        if self.rank == 0 and self.cadence.due(time.perf_counter()):
            self.run_spec_eval(periodic=True)

    def check_finite(self, g: int, m: dict) -> None:
        """Count and name a non-finite batch; stop the run after optimizer.max_nonfinite_steps skipped
        optimizer steps in a row. m["skipped_step"] is the same on every rank (all-reduced
        gradients), so every rank stops at the same step, before any collective of it."""
        counts, changed = self.integrity, False
        if m.get("nonfinite"):
            counts["nonfinite_batches"] += 1
            counts["last_nonfinite"] = f"{m['nonfinite']} (batch g={g}, step {self.state.step})"
            changed = True
            if counts["nonfinite_batches"] <= 3 or counts["nonfinite_batches"] % 100 == 0:
                log.warning("skipped batch g=%d: %s (%d so far)", g, m["nonfinite"], counts["nonfinite_batches"])
        if self.state.micro_step % self.state.settings.grad_accum == 0:
            if m.get("skipped_step"):
                counts["skipped_steps"] += 1
                self.skipped_in_a_row += 1
                changed = True
                log.warning("optimizer step %d skipped: non-finite gradient norm", self.state.step)
            else:
                self.skipped_in_a_row = 0
        if changed:
            self.health.progress(integrity=dict(counts))
        limit = self.settings.max_nonfinite_steps
        if self.skipped_in_a_row >= limit:
            cause = counts["last_nonfinite"] or "non-finite gradients from another drafter rank's batches (see its log)"
            raise NonFiniteError(
                f"{self.skipped_in_a_row} optimizer steps in a row skipped "
                f"(optimizer.max_nonfinite_steps={limit}): {cause}; no weights were updated "
                "from them and none were saved"
            )

    def log_metrics(self, m: dict) -> None:
        """Collective: one train line, the metrics of every rank's batch of this step combined."""
        record = {
            "step": self.state.step,
            **reduce_train_metrics(m, self.times, self.state.counters(), self.state.device, self.world_size),
            "lr": m["lr"],
            "grad_norm": round(m["grad_norm"], 6),
            "time": round(time.time(), 3),
        }
        self.metrics.write(record)
        # Health carries this very line (every rank has it, all-reduced), so the launcher's live line
        # and `launcher status` show the figures metrics.jsonl has, not one rank's last step.
        # tokens_per_s of the worker itself: this rank's tokens over the same window.
        window = {k: record[k] for k in ("step", "loss", "tau", "coverage", "tokens_per_s", "data_wait_frac")}
        window["steps"] = self.state.step - self.logged_step
        if "base_tau" in record:  # a Domino drafter: τ of its backbone alone, beside the corrected τ
            window["base_tau"] = record["base_tau"]
        self.health.progress(
            window=window,
            loss=record["loss"],
            tau=record["tau"],
            coverage=record["coverage"],
            tokens_per_s=round(self.times.tokens / max(time.perf_counter() - self.times.start, 1e-9), 1),
        )
        self.times.reset()
        self.window = MetricsWindow()
        self.logged_step = self.state.step

    def run_eval(self) -> bool:
        """Evaluate the held-out split; True when tau is the best so far (same on every rank)."""
        start = time.perf_counter()
        result = evaluate(self.state, self.eval_batches)
        if not result.pop("complete"):  # a stop came while a rank waited for eval data
            return False
        result = {"step": self.state.step, "eval": True, **result, "eval_s": round(time.perf_counter() - start, 3)}
        self.metrics.write(result)
        self.last_eval = result
        new_best = self.best_tau is None or result["tau"] > self.best_tau
        if new_best:
            self.best_tau = result["tau"]
        self.health.progress(eval_loss=result["loss"], eval_tau=result["tau"], best_tau=self.best_tau)
        if self.rank == 0:
            event(
                "eval",
                step=self.state.step,
                eval_loss=round(result["loss"], 4),
                eval_tau=round(result["tau"], 3),
                best=new_best,
                batches=result["batches"],
            )
        self.run_spec_eval()
        return new_best

    # --- real speculative decoding ------------------------------------------------------------
    def check_periodic(self) -> None:
        """Rank 0, once: the periodic pass (eval.every_s) measures on held-out prompts or none. Without
        a held-out split the prompts would be training lines, whose acceptance flatters the drafter."""
        run = self.settings
        if run.spec_eval_prompts <= 0 or self.num_targets <= 0 or not run.target_path:
            self.cadence.every_s = 0  # no real acceptance at all (eval.num_prompts = 0, --synthetic): nothing to say
        elif self.cadence.every_s > 0 and not run.held_out_prompts:
            self.acceptance_off(
                f"real acceptance every {self.cadence.every_s:g} s of training (eval.every_s) is off: the data "
                "has no held-out split; set data.eval_fraction (e.g. 0.01) or data.eval_path, or eval.prompts "
                "to a prompt file"
            )
            self.cadence.every_s = 0

    def acceptance_off(self, message: str) -> None:
        """Say once, in the log and to the launcher (health: it prints it), that real acceptance is off and why."""
        log.warning("%s", message)
        self.health.set(real_acceptance_off=message)

    def spec_eval(self):
        """Rank 0's RemoteSpecEval, made once: the target workers verify (remote_eval.py), this rank
        proposes with the head it trains with; no target model is loaded here. Only with
        eval.num_prompts > 0 and targets to ask (not --synthetic); the other ranks go on to the
        next step and wait there, so the budget bounds their wait."""
        if self._spec_eval is None:
            self._spec_eval = False
            path, run = self.settings.target_path, self.settings
            if self.rank != 0 or run.spec_eval_prompts <= 0 or self.num_targets <= 0 or not path:
                return None
            try:
                self._spec_eval = run.open_spec_eval(
                    self.state.head,
                    self.state.drafter.cfg,
                    self.health,
                    prompts=run.spec_eval_prompts,
                    max_new_tokens=run.spec_eval_max_new_tokens,
                )
                if not self._spec_eval.prompts:
                    self.acceptance_off(
                        "real speculative decoding is off: the held-out data has no prompts (set eval.prompts "
                        "to a prompt file)"
                    )
                    self._spec_eval.close()
                    self._spec_eval = False
            except Exception as exc:  # never fatal: the run trains without it
                self.acceptance_off(f"real speculative decoding is off: {type(exc).__name__}: {exc}")
                self._spec_eval = False
        return self._spec_eval or None

    def run_spec_eval(self, final: bool = False, periodic: bool = False) -> dict | None:
        """Real acceptance of the current weights on held-out prompts (rank 0), into acceptance.jsonl
        and, during training, metrics.jsonl. The final one also decodes the same prompts with the
        repeat-last and random controls; a periodic one (eval.every_s) has the cadence's budget."""
        start = time.perf_counter()
        spec_eval = self.spec_eval()
        if spec_eval is None:
            return None
        self.health.progress()
        try:
            result = spec_eval.evaluate(
                self.state.drafter.state_dict(),
                self.state.drafter.cfg,
                controls=final,
                budget_s=self.cadence.budget_s if periodic else self.settings.spec_eval_budget_s,
                seed=self.settings.seed,
                tick=self.health.progress,
                references=not periodic,  # the clock's passes: acceptance only, cut at their budget
            )
        except Exception as exc:
            self.acceptance_off(f"real speculative decoding failed and is off: {type(exc).__name__}: {exc}")
            self._spec_eval = False
            return None
        if self.models_in_process is None:  # once: the targets verify, this process holds no target model
            self.models_in_process = models_in_process()
            self.health.set(target_models_in_process=self.models_in_process, spec_eval_verifier="target workers")
        self.health.progress(
            spec_eval_seconds_per_prompt=result.get("seconds_per_prompt"), spec_eval_skipped=result.get("skipped", 0)
        )
        # the cost (cadence.py): a pass during training counts; the final one carries the run's total
        now = time.perf_counter()
        cost = self.cadence.figures(start) if final else self.cadence.record(start, now)
        flags = {"final": True} if final else {"periodic": True} if periodic else {}
        record = {"step": self.state.step, "spec": True, **flags, **result, **cost, "time": round(time.time(), 3)}
        with open(self.acceptance, "a") as f:
            f.write(json.dumps(record) + "\n")
        if final:
            self.metrics.plot("spec", record)  # TensorBoard / W&B: spec_eval/acceptance_per_prompt, …
        else:  # metrics.jsonl too, beside the train and eval lines (and the same plots)
            self.metrics.write(record)
            self.health.progress(acceptance=acceptance_figures(record))
        event(
            "spec_eval",
            step=self.state.step,
            final=final,
            acceptance_per_prompt=round(result["acceptance_per_prompt"], 3),
            acceptance_per_step=round(result["acceptance_per_step"], 3),
            tokens_per_forward=round(result["tokens_per_forward"], 3),
            lossless=result.get("lossless"),  # None: not checked (a pass by the clock)
            near_ties=result.get("near_ties"),
            prompts=result["prompts"],
            seconds=result["seconds"],
            skipped=result.get("skipped", 0),
            seconds_per_prompt=result.get("seconds_per_prompt"),
            target_models_in_process=self.models_in_process,
            periodic=periodic,
            **cost,
            **{
                f"{k}_acceptance_per_prompt": round(result[k]["acceptance_per_prompt"], 3)
                for k in ("repeat_last", "random")
                if k in result
            },
        )
        return record

    # --- checkpoints -----------------------------------------------------------------------------
    def checkpoint(self, set_best: bool = False) -> None:
        """Collective (the RNG gather). Rank 0 snapshots the state into host memory and writes it in
        the background (checkpoint_writer.BackgroundWriter); training waits only for the snapshot. A
        failed write keeps the previous checkpoint and the run goes on; it is reported when seen.
        A stop in the middle of gradient accumulation saves the last optimizer step (the partial
        batches are redone after the resume; their ledger lines are dropped then)."""
        state, step = self.state, self.state.step
        rng = gather_rng_states(state.device)
        if self.rank == 0:
            done = self.plan.batches_done(self.boundary["micro_step"]) if self.plan else None
            meta = ckpt.make_meta(
                self.boundary,
                state.drafter.cfg,
                self.world_size,
                batches_done=done,
                best_tau=self.best_tau,
                eval=self.last_eval if self.last_eval and self.last_eval["step"] == step else None,
            )
            self.report_checkpoint(self.writer.wait())
            blob = {"optimizer": state.optimizer.state_dict(), "scheduler": state.scheduler.state_dict()}
            need = checkpoint_bytes(state.drafter.state_dict(), blob)  # once: the writer checks the same size
            if low := space_warning(self.root, need):
                log.warning(low)
                self.health.error(low)
            self.writer.snapshot_and_write(
                step,
                weights=state.drafter.state_dict(),
                optimizer=blob,
                rng=rng,
                meta=meta,
                config=self.settings.config,
                set_best=set_best,
                need_bytes=need,
            )
        self.saved_step = step

    def report_checkpoint(self, outcome: dict | None) -> None:
        """Say how a background write ended (rank 0), once."""
        if outcome is None:
            return
        step = outcome["step"]
        if outcome["error"] is None:
            event(
                "checkpoint",
                step=step,
                path=str(outcome["path"]),
                best=outcome["best"],
                stall_s=outcome["stall_s"],
                write_s=outcome["write_s"],
            )
            self.health.progress(last_checkpoint=step)
            return
        exc, kept = outcome["error"], ckpt.pointer(self.root, ckpt.LATEST)
        message = (
            f"checkpoint at step {step} was not written ({type(exc).__name__}: {exc}); "
            + (f"the previous checkpoint {kept.name} is kept as latest" if kept else "no earlier checkpoint exists")
            + "; training goes on"
        )
        log.warning(message)
        self.health.error(message)

    # --- the end -------------------------------------------------------------------------------
    def finish(self, completed: bool) -> None:
        """Last metrics line, final checkpoint (also on a graceful stop), then, when training
        completed, the export."""
        if self.last_metrics is not None and self.logged_step != self.state.step:
            self.log_metrics(self.window.mean(self.last_metrics))
        if self.saved_step != self.state.step:
            self.checkpoint()
        if self.rank == 0:
            self.report_checkpoint(self.writer.wait())  # the run ends with its checkpoint on disk
        if completed and self.settings.export_at_end and self.rank == 0:
            from services.drafter.checkpoints.export import export_weights, num_speculative_tokens

            try:
                record = self.final_export_record()
                out = export_weights(
                    self.state.drafter.state_dict(),
                    self.state.drafter.cfg,
                    self.run_dir / "export",
                    provenance=record,
                    target=self.settings.target_path,
                )
                event(
                    "exported",
                    out=str(out),
                    **record,
                    num_speculative_tokens=num_speculative_tokens(self.state.drafter.cfg.block_size),
                )
            except Exception as exc:
                message = (
                    f"export at the end of the run failed ({type(exc).__name__}: {exc}); "
                    f"run `launcher export --checkpoint {self.root / ckpt.LATEST} --out DIR`"
                )
                log.warning("%s", message, exc_info=exc)
                self.health.error(message)
        if completed and self.rank == 0 and not self.final_acceptance_recorded():
            self.run_spec_eval(final=True)  # after the export: a failure here costs nothing saved
        self.close()

    def final_acceptance_recorded(self) -> bool:
        """A resume of a finished run ends at the same step with the same weights: its final real
        acceptance is already in acceptance.jsonl, and a second line would count it twice."""
        try:
            lines = self.acceptance.read_text().splitlines()
        except OSError:
            return False
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("final") and record.get("step") == self.state.step:
                return True
        return False

    def final_export_record(self) -> dict:
        """export.json of the export at the end: the last step's weights, and whether that step is
        also the best one (its held-out τ is the best so far; never when the run did not evaluate)."""
        from services.drafter.checkpoints.export import export_record

        step = self.state.step
        best, latest = ckpt.pointer(self.root, ckpt.BEST), ckpt.pointer(self.root, ckpt.LATEST)
        best_step = ckpt.step_of(best) if best else None
        saved = latest is not None and ckpt.step_of(latest) == step  # the final checkpoint was written
        evaluated_now = self.last_eval is not None and self.last_eval["step"] == step
        return export_record(
            step,
            last=True,
            best=best_step == step,
            best_step=best_step,
            checkpoint=latest.name if saved else None,
            eval_tau=self.last_eval["tau"] if evaluated_now else None,
        )

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.ledger.close()
        self.metrics.close()
        if self._spec_eval:
            self._spec_eval.close()
        if self.eval_batches is not None:
            self.eval_batches.close()


def acceptance_figures(record: dict) -> dict:
    """What health carries of a real-acceptance line: the launcher's console line and `launcher status`
    (launcher/progress.py describe_acceptance)."""
    keys = ("step", "time", "prompts", "held_out", "acceptance_per_prompt", "acceptance_per_step")
    keys += ("tokens_per_forward", "lossless", "differences", "skipped", "pass_s", "spent_s", "wall_s", "cost_frac")
    return {k: record[k] for k in keys if k in record} | {"sets": list(record.get("sets") or ())}
