"""Measure what one GPU does in each role, on the user's own model and data (`launcher plan`).

    python -m services.tools.measure_roles --config FILE [--device cuda] [--seconds 60] [section.key=value ...]

Prints one JSON line: the target's capture rate A and the drafter's training rate B, both in
real (non-padding) tokens per second, measured one after the other on the same device:
  A  the target worker's own path (load_target with the config's target.quantize, target.compile
     as the worker applies it, the packed rows of data.path, CaptureRing-free capture_to_host) for
     about --seconds, after two warm-up rows;
  B  the drafter's real train step (compiled as in training) on rows of the same shape for about
     --seconds, counted in the data's mean real tokens per row, since a row costs the drafter
     the same whatever its padding.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from services.data.batch import FIELDS
from services.run import runspec
from services.run.config import Config, load_config


def _timed_loop(step, seconds: float, warmup: int = 2) -> tuple[int, float]:
    """(iterations, seconds) of calls to step(i) after `warmup` untimed ones, for about `seconds`."""
    for i in range(warmup):
        step(i)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start, n = time.perf_counter(), 0
    while n < 2 or time.perf_counter() - start < seconds:
        step(warmup + n)
        n += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return n, time.perf_counter() - start


def target_rate(cfg: Config, device: torch.device, seconds: float, work: Path) -> dict:
    from transformers import AutoTokenizer

    from services.run import runspec
    from services.target.batches.packing import Packing, open_or_build
    from services.target.model.compiled import compile_and_warm_up
    from services.target.model.model import capture_to_host, load_target

    spec = runspec.resolve(cfg)
    target = load_target(spec.target_config(cfg), device)
    tokenizer = AutoTokenizer.from_pretrained(cfg.target.model_path)
    data = open_or_build(Packing.from_config(cfg), work, tokenizer, spec.target.vocab_size, log=lambda msg: None)
    compile_s = compile_and_warm_up(target, cfg.target.compile, data.pack_len, cfg.target.labels_from_target)
    rows = data.num_batches("train")
    out = (
        torch.empty(data.pack_len, target.info.hidden_width, dtype=FIELDS["hidden"], device=device)
        if device.type == "cuda"
        else None
    )
    real = []

    def step(i: int) -> None:
        row = data.batch(i % rows)
        capture_to_host(target, row, cfg.target.labels_from_target, out)
        real.append(int((row["document_ids"] >= 0).sum()))

    n, elapsed = _timed_loop(step, seconds)
    tokens = sum(real[-n:])
    result = {
        "tok_s": tokens / elapsed,
        "rows": n,
        "mean_real_tokens": tokens / n,
        "path": target.path,
        "pack_len": data.pack_len,
        "compiled": bool(target.compiled),
        "compile_s": round(compile_s, 1),
        "quantize": cfg.target.quantize,
    }
    return result


def drafter_rate(cfg: Config, device: torch.device, seconds: float, mean_real_tokens: float) -> dict:
    import dataclasses

    from services.drafter.modeling.target_head import from_target
    from services.drafter.training.core import DrafterCore
    from services.drafter.training.synthetic import SyntheticSource
    from services.drafter.training.train import train_step
    from services.drafter.training.warmup import warmup

    model_cfg, head = from_target(runspec.resolve(cfg))
    state = DrafterCore.build(cfg, model_cfg, head, device, total_steps=1000).state
    batch = SyntheticSource(
        model_cfg, cfg.data.pack_len, device=device, with_target_labels=cfg.target.labels_from_target
    ).batch(0)
    compile_s = warmup(state, batch)
    n, elapsed = _timed_loop(lambda i: train_step(state, dataclasses.replace(batch, g=i)), seconds, warmup=1)
    return {
        "tok_s": n / elapsed * mean_real_tokens,
        "steps": n,
        "step_s": elapsed / n,
        "compile_s": round(compile_s, 1),
        "trainable_params": state.drafter.num_parameters(),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.tools.measure_roles", description=__doc__.split("\n")[0])
    p.add_argument("--config")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--seconds", type=float, default=60.0, help="time each role about this long")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    with tempfile.TemporaryDirectory(prefix="dflash-plan-") as work:
        target = target_rate(cfg, device, args.seconds, Path(work))
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the target model is gone: room for the drafter
    drafter = drafter_rate(cfg, device, args.seconds, target["mean_real_tokens"])
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                "target": target,
                "drafter": drafter,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
