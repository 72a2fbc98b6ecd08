"""Captures in flight: the GPU computes the next batch while the last ones are copied out and sent.

    ring = CaptureRing(target, seq_len, slots, with_labels)
    hidden, labels, ready, release = ring.capture(row)   # returns at once; the GPU works on

On CUDA the forward writes into one of two device buffers; a side stream copies it into one of
`slots` pinned host buffers once the forward is done, and `ready` (a CUDA event) completes when
the copy has. The I/O thread sends from the host buffer and calls `release` once ZMQ has let go of
it. A slot is reused only after that, so host memory is fixed (slots x batch size) and the slot
count is the limit on captures in flight: when every slot is still being sent, capture() waits.
On CPU the capture runs synchronously into fresh tensors (ready and release are None).
"""

from __future__ import annotations

import threading

import torch

from services.data.batch import FIELDS
from services.target.model.model import Target

SLOT_WAIT_S = 120.0  # longer than any send may take (transport SEND_TIMEOUT_S), so a stuck slot is a bug


class CaptureRing:
    def __init__(self, target: Target, seq_len: int, slots: int, with_labels: bool):
        self.target, self.with_labels = target, with_labels
        self.cuda = target.device.type == "cuda"
        self.k = 0
        if not self.cuda:
            return
        width, device = target.info.hidden_width, target.device
        self.device_out = [torch.empty(seq_len, width, dtype=FIELDS["hidden"], device=device) for _ in range(2)]
        self.copied: list[torch.cuda.Event | None] = [None, None]  # copy out of device_out[i] finished
        self.host = [torch.empty(seq_len, width, dtype=FIELDS["hidden"], pin_memory=True) for _ in range(slots)]
        self.host_labels = [torch.empty(seq_len, dtype=torch.int64, pin_memory=True) for _ in range(slots)]
        self.free = [threading.Event() for _ in range(slots)]
        for event in self.free:
            event.set()
        self.copy_stream = torch.cuda.Stream(device)

    def capture(self, row: dict[str, torch.Tensor]):
        """(hidden, labels or None, ready event or None, release callback or None) for one row."""
        if not self.cuda:
            hidden, labels = self.target.capture(
                row["input_ids"], row["position_ids"], row["document_ids"], with_labels=self.with_labels
            )
            return hidden, labels, None, None
        d, h = self.k % 2, self.k % len(self.host)
        self.k += 1
        if not self.free[h].wait(SLOT_WAIT_S):
            raise RuntimeError(f"capture slot {h} not released after {SLOT_WAIT_S:.0f}s")
        self.free[h].clear()
        compute = torch.cuda.current_stream()
        if self.copied[d] is not None:
            compute.wait_event(self.copied[d])  # device_out[d] may be overwritten once copied out
        hidden, labels = self.target.capture(
            row["input_ids"],
            row["position_ids"],
            row["document_ids"],
            with_labels=self.with_labels,
            out=self.device_out[d],
        )
        computed = compute.record_event()
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(computed)
            self.host[h].copy_(hidden, non_blocking=True)
            if labels is not None:
                labels.record_stream(self.copy_stream)  # allocated on the compute stream, read here
                self.host_labels[h].copy_(labels, non_blocking=True)
            ready = self.copy_stream.record_event()
        self.copied[d] = ready
        return self.host[h], self.host_labels[h] if labels is not None else None, ready, self.free[h].set
