"""LocalSpecEval: the drafters' evaluation (services/drafter/acceptance/spec_eval.py SpecEval) with the target in
this process: the target, its prompts (services/data/prompts.py) and their plain greedy outputs, made
once; then any drafter is decoded on them.

`batch` prompts decode together, one target forward per step: each on its own row of a KV cache
(slots.py) for a target of attention layers, or packed without a cache (batched_decode.py) for one
with recurrent layers; batch 1 decodes one prompt at a time on a KV cache
(services/drafter/acceptance/speculative.py), the references as the drafters. A Progress
(services/decoding/decode_progress.py) prints a line every 10 s while it decodes.

The target is loaded by services.target.model.model.load_target (the training capture's own loader,
hooks and packed Gated DeltaNet layers) in fp32 on CPU and in target.dtype elsewhere, and runs
through a LocalVerifier (verifier.py).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from services.data.prompts import interleave, prompt_sets, stop_token_ids
from services.decoding.decode_step import ROLLBACKS, Decoded
from services.drafter.acceptance.spec_eval import SpecEval
from services.drafter.acceptance.speculative import greedy_reference, speculative_generate, summarize_sets
from services.drafter.modeling.model import DrafterModelConfig
from services.drafter.modeling.target_head import TargetHead
from services.eval.batched_decode import PackedVerifier, decode_many
from services.eval.verifier import LocalVerifier
from services.run import runspec
from services.run.config import Config
from services.target.model.model import load_target
from services.target.verify.slot_cache import rows_that_fit
from services.target.verify.slots import decode_slots, slot_decodable


def load_eval_target(cfg: Config, device: torch.device):
    """The run's target capturing the run spec's layers (fp32 on CPU)."""
    target_cfg = runspec.resolve(cfg).target_config(cfg)
    return load_target(dataclasses.replace(target_cfg, dtype="float32") if device.type == "cpu" else target_cfg, device)


# Recomputing every prompt's context each step (batched_decode.py, a target slots.py cannot run) costs
# FLOPs in proportion to the target's size; the cached one-prompt loop is bound by kernel launches on
# a small target and by reading the weights on a large one: past a few billion parameters the cached
# loop wins. Rows of a KV cache (slots.py: attention and Gated DeltaNet layers) cost O(block) per
# prompt and step: many at once win at every size, up to what their cache and states take
# (docs/benchmarks.md, "Evaluation speed"): as many as half the free memory holds, at most AUTO_SLOTS
# (the 264 prompts of two benchmark sets in one pass).
AUTO_BATCH, AUTO_BATCH_MAX_PARAMS, AUTO_SLOTS = 32, 3e9, 512


def auto_batch(target, device: torch.device, capacity: int) -> int:
    """Prompts decoded at once by default on a GPU: the KV-cache rows of `capacity` tokens that fit
    (at most AUTO_SLOTS) for a target slots.py runs, else AUTO_BATCH packed for one of at most
    AUTO_BATCH_MAX_PARAMS parameters, else 1."""
    if device.type != "cuda":
        return 1
    if slot_decodable(target):
        return rows_that_fit(target.model, device, capacity, AUTO_SLOTS, target.info.hidden_width)
    params = sum(p.numel() for p in target.model.parameters())
    return AUTO_BATCH if params <= AUTO_BATCH_MAX_PARAMS else 1


class LocalSpecEval(SpecEval):
    def __init__(
        self,
        cfg: Config,
        device,
        *,
        prompts: int,
        max_new_tokens: int,
        target=None,
        tokenizer=None,
        rollback: str = ROLLBACKS[0],
        files: list[str] = (),
        batch: int = 1,
    ):
        """prompts: at most this many of each set; files: prompt-set files (none: the held-out lines);
        batch: prompts decoded at once (module docstring); 0: auto_batch's choice."""
        if batch < 0:
            raise ValueError(f"batch must be >= 0, got {batch}")
        from transformers import AutoTokenizer

        self.device = torch.device(device)
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(cfg.target.model_path)
        # the prompts before the target: a bad prompt file is named before a large model loads
        held_out = runspec.HeldOut.of(cfg)
        self.prompts, self.names = interleave(prompt_sets(held_out, cfg.data, self.tokenizer, list(files), prompts))
        self.target = target if target is not None else load_eval_target(cfg, self.device)  # a Target
        self.verifier = LocalVerifier(self.target, rollback)
        # a row holds its prompt, the new tokens and a block of drafts past them
        self.capacity = max(map(len, self.prompts), default=1) + max_new_tokens + cfg.drafter.block_size
        self.auto = batch == 0  # the rows that fit are counted again when the captured layers change
        self.batch = batch or auto_batch(self.target, self.device, self.capacity)
        self.slots = self.batch > 1 and slot_decodable(self.target)
        self.packed = PackedVerifier(self.target) if self.batch > 1 and not self.slots else None
        self.progress = None  # a Progress (services/decoding/decode_progress.py): a line every 10 s
        self.dtype = self.target.model.dtype
        self.max_new_tokens = max_new_tokens
        self.stop_ids = stop_token_ids(self.tokenizer, self.target.model)
        # where the prompts come from: the files (None), held-out lines (True) or the last training lines
        self.held_out = None if files else held_out.exists
        self._references: list[Decoded] = []
        self._controls: dict[tuple, dict] = {}

    def decode(self, propose, indices: list[int]) -> list[Decoded]:
        """These prompts decoded with `propose` (None: plain greedy): `batch` at once, or one by one."""
        prompts, limits = (
            [self.prompts[i] for i in indices],
            dict(max_new_tokens=self.max_new_tokens, stop_ids=self.stop_ids),
        )
        step = self.progress.add if self.progress else lambda tokens: None
        if self.slots:  # `batch` rows, each taking the next prompt when its own ends
            return decode_slots(self.target, propose, prompts, **limits, on_step=step, rows=self.batch)
        if self.packed is not None:
            outs = decode_many(self.packed, propose, prompts, **limits)
        elif propose is None:
            outs = [greedy_reference(self.verifier, p, self.max_new_tokens, self.stop_ids) for p in prompts]
        else:
            outs = [speculative_generate(self.verifier, propose, p, **limits) for p in prompts]
        step(sum(len(o.tokens) for o in outs))
        return outs

    def _phase(self, name: str, prompts: int) -> None:
        if self.progress:
            self.progress.phase(name, prompts * self.max_new_tokens)

    def references(self, n: int) -> list[Decoded]:
        """Plain greedy outputs of the first n prompts (computed once, reused at every evaluation;
        on KV-cache rows in one call, else `batch` at a time)."""
        span = len(self.prompts) if self.slots else self.batch
        while len(self._references) < min(n, len(self.prompts)):
            done = len(self._references)
            self._references += self.decode(None, list(range(done, min(done + span, n, len(self.prompts)))))
        return self._references[:n]

    def head(self, model_cfg: DrafterModelConfig) -> TargetHead:
        embed = self.target.model.get_input_embeddings().weight
        lm_head = self.target.model.get_output_embeddings().weight
        if tuple(embed.shape) != (model_cfg.vocab_size, model_cfg.hidden_size):
            raise ValueError(
                f"the target's embedding is {tuple(embed.shape)}, the drafter expects "
                f"[{model_cfg.vocab_size}, {model_cfg.hidden_size}]"
            )
        wanted = sorted(model_cfg.target_layer_ids)
        if wanted != list(self.target.info.layer_ids):  # a checkpoint of another recipe (drafter.num_layers)
            try:
                self.target.capture_layers(wanted)
            except ValueError as exc:
                raise ValueError(
                    f"the drafter reads target layers {wanted}, which this target of "
                    f"{self.target.info.num_layers} layers cannot capture ({exc})"
                ) from None
            if self.auto and self.slots:  # a row holds the features of every captured layer
                self.batch = max(1, auto_batch(self.target, self.device, self.capacity))
        return TargetHead(embed.detach(), lm_head.detach())

    def run(
        self, propose, budget_s: float = 0.0, tick=None, indices: list[int] | None = None, references: bool = True
    ) -> dict:
        """Prompts in order (those of `indices`, else all) until done or past budget_s (0: no limit);
        the figures of those decoded, and their `indices`. `launcher eval` always checks lossless:
        references False is for the training's passes (remote_eval.py) and is refused here."""
        if not references:
            raise ValueError("LocalSpecEval checks every decoding against plain greedy (references=True)")
        start = time.perf_counter()
        if indices is None:  # references inside the budget too: the first evaluation computes them
            count = 0
            self._phase("greedy references", len(self.prompts) - len(self._references))
            while count < len(self.prompts):
                if budget_s > 0 and count and time.perf_counter() - start > budget_s / 2:
                    break
                count = len(self.references(count + (self.batch if budget_s > 0 else len(self.prompts))))
                if tick:
                    tick()
            indices = list(range(count))
        refs = self.references(max(indices, default=-1) + 1)  # cached: the drafter's run computed them
        began, results = time.perf_counter(), []
        self._phase(getattr(propose, "label", "drafter"), len(indices))
        # within a budget `batch` prompts at a time (it is checked between them), else all in one call
        span = self.batch if budget_s > 0 or not self.slots else max(len(indices), 1)
        for first in range(0, len(indices), span):
            if budget_s > 0 and results and time.perf_counter() - start > budget_s:
                break
            if tick:
                tick()
            results += self.decode(propose, indices[first : first + span])
        decoded = indices[: len(results)]
        return {
            **summarize_sets(
                results, [refs[i] for i in decoded], [self.names[i] for i in decoded], time.perf_counter() - began
            ),
            "indices": decoded,
        }
