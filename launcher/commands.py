"""The commands that hand their work on: probe, units, keys, export, plan, eval, report, regenerate.

Each checks its arguments, calls the module that does the work (or starts it as a child process
where it needs torch) and turns that module's errors into one UsageError line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from launcher import process
from launcher.errors import UsageError
from launcher.inputs import PATH_KEYS, check_inputs, load_run_config, make_demo, with_local_model
from launcher.preflight import check_tokenizer, preflight, unread_template_kwargs
from launcher.rundir import LATEST, run_holding
from launcher.topology import host_overrides, hosts, parse_gpu_list, parse_gpu_spec
from services.net.health_probe import probe
from services.process import jobs
from services.run import eval_options
from services.run.config import parse_value, toml_literal, value_of


def _probe_endpoint(text: str) -> str:
    """ipc://PATH or tcp://HOST:PORT; a bare path to a socket file means ipc."""
    if text.startswith(("ipc://", "tcp://")):
        return text
    if "://" not in text and Path(text).is_socket():
        return f"ipc://{Path(text).resolve()}"
    raise UsageError(
        f"endpoint {text!r}: expected ipc://PATH, tcp://HOST:PORT or the path of a socket file "
        "(e.g. <run_dir>/sock/target-0.health)"
    )


def cmd_probe(args) -> int:
    from services.net.curve import CurveError

    try:
        code, status, reason = probe(_probe_endpoint(args.endpoint), timeout_s=args.timeout, keys_dir=args.keys)
    except CurveError as exc:  # a usage error (the keys), not an unhealthy worker: exit 2, one line
        raise UsageError(f"--keys {args.keys}: {exc}") from None
    if args.json:
        print(json.dumps({"exit": code, "reason": reason, "status": status}, indent=2))
    else:
        print(reason)
    return code


def cmd_units(args) -> int:
    from launcher.units import UnitsError, install_command, render_units

    roles, overrides = args.roles.split(","), list(args.overrides)
    if args.master is not None:
        print(
            "launcher units: --master is no longer used: a units run's drafter ranks are on one host and "
            "meet on an ipc socket of the run dir (no TCP port)",
            file=sys.stderr,
        )
    model = load_run_config(args.config, overrides).target.model_path  # a GGUF: the units name its converted folder
    if (local := _local_model(model, "target.model_path")) != model:
        overrides.append(f'target.model_path="{local}"')
    workers = parse_gpu_spec(args.gpus, share_gpus=True, local_host=args.host)
    if hosts(workers):  # GPUS:ROLE@HOST: this host's roles, the tcp endpoints and the rendezvous follow
        if args.host not in hosts(workers):
            raise UsageError(f"--gpus names hosts {', '.join(hosts(workers))}: pass --host with this one")
        roles = sorted({w.role for w in workers if w.host == args.host})
        overrides = host_overrides(workers) + overrides
    try:
        paths = render_units(
            _strip_hosts(args.gpus),
            args.config,
            args.out,
            args.run_dir,
            python=args.python,
            device=args.device,
            roles=roles,
            overrides=overrides,
            start_timeout_s=args.start_timeout,
            stop_timeout_s=args.stop_timeout,
            env_dir=args.env_dir,
            user=args.user,
            group=args.group,
        )
    except UnitsError as exc:
        raise UsageError(str(exc)) from None
    print("\n".join(str(p) for p in paths))
    config = json.loads((Path(args.out) / "dflash-env" / "config.json").read_text())
    env_dir = os.path.abspath(args.env_dir or f"/etc/dflash/{config['run']['name']}")
    if not args.user:
        print("note: the workers will run as root; pass --user (and --group) to run them as an account of their own")
    print(
        "install: "
        + install_command(
            os.path.abspath(args.out), env_dir, os.path.abspath(args.run_dir), args.unit_dir, args.user, args.group
        )
    )
    return 0


def _strip_hosts(spec: str) -> str:
    return ",".join(group.split("@")[0] for group in spec.split(","))


def cmd_keys(args) -> int:
    from services.net.curve import CurveError, generate_keys

    try:
        paths = generate_keys(args.dir, overwrite=args.force)
    except CurveError as exc:
        raise UsageError(str(exc)) from None
    print("\n".join(str(p) for p in paths))
    print(f'set transport.curve_keys_dir = "{Path(args.dir).resolve()}" on every host (copy the folder, mode 0700)')
    return 0


def cmd_export(args) -> int:
    """The export reads tensors, so it runs in a child process: the launcher never imports torch."""
    argv = [
        *jobs.argv("export"),
        "--checkpoint",
        args.checkpoint,
        "--out",
        args.out,
        "--dtype",
        args.dtype,
    ]
    return subprocess.run(argv).returncode


def cmd_plan(args) -> int:
    from launcher import gpu_split

    try:
        gpus = gpu_split.plan_gpus(args.gpus)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    overrides = list(args.overrides)
    if args.demo:
        overrides = make_demo(args.device, args.demo) + overrides
    cfg = with_local_model(load_run_config(args.config, overrides))
    check_inputs(cfg, runs_targets=True)
    preflight(cfg, args.device, runs_targets=True)
    overrides += [f"{key}={toml_literal(value_of(cfg, key))}" for key in PATH_KEYS]  # absolute, resolved
    print(f"measuring each role on one {args.device} device, about {args.seconds:.0f} s each ...", flush=True)
    try:
        measured = gpu_split.measure(args.config, args.device, args.seconds, overrides)
    except RuntimeError as exc:
        raise UsageError(str(exc)) from None
    print(gpu_split.describe(measured, gpus))


