"""The model and the data a run reads: a Hugging Face repo id resolved to its folder, both checked
before any worker starts, the demo built, the data tokenized and packed (each in a child process
where it needs torch: the launcher never imports it).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from launcher.errors import UsageError
from launcher.models import REPO_ID, ModelNotFound, resolve_model_path
from launcher.progress import ProgressLine
from launcher.report import describe_data
from services.process import jobs
from services.run import runspec
from services.run.config import Config, load_config
from services.run.files import write_json_atomic

# Every config key that names a file or folder (a list: each item). tests/unit/test_preflight.py
# checks that every key named like a path is here.
PATH_KEYS = ("target.model_path", "data.path", "data.eval_path", "transport.curve_keys_dir", "eval.prompts")


def absolute_paths(cfg: Config, base: str | Path | None = None) -> Config:
    """cfg with every path key (PATH_KEYS) absolute, resolved against base (default: the folder the
    command runs in): the run's config is read from other folders (`eval`, units with
    WorkingDirectory=<run_dir>, a resume). Empty values stay empty; a Hugging Face repo id in
    target.model_path (`Qwen/Qwen3-8B`, no such local path) stays a repo id."""
    base = Path(base or os.getcwd())

    def absolute(key: str, value: str) -> str:
        if not value:
            return value
        path = Path(value).expanduser()
        if (
            key == "target.model_path"
            and not path.is_absolute()
            and REPO_ID.match(value)
            and not (base / path).exists()
        ):
            return value
        return os.path.normpath(base / path)

    for dotted in PATH_KEYS:
        section, key = dotted.split(".")
        old = getattr(getattr(cfg, section), key)
        new = [absolute(dotted, v) for v in old] if isinstance(old, list) else absolute(dotted, old)
        setattr(getattr(cfg, section), key, new)
    return cfg


def load_run_config(path: str | Path | None, overrides) -> Config:
    """load_config with every path key absolute (absolute_paths): how the launcher reads a config."""
    return absolute_paths(load_config(path, overrides))


def with_local_model(cfg):
    """cfg with a Hugging Face repo id in target.model_path replaced by its local snapshot folder, a
    GGUF file by its converted folder (before any worker starts; written into the run's config)."""
    try:
        cfg.target.model_path = resolve_model_path(cfg.target.model_path)
    except ModelNotFound as exc:
        raise UsageError(str(exc)) from None
    return cfg


def check_inputs(cfg, runs_targets: bool) -> runspec.RunSpec | None:
    """The model and the data, named in the error, before any worker starts (on a host that has them).
    Where targets run here, the run spec resolved from the model's config.json (returned: resolved once):
    a target too shallow for drafter.num_layers is a config error now, not a failed worker minutes later."""
    for key, value in (("target.model_path", cfg.target.model_path), ("data.path", cfg.data.path)):
        if not value:
            raise UsageError(f"{key} is not set (config file, {key}=..., or --demo)")
        if runs_targets and not Path(value).exists():
            raise UsageError(f"{key}: {value} does not exist")
    if runs_targets and not (Path(cfg.target.model_path) / "config.json").is_file():
        raise UsageError(
            f"target.model_path: {cfg.target.model_path} is not a Hugging Face model folder (no config.json)"
        )
    return runspec.resolve(cfg) if runs_targets else None


def prepare_data(run_dir: Path) -> dict:
    """Tokenize and pack the data now, in a child process (no torch here, no model weights there):
    a bad line is one line and exit 2 before any worker starts; the targets reuse the cache. A
    long tokenizing shows its progress on the live line."""
    argv = [*jobs.argv("packing"), "--config", str(run_dir / "config.json"), "--run-dir", str(run_dir)]
    line = ProgressLine()
    code, info, stderr = run_with_progress(argv, line)
    if code != 0 or not info:
        lines = stderr.strip().splitlines() or [f"exit {code}"]
        raise UsageError(lines[-1] if code == 2 else "preparing the data failed:\n" + stderr[-2000:])
    write_json_atomic(run_dir / "data.json", info)  # for `launcher status` and `launcher report`
    line.done(describe_data(info))
    return info


def run_with_progress(argv: list[str], line: ProgressLine) -> tuple[int, dict, str]:
    """Run a child that prints JSON lines: {"progress": text} shown on `line` (a text starting with
    "building" stays as a line of its own), the last other record returned with the exit status
    and the child's stderr."""
    last = {}
    with tempfile.TemporaryFile("w+") as err:  # a file, not a pipe: it never fills while stdout is read
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True)
        for text in child.stdout:
            record = json.loads(text) if text.startswith("{") else {}
            if "progress" in record:
                (line.done if record["progress"].startswith("building") else line.show)(record["progress"])
            elif record:
                last = record
        code = child.wait()
        err.seek(0)
        return code, last, err.read()


def make_demo(device: str, variant: str = "dense") -> list[str]:
    """Build (or reuse, from the demo cache) the demo model and data in a child process (torch
    stays out of the launcher); its config suits the device (bfloat16 target on cuda).
    variant: dense (a Qwen3) or hybrid (a Qwen3.5-family Gated DeltaNet). A build (minutes on a
    busy CPU) shows its progress on the live line; a reuse says so in one line."""
    argv = jobs.argv("demo", "--device", device, "--variant", variant, "--progress")
    line = ProgressLine()
    code, last, stderr = run_with_progress(argv, line)
    if code != 0 or not last:
        raise UsageError(f"building the demo failed:\n{stderr[-2000:]}")
    model = Path(last["model_path"]).parent
    line.done(
        "demo target and dataset built" if not last["reused"] else f"reusing the demo target and dataset in {model}"
    )
    return last["overrides"]
