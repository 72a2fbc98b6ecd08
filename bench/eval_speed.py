"""How fast evaluation and regeneration decode, on random-weight targets of several families: the
KV-cache rows of services/target/verify/slots.py against today's packed recomputation (batched_decode.py),
side by side in one run, with the GPU's busy share sampled from NVML while each phase runs.

    python bench/eval_speed.py                                  # every family, 264 prompts x 128 tokens
    python bench/eval_speed.py --shapes smollm2-135m --prompts 64 --old-prompts 64
    python bench/eval_speed.py --regen 3072 --regen-new 256     # regeneration: slots against HF generate
    python bench/eval_speed.py --device cpu --shapes tiny --prompts 4 --old-prompts 4 --new 8 --regen 0
    python bench/eval_speed.py --shapes qwen3.5-0.8b-hybrid --regen 0    # a Gated DeltaNet hybrid (fla on CUDA)
    python bench/eval_speed.py --shapes smollm2-135m --regen 0 --compile-steps   # then with compiled layers
    python bench/eval_speed.py --shapes '' --regen 3072 --regen-batch 1536 --regen-stops 500   # refilled rows

An evaluation of one checkpoint is four passes over the prompts: the greedy references, the drafter,
and the repeat-last and random-drafter controls (references and controls are made once for several
checkpoints, so an extra checkpoint is one drafter pass). The drafter here has random weights: it
is rejected at almost every step, the slowest case (a trained drafter commits several tokens a step).
Prints one JSON line per shape and one for regeneration.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from bench.timing import sync  # noqa: E402
from services.drafter.acceptance.speculative import DrafterProposer, RepeatLast, eval_drafter, summarize  # noqa: E402
from services.drafter.modeling.model import DrafterModelConfig  # noqa: E402
from services.drafter.modeling.target_head import TargetHead  # noqa: E402
from services.eval.batched_decode import PackedVerifier, decode_many  # noqa: E402
from services.run import layers as layer_rule  # noqa: E402
from services.target.model.attention import PACKED_SDPA, register_packed_sdpa  # noqa: E402
from services.target.model.model import Target  # noqa: E402
from services.target.verify.slots import decode_slots  # noqa: E402

# published config.json values of each family (random weights here): SmolLM2-135M (Llama), a
# Gemma-3 270M (sliding window 512 on 5 of every 6 layers, head_dim 256, vocabulary 262 144),
# Llama-3.2-1B; "tiny" is a CPU smoke test
FAMILIES = {
    "smollm2-135m": (
        "llama",
        dict(
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=49152,
            rope_theta=100000.0,
            tie_word_embeddings=True,
        ),
    ),
    "gemma3-270m": (
        "gemma3",
        dict(
            hidden_size=640,
            intermediate_size=2048,
            num_hidden_layers=18,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            vocab_size=262144,
            sliding_window=512,
            layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3,
            query_pre_attn_scalar=256,
            rope_theta=1000000.0,
        ),
    ),
    "llama3.2-1b": (
        "llama",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            rope_theta=500000.0,
            tie_word_embeddings=True,
        ),
    ),
    # the Qwen3.5 / Qwen3.6 hybrids (Gated DeltaNet + full attention; bench/shapes.py's HYBRID shapes,
    # the recurrent state kept per row): a sub-1B one, the 27B, and a tiny one for the CPU
    "qwen3.5-0.8b-hybrid": ("qwen3_5", "0.8b-hybrid"),
    "qwen3.6-27b-hybrid": ("qwen3_5", "27b-hybrid"),
    "tiny-hybrid": ("qwen3_5", "tiny-hybrid"),
    "tiny": (
        "gemma3",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            vocab_size=512,
            sliding_window=16,
            layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 2,
        ),
    ),
}


def build_target(shape: str, device: str, dtype: torch.dtype) -> Target:
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig

    family, fields = FAMILIES[shape]
    if family == "qwen3_5":
        from bench import shapes

        config = shapes.text_config(fields)
    else:
        config = (LlamaConfig if family == "llama" else Gemma3TextConfig)(max_position_embeddings=8192, **fields)
    register_packed_sdpa()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.config._attn_implementation = PACKED_SDPA
    ids = layer_rule.resolve_layer_ids([], config.num_hidden_layers, 5)
    return Target(model.eval().requires_grad_(False), ids)


def random_drafter(target: Target, block_size: int, seed: int, dtype) -> DrafterProposer:
    cfg = target.model.config
    model_cfg = DrafterModelConfig(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        vocab_size=cfg.vocab_size,
        num_target_layers=cfg.num_hidden_layers,
        num_hidden_layers=5,
        target_layer_ids=list(target.info.layer_ids),
        block_size=block_size,
        mask_token_id=cfg.vocab_size - 1,
    )
    embed = target.model.get_input_embeddings().weight.detach()
    head = TargetHead(embed, target.model.get_output_embeddings().weight.detach())
    torch.manual_seed(seed)
    proposer = DrafterProposer(eval_drafter(None, model_cfg, target.device, dtype), head)
    proposer.label = f"random drafter (seed {seed})"
    return proposer


class Busy:
    """The GPU's busy share (NVML utilization, sampled every 50 ms) while the block runs."""

    def __init__(self, device: str):
        self.on, self.samples = device == "cuda", []

    def __enter__(self):
        self.running = True
        if self.on:
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        return self

    def _sample(self):
        while self.running:
            try:
                self.samples.append(torch.cuda.utilization())
            except Exception:  # no NVML: no figure
                self.on = False
                return
            time.sleep(0.05)

    def __exit__(self, *exc):
        self.running = False
        if self.on:
            self.thread.join()

    @property
    def share(self):
        return round(sum(self.samples) / len(self.samples) / 100, 3) if self.on and self.samples else None


