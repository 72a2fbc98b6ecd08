"""BackgroundWriter: checkpoints written by a thread after a host snapshot (checkpoint.py's files and rules)."""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import torch

from services.drafter.checkpoints.checkpoint import set_best_pointer, write_checkpoint
from services.drafter.checkpoints.checkpoint_space import checkpoint_bytes, ensure_space


class BackgroundWriter:
    """Checkpoints that stop training only for a copy into host memory.

    snapshot_and_write() copies the weights and the optimizer state into host buffers on the
    training stream (pinned and reused on CUDA, so the copy runs at PCIe speed and the next step's
    kernels simply queue behind it), then a thread waits for the copy and writes the files with
    write_checkpoint: same temp dir, manifest, rename, rotation and failure handling as a
    synchronous write. One write at a time: a checkpoint asked for while the last is still being
    written waits for it. wait() joins the write in flight (the end of the run, a stop).
    """

    def __init__(self, root: Path, keep: int, device: torch.device):
        self.root, self.keep, self.device = root, keep, device
        self._buffers: dict[str, torch.Tensor] = {}
        self._thread: threading.Thread | None = None
        self._outcome: dict | None = None  # the finished write, until taken by done()
        self._preparing: threading.Thread | None = None

    def _buffer(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            buf = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.device.type == "cuda")
            self._buffers[name] = buf
        return buf

    def _host(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of `tensor` in the buffer kept for `name` (queued on the current stream)."""
        buf = self._buffer(name, tensor)
        buf.copy_(tensor.detach(), non_blocking=True)
        return buf

    def _host_tree(self, prefix: str, value, leaf=None):
        leaf = leaf or self._host
        if isinstance(value, torch.Tensor):
            return leaf(prefix, value)
        if isinstance(value, dict):
            return {k: self._host_tree(f"{prefix}.{k}", v, leaf) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._host_tree(f"{prefix}.{i}", v, leaf) for i, v in enumerate(value))
        return copy.deepcopy(value)

    def prepare(self, weights: dict[str, torch.Tensor], optimizer: dict) -> None:
        """Allocate the host buffers in the background (pinning 20 GB takes seconds), so that even
        the first checkpoint only copies. Call once the optimizer has its state (after a step)."""
        shapes = {k: v.float() for k, v in weights.items()}, optimizer
        self._preparing = threading.Thread(
            target=lambda: (
                [self._buffer(f"w.{k}", v) for k, v in shapes[0].items()],
                self._host_tree("opt", shapes[1], self._buffer),
            ),
            name="checkpoint-buffers",
            daemon=True,
        )
        self._preparing.start()

    def snapshot_and_write(
        self,
        step: int,
        *,
        weights: dict[str, torch.Tensor],
        optimizer: dict,
        rng: dict[str, torch.Tensor],
        meta: dict,
        config: dict,
        set_best: bool,
        need_bytes: int | None = None,
    ) -> float:
        """Snapshot now, write in the background. Returns the seconds training was held up.
        need_bytes: the checkpoint's size as the caller measured it for its space warning; None:
        measured here, from the snapshot."""
        start = time.perf_counter()
        self.wait()  # one write at a time (bounded host memory)
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None
        host_weights = {k: self._host(f"w.{k}", v.float()) for k, v in weights.items()}
        host_optimizer = self._host_tree("opt", optimizer)
        copied = torch.cuda.current_stream().record_event() if self.device.type == "cuda" else None
        stall = time.perf_counter() - start
        args = dict(weights=host_weights, optimizer=host_optimizer, rng=rng, meta=meta, config=config)
        self._thread = threading.Thread(
            target=self._write,
            args=(step, copied, set_best, stall, args, need_bytes),
            name="checkpoint-writer",
            daemon=True,
        )
        self._thread.start()
        return stall

    def _write(self, step: int, copied, set_best: bool, stall: float, args: dict, need_bytes: int | None) -> None:
        start = time.perf_counter()
        outcome = {"step": step, "path": None, "best": set_best, "error": None, "stall_s": round(stall, 3)}
        try:
            if copied is not None:
                copied.synchronize()
            if need_bytes is None:
                need_bytes = checkpoint_bytes(args["weights"], args["optimizer"])
            ensure_space(self.root, need_bytes)
            outcome["path"] = write_checkpoint(self.root, step, keep=self.keep, **args)
            if set_best:
                set_best_pointer(self.root, outcome["path"])
        except Exception as exc:  # reported by done(): the previous checkpoint stays latest
            outcome["error"] = exc
        outcome["write_s"] = round(time.perf_counter() - start, 3)
        self._outcome = outcome

    def done(self) -> dict | None:
        """The outcome of a write that has finished since the last call, else None."""
        if self._thread is not None and not self._thread.is_alive():
            self._thread = None
            outcome, self._outcome = self._outcome, None
            return outcome
        return None

    def wait(self) -> dict | None:
        """Join the write in flight; its outcome (None when there was none or it was taken)."""
        if self._thread is not None:
            self._thread.join()
        return self.done()
