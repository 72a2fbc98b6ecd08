"""build_parser: every command of `launcher`, its options and their help."""

from __future__ import annotations

import argparse
import os
import sys

from launcher.commands import cmd_eval, cmd_export, cmd_keys, cmd_plan, cmd_probe, cmd_regenerate, cmd_report, cmd_units
from launcher.down import cmd_down
from launcher.rundir import LATEST
from launcher.status import cmd_status
from launcher.up import cmd_up
from services import __version__
from services.process.jobs import DEMO_VARIANTS
from services.run import eval_options


class _Help(argparse.HelpFormatter):
    """--help shows each option's default, unless it is unset or the help already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if _shown_default(action.default) and "default" not in text and action.option_strings:
            text += " (default: %(default)s)"
        return text


def _shown_default(default) -> bool:
    """Whether a default says something: 0 and 0.0 do (--temperature), unset, off and empty do not."""
    # by identity, not `in`: 0 == False, so a membership test would hide every zero default
    unset = default is None or default is False or default is argparse.SUPPRESS
    return not unset and default != "" and default != []


def _command(sub, name: str, help: str, description: str = "", **kwargs) -> argparse.ArgumentParser:
    """A subcommand whose --help opens with what it does (its one-line help), then `description`."""
    what = help[0].upper() + help[1:] + "."
    return sub.add_parser(name, help=help, description=f"{what} {description}".strip(), formatter_class=_Help, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="launcher", description="DFlash drafter training service", formatter_class=_Help
    )
    parser.add_argument("--version", action="version", version=f"launcher {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    latest_help = "run dir (runs/latest: the last run started here whose workers became ready)"

    up = _command(
        sub,
        "up",
        help="start targets and drafters, supervise until training ends",
        description="Exit codes: 0 training finished, 1 failed, 2 bad usage or config, "
        "3 stopped by a signal before the end (resume with --resume).",
    )
    up.add_argument(
        "--gpus",
        required=True,
        help="GPUS:ROLE groups, e.g. 0-4:target,5-7:drafter; join GPUs of one role with '+' (0+2:target)",
    )
    up.add_argument("--config", help="run config (TOML); every key and default is in docs/config.md")
    up.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: GPU numbers are logical slots, for tests and the demo",
    )
    up.add_argument(
        "--demo",
        nargs="?",
        const="dense",
        choices=DEMO_VARIANTS,
        metavar="{dense,hybrid}",
        help="train on the built-in tiny demo target and dataset: dense (default) a Qwen3, "
        "hybrid a Qwen3.5-family Gated DeltaNet hybrid",
    )
    up.add_argument(
        "--run-dir",
        help="run folder (default: a new runs/<run.name>-<time>, linked as runs/latest once its workers are ready)",
    )
    up.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in the run dir (runs/latest without --run-dir)",
    )
    up.add_argument("--share-gpus", action="store_true", help="allow several workers on one GPU")
    up.add_argument("--host", default="", help="across hosts: which GPUS:ROLE@HOST host this launcher runs")
    up.add_argument(
        "--slurm",
        action="store_true",
        help="under srun (one task per node): --host and the hosts of --gpus from the Slurm environment; "
        "in --gpus, @N is the job's N-th node (@1-2: the same group on nodes 1 and 2)",
    )
    up.add_argument("--ready-timeout", type=float, default=3600.0, help="seconds to wait for every worker to be ready")
    up.add_argument(
        "--stop-timeout",
        type=float,
        help="seconds a graceful stop may take before workers are killed (default: supervise.stop_timeout_s + 30)",
    )
    up.add_argument(
        "overrides", nargs="*", metavar="section.key=value", help="config overrides, applied after --config"
    )
    up.set_defaults(func=cmd_up)

    status = _command(
        sub,
        "status",
        help="probe every worker of a run and print a table",
        description="Exit code: while the run is live, the worst probe (0 healthy, 1 unhealthy, "
        "2 unreachable); once it has ended, its own: 0 finished, 1 failed, 3 stopped. What the columns, "
        "τ and cov mean: docs/guide/monitoring.md#glossary.",
    )
    status.add_argument("--run-dir", default=str(LATEST), help=latest_help)
    status.add_argument("--json", action="store_true", help="print JSON instead of the table")
    status.add_argument(
        "--timeout", type=float, default=2.0, help="seconds to wait for each worker (probed in parallel)"
    )
    status.set_defaults(func=cmd_status)

    down = _command(sub, "down", help="stop a run gracefully, then kill what is left")
    down.add_argument("--run-dir", default=str(LATEST), help=latest_help)
    down.add_argument(
        "--timeout",
        type=float,
        default=330.0,
        help="seconds the launcher may take to stop gracefully before it is killed",
    )
    down.set_defaults(func=cmd_down)

    pr = _command(
        sub,
        "probe",
        help="probe one health endpoint: exit 0 healthy, 1 unhealthy/stalled, 2 unreachable",
    )
    pr.add_argument("endpoint", help="health endpoint, e.g. ipc://<run_dir>/sock/drafter-0.health or tcp://HOST:PORT")
    pr.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for an answer")
    pr.add_argument("--json", action="store_true", help="print the whole status as JSON")
    pr.add_argument(
        "--keys",
        default=os.environ.get("DFLASH_CURVE_KEYS_DIR", ""),
        help="CURVE keys folder for a tcp endpoint (default: $DFLASH_CURVE_KEYS_DIR)",
    )
    pr.set_defaults(func=cmd_probe)

    units = _command(sub, "units", help="render systemd units for a topology (deploy/systemd)")
    units.add_argument("--gpus", required=True, help="the whole run's GPUS:ROLE[@HOST] spec, as for `up`")
    units.add_argument("--config", required=True, help="run config (TOML)")
    units.add_argument("--out", required=True, help="staging folder for the rendered files (see --env-dir, --unit-dir)")
    units.add_argument(
        "--run-dir",
        required=True,
        help="the run folder the units' workers use (made by the install command, not by rendering)",
    )
    units.add_argument(
        "--env-dir",
        default="",
        help="where the environment files and config.json are installed (default: /etc/dflash/<run.name>)",
    )
    units.add_argument("--unit-dir", default="/etc/systemd/system", help="where the unit files are installed")
    units.add_argument("--user", default="", help="User= of the workers (default: root)")
    units.add_argument("--group", default="", help="Group= of the workers")
    units.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="device the workers train on")
    units.add_argument("--roles", default="target,drafter", help="roles that run on this host")
    units.add_argument("--master", default=None, help=argparse.SUPPRESS)  # no longer used: said, then ignored
    units.add_argument("--host", default="", help="with GPUS:ROLE@HOST specs: the host these units are for")
    units.add_argument("--python", default=sys.executable, help="interpreter the units run")
    units.add_argument("--start-timeout", type=int, default=1800, help="systemd TimeoutStartSec: load and warm-up")
    units.add_argument(
        "--stop-timeout", type=int, default=600, help="systemd TimeoutStopSec: finish the step, checkpoint"
    )
    units.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    units.set_defaults(func=cmd_units)

    keys = _command(sub, "keys", help="generate CURVE keys for authenticated tcp transport")
    keys.add_argument("dir", help="folder for the keys (created mode 0700)")
    keys.add_argument("--force", action="store_true", help="replace existing keys")
    keys.set_defaults(func=cmd_keys)

    export = _command(sub, "export", help="write a checkpoint as an HF-style DFlash drafter (SGLang / vLLM)")
    export.add_argument("--checkpoint", required=True, help="checkpoint dir, or a run dir (its checkpoints/latest)")
    export.add_argument("--out", required=True, help="output dir")
    export.add_argument(
        "--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"), help="dtype of the exported weights"
    )
    export.set_defaults(func=cmd_export)

    pl = _command(
        sub,
        "plan",
        help="measure one GPU in each role on your model and data; print the best split",
        description="Runs the target's capture and the drafter's training step "
        "for about --seconds each on one device, then prints the expected trained tok/s of every "
        "split of --gpus GPUs and which role bounds it.",
    )
    pl.add_argument(
        "--gpus",
        required=True,
        help="the GPUs the run will have: a count (8), GPU numbers (0-7) or an `up` spec (0-4:target,5-7:drafter)",
    )
    pl.add_argument("--config", help="run config (TOML), as for `up`")
    pl.add_argument(
        "--demo",
        nargs="?",
        const="dense",
        choices=DEMO_VARIANTS,
        metavar="{dense,hybrid}",
        help="the built-in tiny demo target and dataset (dense by default, or hybrid)",
    )
    pl.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where to measure")
    pl.add_argument("--seconds", type=float, default=60.0, help="time each role about this long")
    pl.add_argument(
        "overrides", nargs="*", metavar="section.key=value", help="config overrides, applied after --config"
    )
    pl.set_defaults(func=cmd_plan)

    rep = _command(sub, "report", help="plot loss and tau over steps (PNG) and print a summary of a run")
    rep.add_argument("--run-dir", default=str(LATEST), help=latest_help)
    rep.add_argument("--out", help="PNG path (default: <run-dir>/report.png)")
    rep.add_argument(
        "--eval",
        action="store_true",
        help="first run `launcher eval` on the run's latest checkpoint (loads the target)",
    )
    eval_options.add(rep, eval_options.PROMPT_OPTIONS)
    rep.set_defaults(func=cmd_report)

    rg = _command(
        sub,
        "regenerate",
        help="rewrite a chat JSONL's assistant turns with the target (data step)",
        description="Every assistant turn regenerated by the target, greedy by default, so the "
        "drafter trains on what the target writes (docs/guide/data.md#which-labels).",
    )
    rg.add_argument("--model", required=True, help="the target (local HF folder, or a .gguf file: converted once)")
    rg.add_argument("--data", required=True, help="chat JSONL (messages or conversations lines)")
    rg.add_argument("--out", required=True, help="JSONL to write")
    rg.add_argument(
        "--gpus",
        default="0",
        help="GPUs to generate on, one shard each: numbers and ranges, e.g. 0-7 "
        "or 0,2,5 (no roles: every GPU generates)",
    )
    rg.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: one process, no GPU")
    rg.add_argument(
        "--engine",
        choices=("hf", "vllm", "sglang"),
        default="hf",
        help="hf: batched transformers generate; vllm / sglang when installed",
    )
    rg.add_argument(
        "--batch-size",
        type=int,
        default=0,
        help="prompts decoded at once (default 0: on a GPU as many KV-cache rows as half the free memory "
        "holds, at most 3072; 32 on CPU)",
    )
    rg.add_argument("--max-new-tokens", type=int, default=1024, help="longest reply")
    rg.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    rg.add_argument(
        "--samples",
        type=int,
        default=0,
        metavar="K",
        help="after that pass, K more replies per prompt sampled at --sample-temperature, written after it: "
        "varied replies beside the greedy one (docs/guide/data.md)",
    )
    rg.add_argument("--sample-temperature", type=float, default=1.0, help="the sampled passes' temperature")
    rg.add_argument(
        "--cut-prompts",
        type=int,
        default=0,
        metavar="N",
        help='a base model\'s plain text: continue N prompts cut from the {"text"} lines at line ends (up to 1 200 '
        "characters each, the lines in turn; kept as OUT.prompts.jsonl) instead of the lines themselves "
        "(docs/guide/data.md#which-labels)",
    )
    rg.add_argument(
        "--template-kwarg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        dest="template_kwargs",
        help="a chat-template variable for every prompt, VALUE a TOML literal (enable_thinking=false); "
        "repeat for more. Train and serve with the same ones (data.chat_template_kwargs)",
    )
    rg.set_defaults(func=cmd_regenerate)

    ev = _command(
        sub,
        "eval",
        help="real speculative decoding of a drafter with its target on benchmark or held-out prompts",
        description="Greedy DFlash decoding with the run's target (target.model_path) on prompt-set "
        "files (--prompts FILE, repeatable: e.g. a benchmark's prompts) or held-out "
        "prompts of its data: acceptance per prompt and per step, tokens per target "
        "forward, and whether the output equals plain greedy decoding; with the "
        "repeat-last-token and random-drafter controls on the same prompts; a table "
        "per set; on CUDA, the wall-clock speedup over the target alone at batch 1 "
        "(--speedup-prompts). Appends to <run-dir>/spec_eval.jsonl.",
    )
    eval_options.add(ev)
    ev.set_defaults(func=cmd_eval)
    return parser
