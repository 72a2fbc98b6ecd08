"""Real speculative decoding with a DFlash drafter and its target, greedy: the acceptance users see.

The teacher-forced τ of training and evaluation (loss.acceptance_metrics) scores the drafter's
blocks against the *labels* at sampled anchors. This module runs the drafter the way an engine
does (DFlash, arXiv 2602.06036), and counts what the target really accepts:

    prefill   target(prompt) -> hidden features of the captured layers, first token = argmax
    step      block = [last accepted token, mask x (B-1)]  at positions start .. start+B-1
              drafter(features of every accepted token, block) -> B-1 drafted tokens (one pass;
              a sliding_attention layer sees only its window, as in training)
              target(block) in one forward (KV cache of the accepted context) -> greedy tokens
              accept the longest prefix of the drafts equal to the target's greedy tokens, plus
              the target's own next token; keep the target's features of the accepted tokens
              and crop its cache to them

Greedy verification makes the output the target's own greedy output whatever the drafter does
(lossless); `evaluate_prompts` checks that against plain greedy decoding on every prompt.

Figures (summarize):
  acceptance_per_step     tokens committed per verify step (accepted drafts + 1), pooled over all steps
  acceptance_per_prompt   the same per prompt, then averaged over prompts (z-lab's benchmark figure)
  tokens_per_forward      new tokens / target forwards (the prefill included); plain greedy is 1.0
  lossless                prompts whose output equals plain greedy decoding, of all prompts

Controls, on the same prompts: "repeat-last" drafts the last accepted token B-1 times; "random"
is a drafter of the same shape with its initial (random) weights.

    python -m services.drafter.speculative --run-dir runs/latest [--checkpoint DIR] [--prompts 32]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from services.drafter.attention import DenseAttention
from services.drafter.model import DFlashDrafter, DrafterModelConfig
from services.drafter.target_head import TargetHead


def inference_attention(q, k, v, mask):
    """Inference attention: a block's queries see the whole accepted context and their own block
    (mask None, full_attention layers), or what the layer's window mask keeps (sliding_attention)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def block_masks(cfg: DrafterModelConfig, start: int, device) -> dict:
    """{layer type: mask} for one block at position `start` over the `start` accepted tokens before
    it: None for full layers; for sliding ones training's own window mask (attention.visibility)
    with the block's anchor at `start` and its document from position 0."""
    anchors, doc_starts = torch.tensor([start], device=device), torch.zeros(1, dtype=torch.long, device=device)
    return {kind: None if cfg.window(kind) is None else
            DenseAttention().build_mask(anchors, doc_starts, cfg.block_size, start, cfg.window(kind))
            for kind in set(cfg.layer_types)}


# --- proposers: (features [start, K*H], last token, start) -> B-1 drafted token ids --------------------

class DrafterProposer:
    """A DFlash drafter with the target's embedding and lm_head."""

    def __init__(self, drafter: DFlashDrafter, head: TargetHead):
        self.drafter, self.head, self.cfg = drafter, head, drafter.cfg
        self.block_size = drafter.cfg.block_size

    def __call__(self, features: torch.Tensor, last_token: int, start: int) -> torch.Tensor:
        B, device = self.block_size, features.device
        block = torch.full((B,), self.cfg.mask_token_id, dtype=torch.long, device=device)
        block[0] = last_token
        dtype = self.head.embed.dtype
        out = self.drafter(features.to(dtype), self.head.embed_tokens(block),
                           torch.arange(start, device=device), torch.arange(start, start + B, device=device),
                           block_masks(self.cfg, start, device))
        return (out[1:] @ self.head.lm_head.t()).argmax(-1)


class RepeatLast:
    """The trivial baseline: draft the last accepted token B-1 times."""

    def __init__(self, block_size: int):
        self.block_size = block_size

    def __call__(self, features, last_token, start):
        return torch.full((self.block_size - 1,), last_token, dtype=torch.long, device=features.device)


def eval_drafter(weights: dict, cfg: DrafterModelConfig, device, dtype=torch.float32) -> DFlashDrafter:
    """An uncompiled copy for decoding (context lengths change every step: no recompiles in training's graph)."""
    drafter = DFlashDrafter(cfg, attention=inference_attention)
    if weights is not None:
        drafter.load_state_dict(weights)
    return drafter.to(device=device, dtype=dtype).eval()


# --- the loop --------------------------------------------------------------------------------------

@dataclass
class Decoded:
    tokens: list[int]          # the new tokens (prompt excluded)
    steps: list[int]           # tokens committed by each verify forward: accepted drafts + 1
    target_forwards: int       # the prefill and one per step


