"""`launcher`: up, status, down, probe (and units, keys, export, report, eval, regenerate).

The launcher never imports torch: it starts fast, stays small, and can never hold GPU memory.
Exit codes of `up`: 0 training finished, 1 failed, 2 bad usage or config, 3 stopped before the end.

runs/latest is the last run started here whose workers all became ready (or that finished while
starting): a run that fails while starting never takes it over from one that trains. `status`
and `down` default to it, and both name the live runs when the one they reach is not live.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from launcher import process
from launcher.models import ModelNotFound, resolve_model_path
from launcher.preflight import check_resume, preflight, resumed_line, staged
from launcher.progress import describe_window
from launcher.report import describe_data, describe_export, describe_spec, read_spec
from launcher.runlock import RunDirBusy, lock_run_dir
from launcher.supervisor import EXIT_DONE, EXIT_FAILED, EXIT_STOPPED, EXIT_USAGE, RunFailed, Supervisor, probe_all
from launcher.topology import SpecError, host_overrides, hosts, parse_gpu_spec
from services import __version__
from services.config import ConfigError, dump_json, load_config
from services.endpoints import plaintext_problems
from services.drafter.plan import Plan
from services.files import point, write_json_atomic
from services.health import probe
from services.layers import resolve_layer_ids


class UsageError(Exception):
    """A one-line error for the user; printed without a traceback, exit 2."""


def _read_run(run_dir: Path) -> dict:
    path = run_dir / "run.json"
    if not path.is_file():
        raise UsageError(f"no run in {run_dir} (missing {path}); pass --run-dir")
    return json.loads(path.read_text())


LATEST = Path("runs") / "latest"
DEMOS = ("dense", "hybrid")          # services.demo.VARIANTS (the launcher never imports torch)


def _with_local_model(cfg):
    """cfg with a Hugging Face repo id in target.model_path replaced by its local snapshot folder."""
    try:
        cfg.target.model_path = resolve_model_path(cfg.target.model_path)
    except ModelNotFound as exc:
        raise UsageError(str(exc)) from None
    return cfg


def _check_inputs(cfg, runs_targets: bool) -> None:
    """The model and the data, named in the error, before any worker starts (on a host that has them)."""
    for key, value in (("target.model_path", cfg.target.model_path), ("data.path", cfg.data.path)):
        if not value:
            raise UsageError(f"{key} is not set (config file, {key}=..., or --demo)")
        if runs_targets and not Path(value).exists():
            raise UsageError(f"{key}: {value} does not exist")
    if runs_targets and not (Path(cfg.target.model_path) / "config.json").is_file():
        raise UsageError(f"target.model_path: {cfg.target.model_path} is not a Hugging Face model folder (no config.json)")
    if runs_targets:
        _check_layers(cfg)


def _check_layers(cfg) -> None:
    """The captured layers, from the model's config.json: a target too shallow for drafter.num_layers
    is a config error now, not a failed worker minutes later."""
    try:
        conf = json.loads((Path(cfg.target.model_path) / "config.json").read_text())
        conf = conf.get("text_config") or conf          # multimodal wrappers: the text model is loaded
        num_layers = int(conf["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return                                          # an unusual config: the target worker will say
    try:
        resolve_layer_ids(cfg.target.layer_ids, num_layers, cfg.drafter.num_layers)
    except ValueError as exc:
        raise UsageError(f"target.model_path {cfg.target.model_path}: {exc}") from None


def _choose_run_dir(args, name: str) -> tuple[Path, bool]:
    """(run dir, whether `up` named it): --run-dir, else runs/latest for --resume, else a new
    runs/<run.name>-<time>, which becomes runs/latest once its workers are ready. Not made here:
    a new folder appears only once the checks pass (preflight.staged)."""
    if args.run_dir:
        return Path(args.run_dir).resolve(), False
    if args.resume:
        if not LATEST.exists():
            raise UsageError("--resume without --run-dir needs runs/latest (no earlier run here); pass --run-dir")
        return LATEST.resolve(), False
    return (Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve(), True


def _resume_command(argv: list[str], run_dir: Path) -> str:
    """The same `up` command, pointed at this run dir with --resume."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--run-dir":
            skip = True
        elif arg != "--resume" and not arg.startswith("--run-dir="):
            kept.append(arg)
    return shlex.join(["launcher", *kept, "--run-dir", str(run_dir), "--resume"])