def timed(device: str, fn):
    sync()
    with Busy(device) as busy:
        start = time.perf_counter()
        out = fn()
        sync()
        seconds = time.perf_counter() - start
    return out, round(seconds, 2), busy.share


def figures(outs, refs, seconds, busy) -> dict:
    s = summarize(outs, refs, seconds)
    return {
        "seconds": seconds,
        "gpu_busy": busy,
        "tokens_per_s": round(s["tokens"] / seconds, 1),
        "acceptance_per_prompt": round(s["acceptance_per_prompt"], 3),
        "lossless": s.get("lossless"),
        "near_ties": s.get("near_ties"),
    }


def bench_shape(a, shape: str) -> dict:
    dtype = torch.float32 if a.device == "cpu" else getattr(torch, a.dtype)
    target = build_target(shape, a.device, dtype)
    vocab = target.info.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, vocab - 1, (80 + 37 * i % 300,), generator=g).tolist() for i in range(a.prompts)]
    limits = dict(max_new_tokens=a.new)
    drafter, random_control = random_drafter(target, a.block, 1, dtype), random_drafter(target, a.block, 2, dtype)
    decode_slots(target, drafter, prompts[:2], max_new_tokens=4)  # warm-up: kernels, allocator
    result = {"shape": shape, "prompts": a.prompts, "new_tokens": a.new, "block": a.block, "slots": {}}
    # an extra checkpoint (`launcher eval --checkpoint A --checkpoint B`): one drafter pass, after the first's
    drafters = (drafter, random_control, random_drafter(target, a.block, 3, dtype))
    refs, seconds, busy = timed(a.device, lambda: decode_slots(target, None, prompts, **limits))
    references = {"seconds": seconds, "gpu_busy": busy}
    if a.refs_again:  # the same pass once more: what the first one spent meeting new kernels (fla's JIT)
        _, seconds, busy = timed(a.device, lambda: decode_slots(target, None, prompts, **limits))
        result["references_again"] = {"seconds": seconds, "gpu_busy": busy}
    result["slots"] = phases = checkpoint_passes(a, target, prompts, drafters, refs, references)
    if a.old_prompts:  # today's path: packed recomputation, --batch 64, on the first old_prompts prompts
        packed, old = PackedVerifier(target), prompts[: a.old_prompts]
        decode_many(packed, drafter, old[:2], max_new_tokens=4)
        result["packed"] = {"prompts": len(old), "batch": a.old_batch}

        def packed_pass(propose):
            outs = []
            for first in range(0, len(old), a.old_batch):
                outs += decode_many(packed, propose, old[first : first + a.old_batch], **limits)
            return outs

        old_refs, seconds, busy = timed(a.device, lambda: packed_pass(None))
        result["packed"]["references"] = {"seconds": seconds, "gpu_busy": busy}
        outs, seconds, busy = timed(a.device, lambda: packed_pass(drafter))
        result["packed"]["drafter"] = figures(outs, old_refs, seconds, busy)
        same = sum(x.tokens == y.tokens for x, y in zip(old_refs, refs))
        result["packed"]["same_references_as_slots"] = f"{same}/{len(old)}"
        per_prompt = lambda r: (r["references"]["seconds"] + r["drafter"]["seconds"]) / r["prompts"]  # noqa: E731
        result["speedup_refs_plus_drafter_per_prompt"] = round(
            per_prompt(result["packed"])
            / ((phases["references"]["seconds"] + phases["drafter"]["seconds"]) / a.prompts),
            2,
        )
    if a.compile_steps:  # the same passes with every layer compiled for the steps (Target.compile_steps), last
        result["compiled"] = compiled_passes(a, target, prompts, drafters, refs)
    if a.profile_old and a.old_prompts:
        profile_packed(a, target, prompts[: a.old_batch])
    if a.profile_slots:
        profile_slots(a, target, drafter, prompts)
    return result