def target_forward(target, ids: torch.Tensor, start: int, cache, layer_ids: list[int]):
    """ids [n] at positions start..start+n-1 on top of `cache` -> (logits [n, V], features [n, K*H]).
    Layer i is HF hidden_states[i + 1], as captured for training (services/target/model.py)."""
    positions = torch.arange(start, start + ids.shape[0], device=ids.device)
    out = target(input_ids=ids[None], position_ids=positions[None], use_cache=True, output_hidden_states=True,
                 **{_cache_kwarg(target): cache})
    features = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
    return out.logits[0], features


def _cache_kwarg(target) -> str:
    """transformers 5.x renamed past_key_values to cache."""
    import inspect
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


def _crop(cache, length: int) -> None:
    """Keep the first `length` positions (a negative argument means "remove" in every transformers version)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def _new_cache(target):
    from transformers import DynamicCache
    return DynamicCache(config=target.config)


@torch.no_grad()
def speculative_generate(target, propose, prompt_ids: list[int], *, block_size: int, layer_ids: list[int],
                         max_new_tokens: int, stop_ids=()) -> Decoded:
    """Greedy DFlash decoding of one prompt; `propose` drafts block_size-1 tokens per step."""
    device = next(target.parameters()).device
    stop = set(stop_ids)
    cache = _new_cache(target)
    prompt = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    logits, features = target_forward(target, prompt, 0, cache, layer_ids)
    tokens = [int(logits[-1].argmax())]
    steps, forwards = [], 1
    start = len(prompt_ids)                        # position of the last accepted token (not yet in the cache)
    while len(tokens) < max_new_tokens and tokens[-1] not in stop:
        drafts = propose(features, tokens[-1], start)
        block = torch.cat([torch.tensor([tokens[-1]], device=device), drafts.to(device)])
        logits, block_features = target_forward(target, block, start, cache, layer_ids)
        forwards += 1
        greedy = logits.argmax(-1)                 # greedy[j]: the target's token after block[:j+1]
        accepted = int(torch.cumprod((drafts == greedy[:-1]).long(), 0).sum())
        new = drafts[:accepted].tolist() + [int(greedy[accepted])]
        for n, token in enumerate(new):            # a stop token or the length limit ends the output
            if token in stop or len(tokens) + n + 1 >= max_new_tokens:
                new = new[:n + 1]
                break
        tokens += new
        steps.append(len(new))
        # the cache and features keep block[:accepted+1], which are now committed tokens; the
        # target's next token is the next block's first token and enters the cache with it
        start += accepted + 1
        _crop(cache, start)
        features = torch.cat([features, block_features[:accepted + 1]])
    return Decoded(tokens, steps, forwards)


@torch.no_grad()
def greedy_generate(target, prompt_ids: list[int], max_new_tokens: int, stop_ids=()) -> list[int]:
    """The reference: HF generate, plain greedy, one token per target forward."""
    device = next(target.parameters()).device
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    stops = list(stop_ids)
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=stops or None, pad_token_id=stops[0] if stops else 0,
                          temperature=None, top_p=None, top_k=None)
    new = out[0, len(prompt_ids):].tolist()
    for n, token in enumerate(new):
        if token in stops:
            return new[:n + 1]
    return new


def summarize(results: list[Decoded], references: list[list[int]] | None = None, seconds: float = 0.0) -> dict:
    """The figures of a set of decoded prompts (module docstring)."""
    steps = [s for r in results for s in r.steps]
    per_prompt = [sum(r.steps) / len(r.steps) for r in results if r.steps]
    out = {"prompts": len(results), "steps": len(steps),
           "tokens": sum(len(r.tokens) for r in results),
           "acceptance_per_step": sum(steps) / len(steps) if steps else 0.0,
           "acceptance_per_prompt": sum(per_prompt) / len(per_prompt) if per_prompt else 0.0,
           "tokens_per_forward": (sum(len(r.tokens) for r in results)
                                  / max(1, sum(r.target_forwards for r in results))),
           "seconds": round(seconds, 3)}
    if references is not None:
        out["lossless"] = sum(r.tokens == ref for r, ref in zip(results, references))
    return out


def evaluate_prompts(target, propose, prompts: list[list[int]], references: list[list[int]], *, block_size: int,
                     layer_ids: list[int], max_new_tokens: int, stop_ids=(), budget_s: float = 0.0,
                     tick=None) -> dict:
    """Decode prompts in order until done or past budget_s (0 = no limit); figures over those decoded.
    tick: called after every prompt (a worker's health heartbeat)."""
    start, results = time.perf_counter(), []
    for prompt in prompts:
        if budget_s > 0 and results and time.perf_counter() - start > budget_s:
            break
        if tick:
            tick()
        results.append(speculative_generate(target, propose, prompt, block_size=block_size, layer_ids=layer_ids,
                                            max_new_tokens=max_new_tokens, stop_ids=stop_ids))
    return summarize(results, references[:len(results)], time.perf_counter() - start)


# --- held-out prompts -----------------------------------------------------------------------------

def heldout_prompts(cfg, tokenizer, limit: int) -> list[list[int]]:
    """Token ids of the held-out conversations (packing.heldout_chats: up to their last assistant
    turn), with the chat template's generation prompt."""
    from services.target.packing import heldout_chats
    return [list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                               return_dict=True)["input_ids"])
            for messages in heldout_chats(cfg, limit)]


