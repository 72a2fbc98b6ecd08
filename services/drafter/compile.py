"""Per-process compile setup (docs/design.md "Drafter", docs/benchmarks.md "Compile isolation").

Each drafter process compiles for itself: its own dynamo/inductor state, a compile cache shared
on the node's disk, a share of the CPU cores for inductor's compile workers. Shapes are fixed
(pack_len, padded anchor slots, Q and KV padded to multiples of 128), the warmup compiles them
before the worker says `ready`, and every graph compiled after that is counted as a recompile.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from services.files import cpu_share


def setup_environment(run_dir: str | Path, workers_on_node: int) -> dict:
    """Set the inductor cache dir and compile-thread cap unless the environment already does.
    Call before the first torch.compile (ideally before importing torch)."""
    cache_dir = os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(run_dir).resolve() / "compile-cache"))
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    threads = cpu_share(workers_on_node)
    threads = int(os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(threads)))
    import sys
    if "torch._inductor.config" in sys.modules:        # already imported: its default is already decided
        sys.modules["torch._inductor.config"].compile_threads = threads
    return {"TORCHINDUCTOR_CACHE_DIR": cache_dir, "TORCHINDUCTOR_COMPILE_THREADS": threads}


def graphs_compiled() -> int:
    """Dynamo graphs compiled so far in this process (each compile or recompile adds one)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


class RecompileWatch:
    """Counts graphs compiled after it is made (make it once warmup is done): should stay 0."""

    def __init__(self):
        self.baseline = graphs_compiled()

    @property
    def count(self) -> int:
        return graphs_compiled() - self.baseline


def warmup(state, batch, repeats: int = 2) -> float:
    """Compile at the exact shapes: full forward + backward on `batch`, `repeats` times (the second
    pass proves the graphs are reused), leaving parameters and optimizer untouched. Returns seconds."""
    import torch
    from services.drafter.train import train_step

    start = time.perf_counter()
    for _ in range(repeats):
        train_step(state, batch, dry_run=True)
    if state.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start
