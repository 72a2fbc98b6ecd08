"""Real speculative decoding of many prompts at once: every step is ONE packed target forward.

The drafter's speculative.py decodes one prompt at a time on a KV cache. A forward of a small
target is a few milliseconds of kernel launches whatever it holds, so hundreds of prompts keep a GPU mostly idle
for many minutes (measured: docs/benchmarks.md, "A real model"). Here every unfinished prompt is
one document of a packed row, packed as training's capture packs them (varlen attention; Gated
DeltaNet layers per document), and the row runs through the target each step, with no cache:

    prefill    sequence_i = prompt_i                      -> first token, context_i = its features
    step       drafts_i = drafter(context_i, last token)  all prompts' blocks in one drafter call
               sequence_i = prompt_i + accepted_i + drafts_i, one target forward for all
               accept per prompt exactly as speculative.py does (longest agreeing prefix of the
               drafts + the target's own next token); context_i = the features of its committed
               tokens, from this same forward

The drafter call packs the contexts too: block i is an anchor at the end of context i, and
training's own mask (attention.visibility: its context and its block, nothing of another prompt;
the window of a sliding_attention layer) keeps the prompts apart.

What it costs: recomputing the context is O(length) per prompt and step instead of O(block). For
evaluation lengths (hundreds of tokens) on a target that fits a GPU many times over that is cheap,
and it needs no cache and no rollback of recurrent state. For a large target, `launcher eval
--batch 1` keeps speculative.py's cached one-prompt loop. Decisions, records (Decoded) and figures
are speculative.py's; the numbers differ only by rounding (another packing rounds differently:
services/decoding/lossless.py's near-tie rule).

Logits are computed in fp32 from the final hidden state: SmolLM2's bf16 logits tie exactly often
enough to split greedy decoding at a tie (measured); the near-tie tolerance stays the model dtype's
(widened for FP8 decoder linears: rounding_tolerance), the rounding of the hidden state the logits come from.
"""

from __future__ import annotations

import time

import torch

from services.decoding.decode_step import Decoded, Step, exact_logits, logits_weight, rounding_tolerance


class PackedVerifier:
    """The target on many token sequences at once, each one document of a packed row, no cache."""

    def __init__(self, target):
        self.target = target
        self.dtype = target.model.dtype
        self.fp8 = target.fp8_linears  # the near-tie rounding (rounding_tolerance)
        self.lm_head = logits_weight(target.model.get_output_embeddings().weight, self.dtype)

    @torch.no_grad()
    def forward(self, sequences: list[list[int]], tails: list[int]) -> list[Step]:
        """One Step per sequence: greedy/margin/tolerance at its last `tails[i]` positions, features
        at every position."""
        t, device = self.target, self.target.device
        lengths = torch.tensor([len(s) for s in sequences])
        total = int(lengths.sum())
        # index tensors built on the host and moved once: per-prompt device work is launch overhead
        ids = torch.tensor([token for s in sequences for token in s], dtype=torch.long).to(device)
        positions = torch.cat([torch.arange(n) for n in lengths.tolist()]).to(device)
        documents = torch.repeat_interleave(torch.arange(len(sequences)), lengths).to(device)
        features = torch.empty(total, t.info.hidden_width, dtype=self.dtype, device=device)
        final = torch.empty(total, t.info.hidden_size, dtype=self.dtype, device=device)
        t.capture(ids, positions, documents, out=features, final_out=final)
        ends = torch.cumsum(lengths, 0).tolist()
        rows = torch.cat([torch.arange(end - tail, end) for end, tail in zip(ends, tails)]).to(device)
        top = exact_logits(final[rows], self.lm_head, self.dtype).topk(2, dim=-1)
        greedy, margin = top.indices[:, 0].cpu(), (top.values[:, 0] - top.values[:, 1]).cpu()
        tolerance = rounding_tolerance(top.values[:, 0], self.dtype, self.fp8).cpu()
        out, first = [], 0
        for end, n, tail in zip(ends, lengths.tolist(), tails):
            cut = slice(first, first + tail)
            out.append(Step(greedy[cut], margin[cut], tolerance[cut], features[end - n : end]))
            first += tail
        return out


def _proposals(propose, contexts, last_tokens, draft_len: int) -> list[list[int]]:
    if draft_len == 0:  # plain greedy decoding: no drafts
        return [[] for _ in contexts]
    return propose.many(contexts, last_tokens)


@torch.no_grad()
def decode_many(
    verifier: PackedVerifier, propose, prompts: list[list[int]], *, max_new_tokens: int, stop_ids=()
) -> list[Decoded]:
    """speculative_generate for all `prompts` at once (propose None: plain greedy, one token per
    forward: the reference). propose.many(contexts, last tokens) drafts every block in one call."""
    stop, began = set(stop_ids), time.perf_counter()
    draft_len = 0 if propose is None else propose.block_size - 1
    outs, contexts = [], []
    for step in verifier.forward(prompts, [1] * len(prompts)):
        outs.append(Decoded.first(step))
        contexts.append(step.features)
    active = [i for i, o in enumerate(outs) if not o.done(max_new_tokens, stop)]
    while active:
        drafts = _proposals(propose, [contexts[i] for i in active], [outs[i].tokens[-1] for i in active], draft_len)
        steps = verifier.forward(
            [prompts[i] + outs[i].tokens + d for i, d in zip(active, drafts)], [len(d) + 1 for d in drafts]
        )
        still = []
        for i, d, step in zip(active, drafts, steps):
            committed = len(prompts[i]) + len(outs[i].tokens)  # the last token not in a context yet
            accepted = outs[i].accept(
                d, step.greedy.tolist(), step.margin.tolist(), step.tolerance.tolist(), max_new_tokens, stop
            )
            contexts[i] = None if outs[i].done(max_new_tokens, stop) else step.features[: committed + accepted]
            if contexts[i] is not None:
                still.append(i)
        active = still
    seconds = (time.perf_counter() - began) / max(1, len(prompts))  # the batch's wall time, shared out
    for out in outs:
        out.seconds = seconds
    return outs
