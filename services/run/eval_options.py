"""`launcher eval`'s options, declared once.

The launcher's parser (which never imports torch) and the evaluation's own (services/eval/launcher_eval.py,
the child process `launcher eval` runs) both add them from here; the launcher hands on what the
user gave with forward(). `launcher report --eval` takes the prompt options only.
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROLLBACKS = ("per-token", "refeed")  # a hybrid's state drops rejected drafts; the first is the default (measured)
SPEEDUP_PROMPTS = 16  # prompts of each set timed at batch 1 by default on CUDA: each is decoded 4 times

PROMPT_OPTIONS = [
    (
        ("--prompts",),
        dict(
            action="append",
            default=[],
            metavar="FILE|N",
            help='a prompt-set file, JSONL or .jsonl.gz, one prompt a line: {"messages": [...]}, '
            '{"prompt": "..."} or {"input_ids": [...]} (repeatable: a table per set); or N '
            "held-out prompts of the run's data (default: 32 held-out prompts)",
        ),
    ),
    (("--limit",), dict(type=int, default=0, help="prompts per set at most (0: every prompt of a file)")),
    (("--max-new-tokens",), dict(type=int, default=128, help="new tokens per prompt at most")),
    (
        ("--batch",),
        dict(
            type=int,
            default=0,
            help="prompts decoded at once, one target forward per step for all of them: a KV-cache row each "
            "for a target of attention and Gated DeltaNet layers (default on a GPU: as many as half the free "
            "memory holds, at most 512), packed without a cache for another recurrent target "
            "(default 32 up to 3B parameters); 1 (the default on a CPU): one prompt at a time on a KV cache",
        ),
    ),
    (
        ("--device", "--eval-device"),
        dict(
            dest="eval_device",
            help="device for the target and drafter, e.g. cuda, cuda:1, cpu (default: cuda if available, "
            "else cpu; --eval-device is the older name)",
        ),
    ),
]

EVAL_OPTIONS = [
    (
        ("--checkpoint",),
        dict(
            action="append",
            default=[],
            help="checkpoint dir, export dir or run dir (default: <run-dir>/checkpoints/latest); repeatable: "
            "each is decoded on the same prompts, their greedy references and the controls made once",
        ),
    ),
    (
        ("--run-dir",),
        dict(
            help="run dir whose config names the target and data (default: the run that --checkpoint is or "
            "lies in, else runs/latest: the last run started here whose workers became ready)"
        ),
    ),
    (("--no-controls",), dict(action="store_true", help="skip the repeat-last and random-drafter controls")),
    (
        ("--set",),
        dict(
            action="append",
            default=[],
            metavar="SECTION.KEY=VALUE",
            help="override a key of the run's config for this evaluation, e.g. target.quantize=none "
            "(verify an FP8-trained drafter with the bf16 target); repeatable",
        ),
    ),
    (
        ("--speedup-prompts",),
        dict(
            type=int,
            metavar="N",
            help="time the first N prompts of each set at batch 1, the target alone and with the drafter: "
            f"the wall-clock speedup (default {SPEEDUP_PROMPTS} on CUDA; 0, off, on a CPU: a CPU timing is not "
            "what users run; N > 0 forces it there)",
        ),
    ),
    (("--json",), dict(action="store_true", help="print one JSON line")),
    (("--threads",), dict(type=int, default=1, help="CPU threads (tiny demo models decode fastest on one)")),
    (
        ("--rollback",),
        dict(
            choices=ROLLBACKS,
            default=ROLLBACKS[0],
            help="how a hybrid target's Gated DeltaNet state drops rejected drafts (docs/guide/acceptance.md)",
        ),
    ),
    *PROMPT_OPTIONS,
]


def add(parser: argparse.ArgumentParser, options=EVAL_OPTIONS) -> None:
    for flags, kwargs in options:
        parser.add_argument(*flags, **kwargs)


def forward(args: argparse.Namespace, options=EVAL_OPTIONS) -> list[str]:
    """The arguments of `options` that differ from their defaults, as an argv the same options parse."""
    argv = []
    for flags, kwargs in options:
        dest = kwargs.get("dest") or flags[0].lstrip("-").replace("-", "_")
        value = getattr(args, dest, None)
        if kwargs.get("action") == "store_true":
            argv += [flags[0]] if value else []
        elif value is None or value == kwargs.get("default"):
            continue
        elif kwargs.get("action") == "append":
            argv += [f"{flags[0]}={item}" for item in value]
        else:
            argv.append(f"{flags[0]}={value}")
    return argv


def prompt_files(values: list[str]) -> list[str]:
    """The files among --prompts values (a number is a count of held-out prompts)."""
    return [value for value in values if not value.isdigit()]


def prompt_file_problem(file: str) -> str | None:
    """Why a --prompts FILE cannot be used, or None: checked before any model loads, so a typo
    costs no target load."""
    path = Path(file)
    if not path.exists():
        return f"--prompts {file}: no such file"
    if path.is_dir():
        return f"--prompts {file}: a folder, not a prompt file (JSONL or .jsonl.gz)"
    try:
        with open(path, "rb") as f:
            empty = not f.read(1)
    except OSError as exc:
        return f"--prompts {file}: unreadable ({exc.strerror or exc})"
    return f"--prompts {file}: empty file (a prompt file holds one JSON prompt a line)" if empty else None


def check_prompt_files(values: list[str]) -> str | None:
    """The first problem of the prompt files among --prompts values, or None."""
    return next(filter(None, map(prompt_file_problem, prompt_files(values))), None)
