"""`launcher up`: check the inputs, make the run folder, start every worker, supervise until the end.

Exit codes: 0 training finished, 1 failed, 2 bad usage or config, 3 stopped before the end.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from launcher import process, slurm
from launcher.commands import demo_speedup
from launcher.elastic import rendezvous_problems
from launcher.errors import UsageError
from launcher.inputs import check_inputs, load_run_config, make_demo, prepare_data, with_local_model
from launcher.output import keep_running_on_closed_pipes
from launcher.preflight import (
    check_resume_config,
    max_steps_warning,
    preflight,
    resume_config_path,
    resumed_from,
    resumed_line,
    staged,
)
from launcher.report import describe_cost, describe_export, describe_real_acceptance, read_acceptance_lines
from launcher.rundir import LATEST, choose_run_dir, claim, lock, resume_command
from launcher.supervisor import EXIT_FAILED, EXIT_STOPPED, RunFailed, Supervisor
from launcher.topology import host_overrides, hosts, parse_gpu_spec
from services.net.endpoints import plaintext_problems
from services.run import runspec
from services.run.config import dump_json, old_names_used
from services.run.files import point


def cmd_up(args) -> int:
    keep_running_on_closed_pipes()  # `up ... | head`: the run goes on, its output dropped (the logs keep it)
    if args.device == "cuda":
        available = process.gpu_count()
        if available == 0:
            raise UsageError("--device cuda but no NVIDIA GPU is visible; use --device cpu for a CPU run")
    else:
        available = None  # on cpu, GPU numbers are logical slots
    if args.slurm:  # this node and the spec's hosts from the Slurm environment
        if args.host:
            raise UsageError("--slurm sets --host from the Slurm environment: give one of them")
        args.gpus, args.host = slurm.from_slurm(args.gpus, os.environ)
        print(f"slurm: --gpus {args.gpus} --host {args.host}", flush=True)
    workers = parse_gpu_spec(args.gpus, available=available, share_gpus=args.share_gpus, local_host=args.host)
    named = hosts(workers)
    if named and args.host not in named:
        raise UsageError(f"--gpus names hosts {', '.join(named)}: pass --host with the one this launcher runs on")
    if args.host and not named:
        raise UsageError("--host is for runs across hosts: name the host of every --gpus group (GPUS:ROLE@HOST)")
    overrides = host_overrides(workers) + list(args.overrides)
    if config := resume_config_path(args):
        args.config = str(config)
        print(
            f"--resume without --config: using the run's config, {config} (the overrides given here apply on top)",
            flush=True,
        )
    cfg = load_run_config(args.config, overrides)  # validate before touching the disk
    if old := old_names_used(args.config, args.overrides):
        print(
            f"launcher: note: keys given by their old names, which still work: {', '.join(old)} (docs/config.md)",
            file=sys.stderr,
            flush=True,
        )
    refusal, warning = plaintext_problems(
        cfg.transport, sum(w.role == "target" for w in workers), sum(w.role == "drafter" for w in workers)
    )  # every rank's real endpoint
    if refusal:
        raise UsageError(refusal)
    if warning:
        print(f"launcher: warning: {warning}", file=sys.stderr, flush=True)
    refusal, warning = rendezvous_problems(cfg.transport, [w.host for w in workers if w.role == "drafter"])
    if refusal:
        raise UsageError(refusal)
    if warning:
        print(f"launcher: warning: {warning}", file=sys.stderr, flush=True)
    run_dir, named_here = choose_run_dir(args, cfg.run.name)
    lock(run_dir, early=True)  # a second `up` here is refused now, not after resolving the model, the data...
    runs_targets = any(w.role == "target" and w.host == args.host for w in workers)
    spec = None  # the run spec, resolved once (runspec.json)
    if not args.demo:  # drafters read the target's head: every host resolves
        spec = check_inputs(with_local_model(cfg), runs_targets)
    if args.demo:  # built once the user's config and run dir passed; the user's overrides win over its own
        cfg = with_local_model(load_run_config(args.config, make_demo(args.device, args.demo) + overrides))
        spec = check_inputs(cfg, runs_targets)
    if args.resume:  # before anything is written in the run folder (its lock too)
        check_resumable(run_dir, cfg, spec)
    locked = claim(run_dir, args.resume)
    preflight(cfg, args.device, runs_targets)
    with staged(run_dir) as where:  # a new run dir appears only once the data is ready
        dump_json(cfg, where / "config.json")
        (spec or runspec.resolve(cfg)).save(where)  # runspec.json: what the run is, for every worker (a host
        # without targets resolves it only here)
        if runs_targets:
            info = prepare_data(where)
            past = (
                None
                if args.resume
                else max_steps_warning(cfg, info["train_rows"], sum(w.role == "drafter" for w in workers))
            )
            if past:  # (a resume continues the schedule its checkpoint planned)
                print(f"launcher: warning: {past}", file=sys.stderr, flush=True)
    if not locked:
        lock(run_dir)
    sup = Supervisor(
        run_dir,
        cfg,
        workers,
        args.device,
        resume=args.resume,
        host=args.host,
        ready_timeout_s=args.ready_timeout,
        stop_timeout_s=args.stop_timeout or cfg.supervise.stop_timeout_s + 30,
    )
    sup.install_signal_handlers()
    print(
        f"run dir: {run_dir}\nlogs:    {run_dir / 'logs'}/<role>-<rank>.log\n"
        f"workers: {', '.join(f'{w.name}@gpu{w.gpu}' for w in sup.local)} ({args.device})",
        flush=True,
    )
    # runs/latest only once ready: a run that fails while starting never becomes latest
    code, reason = run_supervised(sup, on_ready=when_ready(sup, run_dir, named_here, args.resume))
    sup.record_outcome(code, reason)
    for name in sup.drops.dropped():  # at the end too: the warnings scrolled away long ago
        print(f"warning: {sup.drops.describe(name)}", flush=True)
    export = describe_export(run_dir / "export")
    if code == 0 and export:
        print(export, flush=True)
    final = [r for r in read_acceptance_lines(run_dir)[0] if r.get("final")]
    if code == 0 and final:
        print("\n".join(describe_real_acceptance(final[-1], f"step {final[-1]['step']}, end of training")), flush=True)
        if cost := describe_cost(final[-1]):
            print(cost, flush=True)
    if code == 0 and export and args.demo:  # what the drafter buys, in wall-clock time
        print("\n".join(demo_speedup(run_dir, args.device)), flush=True)
    # the reason again at the very end: the stop messages came after the first "run failed" line
    why = f" (failed: {reason})" if code == EXIT_FAILED and reason else ""
    print(f"exit {code}{why}; logs in {run_dir / 'logs'}; metrics in {run_dir / 'metrics.jsonl'}", flush=True)
    if code == EXIT_STOPPED:
        print(f"stopped before the end; to continue: {resume_command(args.argv, run_dir)}", flush=True)
    return code


def check_resumable(run_dir: Path, cfg, spec: runspec.RunSpec | None) -> None:
    """The checkpoint a resume starts from against this config (the drafter's shape too where the
    target's config.json is here: spec, the run spec check_inputs resolved): refused in one line before
    the run folder is touched."""
    check_resume_config(run_dir, cfg, spec.drafter if spec is not None else None)


def when_ready(sup: Supervisor, run_dir: Path, named_here: bool, resume: bool):
    """Once every worker is ready: a new run becomes runs/latest; a resume says what it resumed."""

    def ready() -> None:
        if named_here:
            point(LATEST, run_dir)
        first = next((w for w in sup.local if w.role == "drafter" and w.rank == 0), None)
        if resume and first is not None and (found := resumed_from(sup.log(first))) is not None:
            print(resumed_line(found, run_dir / "checkpoints"), flush=True)
            sup.resumed = found  # run.json's `resumed`: the step, and what was skipped and why
            sup.write_run_json()

    return ready


def run_supervised(sup: Supervisor, on_ready=lambda: None) -> tuple[int, str]:
    """Start every worker, wait until they are ready, supervise until the run ends. A failure
    (a worker, a full disk...) stops every worker. Returns (exit code, reason: a failure's, or why the
    drafters stopped before the end)."""
    try:
        sup.start_all()
        sup.wait_ready()
        if not sup.stopping:
            on_ready()
        code = sup.supervise()
        return code, sup.stop_reason
    except RunFailed as exc:
        sup.progress.done(f"run failed: {exc}")
        sup.shutdown()
        return EXIT_FAILED, str(exc).splitlines()[0]