def stop_token_ids(tokenizer, target) -> list[int]:
    ids = {tokenizer.eos_token_id}
    eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos])
    return sorted(i for i in ids if i is not None)


# --- one evaluation of a drafter, with its target loaded ------------------------------------------

class SpecEval:
    """The target, its held-out prompts and their plain greedy outputs, made once; then any
    drafter (weights) can be evaluated on them."""

    def __init__(self, cfg, device, *, prompts: int, max_new_tokens: int, target=None, tokenizer=None):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        self.device = torch.device(device)
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(cfg.target.model_path)
        if target is None:
            dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
            target = AutoModelForCausalLM.from_pretrained(cfg.target.model_path, dtype=dtype).to(self.device)
        self.target = target.eval()
        self.dtype = next(self.target.parameters()).dtype
        self.max_new_tokens = max_new_tokens
        self.stop_ids = stop_token_ids(self.tokenizer, self.target)
        self.prompts = heldout_prompts(cfg, self.tokenizer, prompts)
        self._references: list[list[int]] = []

    def references(self, n: int) -> list[list[int]]:
        """Plain greedy outputs of the first n prompts (computed once, reused at every evaluation)."""
        while len(self._references) < min(n, len(self.prompts)):
            prompt = self.prompts[len(self._references)]
            self._references.append(greedy_generate(self.target, prompt, self.max_new_tokens, self.stop_ids))
        return self._references[:n]

    def head(self, model_cfg: DrafterModelConfig) -> TargetHead:
        embed = self.target.get_input_embeddings().weight
        lm_head = self.target.get_output_embeddings().weight
        if tuple(embed.shape) != (model_cfg.vocab_size, model_cfg.hidden_size):
            raise ValueError(f"the target's embedding is {tuple(embed.shape)}, the drafter expects "
                             f"[{model_cfg.vocab_size}, {model_cfg.hidden_size}]")
        return TargetHead(embed.detach(), lm_head.detach())

    def proposer(self, weights: dict | None, model_cfg: DrafterModelConfig) -> DrafterProposer:
        """The drafter (weights; None: its random initial weights) as evaluated here, with the target's head."""
        return DrafterProposer(eval_drafter(weights, model_cfg, self.device, self.dtype), self.head(model_cfg))

    def run(self, propose, block_size: int, layer_ids: list[int], budget_s: float = 0.0, tick=None) -> dict:
        # references inside the budget too: the first evaluation computes them
        start, refs = time.perf_counter(), []
        for i in range(len(self.prompts)):
            if budget_s > 0 and refs and time.perf_counter() - start > budget_s / 2:
                break
            refs = self.references(i + 1)
            if tick:
                tick()
        left = 0.0 if budget_s <= 0 else max(1e-3, budget_s - (time.perf_counter() - start))
        return evaluate_prompts(self.target, propose, self.prompts[:len(refs)], refs, block_size=block_size,
                                layer_ids=sorted(layer_ids), max_new_tokens=self.max_new_tokens,
                                stop_ids=self.stop_ids, budget_s=left, tick=tick)

    def evaluate(self, weights: dict, model_cfg: DrafterModelConfig, *, controls: bool = False,
                 budget_s: float = 0.0, seed: int = 0, tick=None) -> dict:
        """The drafter's figures; with controls also those of repeat-last and a random drafter."""
        propose = self.proposer(weights, model_cfg)
        result = self.run(propose, model_cfg.block_size, model_cfg.target_layer_ids, budget_s, tick)
        if controls:
            n = result["prompts"]
            saved, self.prompts = self.prompts, self.prompts[:n]          # the same prompts as the drafter
            try:
                result["repeat_last"] = self.run(RepeatLast(model_cfg.block_size), model_cfg.block_size,
                                                 model_cfg.target_layer_ids, tick=tick)
                torch.manual_seed(seed)
                random = self.proposer(None, model_cfg)
                result["random"] = self.run(random, model_cfg.block_size, model_cfg.target_layer_ids, tick=tick)
            finally:
                self.prompts = saved
        return result