def checkpoint_passes(a, target, prompts, drafters, refs, references: dict) -> dict:
    """After the references' pass (its figures `references`): the drafter's and both controls'
    passes, the checkpoint's seconds (the four), then one more drafter pass (an extra checkpoint)."""
    drafter, random_control, extra = drafters
    limits = dict(max_new_tokens=a.new)
    out = {"references": references}
    for name, propose in (("drafter", drafter), ("repeat_last", RepeatLast(a.block)), ("random", random_control)):
        outs, seconds, busy = timed(a.device, lambda: decode_slots(target, propose, prompts, **limits))
        out[name] = figures(outs, refs, seconds, busy)
    out["checkpoint_s"] = round(sum(p["seconds"] for p in out.values()), 2)
    outs, seconds, busy = timed(a.device, lambda: decode_slots(target, extra, prompts, **limits))
    out["extra_checkpoint"] = figures(outs, refs, seconds, busy)
    return out


def compiled_passes(a, target, prompts, drafters, eager_refs) -> dict:
    """The checkpoint's passes again, the target's layers compiled for decoding steps: the compile's
    seconds (its warm-up), each pass, the references' agreement with the eager layers'."""
    target.compile_steps()
    _, warmup, _ = timed(a.device, lambda: decode_slots(target, drafters[0], prompts[:2], max_new_tokens=4))
    refs, seconds, busy = timed(a.device, lambda: decode_slots(target, None, prompts, max_new_tokens=a.new))
    same = sum(x.tokens == y.tokens for x, y in zip(refs, eager_refs))
    passes = checkpoint_passes(a, target, prompts, drafters, refs, {"seconds": seconds, "gpu_busy": busy})
    return {"compile_warmup_s": warmup, "same_references_as_eager": f"{same}/{len(refs)}", **passes}


def profile_packed(a, target, prompts):
    """Where one packed verify forward's time goes (host ops and kernels), to stderr."""
    from torch.profiler import ProfilerActivity, profile

    packed = PackedVerifier(target)
    seqs = [p + [1] * 40 for p in prompts]
    packed.forward(seqs, [16] * len(seqs))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
    with profile(activities=activities) as prof:
        packed.forward(seqs, [16] * len(seqs))
        sync()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25), file=sys.stderr, flush=True)


