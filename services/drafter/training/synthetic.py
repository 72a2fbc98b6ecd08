"""A synthetic batch source: fixed-seed packed sequences with a pattern a drafter can learn.

Tokens walk one fixed random cycle through the vocabulary inside each document (t[j+1] =
next[t[j]]), so the block after an anchor is a function of the anchor token. Hidden states encode each position's
token through a fixed random low-rank projection, like a target's features would. Documents
have random lengths, an unsupervised "prompt" head, and the tail of the pack is padding.
Batch g is a pure function of (seed, g): every rank, restart and run sees the same batch g.
"""

from __future__ import annotations

import torch

from services.data.batch import FIELDS, Batch
from services.drafter.modeling.model import DrafterModelConfig
from services.run.shapes import SYNTHETIC_MODEL  # noqa: F401  (the made-up target's fields; runspec.resolve reads them)

_FEATURE_RANK = 64


class SyntheticSource:
    def __init__(
        self,
        model_cfg: DrafterModelConfig,
        pack_len: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        total_steps: int = 1000,
        start_step: int = 0,
        device="cpu",
        with_target_labels: bool = False,
        first_g: int | None = None,
    ):
        """first_g: batches done before start_step (a resume's checkpoint; default start_step·world_size)."""
        self.cfg, self.pack_len, self.rank, self.world_size = model_cfg, pack_len, rank, world_size
        self.seed, self.total_steps, self.start_step = seed, total_steps, start_step
        self.first_g = start_step * world_size if first_g is None else first_g
        self.device = torch.device(device)
        self.with_target_labels = with_target_labels
        gen = torch.Generator().manual_seed(seed + 7919)
        vocab, mask = model_cfg.vocab_size, model_cfg.mask_token_id
        data_tokens = torch.arange(vocab)[torch.arange(vocab) != mask]  # never the mask token
        # one random cycle through the data tokens: next(cycle[i]) = cycle[i + 1]
        self.cycle = data_tokens[torch.randperm(len(data_tokens), generator=gen)].to(self.device)
        self.next_token = torch.zeros(vocab, dtype=torch.long, device=self.device)
        self.next_token[self.cycle] = torch.roll(self.cycle, -1)
        self.token_code = torch.randn(vocab, _FEATURE_RANK, generator=gen).to(self.device, FIELDS["hidden"])
        self.projection = (torch.randn(_FEATURE_RANK, model_cfg.hidden_width, generator=gen) / _FEATURE_RANK**0.5).to(
            self.device, FIELDS["hidden"]
        )

    def __iter__(self):
        for step in range(self.start_step, self.total_steps):
            # docs/design.md "Scheduling" (plan.Plan.g_of): g = g0 + (m - m0)·D + d
            yield self.batch(self.first_g + (step - self.start_step) * self.world_size + self.rank)

    # services/drafter/training/pick_source.py's BatchSource: no targets, so nothing to check, record or close
    def check_targets(self, spec) -> None:
        pass

    def provenance_of(self, g: int) -> None:
        return None

    def target_of(self, g: int) -> None:
        return None

    def close(self) -> None:
        pass

    def batch(self, g: int) -> Batch:
        S = self.pack_len
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + g + 1)
        document_ids = torch.full((S,), -1, dtype=torch.long)
        position_ids = torch.zeros(S, dtype=torch.long)
        loss_mask = torch.zeros(S, dtype=torch.bool)
        starts = []
        used, n_docs = 0, 0
        real_len = S - int(torch.randint(0, max(1, S // 16), (1,), generator=gen))  # padding at the end
        while used < real_len:
            length = min(real_len - used, int(torch.randint(max(2, S // 8), max(3, S // 2), (1,), generator=gen)))
            document_ids[used : used + length] = n_docs
            position_ids[used : used + length] = torch.arange(length)
            prompt = length // 8
            loss_mask[used + prompt : used + length] = True
            starts.append(used)
            used, n_docs = used + length, n_docs + 1
        first = torch.randint(0, len(self.cycle), (len(starts),), generator=gen).to(self.device)
        doc, pos = document_ids.to(self.device), position_ids.to(self.device)
        input_ids = torch.where(doc >= 0, self.cycle[(first[doc.clamp(min=0)] + pos) % len(self.cycle)], 0)
        hidden = (self.token_code[input_ids] @ self.projection) * (doc >= 0)[:, None].to(FIELDS["hidden"])
        labels = self.next_token[input_ids] if self.with_target_labels else None
        return Batch(
            g=g,
            hidden=hidden,
            input_ids=input_ids,
            loss_mask=loss_mask.to(self.device),
            position_ids=pos,
            document_ids=doc,
            target_labels=labels,
        )


EVAL_BATCHES = 8
EVAL_FIRST_G = 1 << 40  # held-out synthetic batches: same data distribution, g never trained


class SyntheticEval:
    """Rank d's share (i*D + d) of the synthetic held-out batches, made lazily on each pass."""

    def __init__(self, source: SyntheticSource, rank: int, world_size: int):
        self.source, self.rank, self.world_size = source, rank, world_size

    def __iter__(self):
        for i in range(-(-EVAL_BATCHES // self.world_size)):
            g = i * self.world_size + self.rank
            batch = self.source.batch(EVAL_FIRST_G + g)
            if g >= EVAL_BATCHES:  # the split's end: an empty batch keeps ranks in step
                batch.loss_mask[:] = False
            yield batch

    def close(self) -> None:
        pass