def _live_runs(root: Path) -> list[tuple[Path, int]]:
    """(run dir, launcher pid) of every run under root whose launcher is still running."""
    live = []
    for run_json in sorted(root.glob("*/run.json")):
        if run_json.parent.is_symlink():                # runs/latest: the run itself is listed
            continue
        try:
            launcher = json.loads(run_json.read_text()).get("launcher")
        except (OSError, ValueError):
            continue
        if process.alive(launcher):
            live.append((run_json.parent, launcher["pid"]))
    return live


def _describe_live(root: Path, but: Path) -> str:
    others = [f"{d} (launcher pid {pid})" for d, pid in _live_runs(root) if d != but]
    return f"live runs: {', '.join(others)}" if others else f"no live run in {root}"


def _prepare_data(run_dir: Path) -> None:
    """Tokenize and pack the data now, in a child process (no torch here, no model weights there):
    a bad line is one line and exit 2 before any worker starts; the targets reuse the cache."""
    out = subprocess.run([sys.executable, "-m", "services.target.packing", "--config", str(run_dir / "config.json"),
                          "--run-dir", str(run_dir)], capture_output=True, text=True)
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines() or [f"exit {out.returncode}"]
        raise UsageError(lines[-1] if out.returncode == 2 else "preparing the data failed:\n" + out.stderr[-2000:])
    info = json.loads(out.stdout.strip().splitlines()[-1])
    write_json_atomic(run_dir / "data.json", info)              # for `launcher status` and `launcher report`
    print(describe_data(info), flush=True)


