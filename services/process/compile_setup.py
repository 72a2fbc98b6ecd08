"""Per-process compile setup, for each worker that compiles (the drafters; the targets with
target.compile): its own dynamo/inductor state, a compile cache shared on the node's disk, a share
of the CPU cores for inductor's compile workers, and a count of graphs compiled after warmup
(which should stay 0: the shapes are fixed). No torch import here: call setup_environment before
torch is imported.
"""

from __future__ import annotations

import os
from pathlib import Path

from services.run.files import cpu_share


def setup_environment(run_dir: str | Path, workers_on_node: int) -> dict:
    """Set the inductor cache dir and compile-thread cap unless the environment already does.
    Call before the first torch.compile (ideally before importing torch)."""
    cache_dir = os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(run_dir).resolve() / "compile-cache"))
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    threads = cpu_share(workers_on_node)
    threads = int(os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(threads)))
    import sys

    if "torch._inductor.config" in sys.modules:  # already imported: its default is already decided
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
