"""How fast packing tokenizes a data file: one process against worker processes, side by side.

    python bench/tokenize_speed.py --lines 20000 --workers 0            # 0: as packing picks (every CPU, <= 16)
    python bench/tokenize_speed.py --tokenizer DIR [--gguf FILE.gguf]   # a real model's tokenizer

Writes --lines chat lines like the regenerated data of bench/real_model.py (a user turn asking
about a function of Python's standard library, the function's own source as the reply), then runs
services/target/data.py's read_documents on them with workers=1 and with --workers, checks both
give the same documents, and prints one JSON line: lines per second of each and the ratio.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from services.target.data import BadSamples, read_documents  # noqa: E402
from services.target.tokenizing import MAX_WORKERS  # noqa: E402


def functions(limit: int) -> list[tuple[str, str]]:
    """(name, source) of stdlib functions, up to `limit`."""
    out = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            text = path.read_text()
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and (src := ast.get_source_segment(text, node)):
                out.append((f"{path.stem}.{node.name}", src[:1500]))
                if len(out) >= limit:
                    return out
    return out


def write_lines(path: Path, n: int) -> None:
    funcs = functions(4000)
    with open(path, "w") as f:
        for i in range(n):
            name, src = funcs[i % len(funcs)]
            user = f"Write a Python function like `{name}` (variant {i}) and explain it briefly."
            messages = [{"role": "user", "content": user}, {"role": "assistant", "content": src}]
            f.write(json.dumps({"messages": messages}) + "\n")


def load_tokenizer(args):
    from transformers import AutoTokenizer

    if args.tokenizer:
        kwargs = {"gguf_file": args.gguf} if args.gguf else {}
        return AutoTokenizer.from_pretrained(args.tokenizer, **kwargs)
    from services.tools.demo import CHAT_TEMPLATE, build_tokenizer, conversations

    texts = [m["content"] for c in conversations(2000, seed=0) for m in c["messages"]]
    tok = build_tokenizer(texts + [src for _, src in functions(500)], vocab_size=4096)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def timed(path: Path, tokenizer, workers: int) -> tuple[float, list]:
    t0 = time.perf_counter()
    docs = read_documents(path, tokenizer, len(tokenizer), "skip", BadSamples(), workers=workers)
    return time.perf_counter() - t0, docs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=20000)
    ap.add_argument("--workers", type=int, default=0, help="0: every CPU of this process's affinity, at most 16")
    ap.add_argument("--tokenizer", help="a model folder (default: a byte-level BPE trained here, the demo's template)")
    ap.add_argument("--gguf", help="with --tokenizer: the GGUF file in that folder")
    args = ap.parse_args(argv)
    workers = args.workers or max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0))))
    tokenizer = load_tokenizer(args)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.jsonl"
        write_lines(path, args.lines)
        one_s, one = timed(path, tokenizer, 1)
        many_s, many = timed(path, tokenizer, workers)
        same = [(d.line, d.input_ids.tolist()) for d in one] == [(d.line, d.input_ids.tolist()) for d in many]
        result = {
            "lines": args.lines,
            "mib": round(path.stat().st_size / 2**20, 1),
            "tokens": int(sum(len(d.input_ids) for d in one)),
            "cpus": len(os.sched_getaffinity(0)),
            "one_process_s": round(one_s, 2),
            "one_process_lines_per_s": round(args.lines / one_s),
            "workers": workers,
            "workers_s": round(many_s, 2),
            "workers_lines_per_s": round(args.lines / many_s),
            "speedup": round(one_s / many_s, 2),
            "same_documents": same,
        }
    print(json.dumps(result))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
