"""Real speculative decoding with a DFlash drafter and its target, greedy: the acceptance users see.

The teacher-forced τ of training and evaluation (loss.acceptance_metrics) scores the drafter's
blocks against the *labels* at sampled anchors. This module runs the drafter the way an engine
does (DFlash, arXiv 2602.06036), and counts what the target really accepts:

    prefill   verifier.prefill(prompt) -> features of the captured layers, first token = argmax
    step      block = [last accepted token, mask x (B-1)]  at positions start .. start+B-1
              drafter(features of every accepted token, block) -> B-1 drafted tokens (one pass;
              a sliding_attention layer sees only its window, as in training)
              verifier.verify([last accepted token] + drafts), one target forward -> greedy tokens
              accept the longest prefix of the drafts equal to the target's greedy tokens, plus
              the target's own next token; verifier.commit(accepted + 1) keeps those block tokens
              (KV cache and recurrent state rolled back to them) and their features are kept

The Verifier (services/decoding/decode_step.py) is the target; a local one runs the training Target's DecodeSession.
Greedy verification makes the output the target's own greedy output whatever the drafter does;
`evaluate_prompts` checks that against plain greedy decoding through the same Verifier, one token
per forward, on every prompt (lossless.py says how a difference reads: near-tie or bug).

Figures (summarize):
  acceptance_per_step     tokens committed per verify step (accepted drafts + 1), pooled over all steps
  acceptance_per_prompt   the same per prompt, then averaged over prompts (z-lab's benchmark figure)
  tokens_per_forward      new tokens / target forwards (the prefill included); plain greedy is 1.0
  lossless                prompts whose output equals plain greedy decoding, of all prompts;
                          near_ties and differences (lossless.py) for the others

Controls, on the same prompts: "repeat-last" drafts the last accepted token B-1 times; "random"
is a drafter of the same shape with its initial (random) weights.

`launcher eval` (services/eval/launcher_eval.py) runs it on a drafter; spec_eval.SpecEval holds the prompts.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from services.decoding.decode_step import Decoded
from services.decoding.lossless import first_difference, lossless_figures
from services.drafter.modeling import domino
from services.drafter.modeling.attention import DenseAttention, padded_mask
from services.drafter.modeling.model import DFlashDrafter, DrafterModelConfig
from services.drafter.modeling.target_head import TargetHead


def inference_attention(q, k, v, mask):
    """Inference attention with training's block mask (DenseAttention.build_mask): a block sees its
    prompt's accepted context and itself, within the window of a sliding_attention layer."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


# --- proposers: (features [start, K*H], last token, start) -> B-1 drafted token ids --------------------


class DrafterProposer:
    """A DFlash drafter with the target's embedding and lm_head."""

    label = "drafter"  # what a progress line calls it

    def __init__(self, drafter: DFlashDrafter, head: TargetHead):
        self.drafter, self.head, self.cfg = drafter, head, drafter.cfg
        self.block_size = drafter.cfg.block_size

    def __call__(self, features: torch.Tensor, last_token: int, start: int) -> torch.Tensor:
        return torch.tensor(self.many([features], [last_token])[0])

    def many(self, contexts: list[torch.Tensor], last_tokens: list[int]) -> list[list[int]]:
        """Every prompt's B-1 drafts in one call (services/eval/batched_decode.py): the contexts packed one after
        another, block i an anchor right after context i, training's mask keeping the prompts apart."""
        B, head = self.block_size, self.head
        device, dtype = head.embed.device, head.embed.dtype
        lengths = torch.tensor([c.shape[0] for c in contexts])  # index tensors made on the host, moved once
        starts = torch.cumsum(lengths, 0) - lengths  # where each context begins in the pack
        block = torch.full((len(contexts), B), self.cfg.mask_token_id, dtype=torch.long)
        block[:, 0] = torch.tensor(last_tokens)
        anchors, starts = (starts + lengths).to(device), starts.to(device)
        masks = {
            kind: DenseAttention().build_mask(anchors, starts, B, int(lengths.sum()), self.cfg.window(kind))
            for kind in set(self.cfg.layer_types)
        }
        out = self.drafter(
            torch.cat(contexts).to(device=device, dtype=dtype),
            head.embed_tokens(block.flatten().to(device)),
            torch.cat([torch.arange(int(n)) for n in lengths]).to(device),
            (lengths[:, None] + torch.arange(B)).flatten().to(device),
            masks,
        )
        return self.drafts(out.view(len(contexts), B, -1)[:, 1:], block[:, 0].to(device)).tolist()

    def padded(self, features, starts: torch.Tensor, last_tokens: torch.Tensor, context_len: int) -> torch.Tensor:
        """Every row's B-1 drafts in one call on padded rows (services/target/verify/slots.py): row b's context
        is features[b, :starts[b]], its block an anchor at starts[b]; context_len = max(starts), known
        to the caller. Returns [rows, B-1] on the drafter's device, with no host sync."""
        B, head = self.block_size, self.head
        device, dtype = head.embed.device, head.embed.dtype
        anchors = starts.to(device)
        block = torch.full((len(last_tokens), B), self.cfg.mask_token_id, dtype=torch.long, device=device)
        block[:, 0] = last_tokens.to(device)
        masks = {
            kind: padded_mask(anchors, B, context_len, self.cfg.window(kind)) for kind in set(self.cfg.layer_types)
        }
        out = self.drafter(
            features[:, :context_len].to(device=device, dtype=dtype),
            head.embed_tokens(block),
            torch.arange(context_len, device=device).expand(len(last_tokens), -1),
            anchors[:, None] + torch.arange(B, device=device),
            masks,
        )
        return self.drafts(out[:, 1:], block[:, 0])

    def drafts(self, z: torch.Tensor, first_tokens: torch.Tensor) -> torch.Tensor:
        """Greedy tokens [N, B-1] of the drafter's outputs z [N, B-1, H]: the lm_head's argmax, or a
        Domino drafter's corrected rollout (domino.py)."""
        if self.cfg.domino:
            return domino.rollout(self.drafter, self.head.embed_tokens, self.head.lm_head, z, first_tokens)
        return (z @ self.head.lm_head.t()).argmax(-1)


