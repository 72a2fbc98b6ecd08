"""Every child process the launcher may start: the job, the module it runs (`python -m`), what it is.

The launcher builds each child's argv here and nowhere else (tests/unit/test_layering.py checks
that no launcher file names a services module and that every module here runs as a program), so
this table is the one list of what `launcher` may run.
"""

from __future__ import annotations

import sys

JOBS = {
    "target": ("services.target", "a target worker, one per target GPU"),
    "drafter": ("services.drafter", "a drafter worker, one per drafter GPU"),
    "drafter-agent": (
        "services.drafter.group.agent",
        "torch's elastic agent over one host's drafters (a group across hosts)",
    ),
    "packing": ("services.target.jobs.pack", "tokenizes and packs the data before any worker starts"),
    "demo": ("services.tools.demo", "builds (or reuses) the demo's target and data"),
    "export": ("services.drafter.checkpoints.export", "a checkpoint to a Hugging Face folder (launcher export)"),
    "eval": ("services.eval.launcher_eval", "acceptance of checkpoints on benchmark prompts (launcher eval)"),
    "regenerate-shard": ("services.target.jobs.regenerate_shard", "one GPU's share of launcher regenerate"),
    "gguf-model": ("services.tools.gguf_model", "a GGUF file to a Hugging Face folder (target.model_path=*.gguf)"),
    "measure-roles": ("services.tools.measure_roles", "each role's rate on this machine (launcher plan)"),
}
DEMO_VARIANTS = ("dense", "hybrid")  # `launcher up --demo [VARIANT]`: the demo job builds each (services/tools/demo.py)


def argv(job: str, *args) -> list[str]:
    """`python -m MODULE ARGS` for a job of the table (each argument made a string)."""
    module, _ = JOBS[job]
    return [sys.executable, "-m", module, *map(str, args)]
