"""How long a checkpoint stops training: the background writer at a real drafter size.

    python bench/checkpoint_stall.py --out $OUT/checkpoint_stall.json           # the 27B-target drafter
    python bench/checkpoint_stall.py --hidden 256 --intermediate 512 --heads 4 --kv-heads 2 --head-dim 64 \\
        --vocab 4096 --device cpu                                                # CPU smoke test

Builds the real TrainState (services.drafter.training.train) at the drafter shape for a Qwen3.6-27B target
(width 5120, intermediate 17408, 24/4 heads x 256, 5 layers, vocab 248320: 1.84 B trainable
parameters, fp32 master weights + AdamW moments, about 22 GB), trains two steps so the optimizer
has its state, then takes checkpoints with checkpoint_writer.BackgroundWriter as the worker does:
  prepare_s  allocating the pinned host buffers in the background (the worker does it after step 1)
  stall_s    what training waits for: the snapshot call plus the copies into host memory on the
             GPU (timed here by a synchronize right after; in training the next step queues behind them)
  write_s    the background write (files, fsync, sha256 manifest, rename)
  steps      training steps run while the write went on, and their time against steps without it
With --sync-baseline it also times the synchronous write_checkpoint of the same state (what a
checkpoint cost before: training stopped for all of it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPE = dict(
    hidden=5120, intermediate=17408, heads=24, kv_heads=4, head_dim=256, layers=5, vocab=248320, target_layers=64
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for key, value in SHAPE.items():
        p.add_argument("--" + key.replace("_", "-"), type=int, default=value)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dir", default="", help="where checkpoints go (default: a temp dir, removed after)")
    p.add_argument("--sync-baseline", action="store_true")
    p.add_argument("--out")
    a = p.parse_args()

    import dataclasses

    import torch

    from services.drafter.checkpoints import checkpoint as ckpt
    from services.drafter.checkpoints.checkpoint_writer import BackgroundWriter
    from services.drafter.modeling.target_head import TargetHead
    from services.drafter.training.core import DrafterCore
    from services.drafter.training.synthetic import SyntheticSource
    from services.drafter.training.train import train_step
    from services.run.config import load_config
    from services.run.runspec import drafter_shape

    device = torch.device("cuda:0" if a.device == "cuda" else "cpu")
    cfg = load_config(
        None,
        [
            f"data.pack_len={a.seq_len}",
            "drafter.num_anchors=64",
            "drafter.block_size=16",
            f"drafter.num_layers={a.layers}",
            "kernels.compile=false",
            "optimizer.lr=1e-4",
        ],
    )
    base = dict(
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim,
        vocab_size=a.vocab,
        num_target_layers=a.target_layers,
        rope_theta=1_000_000.0,
    )
    model_cfg = drafter_shape(cfg, base, mask_token_id=a.vocab - 1)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    head = TargetHead(
        torch.randn(a.vocab, a.hidden, device=device, dtype=dtype) * 0.02,
        torch.randn(a.vocab, a.hidden, device=device, dtype=dtype) * (4.0 / a.hidden),
    )
    state = DrafterCore.build(cfg, model_cfg, head, device, total_steps=1000).state
    batch = SyntheticSource(
        model_cfg, a.seq_len, device=device, with_target_labels=cfg.target.labels_from_target
    ).batch(0)

    def step(i: int) -> float:
        start = time.perf_counter()
        train_step(state, dataclasses.replace(batch, g=i))  # ends in a host sync (its metrics)
        return time.perf_counter() - start

    plain = [step(i) for i in range(4)][1:]
    params = state.drafter.num_parameters()
    root = Path(a.dir or tempfile.mkdtemp(prefix="ckpt-stall-"))
    result = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "trainable_params": params,
        "step_s": round(statistics.median(plain), 4),
        "checkpoints": [],
    }
    print(f"{params / 1e9:.3f} B trainable params; step {result['step_s']} s", flush=True)

    def blob():
        return {"optimizer": state.optimizer.state_dict(), "scheduler": state.scheduler.state_dict()}

    try:
        if a.sync_baseline:
            start = time.perf_counter()
            ckpt.write_checkpoint(
                root / "sync",
                state.step,
                weights=state.drafter.state_dict(),
                optimizer=blob(),
                rng={"cpu.0": torch.get_rng_state()},
                meta={"step": state.step},
                config={},
                keep=1,
            )
            result["sync_write_s"] = round(time.perf_counter() - start, 2)
            shutil.rmtree(root / "sync")
            print(f"synchronous checkpoint: training stopped {result['sync_write_s']} s", flush=True)
        writer = BackgroundWriter(root / "async", keep=1, device=device)
        start = time.perf_counter()
        writer.prepare(state.drafter.state_dict(), blob())  # as the worker does after its first step
        prepare_steps = []
        while writer._preparing.is_alive():
            prepare_steps.append(step(50 + len(prepare_steps)))
        result["prepare_s"] = round(time.perf_counter() - start, 2)
        result["steps_during_prepare"] = len(prepare_steps)
        result["step_s_during_prepare"] = round(statistics.median(prepare_steps), 4) if prepare_steps else None
        print(f"host buffers allocated in the background in {result['prepare_s']} s", flush=True)
        for n in range(2):
            stall = writer.snapshot_and_write(
                state.step,
                weights=state.drafter.state_dict(),
                optimizer=blob(),
                rng={"cpu.0": torch.get_rng_state()},
                meta={"step": state.step},
                config={},
                set_best=False,
            )
            start = time.perf_counter()
            if device.type == "cuda":
                torch.cuda.synchronize()  # the copies into host memory: the next step queues behind them
            stall += time.perf_counter() - start
            during = []
            while writer._thread is not None and writer._thread.is_alive():
                during.append(step(100 + n * 1000 + len(during)))
            outcome = writer.wait()
            record = {
                "stall_s": round(stall, 3),
                "write_s": outcome["write_s"],
                "error": repr(outcome["error"]),
                "steps_during_write": len(during),
                "step_s_during_write": round(statistics.median(during), 4) if during else None,
            }
            result["checkpoints"].append(record)
            print(f"checkpoint {n + 1}: {record}", flush=True)
    finally:
        if not a.dir:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result, indent=2), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