class RepeatLast:
    """The trivial baseline: draft the last accepted token B-1 times."""

    label = "repeat-last control"

    def __init__(self, block_size: int):
        self.block_size = block_size

    def __call__(self, features, last_token, start):
        return torch.full((self.block_size - 1,), last_token, dtype=torch.long)

    def many(self, contexts, last_tokens: list[int]) -> list[list[int]]:
        return [[token] * (self.block_size - 1) for token in last_tokens]

    def padded(self, features, starts, last_tokens: torch.Tensor, context_len: int) -> torch.Tensor:
        return last_tokens[:, None].expand(-1, self.block_size - 1).clone()


def eval_drafter(weights: dict, cfg: DrafterModelConfig, device, dtype=torch.float32) -> DFlashDrafter:
    """An uncompiled copy for decoding (context lengths change every step: no recompiles in training's graph)."""
    drafter = DFlashDrafter(cfg, attention=inference_attention)
    if weights is not None:
        drafter.load_state_dict(weights)
    return drafter.to(device=device, dtype=dtype).eval()


# --- the loop --------------------------------------------------------------------------------------


def _take(step, n: int) -> tuple[list[int], list[float], list[float]]:
    return step.greedy[:n].tolist(), step.margin[:n].tolist(), step.tolerance[:n].tolist()


@torch.no_grad()
def speculative_generate(verifier, propose, prompt_ids: list[int], *, max_new_tokens: int, stop_ids=()) -> Decoded:
    """Greedy DFlash decoding of one prompt; `propose` drafts the block's B-1 tokens per step."""
    stop, began = set(stop_ids), time.perf_counter()
    step = verifier.prefill(prompt_ids)
    features = step.features
    out = Decoded.first(step)
    start = len(prompt_ids)  # position of the last accepted token (not yet in the cache)
    while not out.done(max_new_tokens, stop):
        drafts = propose(features, out.tokens[-1], start).tolist()
        step = verifier.verify([out.tokens[-1]] + drafts)
        accepted = out.accept(drafts, *_take(step, len(drafts) + 1), max_new_tokens, stop)
        # block[:accepted+1] are now committed tokens; the target's next token is the next
        # block's first token and enters the cache with it
        verifier.commit(accepted + 1)
        start += accepted + 1
        features = torch.cat([features, step.features[: accepted + 1].to(features.device)])
    out.seconds = time.perf_counter() - began
    return out


@torch.no_grad()
def greedy_reference(verifier, prompt_ids: list[int], max_new_tokens: int, stop_ids=()) -> Decoded:
    """Plain greedy decoding, one token per target forward through the same verifier: prefill,
    then verify([token]) + commit(1) per token. Its margins say where the target nearly ties."""
    stop = set(stop_ids)
    step = verifier.prefill(prompt_ids)
    out = Decoded.first(step)
    while not out.done(max_new_tokens, stop):
        step = verifier.verify([out.tokens[-1]])
        verifier.commit(1)
        out.accept([], *_take(step, 1), max_new_tokens, stop)
    return out


def summarize(results: list[Decoded], references: list[Decoded] | None = None, seconds: float | None = None) -> dict:
    """The figures of a set of decoded prompts (module docstring); seconds: the wall time (default:
    the decodings' own)."""
    seconds = sum(r.seconds for r in results) if seconds is None else seconds
    steps = [s for r in results for s in r.steps]
    per_prompt = [sum(r.steps) / len(r.steps) for r in results if r.steps]
    out = {
        "prompts": len(results),
        "steps": len(steps),
        "tokens": sum(len(r.tokens) for r in results),
        "acceptance_per_step": sum(steps) / len(steps) if steps else 0.0,
        "acceptance_per_prompt": sum(per_prompt) / len(per_prompt) if per_prompt else 0.0,
        "tokens_per_forward": (sum(len(r.tokens) for r in results) / max(1, sum(r.target_forwards for r in results))),
        # the sums behind the ratios, so figures of several evaluations can be pooled exactly
        "committed": sum(steps),
        "target_forwards": sum(r.target_forwards for r in results),
        "stepped_prompts": len(per_prompt),
        "seconds": round(seconds, 3),
    }
    if references is not None:
        out.update(
            lossless_figures(
                [
                    first_difference(r.tokens, ref.tokens, r.margins, r.tolerances, ref.margins, ref.tolerances)
                    for r, ref in zip(results, references)
                ]
            )
        )
    return out


def summarize_sets(
    results: list[Decoded], references: list[Decoded] | None, names: list[str], seconds: float | None = None
) -> dict:
    """summarize() over all the prompts, and under "sets" per prompt set (names[i]: the set of results[i]);
    references None: no lossless figures."""

    def of(name: str, items: list | None) -> list | None:
        return None if items is None else [x for x, n in zip(items, names) if n == name]

    return {
        **summarize(results, references, seconds),
        "sets": {name: summarize(of(name, results), of(name, references)) for name in dict.fromkeys(names)},
    }
