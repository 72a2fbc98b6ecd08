"""The demo targets' capture on the CPU, per packed row, as `launcher up --demo [hybrid]` runs it.

    python bench/demo_capture_cpu.py                 # dense and hybrid demo, 20 rows each
    python bench/demo_capture_cpu.py --rows 50 --threads 2

Builds (or reuses, from the demo cache) the demo targets, packs the demo data with the demo's
config, and times Target.capture with labels (what the demo's target worker does: labels_from_target
is on) on the first --rows training rows. The hybrid runs the "packed-reference" path twice: with
its chunked gated delta rule (hybrid.reference_delta_rule, what the worker uses) and with the rule
token by token (hybrid.token_by_token_delta_rule); the largest difference of the two captures is
printed with them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from services.run.config import load_config  # noqa: E402
from services.target.batches.packing import Packing, open_or_build  # noqa: E402
from services.target.model import hybrid  # noqa: E402
from services.target.model.model import load_target  # noqa: E402
from services.tools.demo import cache_dir, make_demo  # noqa: E402


def time_rows(target, rows) -> tuple[float, list[torch.Tensor]]:
    out = []
    t0 = time.perf_counter()
    for row in rows:
        hidden, _ = target.capture(
            row["input_ids"], row["position_ids"], row["document_ids"], with_labels=True, out_dtype=torch.float32
        )
        out.append(hidden)
    return (time.perf_counter() - t0) / len(rows), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=20)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (the demo's target runs on 1)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    for variant in ("dense", "hybrid"):
        demo = make_demo(cache_dir(variant), variant=variant)
        cfg = load_config(None, demo["overrides"])
        target = load_target(cfg.target, "cpu", cfg.drafter.num_layers)
        tokenizer = AutoTokenizer.from_pretrained(demo["model_path"])
        with tempfile.TemporaryDirectory() as run_dir:
            data = open_or_build(
                Packing.from_config(cfg), run_dir, tokenizer, target.info.vocab_size, log=lambda _m: None
            )
            rows = [data.batch(g) for g in range(min(args.rows, data.num_batches()))]
        docs = sum(len(set(r["document_ids"].tolist())) for r in rows) / len(rows)
        time_rows(target, rows[:2])  # warm-up
        seconds, chunked = time_rows(target, rows)
        print(
            f"{variant:6s} {target.path:16s} {seconds * 1e3:7.1f} ms/row  ({len(rows)} rows of "
            f"{cfg.data.pack_len} tokens, {docs:.1f} documents each, {args.threads} thread(s))",
            flush=True,
        )
        if target.path == "packed-reference":
            fast = hybrid.reference_delta_rule
            hybrid.reference_delta_rule = hybrid.token_by_token_delta_rule
            try:
                slow, token_by_token = time_rows(target, rows)
            finally:
                hybrid.reference_delta_rule = fast
            diff = max(float((a - b).abs().max()) for a, b in zip(chunked, token_by_token))
            print(
                f"{variant:6s} {'token by token':16s} {slow * 1e3:7.1f} ms/row  (chunked is {slow / seconds:.1f}x "
                f"faster; largest capture difference {diff:.1e})",
                flush=True,
            )


if __name__ == "__main__":
    main()