def describe(result: dict) -> str:
    """One line per drafter: the figures a user reads."""
    def line(name, r):
        return (f"{name:<11} acceptance {r['acceptance_per_prompt']:.2f} per prompt, {r['acceptance_per_step']:.2f} "
                f"per step; {r['tokens_per_forward']:.2f} tokens per target forward; "
                f"lossless {r.get('lossless', '?')}/{r['prompts']} prompts")
    lines = [line("drafter", result)]
    for name in ("repeat_last", "random"):
        if name in result:
            lines.append(line(name.replace("_", "-"), result[name]))
    return "\n".join(lines)


# --- loading a drafter ----------------------------------------------------------------------------

def load_weights(path: str | Path) -> tuple[dict, DrafterModelConfig, str]:
    """(weights, model config, what) from a checkpoint dir, a run dir (its checkpoints/latest) or an export."""
    from safetensors.torch import load_file

    path = Path(path)
    conf = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    if "DFlashDraftModel" in conf.get("architectures", []):
        return load_file(str(path / "model.safetensors")), model_config_from_export(conf), f"export {path.resolve()}"
    from services.drafter.checkpoint import verify
    from services.drafter.export import resolve_checkpoint
    ckpt = resolve_checkpoint(path)
    meta = verify(ckpt)
    return load_file(str(ckpt / "model.safetensors")), DrafterModelConfig(**meta["model"]), \
        f"checkpoint {ckpt} (step {meta['step']})"


def model_config_from_export(conf: dict) -> DrafterModelConfig:
    dflash = conf.get("dflash_config") or {}
    return DrafterModelConfig(
        hidden_size=conf["hidden_size"], intermediate_size=conf["intermediate_size"],
        num_attention_heads=conf["num_attention_heads"], num_key_value_heads=conf["num_key_value_heads"],
        head_dim=conf["head_dim"], vocab_size=conf["vocab_size"], num_target_layers=conf["num_target_layers"],
        num_hidden_layers=conf["num_hidden_layers"],
        target_layer_ids=list(dflash.get("target_layer_ids", conf.get("target_layer_ids", []))),
        block_size=conf["block_size"], mask_token_id=dflash.get("mask_token_id", conf.get("mask_token_id", -1)),
        rms_norm_eps=conf["rms_norm_eps"], rope_theta=conf["rope_theta"], attention_bias=conf["attention_bias"],
        max_position_embeddings=conf["max_position_embeddings"], tie_word_embeddings=conf["tie_word_embeddings"],
        layer_types=list(conf.get("layer_types") or []), sliding_window=conf.get("sliding_window"))


def main(argv=None) -> int:
    from services.config import load_config
    p = argparse.ArgumentParser(prog="launcher eval", description="Real (greedy) speculative decoding of a drafter "
                                "with its target on held-out prompts of the run's data.")
    p.add_argument("--run-dir", default="runs/latest", help="the run: its config.json names the target and the data")
    p.add_argument("--checkpoint", help="checkpoint dir, export dir, or run dir (default: <run-dir>/checkpoints/latest)")
    p.add_argument("--prompts", type=int, default=32, help="held-out prompts to decode")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-controls", action="store_true", help="skip the repeat-last and random-drafter controls")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (tiny demo models decode fastest on one)")
    args = p.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    run_dir = Path(args.run_dir)
    try:
        cfg = load_config(run_dir / "config.json")
        weights, model_cfg, what = load_weights(args.checkpoint or run_dir)
    except Exception as exc:                    # a bad run dir or checkpoint: one line for the user
        print(f"eval: error: {exc}", file=sys.stderr)
        return 2
    spec = SpecEval(cfg, args.device, prompts=args.prompts, max_new_tokens=args.max_new_tokens)
    if not spec.prompts:
        print(f"eval: error: no chat prompts in the held-out data of {run_dir}", file=sys.stderr)
        return 2
    result = spec.evaluate(weights, model_cfg, controls=not args.no_controls, seed=cfg.run.seed)
    record = {"event": "spec_eval", "drafter": what, "block_size": model_cfg.block_size, **result}
    with open(run_dir / "spec_eval.jsonl", "a") as f:           # `launcher report` shows the latest
        f.write(json.dumps({**record, "time": round(time.time(), 3)}) + "\n")
    if args.json:
        print(json.dumps(record))
    else:
        print(f"{what}: {result['prompts']} held-out prompts, block {model_cfg.block_size}, "
              f"greedy, up to {args.max_new_tokens} new tokens")
        print(describe(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
