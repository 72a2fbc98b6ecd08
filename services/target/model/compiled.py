"""Regional compile of the target's decoder layers (target.compile; docs/benchmarks.md "Compiled capture").

Every decoder layer's forward is torch.compile'd on its own, as torchtitan compiles its blocks: the
norms, rotary, gates, SwiGLU and residual adds around the GEMMs fuse into fewer kernels. What
varies from row to row (where the documents begin) stays outside the graphs: the attention function
and the Gated DeltaNet conv and kernel read it from the row slot (row.py) inside functions marked
torch.compiler.disable. Every row has pack_len tokens, so the graphs compiled on the warmup row
serve every later row (graphs_compiled() counts; the worker reports recompiles after warmup).
verify/decode.py's decoding forwards and plain forwards keep the eager layers; verify/slots.py's decoding steps
can have compiled layers of their own (compile_steps: dynamic shapes, target.compile_steps()).
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from services.target.model.attention import PACKED_SDPA
from services.target.model.row import RowSlot

log = logging.getLogger("target")


def compile_layers(layers: nn.ModuleList, slot: RowSlot, backend: str = "inductor") -> None:
    """Compile each decoder layer's capture forward; the eager forward stays for everything else."""
    _compile_each(layers, slot, "capture_forward", lambda eager: torch.compile(eager, dynamic=False, backend=backend))


def compile_steps(layers: nn.ModuleList, slot: RowSlot, backend: str = "inductor") -> None:
    """Compile each decoder layer's forward for verify/slots.py's decoding steps: a few tokens on each of
    many KV-cache rows. The rows and the cache length change from step to step, so the shapes are
    dynamic; the KV cache writes and the Gated DeltaNet states stay eager (torch.compiler.disable).
    Inside a CUDA graph (verify/step_graphs.py) this removes what the graph cannot: the many small kernels
    of the norms, rotary, gates and SwiGLU. Each layer still compiles on its own (transformers hands
    the cache its layer_idx, an int torch.compile keeps constant), so compiling costs 30-130 s:
    docs/benchmarks.md, "The verify step with compiled layers"."""
    _compile_each(layers, slot, "step_forward", lambda eager: torch.compile(eager, dynamic=True, backend=backend))


def _compile_each(layers: nn.ModuleList, slot: RowSlot, name: str, compile_one) -> None:
    import torch._dynamo

    # layers of one kind share their graph; room for a model whose layers all differ, twice
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 4 * len(layers))
    for layer in layers:
        eager = layer.__dict__.setdefault("eager_forward", layer.forward)  # compiling again wraps the eager one
        layer.__dict__[name] = compile_one(eager)
        layer.forward = _dispatch(layer.__dict__, slot, eager)


def _dispatch(compiled: dict, slot: RowSlot, eager):
    """The layer's forward: a compiled one where the slot says this forward is of its kind."""

    def forward(*args, **kwargs):
        if slot.slots is not None:
            step = compiled.get("step_forward") if slot.compiled_steps else None
            return (step or eager)(*args, **kwargs)
        if slot.compiled and slot.layout is not None and slot.decode is None:
            return compiled["capture_forward"](*args, **kwargs)
        return eager(*args, **kwargs)

    return forward


def why_not(target, setting: str) -> str:
    """ "" if target.compile = `setting` compiles this target, else why it does not."""
    if setting == "off":
        return "target.compile=off"
    if setting == "auto" and target.device.type != "cuda":
        return "target.compile=auto compiles on CUDA only"
    if getattr(target.model.config, "_attn_implementation", None) != PACKED_SDPA:
        return "target.compile needs target.attn_implementation=sdpa (the packed attention that keeps rows apart)"
    if target.per_document:
        return "target.compile does not serve the per-document capture path"
    return ""


def warmup_row(pack_len: int, vocab_size: int) -> dict[str, torch.Tensor]:
    """A made-up row of pack_len tokens in a few documents: the shapes every real row has."""
    lengths = [pack_len // 8] * 7
    lengths.append(pack_len - sum(lengths))
    lengths = [n for n in lengths if n > 0]
    gen = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.randint(0, vocab_size, (pack_len,), generator=gen),
        "position_ids": torch.cat([torch.arange(n) for n in lengths]),
        "document_ids": torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]),
    }


def compile_and_warm_up(target, setting: str, pack_len: int, with_labels: bool, backend: str = "inductor") -> float:
    """Compile the target's layers as `setting` asks and run the warmup row through them twice (the
    second proves the graphs are reused), so that `ready` means compiled. Returns the seconds spent.

    With "auto" a compile that fails leaves the eager layers and logs why; with "on" it raises."""
    reason = why_not(target, setting)
    if reason:
        if setting == "on":
            raise ValueError(reason)
        log.info("eager target layers: %s", reason)
        return 0.0
    start = time.perf_counter()
    target.compile(backend)
    row = warmup_row(pack_len, target.info.vocab_size)
    try:
        for _ in range(2):
            target.capture(row["input_ids"], row["position_ids"], row["document_ids"], with_labels=with_labels)
        if target.device.type == "cuda":
            torch.cuda.synchronize(target.device)
    except Exception as exc:
        if setting == "on":
            raise
        target.slot.compiled = False
        log.warning(
            "target.compile=auto: compiling the layers failed (%s: %s); capturing with the eager layers",
            type(exc).__name__,
            str(exc).splitlines()[0][:300] if str(exc) else "",
        )
        return time.perf_counter() - start
    seconds = time.perf_counter() - start
    log.info("compiled the target's layers (%s) in %.1f s", backend, seconds)
    return seconds
