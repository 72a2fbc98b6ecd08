"""`launcher`: up, status, down, probe (and units, keys, export, report).

The launcher never imports torch: it starts fast, stays small, and can never hold GPU memory.
Exit codes of `up`: 0 training finished, 1 failed, 2 bad usage or config, 3 stopped before the end.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from launcher import process
from launcher.report import describe_export
from launcher.supervisor import EXIT_FAILED, EXIT_USAGE, RunFailed, Supervisor
from launcher.topology import SpecError, host_overrides, hosts, parse_gpu_spec
from services.config import ConfigError, dump_json, load_config
from services.drafter.plan import Plan
from services.files import point
from services.health import probe


class UsageError(Exception):
    """A one-line error for the user; printed without a traceback, exit 2."""


def _read_run(run_dir: Path) -> dict:
    path = run_dir / "run.json"
    if not path.is_file():
        raise UsageError(f"no run in {run_dir} (missing {path}); pass --run-dir")
    return json.loads(path.read_text())


LATEST = Path("runs") / "latest"


def _check_inputs(cfg, runs_targets: bool) -> None:
    """The model and the data, named in the error, before any worker starts (on a host that has them)."""
    for key, value in (("target.model_path", cfg.target.model_path), ("data.path", cfg.data.path)):
        if not value:
            raise UsageError(f"{key} is not set (config file, {key}=..., or --demo)")
        if runs_targets and not Path(value).exists():
            raise UsageError(f"{key}: {value} does not exist")
    if runs_targets and not (Path(cfg.target.model_path) / "config.json").is_file():
        raise UsageError(f"target.model_path: {cfg.target.model_path} is not a Hugging Face model folder (no config.json)")


def _choose_run_dir(args, name: str) -> Path:
    """--run-dir, else runs/latest for --resume, else a new runs/<run.name>-<time> (runs/latest points to it)."""
    if args.run_dir:
        return Path(args.run_dir).resolve()
    if args.resume:
        if not LATEST.exists():
            raise UsageError("--resume without --run-dir needs runs/latest (no earlier run here); pass --run-dir")
        return LATEST.resolve()
    run_dir = (Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    point(LATEST, run_dir)
    return run_dir


def _make_demo(run_dir: Path) -> list[str]:
    """Build the demo model and data in a child process (torch stays out of the launcher)."""
    out = subprocess.run([sys.executable, "-m", "services.demo", "--out", str(run_dir / "demo")],
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
    runs_targets = any(w.role == "target" and w.host == args.host for w in workers)
    if not args.demo:
        _check_inputs(cfg, runs_targets)
    run_dir = _choose_run_dir(args, cfg.run.name)
    if (run_dir / "run.json").is_file():
        old = json.loads((run_dir / "run.json").read_text())
        if process.alive(old.get("launcher_pid", -1)) and old.get("launcher_pid") != os.getpid():
            raise UsageError(f"a run is active in {run_dir} (launcher pid {old['launcher_pid']}); "
                             f"`launcher down --run-dir {run_dir}` first")
    if (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()) and not args.resume:
        raise UsageError(f"{run_dir} has checkpoints; pass --resume to continue, or choose another --run-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    if args.demo:
        print("building the demo target and dataset…", flush=True)
        overrides = _make_demo(run_dir) + overrides
    cfg = load_config(args.config, overrides)
    _check_inputs(cfg, runs_targets)
    dump_json(cfg, run_dir / "config.json")
    sup = Supervisor(run_dir, cfg, workers, args.device, resume=args.resume, host=args.host,
                     ready_timeout_s=args.ready_timeout,
                     stop_timeout_s=args.stop_timeout or cfg.run.stop_timeout_s + 30)
    sup.install_signal_handlers()
    print(f"run dir: {run_dir}\nlogs:    {run_dir / 'logs'}/<role>-<rank>.log\n"
          f"workers: {', '.join(f'{w.name}@gpu{w.gpu}' for w in sup.local)} ({args.device})", flush=True)
    try:
        sup.start_all()
        sup.wait_ready()
        code = sup.supervise()
    except RunFailed as exc:
        sup.progress.done(f"run failed: {exc}")
        sup.shutdown()
        code = EXIT_FAILED
    export = describe_export(run_dir / "export")
    if code == 0 and export:
        print(export, flush=True)
    print(f"exit {code}; logs in {run_dir / 'logs'}; metrics in {run_dir / 'metrics.jsonl'}", flush=True)
    return code


def _run_keys(run_dir: Path) -> str:
    """CURVE keys of a run (tcp with transport.curve_keys_dir), from its resolved config."""
    try:
        transport = json.loads((run_dir / "config.json").read_text())["transport"]
    except (OSError, ValueError, KeyError):
        return ""
    return transport.get("curve_keys_dir", "") if transport.get("scheme") == "tcp" else ""


def _probe_row(w: dict, timeout: float, keys: str) -> dict:
    code, status, reason = probe(w["endpoints"]["health"], timeout_s=timeout, keys_dir=keys)
    row = {"name": w["name"], "gpu": w["gpu"], "pid": w["pid"], "probe": code, "reason": reason}
    if status:
        row.update({k: status.get(k) for k in ("state", "step", "total_steps", "samples_done", "tokens_per_s",
                                                 "last_progress_age_s", "compile_s", "rss_bytes",
                                                 "gpu_mem_bytes", "bad_messages", "loss", "tau", "warning")})
    return row


def cmd_status(args) -> int:
    run_dir = Path(args.run_dir).resolve()
    run = _read_run(run_dir)
    rows = [_probe_row(w, args.timeout, _run_keys(run_dir)) for w in run["workers"]]
    plan = _read_plan(run_dir)
    if args.json:
        print(json.dumps({"launcher_pid": run["launcher_pid"], "launcher_alive": process.alive(run["launcher_pid"]),
                          "plan": plan.to_dict() if plan else None, "workers": rows}, indent=2))
    else:
        cols = ("name", "gpu", "pid", "state", "step", "total_steps", "samples_done", "tokens_per_s", "last_progress_age_s",
                "rss_bytes", "gpu_mem_bytes", "bad_messages", "probe")
        table = [cols] + [tuple(_cell(r.get(c)) for c in cols) for r in rows]
        widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
        for row in table:
            print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)))
        for r in rows:
            if r.get("warning"):
                print(f"{r['name']}: warning: {r['warning']}")
        if plan:
            print(f"plan: {plan.describe()}")
        print(f"launcher pid {run['launcher_pid']} {'alive' if process.alive(run['launcher_pid']) else 'not running'}")
    return max((r["probe"] for r in rows), default=0)


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
    pid = run["launcher_pid"]
    if process.alive(pid):
        os.kill(pid, signal.SIGTERM)     # the launcher stops drafters (checkpoint), then targets
        deadline = time.monotonic() + args.timeout
        while process.alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
    leftovers = [w["pid"] for w in run["workers"] if w.get("pid") and process.alive(w["pid"])]
    hard = process.stop_all(leftovers, deadline_s=10) if leftovers else []
    if process.alive(pid):
        process.kill_tree(pid)
        hard.append(pid)
    print(f"stopped {run_dir}" + (f"; killed hard: {hard}" if hard else ""))
    return 0


def cmd_probe(args) -> int:
    code, status, reason = probe(args.endpoint, timeout_s=args.timeout, keys_dir=args.keys)
    if args.json:
        print(json.dumps({"exit": code, "reason": reason, "status": status}, indent=2))
    else:
        print(reason)
    return code


def cmd_units(args) -> int:
    from launcher.units import UnitsError, render_units
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
                             start_timeout_s=args.start_timeout, stop_timeout_s=args.stop_timeout)
    except UnitsError as exc:
        raise UsageError(str(exc)) from None
    print("\n".join(str(p) for p in paths))
    print(f"install: cp -r {args.out}/* /etc/systemd/system/ && systemctl daemon-reload && systemctl start dflash.target")
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


def cmd_report(args) -> int:
    from launcher.report import ReportError, report
    try:
        lines, _ = report(args.run_dir, args.out)
    except ReportError as exc:
        raise UsageError(str(exc)) from None
    print("\n".join(lines))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="launcher", description="DFlash drafter training service")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start targets and drafters, supervise until training ends")
    up.add_argument("--gpus", required=True, help="e.g. 0-4:target,5-7:drafter")
    up.add_argument("--config", help="run config (TOML)")
    up.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    up.add_argument("--demo", action="store_true", help="train on the built-in tiny demo target and dataset")
    up.add_argument("--run-dir", help="default: a new runs/<run.name>-<time>, linked as runs/latest")
    up.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in the run dir")
    up.add_argument("--share-gpus", action="store_true", help="allow several workers on one GPU")
    up.add_argument("--host", default="", help="across hosts: which GPUS:ROLE@HOST host this launcher runs")
    up.add_argument("--ready-timeout", type=float, default=3600.0, help="seconds to wait for every worker to be ready")
    up.add_argument("--stop-timeout", type=float, help="seconds a graceful stop may take (default: run.stop_timeout_s + 30)")
    up.add_argument("overrides", nargs="*", metavar="section.key=value")
    up.set_defaults(func=cmd_up)

    status = sub.add_parser("status", help="probe every worker of a run and print a table")
    status.add_argument("--run-dir", default=str(LATEST), help="default: runs/latest, the last run started here")
    status.add_argument("--json", action="store_true")
    status.add_argument("--timeout", type=float, default=2.0)
    status.set_defaults(func=cmd_status)

    down = sub.add_parser("down", help="stop a run gracefully, then kill what is left")
    down.add_argument("--run-dir", default=str(LATEST), help="default: runs/latest, the last run started here")
    down.add_argument("--timeout", type=float, default=330.0)
    down.set_defaults(func=cmd_down)

    pr = sub.add_parser("probe", help="probe one health endpoint: exit 0 healthy, 1 unhealthy/stalled, 2 unreachable")
    pr.add_argument("endpoint")
    pr.add_argument("--timeout", type=float, default=3.0)
    pr.add_argument("--json", action="store_true")
    pr.add_argument("--keys", default=os.environ.get("DFLASH_CURVE_KEYS_DIR", ""),
                    help="CURVE keys folder for a tcp endpoint (default: $DFLASH_CURVE_KEYS_DIR)")
    pr.set_defaults(func=cmd_probe)

    units = sub.add_parser("units", help="render systemd units for a topology (deploy/systemd)")
    units.add_argument("--gpus", required=True)
    units.add_argument("--config", required=True)
    units.add_argument("--out", required=True, help="folder for the unit files")
    units.add_argument("--run-dir", required=True)
    units.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    units.add_argument("--roles", default="target,drafter", help="roles that run on this host")
    units.add_argument("--master", default="127.0.0.1", help="host of drafter rank 0 (rendezvous)")
    units.add_argument("--host", default="", help="with GPUS:ROLE@HOST specs: the host these units are for")
    units.add_argument("--python", default=sys.executable)
    units.add_argument("--start-timeout", type=int, default=1800)
    units.add_argument("--stop-timeout", type=int, default=600)
    units.add_argument("overrides", nargs="*", metavar="section.key=value")
    units.set_defaults(func=cmd_units)

    keys = sub.add_parser("keys", help="generate CURVE keys for authenticated tcp transport")
    keys.add_argument("dir")
    keys.add_argument("--force", action="store_true", help="replace existing keys")
    keys.set_defaults(func=cmd_keys)

    export = sub.add_parser("export", help="write a checkpoint as an HF-style DFlash drafter (SGLang / vLLM)")
    export.add_argument("--checkpoint", required=True, help="checkpoint dir, or a run dir (its checkpoints/latest)")
    export.add_argument("--out", required=True, help="output dir")
    export.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    export.set_defaults(func=cmd_export)

    rep = sub.add_parser("report", help="plot loss and tau over steps (PNG) and print a summary of a run")
    rep.add_argument("--run-dir", default=str(LATEST), help="default: runs/latest, the last run started here")
    rep.add_argument("--out", help="PNG path (default <run-dir>/report.png)")
    rep.set_defaults(func=cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (UsageError, SpecError, ConfigError) as exc:
        print(f"launcher: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
