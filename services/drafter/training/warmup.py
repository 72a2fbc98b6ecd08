"""The drafter's compile warmup (docs/design.md "Drafter", docs/benchmarks.md "Compile isolation").

Each drafter process compiles for itself (services/process/compile_setup.py sets up its cache
and threads). Shapes are fixed
(pack_len, padded anchor slots, Q and KV padded to multiples of 128), the warmup compiles them
before the worker says `ready`, and every graph compiled after that is counted as a recompile.
"""

from __future__ import annotations

import contextlib
import time


def warmup(state, batch, repeats: int = 2, with_eval: bool = False) -> float:
    """Compile at the exact shapes: full forward + backward on `batch`, `repeats` times (the second
    pass proves the graphs are reused), and with_eval the held-out evaluation's forward, leaving
    parameters and optimizer untouched. Returns seconds.

    A Domino drafter's loss leaves out its base CE once the curriculum's lambda reaches 0
    (modeling/domino.py), a second graph of the compiled loss: one more pass as at the run's end
    compiles it here, not as one step of seconds mid-run (3.5 s on the 27B preset's GPU run)."""
    import torch

    from services.drafter.training.evaluate import evaluate
    from services.drafter.training.train import train_step

    start = time.perf_counter()
    for _ in range(repeats):
        train_step(state, batch, dry_run=True)
    if with_eval:
        evaluate(state, [batch])
    if state.drafter.cfg.domino:
        with at_run_end(state):
            train_step(state, batch, dry_run=True)
            if with_eval:
                evaluate(state, [batch])
    if state.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


@contextlib.contextmanager
def at_run_end(state):
    """state.step moved to the end of its lr schedule (progress 1) for the block, then put back."""
    step = state.step
    state.step = step + state.scheduler.lr_lambdas[0].total
    try:
        yield
    finally:
        state.step = step
