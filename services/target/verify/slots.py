"""Speculative decoding of many prompts at once, each on its own row of one KV cache.

    slots = Slots(target, prompts, room)            # one row per prompt: KV cache + captured features
    outs = decode_slots(slots, propose, max_new_tokens=128)   # every step ONE target forward for all rows

A row holds its prompt's committed tokens at their own positions: row b's token at position p is at
index p of every attention layer's cache, and the captured layers' outputs (the drafter's context)
at index p of `features`. A step feeds each unfinished row its block (last committed token + drafts)
at its next positions, so rows of different lengths run in one forward: the masks (per row: keys up
to the query's position, within the window of a sliding-window layer) keep every row to its own
prefix. Rolling back a rejected suffix is moving the row's length: what lies past it is never read
and is overwritten by the next block. So each step costs O(block) per prompt, not O(length) as the
packed recomputation of batched_decode.py does, and there is no rollback to get wrong.

Attention layers (full and sliding window, any transformers causal LM the loader takes) and the Gated
DeltaNet layers of the Qwen3.5 / Qwen3.6 hybrids: their recurrent and conv states are kept per row
(hybrid_states.RowStates); a step feeds each row its block from its committed state, and commit_block then
keeps each row's accepted prefix (the rule run again with the rejected tokens made no-ops).

The decisions (acceptance, stop tokens, limits) are speculative.py's Decoded.accept, so the records
and figures are the same as the one-prompt loop's; logits are computed in fp32 from the final hidden
state, as batched_decode.py does (the near-tie tolerance stays the model dtype's, or FP8's).
"""

from __future__ import annotations

import inspect
import time

import torch
from torch.nn.attention import sdpa_kernel

from services.decoding.decode_step import Decoded, exact_logits, logits_weight, mm_writes_fp32, rounding_tolerance
from services.target.model.hybrid import PackedGatedDeltaNet
from services.target.model.hybrid_states import RowStates
from services.target.model.model import Target
from services.target.verify.decode import ATTENTION_KINDS, DECODE_SDPA
from services.target.verify.slot_cache import SlotCache, SlotMasks
from services.target.verify.step_graphs import StepGraphs

PREFILL_TOKENS = 1 << 15  # prompt tokens per prefill forward: bounds the padded activations and masks
SYNC_EVERY = 8  # plain decoding reads the device back every 8 steps (to drop finished rows, to stop)
LENGTH_STEP = 128  # cache and context lengths are read in multiples of this: a few shapes, not one a step


def slot_decodable(target: Target) -> bool:
    """True when every decoder layer is an attention layer, or a Gated DeltaNet this service runs
    (hybrid.PackedGatedDeltaNet: its state kept per row, hybrid_states.RowStates)."""
    recurrent = [layer.linear_attn for layer in target.layers if hasattr(layer, "linear_attn")]
    if not all(isinstance(m, PackedGatedDeltaNet) for m in recurrent):
        return False
    types = set(getattr(target.model.config.get_text_config(), "layer_types", None) or [])
    return not types - ATTENTION_KINDS - ({"linear_attention"} if recurrent else set())


