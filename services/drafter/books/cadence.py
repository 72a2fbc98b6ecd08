"""When drafter rank 0 measures real acceptance by the clock (eval.every_s), and what that costs.

A pass is due every `every_s` seconds of training (start to start), and each is cut at
budget_s = min(eval.budget_s, COST_SHARE * every_s): at 300 s, 15 s, so passes cost at most 5 % of
every interval. Such a pass decodes no plain greedy references and its rows end where they are when
the budget is spent (remote_eval.py, references=False), so it keeps to the budget within one step.
As a guard (the first pass also sets up: the tokenizer, the prompts, the drafter's decoding path),
a pass is also due only when the seconds spent in real acceptance, with one more pass as long as the
last, stay within COST_SHARE of the training time: a slow pass delays the next one instead of adding
up. The first pass's time is no guess for the next (its set-up is done once).

The clock is rank 0's, from its first batch (this process: a resume starts a new one). Every
real-acceptance pass during training counts, eval.every's too, and each resets the interval.
"""

from __future__ import annotations

COST_SHARE = 0.05  # of the training time, at most, for real acceptance during training
CUDA_EVERY_S = 300.0  # eval.every_s = -1 (the default) on CUDA


def every_s_for(setting: float, device_type: str) -> float:
    """eval.every_s as it applies: -1 is CUDA_EVERY_S on CUDA and off elsewhere, so CPU runs (tests,
    the CPU demo) keep their timing; any other value as given (0: off)."""
    if setting >= 0:
        return setting
    return CUDA_EVERY_S if device_type == "cuda" else 0.0


class Cadence:
    def __init__(self, every_s: float, budget_s: float):
        self.every_s = every_s
        self.budget_s = min(budget_s, COST_SHARE * every_s) if every_s > 0 else budget_s
        self.started: float | None = None  # the first batch
        self.last: float | None = None  # the last pass's start
        self.spent = 0.0  # seconds in real-acceptance passes
        self.passes = 0
        self.last_s = 0.0  # the last pass's seconds: the guess for the next one

    def begin(self, now: float) -> None:
        """Training has started (the first call counts)."""
        if self.started is None:
            self.started = self.last = now

    def due(self, now: float) -> bool:
        """A periodic pass now: its interval is over, and the cost with it (as long as the last) within its share."""
        if self.every_s <= 0 or self.started is None:
            return False
        guess = self.last_s if self.passes > 1 else 0.0
        return now - self.last >= self.every_s and self.spent + guess <= COST_SHARE * (now - self.started + guess)

    def record(self, start: float, end: float) -> dict:
        """A pass ran from start to end (perf_counter seconds); its cost figures."""
        self.begin(start)
        self.last, self.last_s, self.passes = start, end - start, self.passes + 1
        self.spent += self.last_s
        return {"pass_s": round(end - start, 3), **self.figures(end)}

    def figures(self, now: float) -> dict:
        """The cost so far: real-acceptance seconds, training seconds (wall, passes included), their
        ratio, and the passes; {} before training started."""
        if self.started is None:
            return {}
        wall = now - self.started
        return {
            "passes": self.passes,
            "spent_s": round(self.spent, 3),
            "wall_s": round(wall, 3),
            "cost_frac": round(self.spent / wall, 4) if wall > 0 else 0.0,
        }
