"""One evaluation of drafters by real speculative decoding: prompts (prompt sets from files, else the
held-out lines; services/data/prompts.py) and their plain greedy references, made once; then any drafter
(weights) is decoded on them, with figures over all prompts and per set, and the controls.

SpecEval holds what does not depend on where the target runs; a subclass says how prompts are
decoded (`run`) and where the target's embedding and lm_head come from (`head`): RemoteSpecEval
(remote_eval.py) through the target workers during training, LocalSpecEval (services/eval/local_spec_eval.py)
with the target in this process for `launcher eval`.
"""

from __future__ import annotations

import torch

from services.drafter.acceptance.speculative import DrafterProposer, RepeatLast, eval_drafter
from services.drafter.modeling.model import DrafterModelConfig
from services.drafter.modeling.target_head import TargetHead


class SpecEval:
    device: torch.device
    dtype: torch.dtype
    _controls: dict[tuple, dict]
    held_out: bool | None  # where the prompts come from: files (None), held-out lines (True) or training's

    def head(self, model_cfg: DrafterModelConfig) -> TargetHead:
        raise NotImplementedError

    def run(
        self, propose, budget_s: float = 0.0, tick=None, indices: list[int] | None = None, references: bool = True
    ) -> dict:
        """Prompts in order (those of `indices`, else all) until done or past budget_s (0: no limit);
        the figures of those decoded, and their `indices`; references False: no lossless check."""
        raise NotImplementedError

    def proposer(self, weights: dict | None, model_cfg: DrafterModelConfig) -> DrafterProposer:
        """The drafter (weights; None: its random initial weights) as evaluated here, with the target's head."""
        return DrafterProposer(eval_drafter(weights, model_cfg, self.device, self.dtype), self.head(model_cfg))

    def _random(self, model_cfg: DrafterModelConfig) -> DrafterProposer:
        random = self.proposer(None, model_cfg)
        random.label = "random-drafter control"
        return random

    def evaluate(
        self,
        weights: dict,
        model_cfg: DrafterModelConfig,
        *,
        controls: bool = False,
        budget_s: float = 0.0,
        seed: int = 0,
        tick=None,
        references: bool = True,
    ) -> dict:
        """The drafter's figures; with controls also those of repeat-last and a random drafter, on
        exactly the prompts the drafter decoded (not the first n: a skipped prompt is no control's).
        references False: acceptance only, no lossless check against plain greedy decoding."""
        result = self.run(self.proposer(weights, model_cfg), budget_s, tick, references=references)
        if controls:
            # the controls depend on the drafter's shape and the prompts only: several checkpoints
            # evaluated here (`launcher eval --checkpoint A --checkpoint B`) decode them once
            key = (repr(model_cfg), seed, tuple(result["indices"]))
            if key not in self._controls:
                decoded = result["indices"]
                torch.manual_seed(seed)
                self._controls[key] = {
                    "repeat_last": self.run(RepeatLast(model_cfg.block_size), tick=tick, indices=decoded),
                    "random": self.run(self._random(model_cfg), tick=tick, indices=decoded),
                }
            result.update(self._controls[key])
        result["held_out"] = self.held_out
        return result
