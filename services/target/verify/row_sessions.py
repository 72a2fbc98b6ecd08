"""A session of rows: the prompts of one real-acceptance evaluation verified together, each a row of
one KV cache (slots.py), so a step is ONE target forward for every prompt still decoding
(services/net/verify.py, the ops "open-rows" and "step-rows"; verifying.py serves them).

    session = RowSession(target, prompts, room)   # every prompt prefilled: (greedy, margin, tolerance, features)
    tokens, margin, tolerance, counts, features = session.step(rows, blocks)

A step feeds each asked row its block (the last committed token, then the drafts) at its next
positions, accepts the longest prefix of the drafts equal to the target's greedy tokens and commits
it + 1 token, as a one-prompt session does (decode.py): the KV cache keeps what lies before each
row's length, a hybrid's Gated DeltaNet rows their accepted prefix (Slots.commit_block). A row the
drafter no longer asks for (its prompt ended) leaves the cache for good.
"""

from __future__ import annotations

import torch

from services.target.model.attention import PACKED_SDPA
from services.target.verify.slots import LENGTH_STEP, Slots, slot_decodable


def check_rows(target) -> None:
    """ValueError naming why this target cannot verify on rows (the drafter then asks prompt by prompt)."""
    if getattr(target.model.config, "_attn_implementation", None) != PACKED_SDPA:
        raise ValueError('rows need target.attn_implementation = "sdpa" (the packed attention reads the rows\' masks)')
    if not slot_decodable(target):
        raise ValueError("rows take attention and Gated DeltaNet layers only")


class RowSession:
    def __init__(self, target, prompts: list[list[int]], room: int):
        """Every prompt through the target (room: the tokens each row may commit after its prompt)."""
        check_rows(target)
        self.slots = Slots(target, prompts, room, features=True)
        self.rows = list(range(len(prompts)))  # the prompt of each row, in row order
        self.starts = [len(p) for p in prompts]  # each row's committed tokens: where its next block goes
        firsts = self.slots.prefill(prompts)
        self.first = (
            torch.tensor([f.tokens[0] for f in firsts]),
            torch.tensor([f.margins[0] for f in firsts], dtype=torch.float32),
            torch.tensor([f.tolerances[0] for f in firsts], dtype=torch.float32),
            torch.tensor(self.starts),
            torch.cat([self.slots.features[r, :n] for r, n in enumerate(self.starts)]).cpu(),
        )

    @property
    def length(self) -> int:
        return max(self.starts)

    def step(self, rows: list[int], blocks: list[list[int]]):
        """Rows `rows` (prompt indices, ascending, each still held) fed `blocks` (one length):
        (greedy, margin, tolerance) flat over the blocks' positions, the tokens each row committed,
        and their features, row after row; all on the CPU."""
        self._keep(rows)
        slots, dev = self.slots, self.slots.device
        q = len(blocks[0])
        if self.length + q > slots.capacity:
            raise ValueError(f"a row would hold {self.length + q} tokens; this session has room for {slots.capacity}")
        ids, starts = torch.tensor(blocks), torch.tensor(self.starts)
        # the cache read up to a multiple of LENGTH_STEP: a few kernel shapes, not one a step
        length = min(slots.capacity, -(-(self.length + q) // LENGTH_STEP) * LENGTH_STEP)
        tokens, margin, tolerance = slots.step(ids.to(dev), starts.to(dev), length)
        drafts = ids.to(dev)[:, 1:]
        counts = (drafts == tokens[:, :-1]).long().cumprod(1).sum(1) + 1  # the accepted drafts + the target's own
        slots.commit_block(counts)
        tokens, margin, tolerance, counts = (t.cpu() for t in (tokens, margin, tolerance, counts))  # the sync
        features = torch.cat(
            [slots.features[r, s : s + int(n)] for r, (s, n) in enumerate(zip(self.starts, counts))]
        ).cpu()
        self.starts = [s + int(n) for s, n in zip(self.starts, counts)]
        return tokens.flatten(), margin.flatten().float(), tolerance.flatten().float(), counts, features

    def _keep(self, rows: list[int]) -> None:
        """Only the rows of prompts `rows` from now on (moved to the front of the cache, in order)."""
        if rows == self.rows:
            return
        where = {prompt: r for r, prompt in enumerate(self.rows)}
        missing = [prompt for prompt in rows if prompt not in where]
        if missing:
            raise ValueError(f"rows {missing} are not in this session (closed, or never opened)")
        keep = [where[prompt] for prompt in rows]
        self.slots.keep_rows(torch.tensor(keep, device=self.slots.device))
        self.rows, self.starts = list(rows), [self.starts[r] for r in keep]
