"""How much faster evaluation decodes many prompts at once: plain greedy decoding (the reference
every evaluation makes, and the cost of a verify step) of the same prompts, one prompt at a time on
a KV cache (speculative.py's loop through a LocalVerifier) against --batch prompts at once, one packed
forward per step with no cache (services/eval/batched_decode.py), on a random-weight target of a real shape.

    python bench/batched_eval.py                         # 135m (SmolLM2-135M's widths), cuda, bf16
    python bench/batched_eval.py --device cpu --shape tiny --prompts 8 --batch 8 --new 16

Prints one JSON object: seconds, prompts per second and target forwards per second of each way,
the speed-up (a ratio measured side by side in one run), and whether both made the same tokens
(random weights: ties are rare in fp32, not in bf16: `same_tokens` is a count, not a check).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from bench.shapes import QWEN3, text_config  # noqa: E402
from bench.timing import sync  # noqa: E402
from services.drafter.acceptance.speculative import greedy_reference  # noqa: E402
from services.eval.batched_decode import PackedVerifier, decode_many  # noqa: E402
from services.eval.verifier import LocalVerifier  # noqa: E402
from services.run import layers as layer_rule  # noqa: E402
from services.target.model.attention import PACKED_SDPA, register_packed_sdpa  # noqa: E402
from services.target.model.model import Target  # noqa: E402


def build_target(shape: str, device: str, dtype: torch.dtype) -> Target:
    from transformers import AutoModelForCausalLM

    cfg = text_config(shape)
    register_packed_sdpa()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    model.config._attn_implementation = PACKED_SDPA
    return Target(model.eval().requires_grad_(False), layer_rule.resolve_layer_ids([], cfg.num_hidden_layers, 5))


def run_timed(fn):
    """(fn(), its wall seconds), the GPU synchronized around it."""
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - start


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="135m", choices=sorted(QWEN3))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--new", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--cached-prompts", type=int, default=8, help="prompts the one-at-a-time loop decodes (it is slow)")
    a = ap.parse_args(argv)
    dtype = torch.float32 if a.device == "cpu" else torch.bfloat16
    target = build_target(a.shape, a.device, dtype)
    vocab = target.info.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, vocab, (a.prompt_len + 7 * i % 50,), generator=g).tolist() for i in range(a.prompts)]
    cached, packed = LocalVerifier(target), PackedVerifier(target)
    decode_many(packed, None, prompts[:2], max_new_tokens=4)  # warm-up: kernels, allocator
    greedy_reference(cached, prompts[0], 4)
    one, one_s = run_timed(lambda: [greedy_reference(cached, p, a.new) for p in prompts[: a.cached_prompts]])
    many, many_s = [], 0.0
    for first in range(0, a.prompts, a.batch):
        part, seconds = run_timed(
            lambda: decode_many(packed, None, prompts[first : first + a.batch], max_new_tokens=a.new)
        )
        many, many_s = many + part, many_s + seconds
    forwards = lambda outs: sum(o.target_forwards for o in outs)  # noqa: E731
    result = {
        "shape": a.shape,
        "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "prompt_len": a.prompt_len,
        "new_tokens": a.new,
        "one_at_a_time": {
            "prompts": len(one),
            "seconds": round(one_s, 3),
            "prompts_per_s": round(len(one) / one_s, 2),
            "forwards_per_s": round(forwards(one) / one_s, 1),
        },
        "batched": {
            "prompts": len(many),
            "batch": a.batch,
            "seconds": round(many_s, 3),
            "prompts_per_s": round(len(many) / many_s, 2),
            "prompt_forwards_per_s": round(forwards(many) / many_s, 1),
        },
        "same_tokens": sum(x.tokens == y.tokens for x, y in zip(one, many)),
        "compared": len(one),
    }
    result["speedup"] = round(result["batched"]["prompts_per_s"] / result["one_at_a_time"]["prompts_per_s"], 2)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
