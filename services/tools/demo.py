"""A self-contained demo: a tiny target trained on the spot on its data, a tokenizer trained on
the spot, and a synthetic chat dataset whose assistant replies follow learnable patterns.

    from services.tools.demo import make_demo
    demo = make_demo(cache_dir())                        # dict(model_path, data_path, overrides)
    demo = make_demo(cache_dir("hybrid"), variant="hybrid")

Two targets (`variant`): "dense", a Qwen3 (Qwen3ForCausalLM), and "hybrid", the Qwen3.5 / Qwen3.6
family: Gated DeltaNet (linear_attention) layers and a full-attention layer, saved as the composite
multimodal checkpoint Qwen3_5ForConditionalGeneration (text_config + a minimal vision_config) as
Qwen3.6-27B is. Same data, same tokenizer file, same training recipe.

No network, no GPU. Deterministic given the seed and idempotent: an existing, complete demo
directory (marked by demo.json with the same seed and version) is reused as it is.

The assistant replies are patterns a small drafter picks up fast (counting, repeating the user's
words, spelling, a fixed greeting), so its simulated acceptance length rises within minutes on CPU.
The target is trained on them for TARGET_STEPS steps, so its greedy output follows the data
(greetings and counting well, echoing and spelling partly) instead of one token repeated, and the
demo's real acceptance (speculative decoding, printed at the end of `launcher up --demo`) tests
the drafter against a target that writes varied text.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import shutil
from pathlib import Path

from services.process.jobs import DEMO_VARIANTS

DEMO_VERSION = 2
TARGET_STEPS = 300  # teaching the target its data: about a minute on 2 cores, one thread
VARIANTS = DEMO_VARIANTS  # the launcher's --demo choices (services/process/jobs.py)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]

# ChatML; the {% generation %} markers let transformers return the assistant-token mask.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{- message['content'] + '<|im_end|>' -}}{% endgeneration %}{{- '\\n' -}}"
    "{%- else -%}"
    "{{- message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

WORDS = (
    "apple banana cherry river mountain cloud stone green blue red yellow happy quick slow "
    "bright dark tiger horse rabbit window garden music paper silver golden ocean forest "
    "winter summer light shadow dream story number letter train rocket planet coffee bread "
    "candle mirror bridge castle dragon violin pencil basket lemon orange purple thunder"
).split()
GREETING_PROMPTS = ["hi", "hello", "hey there", "good morning", "hello friend", "hi assistant"]
GREETING_REPLY = "hello ! i am a tiny demo model . how can i help you today ?"
SYSTEM_PROMPT = "you are a helpful assistant ."

# Model shape: small enough for a CPU demo, a real Qwen3 architecture.
MODEL_SHAPE = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
# The hybrid: the same widths; Gated DeltaNet, Gated DeltaNet, full attention, Gated DeltaNet (every 3rd
# layer full attention; the drafter's default captured layer, 2, is the full-attention one, so a
# capture runs both kinds). Untied lm_head and key/value head ratio 2, as in the real family.
HYBRID_SHAPE = dict(
    MODEL_SHAPE,
    tie_word_embeddings=False,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
)
VISION_SHAPE = dict(
    depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, num_position_embeddings=16
)  # present as in the real checkpoint; never run


def _exchange(rng: random.Random) -> tuple[str, str]:
    """One user prompt and the assistant reply that follows from it."""
    kind = rng.choice(["count", "count", "repeat", "repeat", "spell", "greet"])
    if kind == "count":
        a = rng.randint(0, 40)
        b = a + rng.randint(4, 14)
        return f"count from {a} to {b}", " ".join(str(i) for i in range(a, b + 1))
    if kind == "repeat":
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))
        return f"repeat after me : {words}", words
    if kind == "spell":
        word = rng.choice(WORDS)
        return f"spell {word}", " ".join(word) + " . done ."
    return rng.choice(GREETING_PROMPTS), GREETING_REPLY


def conversations(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < 0.3 else []
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            user, reply = _exchange(rng)
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        out.append({"messages": messages})
    return out


def build_tokenizer(texts: list[str], vocab_size: int = 1024):
    """A byte-level BPE trained on `texts`, wrapped as a transformers fast tokenizer with ChatML."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", mask_token="<|MASK|>"
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def build_model(tokenizer, seed: int, variant: str = "dense"):
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3Config, Qwen3ForCausalLM

    vocab = -(-len(tokenizer) // 64) * 64  # round the embedding up, as real checkpoints do
    ids = dict(
        vocab_size=vocab, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    torch.manual_seed(seed)
    if variant == "dense":
        return Qwen3ForCausalLM(Qwen3Config(**ids, **MODEL_SHAPE)).eval()
    vision = dict(VISION_SHAPE, out_hidden_size=HYBRID_SHAPE["hidden_size"])
    config = Qwen3_5Config(text_config=dict(**ids, **HYBRID_SHAPE), vision_config=vision, tie_word_embeddings=False)
    return Qwen3_5ForConditionalGeneration(config).eval()


@contextlib.contextmanager
def torch_linear_attention():
    """transformers' pure-torch Gated DeltaNet code while the hybrid target trains on the CPU:
    where flash-linear-attention imports, transformers would send these CPU tensors to Triton."""
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

    names = (
        "causal_conv1d_fn",
        "causal_conv1d_update",
        "torch_chunk_gated_delta_rule",
        "torch_recurrent_gated_delta_rule",
    )
    saved = {name: getattr(qwen3_5, name) for name in names}
    try:
        for name, fn in saved.items():
            setattr(qwen3_5, name, inspect.unwrap(fn))
        yield
    finally:
        for name, fn in saved.items():
            setattr(qwen3_5, name, fn)


def train_target(
    model, tokenizer, convs: list[dict], steps: int, seed: int, batch_size: int = 16, lr: float = 3e-3, progress=None
):
    """Teach the tiny target its data: next-token loss on the assistant tokens, AdamW, warmup + cosine.
    A fixed number of steps on a seeded sample, so the weights are a function of the seed. A target
    that models its data is what makes the demo's acceptance mean something: a random target's
    greedy output is one token repeated, which a drafter that repeats the last token predicts.
    progress(text): called every 10 steps with the step and an ETA (minutes on a busy CPU)."""
    import math
    import time

    import torch

    from services.target.batches.tokenizing import chat_tokens

    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is as fast, and 10x faster on a busy machine
    docs = [chat_tokens(tokenizer, c["messages"]) for c in convs]
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 10)
    model.train()
    start = time.monotonic()
    for step in range(steps):
        if progress and step and step % 10 == 0:
            eta = (time.monotonic() - start) / step * (steps - step)
            progress(f"training the demo target on its data: step {step}/{steps}, about {eta:.0f} s left")
        for group in opt.param_groups:
            group["lr"] = lr * min((step + 1) / warmup, 0.5 * (1 + math.cos(math.pi * step / steps)))
        batch = rng.sample(docs, min(batch_size, len(docs)))
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (tokens, mask) in enumerate(batch):
            t = torch.tensor(tokens)
            ids[i, : len(t)], attention[i, : len(t)] = t, 1
            labels[i, : len(t)] = torch.where(torch.tensor(mask, dtype=torch.bool), t, -100)
        loss = model(input_ids=ids, attention_mask=attention, labels=labels, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.set_num_threads(threads)
    return model.eval(), float(loss.detach())


def demo_overrides(model_path: str, data_path: str, device: str = "cpu") -> list[str]:
    """Dotted config overrides for a fast CPU demo (1 target + 2 drafters on 2 cores); on CUDA the
    target runs in bfloat16, as real targets do."""
    return [
        f'target.model_path="{model_path}"',
        f'data.path="{data_path}"',
        # bf16 matmuls are slow on CPU; the hidden states still travel as bf16
        "target.dtype=bfloat16" if device == "cuda" else "target.dtype=float32",
        "data.pack_len=512",
        "data.eval_fraction=0.02",
        "drafter.num_layers=1",
        "drafter.block_size=8",
        "drafter.num_anchors=32",
        "optimizer.lr=3e-3",
        "optimizer.warmup_ratio=0.02",
        "kernels.compile=false",
        "run.epochs=2",
        "checkpoint.every=100",
        "log.every=10",
        "eval.every=100",  # held-out τ and real acceptance, plotted side by side by `launcher report`
        "eval.num_prompts=32",  # real acceptance on held-out prompts; at the end with its controls
        "eval.max_new_tokens=64",
    ]


def cache_dir(variant: str = "dense") -> Path:
    """Where `launcher up --demo [hybrid]` keeps the demo: built once per machine, demo version and
    variant (teaching the target takes a minute or two on 2 cores), then reused by every demo run."""
    from services.run.files import cache_root

    return cache_root() / (f"demo-v{DEMO_VERSION}" + ("" if variant == "dense" else f"-{variant}"))


def make_demo(
    out_dir: str | os.PathLike,
    seed: int = 0,
    num_conversations: int = 4000,
    target_steps: int = TARGET_STEPS,
    variant: str = "dense",
    device: str = "cpu",
    progress=None,
) -> dict:
    """Create (or reuse) the demo under out_dir; return model_path, data_path, config overrides and
    whether it was reused. target_steps: training steps of the target on its data (0: random weights,
    for tests that only need a loadable model). variant: "dense" or "hybrid" (see the top of this
    file). progress(text): what the build is doing, while it builds."""
    if variant not in VARIANTS:
        raise ValueError(f"demo variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    out = Path(out_dir).resolve()
    model_path, data_path = out / "model", out / "chat.jsonl"
    marker = out / "demo.json"
    want = {
        "version": DEMO_VERSION,
        "seed": seed,
        "num_conversations": num_conversations,
        "target_steps": target_steps,
        "variant": variant,
    }
    out.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda text: None)
    with open(out / ".lock", "w") as lock:  # demo runs started together build it once
        fcntl.flock(lock, fcntl.LOCK_EX)
        reused = marker.is_file() and json.loads(marker.read_text()) == want
        if not reused:
            marker.unlink(missing_ok=True)  # a build cut short leaves no marker: rebuilt next time
            say(f"building the demo target and dataset in {out} (once; later demo runs reuse it)")
            _build(out, seed, num_conversations, target_steps, variant, say)
            marker.write_text(json.dumps(want))
    return {
        "model_path": str(model_path),
        "data_path": str(data_path),
        "overrides": demo_overrides(str(model_path), str(data_path), device),
        "reused": reused,
    }


def _build(out: Path, seed: int, num_conversations: int, target_steps: int, variant: str, say) -> None:
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    convs = conversations(num_conversations, seed)
    texts = [m["content"] for c in convs for m in c["messages"]]
    tokenizer = build_tokenizer(texts)
    model = build_model(tokenizer, seed, variant)
    tmp = out / f".model-{os.getpid()}"  # written aside, then renamed: never a half-made model dir
    shutil.rmtree(tmp, ignore_errors=True)
    model.config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    # the target learns on the tokens the service will feed it: AutoTokenizer picks its class by the
    # model type (Qwen3.5's splits digits one by one, unlike the trained tokenizer object)
    tokenizer = AutoTokenizer.from_pretrained(tmp)
    if target_steps > 0:
        with torch_linear_attention() if variant == "hybrid" else contextlib.nullcontext():
            model, _ = train_target(model, tokenizer, convs, target_steps, seed, progress=say)
    model.save_pretrained(tmp)
    shutil.rmtree(out / "model", ignore_errors=True)
    os.replace(tmp, out / "model")
    data_tmp = out / f".chat-{os.getpid()}.jsonl"
    with open(data_tmp, "w") as f:
        for c in convs:
            f.write(json.dumps(c) + "\n")
    os.replace(data_tmp, out / "chat.jsonl")


def main(argv=None) -> None:
    """python -m services.tools.demo --out DIR: build (or reuse) the demo; print the result as one JSON line."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m services.tools.demo", description=main.__doc__)
    p.add_argument(
        "--out",
        default=None,
        help="where to build it (default: the demo cache, "
        "$DFLASH_CACHE_DIR/demo-v<N>[-hybrid], else ~/.cache/dflash/demo-v<N>[-hybrid])",
    )
    p.add_argument(
        "--variant",
        choices=VARIANTS,
        default="dense",
        help="dense: a Qwen3 target; hybrid: a Qwen3.5-family Gated DeltaNet hybrid (composite checkpoint)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--conversations", type=int, default=4000)
    p.add_argument("--target-steps", type=int, default=TARGET_STEPS, help="0: an untrained (random) target")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the device the demo will train on")
    p.add_argument(
        "--progress", action="store_true", help='while building, JSON lines {"progress": TEXT} before the result'
    )
    args = p.parse_args(argv)
    demo = make_demo(
        args.out or cache_dir(args.variant),
        seed=args.seed,
        num_conversations=args.conversations,
        target_steps=args.target_steps,
        variant=args.variant,
        device=args.device,
        progress=(lambda text: print(json.dumps({"progress": text}), flush=True)) if args.progress else None,
    )
    print(json.dumps(demo), flush=True)


if __name__ == "__main__":
    main()