def cmd_eval(args) -> int:
    """Real speculative decoding loads the target and the drafter: a child process (no torch here)."""
    for checkpoint in args.checkpoint:  # before anything loads: a typo costs no target load
        if not Path(checkpoint).exists():
            raise UsageError(f"--checkpoint {checkpoint} does not exist")
    if problem := eval_options.check_prompt_files(args.prompts):
        raise UsageError(problem)
    # a run's checkpoint names its run (the first's, of several)
    args.run_dir = args.run_dir or str((run_holding(args.checkpoint[0]) if args.checkpoint else None) or LATEST)
    args.set = [_with_local_model(item) for item in args.set]
    return subprocess.run(jobs.argv("eval", *eval_options.forward(args))).returncode


DEMO_SPEEDUP_PROMPTS = 16  # held-out prompts of the demo, each timed at batch 1: seconds on a GPU


def demo_speedup(run_dir: Path, device: str) -> list[str]:
    """The end of `launcher up --demo`: the export's wall-clock speedup over its target alone
    (`launcher eval` at batch 1, its progress on stderr), on CUDA; a CPU run says where it is measured."""
    from services.decoding.acceptance_text import speedup_summary

    if device != "cuda":
        return ["speedup over the target alone: measured on CUDA only (`launcher eval --device cuda` on a GPU)"]
    print("measuring the export's speedup over the target alone (launcher eval, batch 1) ...", flush=True)
    argv = jobs.argv(
        "eval",
        f"--run-dir={run_dir}",
        f"--checkpoint={run_dir / 'export'}",
        f"--prompts={DEMO_SPEEDUP_PROMPTS}",
        f"--speedup-prompts={DEMO_SPEEDUP_PROMPTS}",
        "--no-controls",  # the end of training measured them
        "--json",
    )
    done = subprocess.run(argv, stdout=subprocess.PIPE, text=True)
    try:
        record = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):  # it said why on stderr
        return [f"speedup over the target alone: not measured (launcher eval exited with code {done.returncode})"]
    return speedup_summary(record)


def _local_model(value: str, key: str) -> str:
    """value, or the converted folder of the GGUF it names (launcher/gguf.py)."""
    from launcher.gguf import GgufError, resolve_if_gguf

    try:
        return resolve_if_gguf(value, key)
    except GgufError as exc:
        raise UsageError(str(exc)) from None


def _with_local_model(item: str) -> str:
    """An eval --set item; target.model_path=X.gguf becomes its converted folder."""
    key, _, value = item.partition("=")
    if key.strip() != "target.model_path":
        return item
    return f'target.model_path="{_local_model(value.strip().strip(chr(34)), key.strip())}"'


def cmd_regenerate(args) -> int:
    """launcher/regenerate.py: one child per GPU, a progress line, the summary of what changed."""
    from launcher import regenerate

    if not Path(args.data).is_file():
        raise UsageError(f"--data {args.data} does not exist")
    args.model = _local_model(args.model, "--model")
    if not (Path(args.model) / "config.json").is_file():
        raise UsageError(f"--model {args.model} is not a Hugging Face model folder (no config.json)")
    check_tokenizer(Path(args.model), key="--model")  # a PreflightError: one line, before any child loads
    args.template_kwargs = template_kwargs(args.template_kwargs)
    for key in unread_template_kwargs(Path(args.model), args.template_kwargs):  # the record would tie the data to it
        print(
            f"launcher: warning: --template-kwarg {key}: the chat template of {args.model} never reads "
            f"{key}, so it renders alike with it or without it",
            file=sys.stderr,
            flush=True,
        )
    args.gpu_list = []
    if args.device == "cuda":  # a plain GPU list: every GPU runs the one kind of child
        parse_gpu_list(args.gpus)  # a typo is named before the GPUs are counted
        available = process.gpu_count()
        if not available:
            raise UsageError("--device cuda but no NVIDIA GPU is visible; use --device cpu for a CPU run")
        args.gpu_list = parse_gpu_list(args.gpus, available)
    try:
        regenerate.run(args)
    except regenerate.RegenerateError as exc:
        raise UsageError(str(exc)) from None
    return 0


def template_kwargs(items: list[str]) -> dict:
    """--template-kwarg KEY=VALUE items -> {KEY: VALUE}, each VALUE a TOML literal as in config overrides."""
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--template-kwarg {item!r}: expected KEY=VALUE, e.g. enable_thinking=false")
        out[key.strip()] = parse_value(raw)
    return out


def cmd_report(args) -> int:
    from launcher.report import ReportError, report

    if args.eval:
        if problem := eval_options.check_prompt_files(args.prompts):  # before the target loads
            raise UsageError(problem)
        argv = jobs.argv("eval", f"--run-dir={args.run_dir}", *eval_options.forward(args, eval_options.PROMPT_OPTIONS))
        code = subprocess.run(argv).returncode
        if code != 0:
            return code
    try:
        lines, _ = report(args.run_dir, args.out)
    except ReportError as exc:
        raise UsageError(str(exc)) from None
    print("\n".join(lines))
    return 0
