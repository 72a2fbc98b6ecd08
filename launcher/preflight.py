"""What `launcher up` checks before it makes the run folder, and what it says about a resume.

Every check here needs no worker and no torch (config keys against each other and against the
device, the model folder's files, the data files' first line and what `launcher regenerate`
recorded beside them), so a mistake costs one line and
exit 2 in a second, not a failed worker minutes later. Each error names the key or file. What
the run spec decides (the captured layers, the drafter's shape, one batch's size against
transport.max_batch_bytes) is checked where it is resolved, services/run/runspec.py.

A new run folder is made only once everything before the workers has passed: `up` prepares the
run (config.json, the tokenized data) in a hidden sibling folder and renames it into place at
the end (`staged`). A start refused before any worker is started leaves no folder behind. Once
workers have started, the folder stays whatever happens: it holds run.json with the outcome and
the workers' logs, which name the cause of a failed start.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
from pathlib import Path

from launcher.regen_record import template_kwargs_problem
from services.process.log import events
from services.run import runspec
from services.run.checkpoint_compat import model_errors, run_errors
from services.run.config import Config, ConfigError
from services.run.schedule import make_plan

# A tokenizer folder has at least one of these (fast tokenizers: tokenizer.json; sentencepiece
# models: tokenizer.model / spiece.model; BPE and WordPiece vocabularies; tiktoken files).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
)
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "additional_chat_templates")
HALF_DTYPES = ("bfloat16", "bf16", "float16", "fp16")
SCAN_LINES = 1000  # blank lines skipped at most while looking for a data file's first line


class PreflightError(ConfigError):
    """A check before the run folder failed; one line naming the key or file (exit 2)."""


def preflight(cfg: Config, device: str, runs_targets: bool) -> None:
    """Every check of `up` that needs no worker (after config.validate and the input checks)."""
    runspec.check_sizes(cfg)
    check_attention(cfg, device)
    check_precision(cfg, device)
    if not runs_targets:  # another host's targets read the model and the data
        return
    files = [
        (key, path) for key, path in (("data.path", cfg.data.path), ("data.eval_path", cfg.data.eval_path)) if path
    ]
    chat = [f"{key} {path}" for key, path in files if first_line_is_chat(check_data_file(key, path))]
    check_tokenizer(Path(cfg.target.model_path), chat[0] if chat else "")
    check_weights(Path(cfg.target.model_path))
    for key, path in files:
        check_regenerated(key, path, cfg.data.chat_template_kwargs)


def check_regenerated(key: str, path: str, template_kwargs: dict) -> None:
    """Data that `launcher regenerate` wrote with other chat-template options than the run's: refused
    (the drafter would learn text rendered differently from what serving renders); a warning when
    the file was edited since its record was written."""
    refusal, warning = template_kwargs_problem(key, path, template_kwargs)
    if refusal:
        raise PreflightError(refusal)
    if warning:
        print(f"launcher: warning: {warning}", file=sys.stderr, flush=True)


def check_attention(cfg: Config, device: str) -> None:
    if cfg.kernels.attention == "flex" and device != "cuda":
        raise PreflightError(
            f"kernels.attention=flex needs --device cuda (flex attention has no backward on "
            f"{device}); use kernels.attention=auto or dense"
        )
    if cfg.target.attn_implementation.startswith("flash_attention") and cfg.target.dtype not in HALF_DTYPES:
        raise PreflightError(
            f"target.attn_implementation={cfg.target.attn_implementation} needs target.dtype "
            f"bfloat16 or float16, got {cfg.target.dtype} (or use target.attn_implementation=sdpa)"
        )


def check_precision(cfg: Config, device: str) -> None:
    """FP8 drafter linears (the 27B preset's) on a device without them; the GPU's capability and
    torchao are the drafter's own check (services/drafter/modeling/precision.py), which needs torch."""
    if cfg.kernels.precision == "fp8" and device != "cuda":
        raise PreflightError(
            f"kernels.precision=fp8 needs --device cuda (FP8 matmuls, compute capability 8.9+), not {device}; "
            'set kernels.precision="bf16"'
        )


def check_data_file(key: str, path: str) -> bytes:
    """The file's first non-blank line (at most 1 MiB of it); PreflightError for a missing, odd or empty file."""
    p = Path(path)
    if not p.exists():
        raise PreflightError(f"{key}: {path} does not exist")
    if not p.is_file():
        raise PreflightError(f"{key}: {path} is not a file (expected JSONL: one sample per line)")
    try:
        with open(p, "rb") as f:
            for _ in range(SCAN_LINES):
                line = f.readline(1 << 20)
                if not line:
                    break
                if line.strip():
                    return line
            else:
                return b""  # only blank lines so far: the data preparation reads on
    except OSError as exc:
        raise PreflightError(f"{key}: cannot read {path}: {exc.strerror or exc}") from None
    raise PreflightError(f"{key}: {path} is empty (no JSONL lines)")


def first_line_is_chat(line: bytes) -> bool:
    """A chat record (messages / conversations). A line that does not parse is the data
    preparation's to name, with its line number."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return False
    return isinstance(record, dict) and ("messages" in record or "conversations" in record)


def check_tokenizer(folder: Path, chat_data: str = "", key: str = "target.model_path") -> None:
    """The target folder has tokenizer files, and a chat template when chat_data ("data.path FILE") needs one.
    key: what the user named the folder with (`regenerate` and `eval` call it with their option's name)."""
    names = {p.name for p in folder.iterdir()}
    if not names & set(TOKENIZER_FILES) and not any(n.endswith(".tiktoken") for n in names):
        raise PreflightError(
            f"{key}: no tokenizer in {folder} (none of {', '.join(TOKENIZER_FILES)}): "
            "save the model's tokenizer there (tokenizer.save_pretrained(FOLDER))"
        )
    if chat_data and not has_chat_template(folder, names):
        raise PreflightError(
            f"target.model_path: the tokenizer in {folder} has no chat template, needed for the chat "
            f"lines of {chat_data}: add chat_template.jinja (or tokenizer_config.json's chat_template), "
            "or give pre-tokenized lines"
        )


def check_weights(folder: Path) -> None:
    """The target folder has its weights, as the workers read them: model.safetensors, or
    model.safetensors.index.json naming files that are there (the drafter reads the target's head
    from these, services/drafter/modeling/target_head.py). A folder of config and tokenizer files only (a
    partial download) is named now, not by a traceback once the workers load it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise PreflightError(f"target.model_path: {index} is not a safetensors index (no weight_map)") from None
        missing = sorted(f for f in files if not (folder / str(f)).is_file())
        if missing:
            raise PreflightError(
                f"target.model_path: {index} names {len(missing)} weight files that are not in "
                f"{folder} ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): "
                "finish downloading the model"
            )
        return
    if (folder / "model.safetensors").is_file():
        return
    other = sorted(p.name for p in folder.iterdir() if p.name.endswith((".safetensors", ".bin", ".bin.index.json")))
    if other:
        raise PreflightError(
            f"target.model_path: {folder} has weights as {', '.join(other[:3])}"
            f"{', ...' if len(other) > 3 else ''} but no model.safetensors or "
            "model.safetensors.index.json, which the workers read: save the model with "
            "save_pretrained(FOLDER, safe_serialization=True)"
        )
    raise PreflightError(
        f"target.model_path: no weights in {folder} (no *.safetensors, *.bin or index json; only "
        "config and tokenizer files?): download the model's weights too"
    )


def template_texts(folder: Path) -> list[str]:
    """Every chat template of a tokenizer folder, as text (chat_template.jinja, chat_template.json,
    additional_chat_templates/, tokenizer_config.json's chat_template: a string or named ones)."""
    texts = [p.read_text(errors="replace") for p in sorted(folder.glob("chat_template.jinja"))]
    texts += [p.read_text(errors="replace") for p in sorted(folder.glob("additional_chat_templates/*.jinja"))]
    for name in ("chat_template.json", "tokenizer_config.json"):
        try:
            value = json.loads((folder / name).read_text()).get("chat_template")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, str):
            texts.append(value)
        elif isinstance(value, list):
            texts += [t.get("template", "") for t in value if isinstance(t, dict)]
    return texts


def unread_template_kwargs(folder: Path, keys) -> list[str]:
    """The keys no chat template of the folder names (a template that never reads enable_thinking
    renders alike with it or without it); [] when the folder has no template to read."""
    texts = template_texts(folder)
    if not texts:
        return []
    return [k for k in keys if not any(re.search(rf"\b{re.escape(k)}\b", t) for t in texts)]


def has_chat_template(folder: Path, names: set[str]) -> bool:
    if names & set(CHAT_TEMPLATE_FILES):
        return True
    try:
        conf = json.loads((folder / "tokenizer_config.json").read_text())
    except OSError:
        return False
    except ValueError:
        return True  # unreadable here: loading the tokenizer will say what is wrong
    return not isinstance(conf, dict) or bool(conf.get("chat_template"))


def max_steps_warning(cfg: Config, batches_per_epoch: int, drafters: int) -> str | None:
    """The line that says so when run.max_steps is past the end of run.epochs: the run ends with the
    epochs (services/run/schedule.py make_plan caps it), which the user must hear before it
    starts, not find out; more epochs are the user's call (they change the lr schedule's horizon and
    how often each row is seen). Once the data is packed: its rows per epoch decide the steps. A
    max_steps far past the data is also how tests and quick runs say "until the data ends", so it
    is a warning, not a refusal."""
    steps, accum = cfg.run.max_steps, max(1, cfg.optimizer.grad_accum)

    def available(epochs: int) -> int:
        return make_plan(batches_per_epoch, epochs, drafters, accum).optimizer_steps

    if not steps or batches_per_epoch <= 0 or steps <= available(cfg.run.epochs):
        return None
    epochs = max(cfg.run.epochs + 1, -(-steps * drafters * accum // batches_per_epoch) - 1)
    while available(epochs) < steps:
        epochs += 1
    per = (
        f"{drafters} drafters x optimizer.grad_accum={accum}"
        if accum > 1
        else f"{drafters} drafter" + "s" * (drafters > 1)
    )
    return (
        f"run.max_steps={steps} is past the end of run.epochs={cfg.run.epochs} ({available(cfg.run.epochs)} "
        f"optimizer steps: {batches_per_epoch} rows per epoch on {per}): the run ends at step "
        f"{available(cfg.run.epochs)}; set run.epochs={epochs} to train {steps} steps"
    )


# --- the run folder ---------------------------------------------------------------------------


@contextlib.contextmanager
def staged(run_dir: Path):
    """The folder to prepare the run in. A new run dir is prepared in a hidden sibling, renamed
    into place when the block ends without an error, removed when it raises (Ctrl-C included);
    an existing run dir (a resume, or a folder made beforehand) is prepared in place."""
    if run_dir.is_dir():
        yield run_dir
        return
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    stage = run_dir.with_name(f".{run_dir.name}.starting-{os.getpid()}")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    try:
        os.rename(stage, run_dir)
    except OSError:  # another launcher made it meanwhile: that run is the one
        shutil.rmtree(stage, ignore_errors=True)
        raise PreflightError(
            f"{run_dir} appeared while this launcher prepared it: another launcher is starting "
            "there; choose another --run-dir"
        ) from None


# --- resume -----------------------------------------------------------------------------------


def check_resume(run_dir: Path) -> None:
    if not run_dir.is_dir():
        raise PreflightError(
            f"--resume: {run_dir} does not exist, so there is nothing to resume; "
            "leave out --resume to start a new run there"
        )


def resume_config_path(args) -> Path | None:
    """`up --resume` without --config: the run's own config.json (None when there is none)."""
    if not args.resume or args.config or args.demo:
        return None
    path = Path(args.run_dir or "runs/latest") / "config.json"
    return path.resolve() if path.is_file() else None


def resume_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint a resume starts from, as the drafter picks it: `latest`, else the newest step-*."""
    root = run_dir / "checkpoints"
    if (root / "latest" / "config.json").is_file():
        return (root / "latest").resolve()
    steps = sorted(p for p in root.glob("step-*") if (p / "config.json").is_file())
    return steps[-1] if steps else None


def check_resume_config(run_dir: Path, cfg: Config, model: dict | None) -> None:
    """`up --resume`: the keys that decide batch g (and the drafter's shape, `model`, when it could be
    resolved here) against the checkpoint the drafter would resume from, before anything is written:
    a refused resume leaves every file of the run as it was. The drafter checks the same again
    (services/run/checkpoint_compat.py)."""
    ckpt = resume_checkpoint(run_dir)
    if ckpt is None:
        return  # nothing to resume: the run starts at step 0
    try:
        config = json.loads((ckpt / "config.json").read_text())
        meta = json.loads((ckpt / "state.json").read_text())
    except (OSError, ValueError):
        return  # a corrupt checkpoint: the drafter falls back to an older one and says so
    errors = run_errors(config, cfg.to_dict())
    if model is not None and isinstance(meta, dict) and meta.get("model"):
        skip = ("mask_token_id",) if cfg.drafter.mask_token_id < 0 else ()  # the tokenizer's: the drafter resolves it
        errors += model_errors(meta, model, skip)
    if errors:
        raise PreflightError(
            f"--resume: the checkpoint {ckpt} was written with another config ("
            + "; ".join(errors)
            + "): resume with the run's values (leave those overrides out), "
            "or start a new --run-dir"
        )


def resumed_from(drafter_log: Path) -> dict | None:
    """What drafter rank 0 resumed from, read from its log since its last start (the `resumed` event):
    {"step", "checkpoint", "skipped": newer checkpoints that failed verification, each with why}
    (run.json's `resumed`); {"step": 0, ...} when there was none to resume; None if the log is unread."""
    try:
        text = drafter_log.read_text(errors="replace")
    except OSError:
        return None
    found = events(text[text.rfind("\n===== ") :], "resumed")
    if not found:
        return {"step": 0, "checkpoint": None, "skipped": []}
    return {"step": found[-1]["step"], "checkpoint": found[-1]["checkpoint"], "skipped": found[-1].get("skipped") or []}


def resumed_line(found: dict, checkpoints: Path) -> str:
    """The console's line of resumed_from's dict (checkpoints: the run's folder of them, named when
    there was none)."""
    if found["checkpoint"] is None:
        return f"no checkpoint in {checkpoints}: training starts at step 0"
    line = f"resumed from step {found['step']} ({found['checkpoint']})"
    if skipped := found["skipped"]:  # newer checkpoints that failed verification, and why
        line += f"; skipped {len(skipped)} newer corrupt checkpoint(s): {'; '.join(skipped)}"
    return line