def _make_demo(device: str, variant: str = "dense") -> list[str]:
    """Build (or reuse, from the demo cache) the demo model and data in a child process (torch
    stays out of the launcher); its config suits the device (bfloat16 target on cuda).
    variant: dense (a Qwen3) or hybrid (a Qwen3.5-family Gated DeltaNet)."""
    out = subprocess.run([sys.executable, "-m", "services.demo", "--device", device, "--variant", variant],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise UsageError(f"building the demo failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["overrides"]


def cmd_up(args) -> int:
    if args.device == "cuda":
        available = process.gpu_count()
        if available == 0:
            raise UsageError("--device cuda but no NVIDIA GPU is visible; use --device cpu for a CPU run")
    else:
        available = None   # on cpu, GPU numbers are logical slots
    workers = parse_gpu_spec(args.gpus, available=available, share_gpus=args.share_gpus, local_host=args.host)
    named = hosts(workers)
    if named and args.host not in named:
        raise UsageError(f"--gpus names hosts {', '.join(named)}: pass --host with the one this launcher runs on")
    if args.host and not named:
        raise UsageError("--host is for runs across hosts: name the host of every --gpus group (GPUS:ROLE@HOST)")
    overrides = host_overrides(workers) + list(args.overrides)
    cfg = load_config(args.config, overrides)               # validate before touching the disk
    refusal, warning = plaintext_problems(cfg.transport, sum(w.role == "target" for w in workers),
                                          sum(w.role == "drafter" for w in workers))   # every rank's real endpoint
    if refusal:
        raise UsageError(refusal)
    if warning:
        print(f"launcher: warning: {warning}", file=sys.stderr, flush=True)
    runs_targets = any(w.role == "target" and w.host == args.host for w in workers)
    if not args.demo:                                      # drafters read the target's head: every host resolves
        _check_inputs(_with_local_model(cfg), runs_targets)
    run_dir, named_here = _choose_run_dir(args, cfg.run.name)
    if args.resume:
        check_resume(run_dir)
    locked = run_dir.is_dir()          # one launcher per run dir: an existing one is locked before anything
    if locked:                         # is written in it, a new one as soon as it exists (after `staged`)
        _lock(run_dir)
    if (run_dir / "run.json").is_file():
        old = json.loads((run_dir / "run.json").read_text())
        if process.alive(old.get("launcher")):          # the recorded launcher itself, not a reused pid
            raise UsageError(f"a run is active in {run_dir} (launcher pid {old['launcher_pid']}); "
                             f"`launcher down --run-dir {run_dir}` first")
    if (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()) and not args.resume:
        raise UsageError(f"{run_dir} has checkpoints; pass --resume to continue, or choose another --run-dir")
    if args.demo:
        print("building the demo target and dataset (once; then reused from the demo cache)…", flush=True)
        overrides = _make_demo(args.device, args.demo) + overrides
    cfg = _with_local_model(load_config(args.config, overrides))
    _check_inputs(cfg, runs_targets)
    preflight(cfg, args.device, runs_targets)
    with staged(run_dir) as where:                  # a new run dir appears only once the data is ready
        dump_json(cfg, where / "config.json")
        if runs_targets:
            _prepare_data(where)
    if not locked:
        _lock(run_dir)
    sup = Supervisor(run_dir, cfg, workers, args.device, resume=args.resume, host=args.host,
                     ready_timeout_s=args.ready_timeout,
                     stop_timeout_s=args.stop_timeout or cfg.run.stop_timeout_s + 30)
    sup.install_signal_handlers()
    print(f"run dir: {run_dir}\nlogs:    {run_dir / 'logs'}/<role>-<rank>.log\n"
          f"workers: {', '.join(f'{w.name}@gpu{w.gpu}' for w in sup.local)} ({args.device})", flush=True)
    # runs/latest only once ready: a run that fails while starting never becomes latest
    code, reason = run_supervised(sup, on_ready=_when_ready(sup, run_dir, named_here, args.resume))
    sup.record_outcome(code, reason)
    export = describe_export(run_dir / "export")
    if code == 0 and export:
        print(export, flush=True)
    final = [r for r in read_spec(run_dir)[0] if r.get("final")]
    if code == 0 and final:
        print("\n".join(describe_spec(final[-1], f"step {final[-1]['step']}, end of training")), flush=True)
    print(f"exit {code}; logs in {run_dir / 'logs'}; metrics in {run_dir / 'metrics.jsonl'}", flush=True)
    if code == EXIT_STOPPED:
        print(f"stopped before the end; to continue: {_resume_command(args.argv, run_dir)}", flush=True)
    return code


def _lock(run_dir: Path) -> None:
    try:
        lock_run_dir(run_dir)
    except RunDirBusy as exc:
        raise UsageError(str(exc)) from None


def _when_ready(sup: Supervisor, run_dir: Path, named_here: bool, resume: bool):
    """Once every worker is ready: a new run becomes runs/latest; a resume says what it resumed."""
    def ready() -> None:
        if named_here:
            point(LATEST, run_dir)
        first = next((w for w in sup.local if w.role == "drafter" and w.rank == 0), None)
        if resume and first is not None and (line := resumed_line(sup.log(first))):
            print(line, flush=True)
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


def _run_keys(run_dir: Path) -> str:
    """CURVE keys of a run (tcp with transport.curve_keys_dir), from its resolved config."""
    try:
        transport = json.loads((run_dir / "config.json").read_text())["transport"]
    except (OSError, ValueError, KeyError):
        return ""
    return transport.get("curve_keys_dir", "") if transport.get("scheme") == "tcp" else ""


STATUS_COLUMNS = ("name", "gpu", "pid", "state", "step", "batches", "tok/s", "samples", "idle_s",
                  "rss", "gpu_mem", "bad_msgs", "probe")
STATUS_LEGEND = """\
step     drafters: optimizer steps done / planned
batches  targets: batches captured and sent since the worker started
tok/s    drafters: tokens this rank trained per second over the last metrics window;
         targets: tokens captured per second of capture (moving average)
idle_s   seconds since the worker's main loop last made progress"""
OUTCOME_EXIT = {"finished": EXIT_DONE, "failed": EXIT_FAILED, "stopped": EXIT_STOPPED}


def _row(w: dict, result: tuple[int, dict | None, str]) -> dict:
    code, status, reason = result
    row = {"name": w["name"], "gpu": w["gpu"], "pid": w["pid"], "probe": code, "reason": reason,
           "last_exit": w.get("last_exit")}
    if status:
        row.update({k: status.get(k) for k in ("state", "step", "total_steps", "batches_served", "samples_done",
                                                 "tokens_per_s", "last_progress_age_s", "compile_s", "rss_bytes",
                                                 "gpu_mem_bytes", "bad_messages", "loss", "tau", "window", "warning",
                                                 "bad_message_kinds", "integrity", "content_check")})
    return row


def _cells(r: dict) -> tuple[str, ...]:
    drafter = r["name"].startswith("drafter")
    step = (f"{r['step']}/{r.get('total_steps') or '?'}" if drafter and r.get("step") is not None else "-")
    return (r["name"], str(r["gpu"]), _cell(r["pid"]), _cell(r.get("state")), step,
            "-" if drafter else _cell(r.get("batches_served")), _cell(r.get("tokens_per_s")),
            _cell(r.get("samples_done")), _cell(r.get("last_progress_age_s")), _cell(r.get("rss_bytes")),
            _cell(r.get("gpu_mem_bytes")), _cell(r.get("bad_messages")), str(r["probe"]))


def _outcome(run: dict, live: bool) -> str:
    outcome = run.get("outcome") or {}
    if live:
        return "running"
    if outcome.get("state") in OUTCOME_EXIT:
        ended = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(outcome.get("ended", 0)))
        why = f": {outcome['reason']}" if outcome.get("reason") else ""
        return f"{outcome['state']}{why} (exit {outcome.get('exit')}, {ended})"
    return "ended without recording an outcome (launcher killed?)"


def cmd_status(args) -> int:
    run_dir = Path(args.run_dir).resolve()
    run = _read_run(run_dir)
    results = probe_all([w["endpoints"]["health"] for w in run["workers"]], args.timeout, _run_keys(run_dir))
    rows = [_row(w, r) for w, r in zip(run["workers"], results)]
    plan = _read_plan(run_dir)
    live = process.alive(run.get("launcher"))
    outcome = _outcome(run, live)
    window = next((r["window"] for r in rows if r.get("window")), None)
    if args.json:
        print(json.dumps({"run_dir": str(run_dir), "launcher_pid": run["launcher_pid"], "launcher_alive": live,
                          "outcome": run.get("outcome"), "window": window,
                          "plan": plan.to_dict() if plan else None, "workers": rows}, indent=2))
    else:
        print(f"run {run_dir}: {outcome}")
        table = [STATUS_COLUMNS] + [_cells(r) for r in rows]
        widths = [max(len(row[i]) for row in table) for i in range(len(STATUS_COLUMNS))]
        for row in table:
            print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)))
        print(STATUS_LEGEND)
        if window:
            print(f"metrics {describe_window(window)}, data wait {100 * window['data_wait_frac']:.0f}% "
                  f"(the metrics.jsonl line of that step)")
        for r in rows:
            if r.get("warning"):
                print(f"{r['name']}: warning: {r['warning']}")
            if (books := r.get("integrity") or {}).get("nonfinite_batches") or books.get("skipped_steps"):
                print(f"{r['name']}: {books['nonfinite_batches']} non-finite batches skipped, {books['skipped_steps']} "
                      f"optimizer steps skipped; last: {books['last_nonfinite'] or 'another rank'}")
        _print_last_exits(rows)
        if plan:
            print(f"plan: {plan.describe()}")
        if (run_dir / "data.json").is_file():
            print(describe_data(json.loads((run_dir / "data.json").read_text())))
        print(f"launcher pid {run['launcher_pid']} {'alive' if live else 'not running'}")
        if not live:
            print(_describe_live(run_dir.parent, run_dir))
    state = (run.get("outcome") or {}).get("state")
    if not live and state in OUTCOME_EXIT:
        return OUTCOME_EXIT[state]       # an ended run: its own exit code, not "every worker unreachable"
    return max((r["probe"] for r in rows), default=0)


