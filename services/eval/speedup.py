"""What the drafter buys in wall-clock time: speculative decoding against the target alone, at batch 1.

    timer = SpeedupTimer(spec_eval, per_set=16)      # spec_eval: a LocalSpecEval (its target, prompts, limits)
    figures = timer.measure(proposer)           # {"sets": {set: figures}, "all": figures}

Both paths decode the first `per_set` prompts of each set greedily on ONE KV-cache row of
decode_slots (services/target/verify/slots.py, rows=1: a prompt at a time, as one user's request runs), to
the same max_new_tokens, their steps CUDA graphs on CUDA: the target alone (propose None, one token
per forward) and speculative decoding, whose drafter (its layers, a Domino drafter's GRU head) runs
inside the timed steps. Speedup: the target alone's seconds over speculative decoding's, on the same
prompts. The target alone is timed once per set, for every drafter evaluated.

Warm-up: decode_slots captures its CUDA graphs (one per step shape) anew in each call, and the first
use of a shape plans its kernels, so a warm-up call would not keep capture out of a later timed call.
Each path decodes its prompts twice in ONE call; the clock starts when the first pass's last prompt
ends (decode_slots' on_done, called right after it reads the device back) and stops after a
synchronize: the timed pass replays the graphs the first pass captured (greedy decoding repeats
itself, so it meets the same shapes).

What decode_slots does either way is in both times: the target alone reads the device back every
SYNC_EVERY (8) steps, so a prompt that ends on a stop token costs it up to 7 forwards more before the
row takes the next prompt (none for one cut at max_new_tokens); speculative decoding reads back every
step, and its drafter re-reads the whole context each step (no drafter KV cache).
"""

from __future__ import annotations

import sys
import time

import torch

from services.decoding.decode_step import Decoded
from services.target.verify.slots import decode_slots


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_line(exc: Exception) -> str:
    """An exception as the record and stderr say it: its type and first line."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"


def describe_device(device: torch.device) -> str:
    """e.g. "cuda:0 (NVIDIA H200)": what the seconds were measured on."""
    if device.type != "cuda":
        return str(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


class SpeedupTimer:
    def __init__(self, spec_eval, per_set: int):
        """spec_eval: a LocalSpecEval; per_set: the first this many prompts of each set are timed."""
        self.spec_eval, self.per_set = spec_eval, per_set
        self.alone: dict[str, tuple[list[Decoded], float]] = {}  # set -> the target alone's outputs, seconds

    def indices(self, name: str) -> list[int]:
        return [i for i, n in enumerate(self.spec_eval.names) if n == name][: self.per_set]

    def timed(self, propose, prompts: list[list[int]], label: str) -> tuple[list[Decoded], float]:
        """The outputs of `prompts` (propose None: the target alone) and the seconds of their second,
        warm pass (module docstring)."""
        spec_eval, n = self.spec_eval, len(prompts)
        progress, began, ended = spec_eval.progress, [], 0
        self._phase(f"speedup, {label} (warm-up pass)", n)

        def on_done(count: int) -> None:
            nonlocal ended
            ended += count
            if not began and ended >= n:
                if ended > n:  # rows=1 ends a prompt per read-back: never, unless decode_slots changes
                    raise RuntimeError("the warm-up and timed passes ended together: no clock start")
                began.append(time.perf_counter())  # the device is idle: decode_slots just read it back
                self._phase(f"speedup, {label} (timed pass)", n)

        synchronize(spec_eval.device)
        outs = decode_slots(
            spec_eval.target,
            propose,
            prompts + prompts,
            max_new_tokens=spec_eval.max_new_tokens,
            stop_ids=spec_eval.stop_ids,
            rows=1,
            on_step=progress.add if progress else None,
            on_done=on_done,
        )
        synchronize(spec_eval.device)
        return outs[n:], time.perf_counter() - began[0]

    def _phase(self, name: str, prompts: int) -> None:
        if self.spec_eval.progress:
            self.spec_eval.progress.phase(name, prompts * self.spec_eval.max_new_tokens)

    def measure_set(self, propose, name: str) -> dict:
        prompts = [self.spec_eval.prompts[i] for i in self.indices(name)]
        if name not in self.alone:
            self.alone[name] = self.timed(None, prompts, f"{name}, target alone")
        alone, alone_s = self.alone[name]
        drafted, spec_s = self.timed(propose, prompts, f"{name}, {getattr(propose, 'label', 'drafter')}")
        return self.figures(
            prompts_timed=len(prompts),
            identical_outputs=sum(a.tokens == d.tokens for a, d in zip(alone, drafted)),  # greedy: all, near ties aside
            target_alone_tokens=sum(len(o.tokens) for o in alone),
            speculative_tokens=sum(len(o.tokens) for o in drafted),
            target_alone_s=alone_s,
            speculative_s=spec_s,
        )

    def figures(self, **counts) -> dict:
        """The counts with what they were measured on, the rates and the speedup, computed from the
        seconds as recorded (rounded to the microsecond): speedup == target_alone_s / speculative_s."""
        alone_s, spec_s = round(counts["target_alone_s"], 6), round(counts["speculative_s"], 6)
        return {
            **counts,
            "batch": 1,
            "device": describe_device(self.spec_eval.device),
            "target_alone_s": alone_s,
            "speculative_s": spec_s,
            "target_alone_tokens_per_s": round(counts["target_alone_tokens"] / alone_s, 1),
            "speculative_tokens_per_s": round(counts["speculative_tokens"] / spec_s, 1),
            "speedup": round(alone_s / spec_s, 3),
        }

    def measure(self, propose, say=lambda line: print(line, file=sys.stderr, flush=True)) -> dict:
        """{"sets": {set: its figures, or {"error": why}}, "all": every timed set's together}; a set
        whose timing fails is said (say) and recorded, the others still timed."""
        sets = {}
        for name in dict.fromkeys(self.spec_eval.names):
            try:
                sets[name] = self.measure_set(propose, name)
            except Exception as exc:  # a timing must never cost the acceptance figures
                sets[name] = {"error": one_line(exc)}
                say(f"eval: speedup on {name} not measured: {sets[name]['error']}")
                if self.spec_eval.device.type == "cuda":
                    torch.cuda.empty_cache()  # an out-of-memory timing leaves no cache behind
        timed = [s for s in sets.values() if "error" not in s]
        if not timed:  # the first set's reason stands for all: they share the target and the device
            return {"sets": sets, "all": {"error": next(iter(sets.values()), {"error": "no prompts"})["error"]}}
        pooled = {key: sum(s[key] for s in timed) for key in POOLED}
        return {"sets": sets, "all": {**self.figures(**pooled), "prompts_per_set": self.per_set}}


POOLED = (
    "prompts_timed",
    "identical_outputs",
    "target_alone_tokens",
    "speculative_tokens",
    "target_alone_s",
    "speculative_s",
)
