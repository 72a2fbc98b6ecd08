"""The packing job: `launcher up` tokenizes and packs the run's data before any worker starts.

    python -m services.target.jobs.pack --config FILE --run-dir DIR    # services/process/jobs.py's "packing"

It builds the index the target workers then open (batches/packing.py's open_or_build, same cache
key), with the tokenizer and vocabulary of the target's config, not its weights: a bad line stops
the run in seconds, before a 27B model loads. It prints one JSON line (rows of each split, bad
samples, real acceptance's prompt count, whether the packed data was built or reused) for the
launcher, with {"progress": ...} lines while it tokenizes; or one error line and exit 2.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from services.data.packed_data import PackedData
from services.run import runspec
from services.run.config import Config
from services.target.batches.data import DataError
from services.target.batches.packing import Packing, open_or_build


def target_tokenizer(model_path: str):
    """The target folder's tokenizer, or a ModelFilesError naming the folder (not transformers' traceback)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ModelFilesError(
            f"target.model_path: cannot load the config and tokenizer of {model_path}: {type(exc).__name__}: {first}"
        ) from None


def prepare(cfg: Config, run_dir: str | Path, tokenizer, log=None, progress=None) -> PackedData:
    """Tokenize and pack cfg.data into the run's cache, with the tokenizer and vocabulary of the
    target's config, not its weights: a bad line stops the run in seconds, before a 27B model
    loads, and the target workers then open the same cache file (same key)."""
    vocab_size = runspec.target_fields_of(cfg.target.model_path)["vocab_size"]  # as the run spec reads it
    packing = Packing.from_config(cfg)
    return open_or_build(packing, run_dir, tokenizer, vocab_size, log=log or (lambda msg: None), progress=progress)


class ModelFilesError(DataError):
    """The target folder's config or tokenizer does not load (named by its key, not as data)."""


def eval_prompt_count(packing: Packing, tokenizer, files: list[str], limit: int) -> int | None:
    """How many prompts real acceptance will decode in training (files: eval.prompts, read and
    checked now, else the held-out lines'; limit: eval.num_prompts); None when it is off (limit 0)."""
    from services.data.prompts import prompt_sets

    if limit <= 0:
        return None
    return sum(len(s.prompts) for s in prompt_sets(packing.held_out, packing.data, tokenizer, files, limit))


def said_first(said: list[str], *starts: str) -> str:
    """The first of open_or_build's lines that begins with one of `starts`, without "data: " (by the
    start only: a skipped line quotes data lines, which may hold any words)."""
    return next((m.removeprefix("data: ") for m in said if m.startswith(starts)), "")


class ProgressReport:
    """Tokenizing's progress as {"progress": "..."} lines on stdout (the launcher shows them on its
    live line), one every EVERY_S at most."""

    EVERY_S = 5.0

    def __init__(self):
        self.began = self.last = time.monotonic()

    def __call__(self, path, lines: int, read: int, size: int) -> None:
        now = time.monotonic()
        if now - self.last < self.EVERY_S:
            return
        self.last, rate = now, read / max(now - self.began, 1e-9)
        eta = f", ETA {int((size - read) / rate)} s" if rate > 0 and read < size else ""
        text = (
            f"data: tokenizing {Path(path).name}: {lines:,} lines, {100 * read / max(size, 1):.0f}% of "
            f"{size / 2**20:,.0f} MiB{eta}"
        )
        print(json.dumps({"progress": text}), flush=True)


def main(argv=None) -> int:
    """python -m services.target.jobs.pack --config FILE --run-dir DIR: one JSON line, or one error line, exit 2."""
    import argparse

    from services.data.prompts import PromptFileError
    from services.run.config import load_config

    p = argparse.ArgumentParser(prog="python -m services.target.jobs.pack", description="build the run's data index")
    p.add_argument("--config", required=True)
    p.add_argument("--run-dir", required=True)
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config)
        said, tokenizer = [], target_tokenizer(cfg.target.model_path)  # once: packing and the prompts use it
        data = prepare(cfg, args.run_dir, tokenizer, log=said.append, progress=ProgressReport())
    except (DataError, runspec.SpecError) as exc:
        print(
            exc if isinstance(exc, (ModelFilesError, runspec.SpecError)) else f"data: {exc}",
            file=sys.stderr,
            flush=True,
        )
        return 2
    try:  # real acceptance's prompts: None when it is off by config (eval.num_prompts = 0)
        packing = Packing.from_config(cfg)
        prompts = eval_prompt_count(packing, tokenizer, cfg.eval.prompts, cfg.eval.num_prompts)
    except PromptFileError as exc:
        print(f"eval.prompts: {exc}", file=sys.stderr, flush=True)
        return 2
    print(
        json.dumps(
            {
                "train_rows": data.num_batches("train"),
                "eval_rows": data.num_batches("eval"),
                "bad_samples": data.bad_samples,
                "bad_examples": data.bad_examples[:3],
                "prompts": prompts,
                "packing": said_first(said, "data: built ", "data: packed data "),
                "store_problem": said_first(said, "data: the packed-data store "),
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
