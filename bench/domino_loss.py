"""Domino's chunked loss alone at a drafter's shape (services/drafter/modeling/domino.py): ms per call,
loss and gradients, as the training step runs it (compiled on CUDA, kernels.compile's default).

Side by side in one process, for each lm_head precision (bf16, and FP8 as kernels.precision = "fp8"):
  - domino, lambda 0.5: the curriculum's first half, the base CE and its gradient included
  - domino, lambda 0: its second half, without them (what the first half's chunk cost before they were skipped)
  - dflash: the plain chunked CE of the same rows (one set of logits; the floor Domino adds its head to)
  - gemms: the loss's matrix products alone (the lm_head's two, the correction's three), every chunk:
    what the loss would cost if its softmax, reductions and casts took no time
The default shape is the Qwen3.6-27B preset's drafter at 4 K packs: 512 anchors x 15 trained positions
= 7 680 rows, width 5 120, vocab 248 320, correction rank 256, chunks of 2 048 rows.

    python bench/domino_loss.py --out $OUT/domino_loss.json [--profile]
    python bench/domino_loss.py --device cpu --rows 60 --hidden 32 --vocab 512 --emb 8 --chunk 32 --iters 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.timing import timed  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=7680, help="trained rows (anchors x (block size - 1))")
    p.add_argument("--positions", type=int, default=15, help="trained positions per block (block size - 1)")
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument("--vocab", type=int, default=248320)
    p.add_argument("--emb", type=int, default=256, help="the correction's rank (drafter.domino_emb_dim)")
    p.add_argument("--chunk", type=int, default=2048, help="kernels.loss_chunk")
    p.add_argument("--precision", default="bf16,fp8")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--profile", action="store_true", help="print the top kernels of one lambda-0.5 call")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    import torch

    from services.drafter.modeling import domino
    from services.drafter.modeling.loss import ChunkFns, Fp8Head, chunked_cross_entropy, head_input_grad, head_logits

    args = parse_args(argv)
    device = torch.device(args.device)
    if args.rows % args.positions:
        raise SystemExit(f"--rows {args.rows} is not a multiple of --positions {args.positions}")
    compile_ = device.type == "cuda"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device).manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device=device)  # noqa: E731
    lm_head = (rand(args.vocab, args.hidden) / args.hidden**0.5).to(dtype)
    leaves = [
        rand(args.rows, args.hidden).to(dtype),
        rand(args.rows, args.emb).to(dtype),
        0.02 * rand(args.vocab, args.emb),
    ]
    labels = torch.randint(0, args.vocab, (args.rows,), generator=gen, device=device)
    weights = torch.rand(args.rows // args.positions, args.positions, generator=gen, device=device)
    domino_fn, dflash_fns = domino.chunk_function(compile=compile_), ChunkFns(compile=compile_)
    chunks = [(a, min(a + args.chunk, args.rows)) for a in range(0, args.rows, args.chunk)]
    print(
        f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}: "
        f"{args.rows} rows x width {args.hidden}, vocab {args.vocab}, rank {args.emb}, {len(chunks)} chunks",
        flush=True,
    )
    records = []
    for precision in args.precision.split(","):
        head = Fp8Head.of(lm_head) if precision == "fp8" else lm_head
        if head is None:
            raise SystemExit(f"--precision fp8: width {args.hidden} and vocab {args.vocab} must be multiples of 16")

        def domino_call(lam):
            h, u, w2 = (t.detach().requires_grad_() for t in leaves)
            loss, _, _ = domino.domino_cross_entropy(h, u, w2, head, labels, weights, lam, args.chunk, domino_fn)
            loss.backward()

        def dflash_call():
            h = leaves[0].detach().requires_grad_()
            loss, _ = chunked_cross_entropy(h, head, labels, weights, args.chunk, dflash_fns)
            loss.backward()

        g = torch.zeros(args.chunk, args.vocab, device=device)  # a logits gradient's shape, for the GEMMs alone
        bound = torch.ones((), device=device)

        @torch.no_grad()
        def gemms():
            h, u, w2 = leaves[0], leaves[1], leaves[2].to(dtype)
            for a, b in chunks:
                head_logits(h[a:b], head)
                head_input_grad(g[: b - a], head, dtype, bound)
                gc = (u[a:b] @ w2.t()).to(dtype)  # the correction's logits, then its two gradient GEMMs
                gc @ w2, gc.t() @ u[a:b]

        calls = {
            "domino, lambda 0.5": lambda: domino_call(0.5),
            "domino, lambda 0": lambda: domino_call(0.0),
            "dflash": dflash_call,
            "gemms": gemms,
        }
        times = {}
        for name, call in calls.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times[name] = timed(call, args.iters, warmup=2)
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
            first = times["domino, lambda 0.5"]
            records.append(
                {
                    "precision": precision,
                    "call": name,
                    "ms": round(times[name] * 1e3, 2),
                    "peak_gib": peak and round(peak, 2),
                }
            )
            print(
                f"  {precision:>4} | {name:<18} | {times[name] * 1e3:8.2f} ms"
                f" | {times[name] / first:5.3f} of lambda 0.5" + (f" | peak {peak:.1f} GiB" if peak else ""),
                flush=True,
            )
        if args.profile and device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                domino_call(0.5)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": vars(args), "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