def _print_last_exits(rows: list[dict]) -> None:
    """Each worker's last exit after it was started (the launcher's words: signal or error line)."""
    for r in rows:
        if last := r.get("last_exit"):
            at = time.strftime("%H:%M:%S", time.localtime(last.get("at", 0)))
            print(f"{r['name']}: last exit at {at}, code {last['code']}: {last['cause']}")


def _read_plan(run_dir: Path) -> Plan | None:
    """The run's plan, as drafter rank 0 wrote it to schedule.json once it knew the data."""
    try:
        return Plan.from_dict(json.loads((run_dir / "schedule.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    if isinstance(value, int) and value > 1 << 20:
        return f"{value / (1 << 30):.2f}G"
    return str(value)


def cmd_down(args) -> int:
    run_dir = Path(args.run_dir).resolve()
    run = _read_run(run_dir)
    # Only processes whose start time and command line match what `up` recorded are signalled:
    # a pid in an old run.json may belong to anything by now.
    launcher = run.get("launcher") if process.alive(run.get("launcher")) else None
    workers = [w.get("identity") for w in run["workers"] if process.alive(w.get("identity"))]
    if launcher is None and not workers:
        print(f"nothing to stop in {run_dir}: {_outcome(run, live=False)}; {_describe_live(run_dir.parent, run_dir)}")
        return 0
    if launcher:
        try:    # psutil re-checks the start time before signalling: a pid reused since is left alone
            process.verified(launcher).send_signal(signal.SIGTERM)   # drafters checkpoint, then targets stop
        except (AttributeError, process.psutil.Error):
            pass
        deadline = time.monotonic() + args.timeout
        while process.alive(launcher) and time.monotonic() < deadline:
            time.sleep(0.2)
    hard = process.stop_all([w for w in workers if process.alive(w)], deadline_s=10)
    if process.alive(launcher):
        process.kill_tree(launcher)
        hard.append(launcher["pid"])
    print(f"stopped {run_dir}" + (f"; killed hard: {hard}" if hard else ""))
    return 0


def _probe_endpoint(text: str) -> str:
    """ipc://PATH or tcp://HOST:PORT; a bare path to a socket file means ipc."""
    if text.startswith(("ipc://", "tcp://")):
        return text
    if "://" not in text and Path(text).is_socket():
        return f"ipc://{Path(text).resolve()}"
    raise UsageError(f"endpoint {text!r}: expected ipc://PATH, tcp://HOST:PORT or the path of a socket file "
                     "(e.g. <run_dir>/sock/target-0.health)")


def cmd_probe(args) -> int:
    from services.curve import CurveError
    try:
        code, status, reason = probe(_probe_endpoint(args.endpoint), timeout_s=args.timeout, keys_dir=args.keys)
    except CurveError as exc:          # a usage error (the keys), not an unhealthy worker: exit 2, one line
        raise UsageError(f"--keys {args.keys}: {exc}") from None
    if args.json:
        print(json.dumps({"exit": code, "reason": reason, "status": status}, indent=2))
    else:
        print(reason)
    return code


def cmd_units(args) -> int:
    from launcher.units import UnitsError, install_command, render_units
    roles, master, overrides = args.roles.split(","), args.master, list(args.overrides)
    workers = parse_gpu_spec(args.gpus, share_gpus=True, local_host=args.host)
    if hosts(workers):        # GPUS:ROLE@HOST: this host's roles, the tcp endpoints and the rendezvous follow
        if args.host not in hosts(workers):
            raise UsageError(f"--gpus names hosts {', '.join(hosts(workers))}: pass --host with this one")
        roles = sorted({w.role for w in workers if w.host == args.host})
        master = next(w.host for w in workers if w.role == "drafter")
        overrides = host_overrides(workers) + overrides
    try:
        paths = render_units(_strip_hosts(args.gpus),
                             args.config, args.out, args.run_dir, python=args.python, device=args.device,
                             roles=roles, master_addr=master, overrides=overrides,
                             start_timeout_s=args.start_timeout, stop_timeout_s=args.stop_timeout,
                             env_dir=args.env_dir, user=args.user, group=args.group)
    except UnitsError as exc:
        raise UsageError(str(exc)) from None
    print("\n".join(str(p) for p in paths))
    config = json.loads((Path(args.out) / "dflash-env" / "config.json").read_text())
    env_dir = os.path.abspath(args.env_dir or f"/etc/dflash/{config['run']['name']}")
    if not args.user:
        print("note: the workers will run as root; pass --user (and --group) to run them as an account of their own")
    print("install: " + install_command(os.path.abspath(args.out), env_dir, os.path.abspath(args.run_dir),
                                        args.unit_dir, args.user, args.group))
    return 0


def _strip_hosts(spec: str) -> str:
    return ",".join(group.split("@")[0] for group in spec.split(","))


def cmd_keys(args) -> int:
    from services.curve import CurveError, generate_keys
    try:
        paths = generate_keys(args.dir, overwrite=args.force)
    except CurveError as exc:
        raise UsageError(str(exc)) from None
    print("\n".join(str(p) for p in paths))
    print(f"set transport.curve_keys_dir = \"{Path(args.dir).resolve()}\" on every host (copy the folder, mode 0700)")
    return 0


def cmd_export(args) -> int:
    """The export reads tensors, so it runs in a child process: the launcher never imports torch."""
    argv = [sys.executable, "-m", "services.drafter.export", "--checkpoint", args.checkpoint, "--out", args.out,
            "--dtype", args.dtype]
    return subprocess.run(argv).returncode


def cmd_plan(args) -> int:
    from launcher import plan
    try:
        gpus = plan.plan_gpus(args.gpus)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    overrides = list(args.overrides)
    if args.demo:
        overrides = _make_demo(args.device, args.demo) + overrides
    cfg = _with_local_model(load_config(args.config, overrides))
    _check_inputs(cfg, runs_targets=True)
    preflight(cfg, args.device, runs_targets=True)
    overrides += [f'target.model_path="{cfg.target.model_path}"']
    print(f"measuring each role on one {args.device} device, about {args.seconds:.0f} s each ...", flush=True)
    try:
        measured = plan.measure(args.config, args.device, args.seconds, overrides)
    except RuntimeError as exc:
        raise UsageError(str(exc)) from None
    print(plan.describe(measured, gpus))


def _eval_argv(args, run_dir: str, checkpoint: str | None) -> list[str]:
    argv = [sys.executable, "-m", "services.drafter.eval_cli", "--run-dir", run_dir,
            "--prompts", str(args.prompts), "--max-new-tokens", str(args.max_new_tokens)]
    if checkpoint:
        argv += ["--checkpoint", checkpoint]
    if args.eval_device:
        argv += ["--device", args.eval_device]
    return argv


def cmd_eval(args) -> int:
    """Real speculative decoding loads the target and the drafter: a child process (no torch here)."""
    argv = _eval_argv(args, args.run_dir, args.checkpoint)
    argv += ["--no-controls"] if args.no_controls else []
    argv += ["--json"] if args.json else []
    return subprocess.run(argv).returncode


def cmd_regenerate(args) -> int:
    """launcher/regenerate.py: one child per GPU, a progress line, the summary of what changed."""
    from launcher import regenerate
    if not Path(args.data).is_file():
        raise UsageError(f"--data {args.data} does not exist")
    if not (Path(args.model) / "config.json").is_file():
        raise UsageError(f"--model {args.model} is not a Hugging Face model folder (no config.json)")
    args.gpu_list = [w.gpu for w in parse_gpu_spec(f"{args.gpus}:target", share_gpus=True)] if args.device == "cuda" else []
    try:
        regenerate.run(args)
    except regenerate.RegenerateError as exc:
        raise UsageError(str(exc)) from None
    return 0


def cmd_report(args) -> int:
    from launcher.report import ReportError, report
    if args.eval:
        code = subprocess.run(_eval_argv(args, args.run_dir, None)).returncode
        if code != 0:
            return code
    try:
        lines, _ = report(args.run_dir, args.out)
    except ReportError as exc:
        raise UsageError(str(exc)) from None
    print("\n".join(lines))
    return 0


class _Help(argparse.HelpFormatter):
    """--help shows each option's default, unless it is unset or the help already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default not in (None, False, "", argparse.SUPPRESS) and "default" not in text and action.option_strings:
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    fmt = _Help
    parser = argparse.ArgumentParser(prog="launcher", description="DFlash drafter training service", formatter_class=fmt)
    parser.add_argument("--version", action="version", version=f"launcher {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    latest_help = "run dir (runs/latest: the last run started here whose workers became ready)"

    up = sub.add_parser("up", help="start targets and drafters, supervise until training ends", formatter_class=fmt,
                        description="Exit codes: 0 training finished, 1 failed, 2 bad usage or config, "
                                    "3 stopped by a signal before the end (resume with --resume).")
    up.add_argument("--gpus", required=True,
                    help="GPUS:ROLE groups, e.g. 0-4:target,5-7:drafter; join GPUs of one role with '+' (0+2:target)")
    up.add_argument("--config", help="run config (TOML); every key and default is in docs/config.md")
    up.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: GPU numbers are logical slots, for tests and the demo")
    up.add_argument("--demo", nargs="?", const="dense", choices=DEMOS, metavar="{dense,hybrid}",
                    help="train on the built-in tiny demo target and dataset: dense (default) a Qwen3, "
                         "hybrid a Qwen3.5-family Gated DeltaNet hybrid")
    up.add_argument("--run-dir", help="run folder (default: a new runs/<run.name>-<time>, linked as runs/latest "
                                      "once its workers are ready)")
    up.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in the run dir "
                                                          "(runs/latest without --run-dir)")
    up.add_argument("--share-gpus", action="store_true", help="allow several workers on one GPU")
    up.add_argument("--host", default="", help="across hosts: which GPUS:ROLE@HOST host this launcher runs")
    up.add_argument("--ready-timeout", type=float, default=3600.0, help="seconds to wait for every worker to be ready")
    up.add_argument("--stop-timeout", type=float,
                    help="seconds a graceful stop may take before workers are killed (default: run.stop_timeout_s + 30)")
    up.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides, applied after --config")
    up.set_defaults(func=cmd_up)

    status = sub.add_parser("status", help="probe every worker of a run and print a table", formatter_class=fmt,
                            description="Exit code: while the run is live, the worst probe (0 healthy, 1 unhealthy, "
                                        "2 unreachable); once it has ended, its own: 0 finished, 1 failed, 3 stopped.")
    status.add_argument("--run-dir", default=str(LATEST), help=latest_help)
    status.add_argument("--json", action="store_true", help="print JSON instead of the table")
    status.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for each worker (probed in parallel)")
    status.set_defaults(func=cmd_status)

    down = sub.add_parser("down", help="stop a run gracefully, then kill what is left", formatter_class=fmt)
    down.add_argument("--run-dir", default=str(LATEST), help=latest_help)
    down.add_argument("--timeout", type=float, default=330.0,
                      help="seconds the launcher may take to stop gracefully before it is killed")
    down.set_defaults(func=cmd_down)

    pr = sub.add_parser("probe", help="probe one health endpoint: exit 0 healthy, 1 unhealthy/stalled, 2 unreachable",
                        formatter_class=fmt)
    pr.add_argument("endpoint", help="health endpoint, e.g. ipc://<run_dir>/sock/drafter-0.health or tcp://HOST:PORT")
    pr.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for an answer")
    pr.add_argument("--json", action="store_true", help="print the whole status as JSON")
    pr.add_argument("--keys", default=os.environ.get("DFLASH_CURVE_KEYS_DIR", ""),
                    help="CURVE keys folder for a tcp endpoint (default: $DFLASH_CURVE_KEYS_DIR)")
    pr.set_defaults(func=cmd_probe)

    units = sub.add_parser("units", help="render systemd units for a topology (deploy/systemd)", formatter_class=fmt)
    units.add_argument("--gpus", required=True, help="the whole run's GPUS:ROLE[@HOST] spec, as for `up`")
    units.add_argument("--config", required=True, help="run config (TOML)")
    units.add_argument("--out", required=True, help="staging folder for the rendered files (see --env-dir, --unit-dir)")
    units.add_argument("--run-dir", required=True, help="the run folder the units' workers use (made by the install "
                                                         "command, not by rendering)")
    units.add_argument("--env-dir", default="", help="where the environment files and config.json are installed "
                                                     "(default: /etc/dflash/<run.name>)")
    units.add_argument("--unit-dir", default="/etc/systemd/system", help="where the unit files are installed")
    units.add_argument("--user", default="", help="User= of the workers (default: root)")
    units.add_argument("--group", default="", help="Group= of the workers")
    units.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="device the workers train on")
    units.add_argument("--roles", default="target,drafter", help="roles that run on this host")
    units.add_argument("--master", default="127.0.0.1", help="host of drafter rank 0 (rendezvous)")
    units.add_argument("--host", default="", help="with GPUS:ROLE@HOST specs: the host these units are for")
    units.add_argument("--python", default=sys.executable, help="interpreter the units run")
    units.add_argument("--start-timeout", type=int, default=1800, help="systemd TimeoutStartSec: load and warm-up")
    units.add_argument("--stop-timeout", type=int, default=600, help="systemd TimeoutStopSec: finish the step, checkpoint")
    units.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    units.set_defaults(func=cmd_units)

    keys = sub.add_parser("keys", help="generate CURVE keys for authenticated tcp transport", formatter_class=fmt)
    keys.add_argument("dir", help="folder for the keys (created mode 0700)")
    keys.add_argument("--force", action="store_true", help="replace existing keys")
    keys.set_defaults(func=cmd_keys)

    export = sub.add_parser("export", help="write a checkpoint as an HF-style DFlash drafter (SGLang / vLLM)",
                            formatter_class=fmt)
    export.add_argument("--checkpoint", required=True, help="checkpoint dir, or a run dir (its checkpoints/latest)")
    export.add_argument("--out", required=True, help="output dir")
    export.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="dtype of the exported weights")
    export.set_defaults(func=cmd_export)

    pl = sub.add_parser("plan", help="measure one GPU in each role on your model and data; print the best split",
                        formatter_class=fmt, description="Runs the target's capture and the drafter's training step "
                        "for about --seconds each on one device, then prints the expected trained tok/s of every "
                        "split of --gpus GPUs and which role bounds it.")
    pl.add_argument("--gpus", required=True, help="the GPUs the run will have: a count (8), GPU numbers (0-7) "
                                                  "or an `up` spec (0-4:target,5-7:drafter)")
    pl.add_argument("--config", help="run config (TOML), as for `up`")
    pl.add_argument("--demo", nargs="?", const="dense", choices=DEMOS, metavar="{dense,hybrid}",
                    help="the built-in tiny demo target and dataset (dense by default, or hybrid)")
    pl.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where to measure")
    pl.add_argument("--seconds", type=float, default=60.0, help="time each role about this long")
    pl.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides, applied after --config")
    pl.set_defaults(func=cmd_plan)

    rep = sub.add_parser("report", help="plot loss and tau over steps (PNG) and print a summary of a run",
                         formatter_class=fmt)
    rep.add_argument("--run-dir", default=str(LATEST), help=latest_help)
    rep.add_argument("--out", help="PNG path (default: <run-dir>/report.png)")
    rep.add_argument("--eval", action="store_true",
                     help="first run `launcher eval` on the run's latest checkpoint (loads the target)")
    _eval_options(rep)
    rep.set_defaults(func=cmd_report)

    rg = sub.add_parser("regenerate", help="rewrite a chat JSONL's assistant turns with the target (data step)",
                        formatter_class=fmt,
                        description="Every assistant turn regenerated by the target, greedy by default, so the "
                                    "drafter trains on what the target writes (docs/operations.md#which-labels).")
    rg.add_argument("--model", required=True, help="the target (local HF folder)")
    rg.add_argument("--data", required=True, help="chat JSONL (messages or conversations lines)")
    rg.add_argument("--out", required=True, help="JSONL to write")
    rg.add_argument("--gpus", default="0", help="GPUs to generate on, one shard each (e.g. 0-7; the targets' GPUs)")
    rg.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: one process, no GPU")
    rg.add_argument("--engine", choices=("hf", "vllm", "sglang"), default="hf",
                    help="hf: batched transformers generate; vllm / sglang when installed")
    rg.add_argument("--batch-size", type=int, default=32, help="prompts per HF generate call")
    rg.add_argument("--max-new-tokens", type=int, default=1024, help="longest reply")
    rg.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    rg.set_defaults(func=cmd_regenerate)

    ev = sub.add_parser("eval", help="real speculative decoding of a drafter with its target on held-out prompts",
                        formatter_class=fmt,
                        description="Greedy DFlash decoding with the run's target (target.model_path) on held-out "
                                    "prompts of its data: acceptance per prompt and per step, tokens per target "
                                    "forward, and whether the output equals plain greedy decoding; with the "
                                    "repeat-last-token and random-drafter controls on the same prompts. Appends "
                                    "to <run-dir>/spec_eval.jsonl.")
    ev.add_argument("--checkpoint", help="checkpoint dir, export dir or run dir (default: <run-dir>/checkpoints/latest)")
    ev.add_argument("--run-dir", default=str(LATEST), help=latest_help + "; its config names the target and data")
    ev.add_argument("--no-controls", action="store_true", help="skip the repeat-last and random-drafter controls")
    ev.add_argument("--json", action="store_true", help="print one JSON line")
    _eval_options(ev)
    ev.set_defaults(func=cmd_eval)
    return parser


def _eval_options(p) -> None:
    p.add_argument("--prompts", type=int, default=32, help="held-out prompts to decode")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt at most")
    p.add_argument("--device", "--eval-device", dest="eval_device",
                   help="device for the target and drafter, e.g. cuda, cuda:1, cpu (default: cuda if available, "
                        "else cpu; --eval-device is the older name)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv             # for the resume hint of `up`
    try:
        return args.func(args)
    except (UsageError, SpecError, ConfigError) as exc:
        print(f"launcher: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