class Slots:
    """Many prompts on one target: row b is prompt b, with room for `room` tokens after it."""

    def __init__(
        self, target: Target, prompts: list[list[int]], room: int, features: bool = True, rows: int | None = None
    ):
        """rows: fewer rows than prompts, each taking any of them in turn (decode_slots' `rows`)."""
        if not slot_decodable(target):
            raise ValueError("slot decoding takes attention and Gated DeltaNet layers only")
        if not prompts or not all(prompts):
            raise ValueError("slot decoding needs at least one prompt, each of at least one token")
        self.target, self.device, self.dtype = target, target.device, target.model.dtype
        self.fp8 = target.fp8_linears  # the near-tie rounding (rounding_tolerance)
        self.capacity = max(len(p) for p in prompts) + room
        rows = rows or len(prompts)
        self.cache = SlotCache(rows, self.capacity)
        recurrent = [layer.linear_attn for layer in target.layers if hasattr(layer, "linear_attn")]
        # the Gated DeltaNet layers' rows
        self.states = RowStates(rows, recurrent, self.dtype, self.device) if recurrent else None
        width = target.info.hidden_width
        self.features = (
            torch.zeros(rows, self.capacity, width, dtype=self.dtype, device=self.device) if features else None
        )
        self.lm_head = logits_weight(target.model.get_output_embeddings().weight, self.dtype)
        self.gemm_attention = torch.device(self.device).type == "cuda" and mm_writes_fp32(torch.device(self.device))
        params = inspect.signature(target.backbone.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x

    @torch.no_grad()
    def step(
        self,
        ids: torch.Tensor,
        starts: torch.Tensor,
        length: int,
        rows=None,
        take=None,
        temperature=0.0,
        generator=None,
        commit=None,
    ):
        """ids [b, q] at positions starts[b] + 0..q-1 of `rows` (default: every row), on the device;
        `length` (the host's bound: max(starts) + q) is how far the cache is read. The captured
        layers go to `features`. Returns (tokens, margin, tolerance) [b, t] on the device, no host sync,
        at the block indices `take` [b, t] (default: all q): the greedy token (or one sampled at
        `temperature` > 0), its top-1 minus top-2 logit and the rounding tolerance. A hybrid's
        recurrent states take each row's first commit[b] tokens now (a prefill), or, commit None,
        nothing until commit_block()."""
        t, dev = self.target, self.device
        b, q = ids.shape
        self.cache.in_order = rows is None
        rows = torch.arange(self.cache.rows, device=dev) if rows is None else rows.to(dev)
        positions = starts.to(dev)[:, None] + torch.arange(q, device=dev)
        row_ids = rows[:, None]
        self.cache.where, self.cache.length = (row_ids, positions), length
        masks = SlotMasks(positions, length, self.gemm_attention)
        captured = torch.empty(b * q, t.info.hidden_width, dtype=self.dtype, device=dev)
        t.slot.slots = masks
        t.slot.compiled_steps = bool(t.steps_backend) and commit is None  # a prefill runs the eager layers
        if self.states is not None:
            self.states.where, self.states.lengths = rows, None if commit is None else commit.to(dev)
            t.slot.rows = self.states
        try:
            with t.capturing_into(captured), sdpa_kernel(DECODE_SDPA):
                out = t.backbone(
                    input_ids=ids.to(dev),
                    position_ids=positions,
                    attention_mask=masks.mask(None),  # 4D: transformers builds no mask of its own
                    use_cache=True,
                    **{self._cache_kwarg: self.cache},
                )
        finally:
            t.slot.slots = t.slot.rows = None
            t.slot.compiled_steps = False
        if self.features is not None:
            self.features[row_ids, positions] = captured.view(b, q, -1)
        hidden = out.last_hidden_state
        if take is not None:
            take = take.to(dev)
            hidden = hidden.gather(1, take[..., None].expand(-1, -1, hidden.shape[-1]))
        logits = exact_logits(hidden, self.lm_head, self.dtype)  # [b, t, vocab] in fp32
        top = logits.topk(2, dim=-1)
        tokens = top.indices[..., 0]
        if temperature > 0:
            probs = torch.softmax(logits.flatten(0, 1) / temperature, -1)
            tokens = torch.multinomial(probs, 1, generator=generator).view(tokens.shape)
        margin = top.values[..., 0] - top.values[..., 1]
        return tokens, margin, rounding_tolerance(top.values[..., 0], self.dtype, self.fp8)

    def prefill(self, prompts: list[list[int]], rows: list[int] | None = None, **sample) -> list[Decoded]:
        """Every prompt through the target, prompt i into row rows[i] (default: row i), a row's
        earlier prompt forgotten (prompts of similar length together, at most PREFILL_TOKENS padded
        tokens a forward): a Decoded per prompt holding its first new token."""
        rows = list(range(len(prompts))) if rows is None else rows
        if self.states is not None:
            self.states.clear(torch.tensor(rows, device=self.device))
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        outs: list[Decoded | None] = [None] * len(prompts)
        first = 0
        while first < len(order):
            last = first + 1
            while last < len(order) and (last + 1 - first) * len(prompts[order[last]]) <= PREFILL_TOKENS:
                last += 1
            chunk = order[first:last]
            width = len(prompts[chunk[-1]])
            ids = torch.zeros(len(chunk), width, dtype=torch.long)  # padding: read by no real token
            for r, i in enumerate(chunk):
                ids[r, : len(prompts[i])] = torch.tensor(prompts[i])
            take = torch.tensor([[len(prompts[i]) - 1] for i in chunk])
            lengths = torch.tensor([len(prompts[i]) for i in chunk])
            starts = torch.zeros(len(chunk), dtype=torch.long)
            at = torch.tensor([rows[i] for i in chunk])
            found = self.step(ids, starts, width, at, take, **sample, commit=lengths)
            tokens, margin, tolerance = torch.stack([x.double() for x in found]).cpu()  # one sync
            for r, i in enumerate(chunk):
                outs[i] = Decoded([int(tokens[r, 0])], [], 1, [float(margin[r, 0])], [float(tolerance[r, 0])])
            first = last
        return outs

    def commit_block(self, n: torch.Tensor) -> None:
        """A hybrid's rows 0..len(n)-1 past the first n[r] tokens of the block they were fed last
        (hybrid_states.RowStates.commit); nothing to do for attention layers (a row's length is its cache)."""
        if self.states is not None:
            self.states.commit(n)

    def keep_rows(self, keep: torch.Tensor) -> None:
        """Only the rows `keep` (ascending, on the device) from now on, in place (SlotCache.keep_rows)."""
        self.cache.keep_rows(keep)
        if self.states is not None:
            self.states.keep_rows(keep)
        if self.features is not None:
            self.features[: len(keep)] = self.features[keep]


class DraftCheck:
    """A draft is the drafter's guess: an id outside the target's vocabulary would index past its
    embedding inside a kernel (on CUDA a device-side assert that ends the process). Each step's drafts
    are checked on the device, no host sync: an id out of range is replaced by 0 and counted, and
    decode_slots reads the count back with the step's other figures and stops with an error."""

    def __init__(self, vocab: int, device):
        self.vocab = vocab
        self.bad = torch.zeros(1, dtype=torch.long, device=device)

    def __call__(self, drafts: torch.Tensor) -> torch.Tensor:
        ok = (drafts >= 0) & (drafts < self.vocab)
        self.bad += (~ok).sum()
        return torch.where(ok, drafts, 0)

    def raise_if_bad(self, bad: int) -> None:
        if bad:
            raise ValueError(
                f"decoding: the drafter proposed {bad} token ids outside the target's vocabulary of {self.vocab}: "
                "is this the drafter of this target?"
            )


class GraphedSteps:
    """decode_slots' step (the drafts, the verify forward, a hybrid's commit) as CUDA graphs: the
    inputs copied into fixed buffers (row b of a step is row b of each), the graphs of that shape
    replayed."""

    def __init__(self, slots: Slots, propose, q: int, check: DraftCheck):
        rows, dev = slots.cache.rows, slots.device
        self.slots, self.propose, self.graphs, self.check = slots, propose, StepGraphs(), check
        self.starts = torch.zeros(rows, dtype=torch.long, device=dev)
        self.ids = torch.zeros(rows, q, dtype=torch.long, device=dev)  # column 0: each row's last token
        self.kept = torch.zeros(rows, dtype=torch.long, device=dev)  # commit: tokens each row keeps

    def __call__(self, starts: torch.Tensor, last: torch.Tensor, context: int, length: int):
        """Returns the block ids [b, q] (a copy: a graph's outputs are overwritten by the next replay)
        and the verify forward's (tokens, margin, tolerance)."""
        b = len(last)
        self.starts[:b], self.ids[:b, 0] = starts, last
        if self.propose is not None and self.ids.shape[1] > 1:
            features = self.slots.features[:b]

            def draft(starts, last):
                return self.propose.padded(features, starts, last, context)

            drafts = self.graphs.run(("draft", b, context), draft, self.starts[:b], self.ids[:b, 0])
            self.ids[:b, 1:] = self.check(drafts)  # outside the graph: its warm-up would count twice
        ids = self.ids[:b].clone()
        return (ids, *self.verify(b, length))

    def verify(self, b: int, length: int):
        """The verify forward of rows 0..b-1 fed self.ids at self.starts: (tokens, margin, tolerance)."""

        def verify(ids, starts):
            return self.slots.step(ids, starts, length)

        return self.graphs.run(("verify", b, length), verify, self.ids[:b], self.starts[:b])

    def commit(self, n: torch.Tensor) -> None:
        """Slots.commit_block(n) as two graphs: the new states computed, then stored (hybrid_states.RowStates)."""
        states, b = self.slots.states, len(n)
        if states is None:
            return
        self.kept[:b] = n
        new = self.graphs.run(("commit", b), states.committed, self.kept[:b])
        self.graphs.run(("store", b), states.store, *new)


class Record:
    """What every prompt decoded so far, on the device (indexed by prompt, not by row): its new
    tokens with their margins and tolerances, how many, how many each verify step committed, and
    whether it goes on. A step updates it for all rows at once: no Python per prompt, no sync."""

    def __init__(self, prompts: int, max_new_tokens: int, stop_ids, device):
        n, self.max_new = prompts, max_new_tokens
        width = max_new_tokens + 1  # the last column takes the writes of what is not committed
        self.tokens = torch.zeros(n, width, dtype=torch.long, device=device)
        self.margins = torch.zeros(n, width, device=device)
        self.tolerances = torch.zeros(n, width, device=device)
        self.count = torch.zeros(n, dtype=torch.long, device=device)  # 1 from its first token on
        self.steps = torch.zeros(n, width, dtype=torch.long, device=device)  # a live step commits >= 1
        self.taken = torch.zeros(n, dtype=torch.long, device=device)  # verify steps so far, per prompt
        self.stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
        self.stop_set = set(stop_ids)
        self.live = torch.zeros(n, dtype=torch.bool, device=device)

    def begin(self, index: list[int], firsts: list[Decoded]) -> list[bool]:
        """Prompts `index` start with their prefill's first token; returns which of them go on."""
        at = torch.tensor(index, device=self.tokens.device)
        self.tokens[at, 0] = torch.tensor([f.tokens[0] for f in firsts], device=at.device)
        self.margins[at, 0] = torch.tensor([f.margins[0] for f in firsts], device=at.device)
        self.tolerances[at, 0] = torch.tensor([f.tolerances[0] for f in firsts], device=at.device)
        self.count[at] = 1
        going = [not f.done(self.max_new, self.stop_set) for f in firsts]
        self.live[at] = torch.tensor(going, device=at.device)
        return going

    def last(self, index: torch.Tensor) -> torch.Tensor:
        return self.tokens[index, self.count[index] - 1]

    def accept(self, index, drafts, greedy, margin, tolerance) -> torch.Tensor:
        """Decoded.accept for every row at once (row r is prompt index[r]): the longest prefix of the
        drafts [b, q-1] equal to the target's tokens greedy [b, q], plus the target's next token, cut
        at a stop token or the length limit. Returns how far each row's next position moves: the
        tokens it committed (0 once ended), so a row that ends stays inside its slot's capacity."""
        live, count = self.live[index], self.count[index]
        j = torch.arange(greedy.shape[1], device=greedy.device)
        accepted = (drafts == greedy[:, :-1]).long().cumprod(1).sum(1)
        ends = (torch.isin(greedy, self.stop) | (count[:, None] + j + 1 >= self.max_new)) & (j <= accepted[:, None])
        ended = ends.any(1)
        new = torch.where(ended, ends.long().argmax(1) + 1, accepted + 1) * live
        columns = torch.where(j < new[:, None], count[:, None] + j, self.max_new)
        self.tokens[index[:, None], columns] = greedy
        self.margins[index[:, None], columns] = margin
        self.tolerances[index[:, None], columns] = tolerance
        taken = self.taken[index]
        self.steps[index, torch.where(live, taken, self.max_new)] = new
        self.taken[index] = taken + live
        self.count[index] = count + new
        self.live[index] = live & ~ended
        # not accepted + 1: a row cut at its limit with more drafts accepted would move past what it
        # committed, and be fed, while it waits to leave the batch, at positions past its capacity
        return new

    def decoded(self) -> list[Decoded]:
        tokens, margins, tolerances = self.tokens.tolist(), self.margins.tolist(), self.tolerances.tolist()
        counts, steps, taken = self.count.tolist(), self.steps.tolist(), self.taken.tolist()
        outs = []
        for i, n in enumerate(counts):
            committed = steps[i][: taken[i]]
            outs.append(Decoded(tokens[i][:n], committed, 1 + len(committed), margins[i][:n], tolerances[i][:n]))
        return outs


@torch.no_grad()
def decode_slots(
    target: Target,
    propose,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    stop_ids=(),
    on_step=None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    graphs: bool = True,
    rows: int = 0,
    on_done=None,
) -> list[Decoded]:
    """speculative_generate for all `prompts` at once (propose None: plain greedy, one token per
    forward: the reference; temperature > 0 samples instead, for regeneration). propose.padded drafts
    every row's block in one call. on_step(new tokens) after every forward that reads back, and
    on_done(prompts) with how many more prompts ended.

    rows: decode on that many KV-cache rows (0: one per prompt); a row whose prompt ended takes the
    next waiting prompt at the next read-back (continuous batching), so a batch of long and short
    replies does not idle its finished rows until the longest ends.

    The host reads the device once a step (the rows' next positions, which the drafter's context and
    the cache's read length need) with drafts, once every SYNC_EVERY steps without (every live row
    moves by one: the host bounds where). On CUDA, greedy steps run as CUDA graphs (`graphs`;
    step_graphs.py), one per shape: rows, and lengths rounded up to LENGTH_STEP."""
    began = time.perf_counter()
    draft_len = 0 if propose is None else propose.block_size - 1
    q = draft_len + 1
    width = min(rows or len(prompts), len(prompts))
    slots = Slots(target, prompts, max_new_tokens + q, features=propose is not None, rows=width)
    dev = slots.device
    sample = dict(temperature=temperature, generator=generator)
    record = Record(len(prompts), max_new_tokens, stop_ids, dev)
    live = record.begin(list(range(width)), slots.prefill(prompts[:width], **sample))
    waiting = list(range(width, len(prompts)))  # prompts not given a row yet, in order
    check = DraftCheck(target.model.get_input_embeddings().num_embeddings, dev)
    graphed = GraphedSteps(slots, propose, q, check) if graphs and dev.type == "cuda" and temperature == 0 else None
    if on_step:
        on_step(width)
    index = torch.arange(width, device=dev)  # row -> prompt
    starts = torch.tensor([len(p) for p in prompts[:width]])  # each row's next position, on the host (a bound)
    starts_dev, committed, ended = starts.to(dev), width, 0
    deadline = max_new_tokens - 2  # the step by which every row's prompt has ended (a live row commits >= 1)
    step = 0
    while any(live) or waiting:
        if not waiting and sum(live) <= len(live) * 7 // 8:  # finished rows leave in bulk
            keep = torch.tensor([r for r, alive in enumerate(live) if alive])
            keep_dev = keep.to(dev)
            slots.keep_rows(keep_dev)
            index, starts, starts_dev = index[keep_dev], starts[keep], starts_dev[keep_dev]
            live = [True] * len(keep)
        last = record.last(index)
        # the lengths read, rounded up: what lies past a row's own length is masked, and each new
        # length would be new kernel shapes to plan (cuBLAS, attention): slow the first time each
        context = min(slots.capacity, -(-int(starts.max()) // LENGTH_STEP) * LENGTH_STEP)
        length = min(slots.capacity, -(-(int(starts.max()) + q) // LENGTH_STEP) * LENGTH_STEP)
        if int(starts.max()) + q > slots.capacity:  # checked here, on the host: past it a kernel would index out
            raise RuntimeError(
                f"decoding: a row at position {int(starts.max())} with a block of {q} tokens passes its slot's "
                f"capacity of {slots.capacity} (the longest prompt + max_new_tokens + the block)"
            )
        if graphed is not None:
            ids, greedy, margin, tolerance = graphed(starts_dev, last, context, length)
        else:
            drafts = (
                check(propose.padded(slots.features[: len(last)], starts_dev, last, context)) if draft_len else None
            )
            ids = last[:, None] if drafts is None else torch.cat([last[:, None], drafts], 1)
            greedy, margin, tolerance = slots.step(ids, starts_dev, length, **sample)
        moved = record.accept(index, ids[:, 1:], greedy, margin, tolerance)
        # a hybrid keeps the fed tokens of its rows that the cache keeps
        (graphed.commit if graphed is not None else slots.commit_block)(moved)
        starts_dev = starts_dev + moved  # a finished row stays where it is
        step += 1
        if not draft_len:  # every live row moves by one: the host's bound moves every row
            starts = torch.clamp(starts + 1, max=slots.capacity - q)
            if step % SYNC_EVERY and step <= deadline:
                continue
        over = ((record.count > 0) & ~record.live).sum()[None]  # prompts that ended
        host = torch.cat([record.live[index].long(), starts_dev, record.count.sum()[None], over, check.bad]).cpu()
        check.raise_if_bad(int(host[-1]))
        live, total = host[: len(index)].bool().tolist(), int(host[-3])
        starts = host[len(index) : 2 * len(index)]
        if on_step:
            on_step(total - committed)
        if on_done and int(host[-2]) > ended:
            on_done(int(host[-2]) - ended)
        committed, ended = total, int(host[-2])
        if waiting and not all(live):  # continuous batching: finished rows take the next prompts
            free = [r for r, alive in enumerate(live) if not alive][: len(waiting)]
            taken, waiting = waiting[: len(free)], waiting[len(free) :]
            going = record.begin(taken, slots.prefill([prompts[i] for i in taken], rows=free, **sample))
            for r, alive in zip(free, going):
                live[r] = alive
            rows_at, lengths = torch.tensor(free), torch.tensor([len(prompts[i]) for i in taken])
            index[rows_at.to(dev)] = torch.tensor(taken, device=dev)
            starts[rows_at], starts_dev[rows_at.to(dev)] = lengths, lengths.to(dev)
            committed += len(taken)  # their first tokens: said now, counted in the next total
            if on_step:
                on_step(len(taken))
            deadline = step + max_new_tokens - 2
    if on_done and len(prompts) > ended:  # those that ended after the last read-back, or at their first token
        on_done(len(prompts) - ended)
    outs = record.decoded()
    seconds = (time.perf_counter() - began) / len(prompts)  # the batch's wall time, shared out
    for out in outs:
        out.seconds = seconds
    return outs
