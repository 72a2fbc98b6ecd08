"""How fast packing tokenizes a data file: one line at a time against batched chunks, side by side.

    python bench/tokenize_speed.py --lines 20000
    python bench/tokenize_speed.py --tokenizer DIR [--gguf FILE.gguf]   # a real model's tokenizer

Writes --lines chat lines like the regenerated data of bench/real_model.py (a user turn asking
about a function of Python's standard library, the function's own source as the reply), then
tokenizes them one line per call (services/target/batches/data.py's line_to_document, a tokenizer call per
line, as packing did before) and as packing does (read_documents: chunks of CHUNK_LINES lines, one
batched tokenizer call per chunk, which a fast tokenizer spreads over every core), checks both give
the same documents, and prints one JSON line: lines per second of each and the ratio.
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
from services.target.batches.data import CHUNK_LINES, BadSamples, line_to_document, read_documents  # noqa: E402


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


def one_line_at_a_time(path: Path, tokenizer) -> list[tuple[int, list]]:
    lines = path.read_text().splitlines()
    return [(n, line_to_document(text, tokenizer, len(tokenizer))[0].tolist()) for n, text in enumerate(lines, 1)]


def batched(path: Path, tokenizer) -> list[tuple[int, list]]:
    docs = read_documents(path, tokenizer, len(tokenizer), "skip", BadSamples())
    return [(d.line, d.input_ids.tolist()) for d in docs]


def timed(fn, *args) -> tuple[float, list]:
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=20000)
    ap.add_argument("--tokenizer", help="a model folder (default: a byte-level BPE trained here, the demo's template)")
    ap.add_argument("--gguf", help="with --tokenizer: the GGUF file in that folder")
    args = ap.parse_args(argv)
    tokenizer = load_tokenizer(args)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.jsonl"
        write_lines(path, args.lines)
        one_s, one = timed(one_line_at_a_time, path, tokenizer)
        many_s, many = timed(batched, path, tokenizer)
        result = {
            "lines": args.lines,
            "mib": round(path.stat().st_size / 2**20, 1),
            "tokens": int(sum(len(ids) for _, ids in one)),
            "cpus": len(os.sched_getaffinity(0)),
            "one_line_at_a_time_s": round(one_s, 2),
            "one_line_at_a_time_lines_per_s": round(args.lines / one_s),
            "chunk_lines": CHUNK_LINES,
            "batched_s": round(many_s, 2),
            "batched_lines_per_s": round(args.lines / many_s),
            "speedup": round(one_s / many_s, 2),
            "same_documents": one == many,
        }
    print(json.dumps(result))
    return 0 if one == many else 1


if __name__ == "__main__":
    sys.exit(main())
