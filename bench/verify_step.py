"""Speculative verification on one GPU: time per verify step of a hybrid target, by rollback method.

    python bench/verify_step.py                                   # 27b-hybrid shape, all 64 layers
    python bench/verify_step.py --layers 16 --context 1024        # a quarter of the layers
    python bench/verify_step.py --lossless                        # tiny hybrid: spec decoding == greedy
    python bench/verify_step.py --methods '' --compile-steps --profile   # slot row: eager, graphed, compiled

A random-weight model of a real shape (bench/shapes.py), built on the GPU in bf16, wrapped in the
training Target (services/target/model/model.py: packed Gated DeltaNet layers, flash-linear-attention's
kernel when it imports) and decoded through services/target/verify/decode.py's DecodeSession. After a
prefill of --context tokens, each step verifies a block of --block tokens and commits k of them
(k cycles through 1, B/4, B/2, B: rejected drafts, partly and fully accepted), for each method:
  refeed      the block runs as one sequence; commit re-runs the delta rule over the kept prefix
  per-token   the rule runs token by token and keeps every state; commit picks one
and, as the yardstick, a plain one-token forward (verify([t]) + commit(1), the greedy reference).
--rows N: a session of N rows (services/target/verify/row_sessions.py, the in-training evaluation's target
side): N prompts of --context tokens, a step verifying all their blocks in one forward.
Then the same steps on one row of services/target/verify/slots.py's KV cache (what `launcher eval`'s
batched path runs: the Gated DeltaNet states in fixed buffers, the block's positions as tensors),
eagerly and, on CUDA, as CUDA graphs (the verify forward one graph, the commit two).
--quantize fp8 swaps the decoder linears for FP8 ones first (target.quantize = "fp8", rowwise: every
token count through cuBLASLt's scaled GEMM, as the service runs them); fp8-quantized and
fp8-weight-only the same with a step's few tokens through services/target/model/fp8_few_tokens.py's kernel
in that mode (fp8.few_token_steps).
Prints one JSON object: milliseconds per verify, per commit, per step, and peak memory.

--lossless runs real speculative decoding on the tiny-hybrid shape (bf16 on CUDA, the kernels when
they import; lm_head scaled by --logit-scale for a peaked target like a trained one) with a
random drafter (drafts mostly rejected), drafts equal to the greedy reference (all accepted) and
drafts right for 2 tokens then wrong, under both methods, against plain greedy decoding through
the same session; exit status 1 when a prompt differs by more than a near-tie.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from bench.shapes import HYBRID, text_config  # noqa: E402
from bench.timing import sync  # noqa: E402
from services.decoding.decode_step import ROLLBACKS  # noqa: E402
from services.run import layers as layer_rule  # noqa: E402
from services.target.model import hybrid  # noqa: E402
from services.target.model.attention import PACKED_SDPA, register_packed_sdpa  # noqa: E402
from services.target.model.model import Target  # noqa: E402
from services.target.verify.decode import DecodeSession  # noqa: E402
from services.target.verify.row_sessions import RowSession  # noqa: E402
from services.target.verify.slots import LENGTH_STEP, GraphedSteps, Slots  # noqa: E402


def build_target(shape: str, num_layers: int | None, device: str, dtype: torch.dtype, logit_scale: float = 1.0):
    from transformers import AutoModelForCausalLM

    cfg = text_config(shape)
    if num_layers:
        cfg.num_hidden_layers = num_layers
        cfg.layer_types = cfg.layer_types[:num_layers]
    register_packed_sdpa()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    model.config._attn_implementation = PACKED_SDPA
    if logit_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(logit_scale)
    ids = layer_rule.resolve_layer_ids([], cfg.num_hidden_layers, 5)
    return Target(model.eval().requires_grad_(False), ids)


def time_steps(target: Target, method: str, context: list[int], block: int, iters: int, gen) -> dict:
    session = DecodeSession(target, method)
    session.prefill(context)
    keeps = [1, max(1, block // 4), max(1, block // 2), block]
    verify_s = commit_s = 0.0
    for i in range(iters + 2):  # two warmup steps
        ids = torch.randint(0, target.info.vocab_size, (block,), generator=gen).tolist()
        sync()
        t0 = time.perf_counter()
        session.verify(ids)
        sync()
        t1 = time.perf_counter()
        session.commit(keeps[i % len(keeps)])
        sync()
        if i >= 2:
            verify_s, commit_s = verify_s + t1 - t0, commit_s + time.perf_counter() - t1
    ms = lambda s: round(1000 * s / iters, 3)  # noqa: E731
    return {"verify_ms": ms(verify_s), "commit_ms": ms(commit_s), "step_ms": ms(verify_s + commit_s)}


def time_slot_steps(
    target: Target, context: list[int], block: int, iters: int, gen, graphs: bool, fp32_head=False, profile=False
) -> dict:
    """time_steps on one KV-cache row (slots.Slots): the block verified, then k of it committed;
    graphs: as decode_slots runs them on CUDA (slots.GraphedSteps), else eagerly. fp32_head: the
    logits from an fp32 copy of the lm_head (the way before decode_step.logits_weight). profile:
    then one more step under torch.profiler, its kernels by GPU time (printed)."""
    slots = Slots(target, [context], room=block * (iters + 3) + LENGTH_STEP)
    if fp32_head:
        slots.lm_head = slots.lm_head.float()
    slots.prefill([context])
    graphed = GraphedSteps(slots, None, block) if graphs else None
    ids = graphed.ids if graphed else torch.zeros(1, block, dtype=torch.long, device=slots.device)
    starts = graphed.starts if graphed else torch.zeros(1, dtype=torch.long, device=slots.device)
    verify = graphed.verify if graphed else lambda b, length: slots.step(ids, starts, length)
    commit = graphed.commit if graphed else slots.commit_block
    start = len(context)
    keeps = [1, max(1, block // 4), max(1, block // 2), block]
    verify_s = commit_s = 0.0
    for i in range(iters + 2):  # two warmup steps (the first of a length also captures its graph)
        ids[0] = torch.randint(0, target.info.vocab_size, (block,), generator=gen).to(slots.device)
        starts[0] = start
        length = -(-(start + block) // LENGTH_STEP) * LENGTH_STEP
        kept = torch.tensor([keeps[i % len(keeps)]], device=slots.device)
        sync()
        t0 = time.perf_counter()
        verify(1, length)
        sync()
        t1 = time.perf_counter()
        commit(kept)
        sync()
        start += keeps[i % len(keeps)]
        if i >= 2:
            verify_s, commit_s = verify_s + t1 - t0, commit_s + time.perf_counter() - t1
    ms = lambda s: round(1000 * s / iters, 3)  # noqa: E731
    out = {"verify_ms": ms(verify_s), "commit_ms": ms(commit_s), "step_ms": ms(verify_s + commit_s)}
    if profile:
        out["profile"] = profile_kernels(lambda: (verify(1, length), commit(kept)))
    return out


def profile_kernels(step) -> dict:
    """One call of step() under torch.profiler: its kernels grouped by name, by GPU time (the top 25
    printed), their total and count; inside CUDA graphs too (the profiler sees a replay's kernels)."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        sync()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in kernels)
    for e in kernels[:25]:
        print(f"{e.self_device_time_total / 1000:9.3f} ms {e.count:6d}x  {e.key[:110]}", file=sys.stderr, flush=True)
    return {"gpu_kernel_ms": round(total / 1000, 2), "kernels": sum(e.count for e in kernels)}


def profile_verify(target: Target, context: list[int], block: int, gen) -> dict:
    """One verify step under torch.profiler: its wall time against the time the GPU spent in kernels
    (a step far above its kernel time is bound by the host: Python, launches, syncs), and the top
    host-side ops, printed."""
    from torch.profiler import ProfilerActivity, profile

    session = DecodeSession(target, ROLLBACKS[0])
    session.prefill(context)
    ids = lambda: torch.randint(0, target.info.vocab_size, (block,), generator=gen).tolist()  # noqa: E731
    for _ in range(2):
        session.verify(ids())
        session.commit(block // 2)
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        session.verify(ids())
        sync()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    syncs = sum(
        e.count for e in events if "Synchronize" in e.key or e.key in ("aten::item", "aten::_local_scalar_dense")
    )
    print(events.table(sort_by="self_cpu_time_total", row_limit=30), file=sys.stderr, flush=True)
    return {
        "wall_ms": round(1000 * wall, 2),
        "gpu_kernel_ms": round(kernel_us / 1000, 2),
        "kernel_launches": launches,
        "host_syncs": syncs,
    }


def time_row_session(target: Target, context_len: int, block: int, iters: int, gen, rows: int) -> dict:
    """The in-training evaluation's target side (services/target/verify/row_sessions.py): `rows` prompts of
    context_len tokens verified together, a step = one forward for all rows + their commits + the
    read-back of tokens and features; random drafts, so each row keeps what the target accepts."""
    vocab = target.info.vocab_size
    prompts = [torch.randint(0, vocab, (context_len,), generator=gen).tolist() for _ in range(rows)]
    sync()
    t0 = time.perf_counter()
    session = RowSession(target, prompts, room=block * (iters + 3))
    sync()
    prefill_s, step_s = time.perf_counter() - t0, 0.0
    for i in range(iters + 2):  # two warmup steps
        blocks = torch.randint(0, vocab, (rows, block), generator=gen).tolist()
        sync()
        t0 = time.perf_counter()
        session.step(session.rows, blocks)  # reads its answers back: the sync a reply needs
        if i >= 2:
            step_s += time.perf_counter() - t0
    step_ms = 1000 * step_s / iters
    return {
        "rows": rows,
        "prefill_s": round(prefill_s, 3),
        "step_ms": round(step_ms, 3),
        "per_row_ms": round(step_ms / rows, 3),
    }


def time_all(args, target: Target, context: list[int], gen) -> dict:
    """Every timing of one precision: the DecodeSession methods, the plain one-token step, the slot row."""
    out = {}
    for method in filter(None, args.methods.split(",")):
        out[method] = time_steps(target, method, context, args.block, args.iters, gen)
    if args.profile:
        out["profile"] = profile_verify(target, context, args.block, gen)
    out["plain_one_token"] = time_steps(target, ROLLBACKS[0], context, 1, args.iters, gen)
    steps = lambda **kw: time_slot_steps(target, context, args.block, args.iters, gen, **kw)  # noqa: E731
    target.steps_backend = ""  # the eager layers first (an earlier precision may have compiled them)
    if args.rows:
        out["row_session"] = time_row_session(target, len(context), args.block, args.iters, gen, args.rows)
    out["slot_row_eager"] = steps(graphs=False, profile=args.profile)
    if target.device.type == "cuda":
        out["slot_row_graphed_fp32_head"] = steps(graphs=True)
        out["slot_row_graphed"] = steps(graphs=True, profile=args.profile)
        if args.compile_steps:  # last: the target keeps its compiled layers
            target.compile_steps()
            t0 = time.perf_counter()
            out["slot_row_compiled_graphed"] = steps(graphs=True, profile=args.profile)
            out["slot_row_compiled_graphed"]["with_compile_s"] = round(time.perf_counter() - t0, 1)
        out["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return out


def bench_steps(args) -> dict:
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    target = build_target(args.shape, args.layers, device, dtype)
    gen = torch.Generator().manual_seed(1)
    context = torch.randint(0, target.info.vocab_size, (args.context,), generator=gen).tolist()
    result = {
        "shape": args.shape,
        "layers": target.info.num_layers,
        "context": args.context,
        "block": args.block,
        "iters": args.iters,
        "dtype": str(dtype).removeprefix("torch."),
        "capture_path": target.path,
        "fla": hybrid.fla_delta_rule() is not None,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
    }
    for precision in args.quantize.split(","):  # "none" first: fp8 replaces the linears in place
        if precision.startswith("fp8"):
            from services.target.model import fp8

            if "fp8_summary" not in result:
                result["fp8_summary"] = str(fp8.quantize_decoder(target.model, target.layers))
            mode = precision.removeprefix("fp8").removeprefix("-")  # "", "quantized" or "weight-only"
            result[f"{precision}_few_token_linears"] = fp8.few_token_steps(target.model, mode)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        result[precision] = time_all(args, target, context, gen)
        print(json.dumps({precision: result[precision]}), file=sys.stderr, flush=True)
    return result


class Oracle:
    """Drafts the greedy reference's continuation: right for `correct` drafts of each block, then wrong."""

    def __init__(self, sequence: list[int], correct: int, block: int, vocab: int):
        self.sequence, self.correct, self.block, self.vocab = sequence, correct, block, vocab

    def __call__(self, features, last_token, start):
        drafts = (self.sequence[start + 1 : start + self.block] + [0] * self.block)[: self.block - 1]
        return torch.tensor([t if j < self.correct else (t + 1) % self.vocab for j, t in enumerate(drafts)])


def bench_lossless(args) -> dict:
    from services.decoding.lossless import describe_lossless
    from services.drafter.acceptance.speculative import (
        DrafterProposer,
        eval_drafter,
        greedy_reference,
        speculative_generate,
        summarize,
    )
    from services.drafter.modeling.model import DrafterModelConfig
    from services.drafter.modeling.target_head import TargetHead
    from services.eval.verifier import LocalVerifier

    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    target = build_target("tiny-hybrid", None, device, dtype, args.logit_scale)
    shape, block = HYBRID["tiny-hybrid"], args.block
    cfg = DrafterModelConfig(
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=shape["vocab_size"],
        num_target_layers=target.info.num_layers,
        num_hidden_layers=1,
        target_layer_ids=target.info.layer_ids,
        block_size=block,
        mask_token_id=0,
    )
    model = target.model
    head = TargetHead(model.get_input_embeddings().weight.detach(), model.lm_head.weight.detach())
    torch.manual_seed(3)
    random = DrafterProposer(eval_drafter(None, cfg, device, dtype), head)
    gen = torch.Generator().manual_seed(2)
    prompts = [
        torch.randint(0, shape["vocab_size"], (int(n),), generator=gen).tolist()
        for n in torch.randint(8, 200, (args.prompts,), generator=gen)
    ]
    out = {
        "shape": "tiny-hybrid",
        "dtype": str(dtype).removeprefix("torch."),
        "capture_path": target.path,
        "fla": hybrid.fla_delta_rule() is not None,
        "block": block,
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "logit_scale": args.logit_scale,
        "ok": True,
    }
    for method in ROLLBACKS:
        verifier = LocalVerifier(target, method)
        refs = [greedy_reference(verifier, p, args.max_new_tokens) for p in prompts]
        for name, make in (
            ("random", lambda ref, p: random),
            ("all-accepted", lambda ref, p: Oracle(p + ref.tokens, block - 1, block, shape["vocab_size"])),
            ("2-then-wrong", lambda ref, p: Oracle(p + ref.tokens, 2, block, shape["vocab_size"])),
        ):
            decoded = [
                speculative_generate(verifier, make(ref, p), p, max_new_tokens=args.max_new_tokens)
                for ref, p in zip(refs, prompts)
            ]
            s = summarize(decoded, refs)
            out[f"{method}/{name}"] = {
                "summary": describe_lossless(s),
                "acceptance_per_step": round(s["acceptance_per_step"], 3),
                "lossless": s["lossless"],
                "near_ties": s["near_ties"],
                "differences": s["differences"],
            }
            out["ok"] = out["ok"] and all(d.get("near_tie", False) for d in s.get("differences") or [])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="27b-hybrid", choices=sorted(HYBRID))
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's; fewer to fit)")
    p.add_argument("--context", type=int, default=1536, help="prompt tokens before the timed steps")
    p.add_argument("--block", type=int, default=16, help="block size B (verified tokens per step)")
    p.add_argument("--iters", type=int, default=12, help="timed steps per method")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--quantize",
        default="none",
        help="none, fp8, fp8-quantized, fp8-weight-only (FP8 with the few-token kernel in that mode) or a "
        "list: none,fp8,fp8-quantized (FP8 decoder linears, rowwise)",
    )
    p.add_argument("--methods", default=",".join(ROLLBACKS), help="DecodeSession methods to time ('' for none)")
    p.add_argument("--profile", action="store_true", help="also profile one verify step (host vs kernel time)")
    p.add_argument(
        "--rows", type=int, default=0, help="also a session of this many rows (the in-training evaluation's path)"
    )
    p.add_argument("--compile-steps", action="store_true", help="also the slot row with compiled layers (last)")
    p.add_argument("--lossless", action="store_true", help="the tiny-hybrid lossless check instead of the timing")
    p.add_argument("--prompts", type=int, default=8, help="--lossless: prompts")
    p.add_argument("--max-new-tokens", type=int, default=48, help="--lossless: tokens per prompt")
    p.add_argument("--logit-scale", type=float, default=20.0, help="--lossless: lm_head scale (a peaked target)")
    args = p.parse_args(argv)
    with torch.no_grad():
        result = bench_lossless(args) if args.lossless else bench_steps(args)
    print(json.dumps(result))
    return 0 if result.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
