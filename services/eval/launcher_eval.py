"""`launcher eval`: real (greedy) speculative decoding of a drafter with its target on prompt sets
(benchmark files) or the run's held-out prompts.

    python -m services.eval.launcher_eval --run-dir runs/latest [--checkpoint DIR] [--prompts FILE.jsonl ...]

The drafter comes from a checkpoint dir, a run dir (its checkpoints/latest) or an export; the
target and the data from the run's config.json. Prompts are rendered with the run's
data.chat_template_kwargs (services/data/prompts.py says what a prompt file holds). On CUDA (or with
--speedup-prompts N) the first prompts of each set are also timed at batch 1, the target alone and
with the drafter: the wall-clock speedup (services/eval/speedup.py). The record is appended to
<run-dir>/spec_eval.jsonl.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from services.decoding.acceptance_text import by_set, describe_prompts, tables
from services.drafter.modeling.model import DrafterModelConfig
from services.run import eval_options

# --- loading a drafter ----------------------------------------------------------------------------


def read_json(file: Path) -> dict:
    """A JSON object from `file`; ValueError naming the file and what is wrong (a corrupt export)."""
    try:
        data = json.loads(file.read_bytes())
    except OSError as exc:
        raise ValueError(f"{file}: unreadable ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file}: not valid JSON ({exc.msg}: line {exc.lineno} column {exc.colno})") from None
    except UnicodeDecodeError as exc:  # binary garbage: json.loads decodes bytes before it parses
        raise ValueError(
            f"{file}: not valid JSON (not UTF-8 text: byte {exc.start} is {exc.object[exc.start]:#04x})"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: not valid JSON for a config (a {type(data).__name__}, not an object)")
    return data


def read_weights(file: Path) -> tuple[dict, dict, str]:
    """(tensors, the file's safetensors metadata, sha256) from one read of the file: the step and the
    digest recorded are those of the weights measured, even if a resume rewrites the export meanwhile.
    ValueError naming the file when it is missing, truncated or not safetensors."""
    import hashlib

    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        data = file.read_bytes()
    except OSError as exc:
        raise ValueError(f"{file}: unreadable ({exc.strerror or exc})") from None
    try:
        tensors = load(data)  # first: it checks the header that the metadata is read from
        size = int.from_bytes(data[:8], "little")
        metadata = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
    except (SafetensorError, ValueError) as exc:
        raise ValueError(f"{file}: not a readable safetensors file ({exc})") from None
    return tensors, metadata, hashlib.sha256(data).hexdigest()


def export_step(file: Path, metadata: dict) -> int | None:
    """The step export.json records, kept in the weights' own metadata (None: an export without one)."""
    try:
        return json.loads(metadata["step"]) if "step" in metadata else None
    except ValueError:
        raise ValueError(f"{file}: metadata step {metadata['step']!r} is not a number") from None


def load_weights(path: str | Path) -> tuple[dict, DrafterModelConfig, str, dict]:
    """(weights, model config, what, identity) from a checkpoint dir, a run dir (its checkpoints/latest)
    or an export. identity: {"drafter_step", "drafter_sha256"} (step None: an export without one);
    `what` names the path, the step and the digest's first 12 digits, for the header. A corrupt
    file is a ValueError that names it."""
    path = Path(path)
    conf = read_json(path / "config.json") if (path / "config.json").is_file() else {}
    if "DFlashDraftModel" in conf.get("architectures", []):
        weights, metadata, digest = read_weights(path / "model.safetensors")
        step = export_step(path / "model.safetensors", metadata)
        try:
            model_cfg = DrafterModelConfig.from_hf(conf)
        except (KeyError, TypeError, ValueError) as exc:
            why = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
            raise ValueError(f"{path / 'config.json'}: not a DFlash drafter config ({why})") from None
        what = f"export {path.resolve()}"
    else:
        from services.drafter.checkpoints.checkpoint import CorruptCheckpoint, verify
        from services.drafter.checkpoints.export import resolve_checkpoint

        ckpt = resolve_checkpoint(path)
        try:
            meta = verify(ckpt)
        except CorruptCheckpoint as exc:  # its message names the file inside the checkpoint
            raise ValueError(f"checkpoint {ckpt} is corrupt: {exc}") from None
        weights, _, digest = read_weights(ckpt / "model.safetensors")
        step, what, model_cfg = int(meta["step"]), f"checkpoint {ckpt}", DrafterModelConfig(**meta["model"])
    held = "step unknown" if step is None else f"step {step}"
    identity = {"drafter_step": step, "drafter_sha256": digest}
    return weights, model_cfg, f"{what} ({held}, weights sha256 {digest[:12]})", identity


# --- the wall-clock speedup -----------------------------------------------------------------------


def speedup_prompts(args) -> int:
    """Prompts timed per set: the option's, else SPEEDUP_PROMPTS on CUDA and none elsewhere (a CPU
    timing is not what users run)."""
    if args.speedup_prompts is not None:
        return args.speedup_prompts
    return eval_options.SPEEDUP_PROMPTS if torch.device(args.device).type == "cuda" else 0


def add_speedup(record: dict, timer, spec_eval, weights, model_cfg) -> None:
    """record["speedup"] (every set's together) and each set's "speedup"; off: {"off": why}; a failure
    is recorded ({"error": why}) and said on stderr, never raised: the acceptance figures stand without it."""
    from services.eval.speedup import one_line

    if timer.per_set <= 0:
        why = (
            "--speedup-prompts 0" if spec_eval.device.type == "cuda" else "on CUDA only; --speedup-prompts N forces it"
        )
        record["speedup"] = {"off": why}
        return
    print(
        f"eval: timing the first {timer.per_set} prompts of each set at batch 1, the target alone and with the "
        "drafter (each decoded twice: a warm-up pass, then the timed one)",
        file=sys.stderr,
        flush=True,
    )
    try:
        measured = timer.measure(spec_eval.proposer(weights, model_cfg))
    except Exception as exc:  # the drafter cannot be built here: said, the acceptance figures kept
        record["speedup"] = {"error": one_line(exc)}
        print(f"eval: speedup not measured: {record['speedup']['error']}", file=sys.stderr, flush=True)
        return
    record["speedup"] = measured["all"]
    for name, figures in measured["sets"].items():
        record["sets"][name]["speedup"] = figures


def main(argv=None) -> int:
    from services.process import torchao_gate
    from services.run.config import load_config

    torchao_gate.hide()  # transformers would import it (and print its warnings) for nothing here

    p = argparse.ArgumentParser(
        prog="launcher eval",
        description="Real (greedy) speculative decoding of a drafter "
        "with its target on prompt-set files, or on held-out prompts of the run's data "
        "(without a held-out split: its last training lines).",
    )
    eval_options.add(p)
    args = p.parse_args(argv)
    args.device = args.eval_device or ("cuda" if torch.cuda.is_available() else "cpu")
    run_dir = Path(args.run_dir or "runs/latest")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Loading weights" bars in the launcher's output
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    files = eval_options.prompt_files(args.prompts)
    counts = [p for p in args.prompts if p.isdigit()]
    if counts and files:
        print("eval: error: --prompts takes prompt files or a number of held-out prompts, not both", file=sys.stderr)
        return 2
    if args.batch < 0:
        print(f"eval: error: --batch must be >= 1 (or 0: automatic), got {args.batch}", file=sys.stderr)
        return 2
    if (args.speedup_prompts or 0) < 0:
        print(f"eval: error: --speedup-prompts must be >= 0 (0: off), got {args.speedup_prompts}", file=sys.stderr)
        return 2
    if problem := eval_options.check_prompt_files(files):  # before the target loads
        print(f"eval: error: {problem}", file=sys.stderr)
        return 2
    limit = args.limit or (int(counts[-1]) if counts else 0 if files else 32)
    files = [str(Path(f).resolve()) for f in files]
    try:
        cfg = load_config(run_dir / "config.json", args.set)
        drafters = [load_weights(path) for path in args.checkpoint or [run_dir]]
    except Exception as exc:  # a bad run dir or checkpoint: one line for the user
        print(f"eval: error: {exc}", file=sys.stderr)
        return 2
    from services.eval.local_spec_eval import LocalSpecEval

    print(f"eval: loading the target {cfg.target.model_path} on {args.device}", file=sys.stderr, flush=True)
    try:
        spec_eval = LocalSpecEval(
            cfg,
            args.device,
            prompts=limit,
            max_new_tokens=args.max_new_tokens,
            rollback=args.rollback,
            files=files,
            batch=args.batch,
        )
    except Exception as exc:  # the target cannot be loaded or decoded: one line
        print(f"eval: error: {exc}", file=sys.stderr)
        return 2
    from services.decoding.decode_progress import Progress
    from services.eval.speedup import SpeedupTimer

    spec_eval.progress = Progress("eval")  # a line on stderr every 10 s while it decodes
    how = (
        "one at a time"
        if spec_eval.batch == 1
        else f"{spec_eval.batch} at once" + (" (KV-cache rows)" if spec_eval.slots else "")
    )
    print(f"eval: {len(spec_eval.prompts)} prompts, decoded {how}", file=sys.stderr, flush=True)
    if not spec_eval.prompts:
        print(
            f"eval: error: no prompts in the held-out data of {run_dir} (chat lines, or pre-tokenized lines with "
            "unsupervised tokens first); give a prompt file with --prompts FILE",
            file=sys.stderr,
        )
        return 2
    timer = SpeedupTimer(spec_eval, speedup_prompts(args))  # the target alone timed once, for every drafter
    for weights, model_cfg, what, identity in drafters:
        try:
            result = spec_eval.evaluate(weights, model_cfg, controls=not args.no_controls, seed=cfg.run.seed)
        except (RuntimeError, ValueError) as exc:  # a decoding bound checked (slots.py): one line, what is wrong
            print(f"eval: error: {what}: {exc}", file=sys.stderr, flush=True)
            return 1
        record = {
            "event": "spec_eval",
            "drafter": what,
            **identity,
            "block_size": model_cfg.block_size,
            "max_new_tokens": args.max_new_tokens,
            **result,
            "sets": by_set(result),
            **({"prompt_files": files} if files else {}),
            **({"overrides": args.set} if args.set else {}),
        }
        add_speedup(record, timer, spec_eval, weights, model_cfg)
        with open(run_dir / "spec_eval.jsonl", "a") as f:  # `launcher report` shows the latest
            f.write(json.dumps({**record, "time": round(time.time(), 3)}) + "\n")
        if args.json:
            print(json.dumps(record), flush=True)
        else:
            prompts = describe_prompts(result["prompts"], result["held_out"], record["sets"])
            print(
                "\n".join(
                    tables(
                        record,
                        f"{what}: {prompts}, block {model_cfg.block_size}, greedy, up to "
                        f"{args.max_new_tokens} new tokens",
                    )
                ),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