def profile_slots(a, target, drafter, prompts):
    """Where the time of a few slot-decoding steps goes (host ops and kernels), to stderr."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
    with profile(activities=activities) as prof:
        decode_slots(target, drafter, prompts, max_new_tokens=6)
        sync()
    sort = "cuda_time_total" if a.device == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=30), file=sys.stderr, flush=True)


def bench_regen(a) -> dict:
    """Greedy replies of a random SmolLM2-shaped target: rows of a KV cache against HF generate."""
    dtype = torch.float32 if a.device == "cpu" else torch.bfloat16
    target = build_target(a.regen_shape, a.device, dtype)
    g = torch.Generator().manual_seed(3)
    vocab = target.info.vocab_size
    prompts = [torch.randint(1, vocab - 1, (40 + 13 * i % 160,), generator=g).tolist() for i in range(a.regen)]
    limits = dict(max_new_tokens=a.regen_new)
    out = {"shape": a.regen_shape, "prompts": a.regen, "new_tokens": a.regen_new, "batch": a.regen_batch}
    decode_slots(target, None, prompts[:4], max_new_tokens=4)

    def slots():
        outs = []
        for first in range(0, len(prompts), a.regen_batch):
            outs += decode_slots(target, None, prompts[first : first + a.regen_batch], **limits)
        return outs

    replies, seconds, busy = timed(a.device, slots)
    out["slots"] = {"seconds": seconds, "gpu_busy": busy, "replies_per_s": round(len(replies) / seconds, 1)}
    out["slots"]["generated_tok_per_s"] = round(sum(len(r.tokens) for r in replies) / seconds)
    if a.regen_stops:  # replies of varied lengths: batch by batch against rows refilled as replies end
        stops = dict(stop_ids=range(1, a.regen_stops + 1), **limits)

        def batches():
            return [
                o
                for f in range(0, len(prompts), a.regen_batch)
                for o in decode_slots(target, None, prompts[f : f + a.regen_batch], **stops)
            ]

        for name, run in (
            ("batches", batches),
            ("continuous", lambda: decode_slots(target, None, prompts, rows=a.regen_batch, **stops)),
        ):
            outs, seconds, busy = timed(a.device, run)
            out[f"stops_{name}"] = {
                "seconds": seconds,
                "gpu_busy": busy,
                "replies_per_s": round(len(outs) / seconds, 1),
                "mean_reply_tokens": round(sum(len(o.tokens) for o in outs) / len(outs), 1),
            }
            out.setdefault("stops_replies", []).append([o.tokens for o in outs])
        same = sum(x == y for x, y in zip(*out.pop("stops_replies")))
        out["stops_same_replies"] = f"{same}/{len(prompts)}"
    hf = prompts[: a.regen_hf]
    model = target.model
    model.config._attn_implementation = "sdpa"  # HF generate: HF's own attention
    model.generation_config.eos_token_id = None

    def generate():
        width = max(len(p) for p in hf)
        ids = torch.zeros(len(hf), width, dtype=torch.long)
        mask = torch.zeros(len(hf), width, dtype=torch.long)
        for r, p in enumerate(hf):
            ids[r, width - len(p) :], mask[r, width - len(p) :] = torch.tensor(p), 1
        with torch.no_grad():
            gen = model.generate(
                ids.to(a.device), attention_mask=mask.to(a.device), do_sample=False, pad_token_id=0, **limits
            )
        return [row[width:].tolist() for row in gen]

    want, seconds, busy = timed(a.device, generate)
    out["hf_generate"] = {
        "prompts": len(hf),
        "seconds": seconds,
        "gpu_busy": busy,
        "replies_per_s": round(len(hf) / seconds, 1),
    }
    out["speedup"] = round(out["slots"]["replies_per_s"] / out["hf_generate"]["replies_per_s"], 2)
    # bf16: a tie between two tokens may break either way in two differently shaped forwards
    out["same_replies_as_hf_generate"] = f"{sum(r.tokens == w for r, w in zip(replies, want))}/{len(hf)}"
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="smollm2-135m,gemma3-270m,llama3.2-1b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=264)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--old-prompts", type=int, default=64, help="prompts today's packed path decodes (0: none)")
    ap.add_argument("--old-batch", type=int, default=64)
    ap.add_argument("--profile-old", action="store_true", help="profile one packed forward (stderr)")
    ap.add_argument("--profile-slots", action="store_true", help="profile a few slot steps (stderr)")
    ap.add_argument("--dtype", default="bfloat16", help="the target's dtype on CUDA (float32: no rounding ties)")
    ap.add_argument("--regen", type=int, default=3072, help="regeneration prompts (0: no regeneration bench)")
    ap.add_argument("--regen-new", type=int, default=256)
    ap.add_argument("--regen-batch", type=int, default=1024)
    ap.add_argument("--regen-hf", type=int, default=512, help="prompts HF generate decodes (one batch)")
    ap.add_argument("--regen-shape", default="smollm2-135m")
    ap.add_argument("--refs-again", action="store_true", help="time the references' pass a second time (warm)")
    ap.add_argument("--compile-steps", action="store_true", help="the passes again with compiled layers (last)")
    ap.add_argument(
        "--regen-stops", type=int, default=0, help="regeneration with N stop tokens too: batches vs continuous"
    )
    a = ap.parse_args(argv)
    device_name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    for shape in [s for s in a.shapes.split(",") if s]:
        print(json.dumps({"device": device_name, **bench_shape(a, shape)}), flush=True)
        if a.device == "cuda":
            torch.cuda.empty_cache()  # the last shape's target is gone: its memory back for the next
    if a.regen:
        print(json.dumps({"device": device_name, "regeneration": bench_regen(a)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
