"""CUDA graphs of decoding steps: each step shape captured once, then replayed with new inputs.

A decoding step of a small target is several hundred kernels of a few microseconds each: the host
launching them, not the GPU running them, bounds the step (docs/benchmarks.md: the GPU 17-43 % busy
on SmolLM2-135M). A CUDA graph launches all of them at once. A graph reads and writes the memory it
was captured on, so a step's inputs are copied into fixed buffers first, and its outputs are the
tensors the capture returned, valid until the next replay of any graph here (they share one pool).

    graphs = StepGraphs()
    tokens = graphs.run(("verify", rows, length), step, ids_buffer, starts_buffer)

`step(*inputs)` must be a pure function of its inputs and of state it only overwrites with the same
values (the KV cache rows a step writes): the first use of a shape runs it once eagerly (warm-up:
lazy initialisation and first allocations stay out of the capture), captures it, then replays it.
"""

from __future__ import annotations

import sys

import torch


class StepGraphs:
    def __init__(self):
        self.graphs: dict = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.failed: str | None = None  # why capturing failed, if it did: every step then runs eagerly

    def run(self, key, step, *inputs):
        if self.failed:
            return step(*inputs)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(step, inputs)
            except Exception as exc:  # an op that syncs with the host cannot be captured: say so, go eager
                self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                print(f"decoding: CUDA graphs off ({self.failed}); steps run eagerly", file=sys.stderr, flush=True)
                self.graphs.clear()
                return step(*inputs)
        graph, out = self.graphs[key]
        graph.replay()
        return out

    def _capture(self, step, inputs):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step(*inputs)
        return graph, out
