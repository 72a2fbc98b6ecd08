"""A worker's GPU memory for its health status: the peak its tensors took, and what the caching
allocator holds (reserved grows when fragmentation does; bench/soak.py follows both over hours)."""

from __future__ import annotations

import torch


def gpu_memory(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"gpu_mem_bytes": 0, "gpu_reserved_bytes": 0}
    return {
        "gpu_mem_bytes": int(torch.cuda.max_memory_allocated(device)),
        "gpu_reserved_bytes": int(torch.cuda.memory_reserved(device)),
    }
