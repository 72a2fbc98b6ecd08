"""The drafter's compile warmup (docs/design.md "Drafter", docs/benchmarks.md "Compile isolation").

Each drafter process compiles for itself (services/process/compile_setup.py sets up its cache
and threads). Shapes are fixed
(pack_len, padded anchor slots, Q and KV padded to multiples of 128), the warmup compiles them
before the worker says `ready`, and every graph compiled after that is counted as a recompile.
"""

from __future__ import annotations

import time


def warmup(state, batch, repeats: int = 2) -> float:
    """Compile at the exact shapes: full forward + backward on `batch`, `repeats` times (the second
    pass proves the graphs are reused), leaving parameters and optimizer untouched. Returns seconds."""
    import torch

    from services.drafter.training.train import train_step

    start = time.perf_counter()
    for _ in range(repeats):
        train_step(state, batch, dry_run=True)
    if state.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start
