"""Drafter train-step benchmark: step time, trained tokens/s, peak memory, MFU, time breakdown.

Runs the real training step (services.drafter.training.train.train_step: anchors, block mask, compiled
layers with flex attention, chunked loss, AdamW) on synthetic batches at fixed shapes, one GPU,
no DDP. MFU = useful model FLOPs per second (model.model_flops) / the GPU's datasheet dense bf16
peak (bench/timing.py; 989.4 TFLOP/s on an H200), whatever the precision, so runs compare; the bf16
matmul rate measured in the same run is printed beside it.

--precision bf16,fp8 runs each shape once per kernels.precision, side by side in one process, and
prints the ratio of each to the first; --objective dflash,domino does the same for drafter.objective
(the product's default, Domino, when not given; its correction head at SpecForge's default size, rank 256
and GRU 1024: services/drafter/modeling/domino.py).

    python bench/drafter_step.py                                   # (a) recipe and (b) large
    python bench/drafter_step.py --shape recipe --steps 20 --out $OUT/drafter_step.json
    python bench/drafter_step.py --shape custom --hidden 256 --intermediate 512 --heads 4 --kv-heads 2 \\
        --head-dim 64 --layers 2 --seq-len 1024 --anchors 64 --block-size 16 --vocab 4096 --device cpu

Shapes: (a) recipe = Qwen3-8B: width 4096, 5 layers, 32/8 heads x 128, S 8192, 512 anchors, B 16,
vocab 151936. (b) large = the user's threaded setup: S 40000, 1024 anchors, B 32, width 5120
(Qwen3-32B layer shape: 64/8 heads x 128, intermediate 25600). (c) qwen36 = the Qwen3.6-27B recipe
drafter (presets/qwen3.6-27b.toml): width 5120, intermediate 17408, 32/8 heads x 128, 5 layers,
vocab 248320, at the seeds' shape S 40000, 1024 anchors, B 32 (--seq-len 8192 for the short pack).

Layout: --layout full (every layer full_attention) or hybrid (4 sliding_attention + 1 full, window
--window, 2048 by default: the 27B preset); --layout both runs each shape twice and prints the
hybrid/full step-time ratio. The layout changes only the attention (mask and attended pairs).

    python bench/drafter_step.py --shape qwen36 --layout both --seq-len 40000 --steps 5
    python bench/drafter_step.py --shape custom --hidden 64 --intermediate 128 --heads 4 --kv-heads 2 \
        --head-dim 16 --layers 5 --seq-len 512 --anchors 32 --block-size 8 --vocab 512 --window 48 \
        --layout both --device cpu --steps 2 --warmup-steps 1 --no-compile       # CPU smoke test
Needs no pyzmq.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.timing import datasheet_tflops, matmul_peak_tflops, timed  # noqa: E402
from services.run.config.schema import DrafterConfig  # noqa: E402

DEFAULT_OBJECTIVE = DrafterConfig().objective  # the product's drafter.objective

SHAPES = {
    "recipe": dict(
        hidden=4096,
        intermediate=12288,
        heads=32,
        kv_heads=8,
        head_dim=128,
        layers=5,
        target_layers=36,
        vocab=151936,
        seq_len=8192,
        anchors=512,
        block_size=16,
    ),
    "large": dict(
        hidden=5120,
        intermediate=25600,
        heads=64,
        kv_heads=8,
        head_dim=128,
        layers=5,
        target_layers=64,
        vocab=151936,
        seq_len=40000,
        anchors=1024,
        block_size=32,
    ),
    "qwen36": dict(
        hidden=5120,
        intermediate=17408,
        heads=32,
        kv_heads=8,
        head_dim=128,
        layers=5,
        target_layers=64,
        vocab=248320,
        seq_len=40000,
        anchors=1024,
        block_size=32,
    ),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=["all", "recipe", "large", "qwen36", "custom"], default="all")
    p.add_argument(
        "--layout",
        choices=["full", "hybrid", "both"],
        default="full",
        help="full: every layer full_attention; hybrid: 4 sliding + 1 full (the 27B preset)",
    )
    p.add_argument("--window", type=int, default=2048, help="sliding_window of the hybrid layout")
    for name in (
        "hidden",
        "intermediate",
        "heads",
        "kv_heads",
        "head_dim",
        "layers",
        "target_layers",
        "vocab",
        "seq_len",
        "anchors",
        "block_size",
    ):
        p.add_argument("--" + name.replace("_", "-"), type=int, help="custom shape (or override a preset)")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup-steps", type=int, default=3, help="untimed steps after compile")
    p.add_argument("--loss-chunk", type=int, default=2048)
    p.add_argument(
        "--fp8-recipe",
        default=None,
        help="torchao float8 recipe for kernels.precision=fp8: tensorwise (the product's), rowwise, rowwise_with_gw_hp",
    )
    p.add_argument("--precision", default="bf16", help="kernels.precision, or a comma list run side by side: bf16,fp8")
    p.add_argument(
        "--objective",
        default=DEFAULT_OBJECTIVE,
        help="drafter.objective, or a comma list run side by side (default: the product's, %(default)s)",
    )
    p.add_argument("--attention", choices=["auto", "flex", "dense"], default="auto")
    p.add_argument("--no-compile", action="store_true", help="eager layers and loss (flex stays compiled)")
    p.add_argument("--no-breakdown", action="store_true")
    p.add_argument("--profile", action="store_true", help="print the top kernels of one step (torch.profiler)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", help="write the results as JSON here")
    return p.parse_args(argv)


def shape_from_args(args, name):
    shape = dict(SHAPES.get(name, {}))
    for key in (
        "hidden",
        "intermediate",
        "heads",
        "kv_heads",
        "head_dim",
        "layers",
        "target_layers",
        "vocab",
        "seq_len",
        "anchors",
        "block_size",
    ):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    shape.setdefault("target_layers", max(8, shape.get("layers", 1) * 4))
    missing = [
        k
        for k in (
            "hidden",
            "intermediate",
            "heads",
            "kv_heads",
            "head_dim",
            "layers",
            "vocab",
            "seq_len",
            "anchors",
            "block_size",
        )
        if k not in shape
    ]
    if missing:
        raise SystemExit(f"--shape custom needs --{' --'.join(m.replace('_', '-') for m in missing)}")
    return shape


def layout_overrides(layout: str, layers: int, window: int) -> list[str]:
    if layout == "full":
        return []
    types = ["sliding_attention"] * (layers - 1) + ["full_attention"]
    return ["drafter.layer_types=" + json.dumps(types), f"drafter.sliding_window={window}"]


def attended_pairs(inputs, block_size: int, window: int | None = None) -> int:
    """Query-key pairs the mask keeps: each row of a valid block sees its context prefix and its block;
    with a window, the row at block offset k sees at most window - 1 - k context keys, and block keys
    from offset k - window + 1 on (attention.visibility)."""
    valid = inputs.anchors >= 0
    context = (inputs.anchors - inputs.context_starts).clamp(min=0)
    if window is None:
        return int(((context + block_size) * valid).sum()) * block_size
    import torch

    k = torch.arange(block_size, device=context.device)
    seen = context[:, None].clamp(max=(window - 1 - k).clamp(min=0)[None, :])
    own = block_size - (k - window + 1).clamp(min=0)
    return int(((seen + own[None, :]) * valid[:, None]).sum())


def bench_shape(name, shape, args, peak_tflops, layout="full", precision="bf16", objective=DEFAULT_OBJECTIVE):
    import torch

    from services.drafter.modeling import precision as drafter_precision
    from services.drafter.modeling.anchors import anchor_generator, build_inputs
    from services.drafter.modeling.model import model_flops
    from services.drafter.modeling.target_head import TargetHead
    from services.drafter.training.core import DrafterCore
    from services.drafter.training.synthetic import SyntheticSource
    from services.drafter.training.train import train_step
    from services.drafter.training.warmup import warmup
    from services.process.compile_setup import RecompileWatch
    from services.run.config import load_config
    from services.run.runspec import drafter_shape

    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    cfg = load_config(
        None,
        [
            f"data.pack_len={shape['seq_len']}",
            f"drafter.num_anchors={shape['anchors']}",
            f"drafter.block_size={shape['block_size']}",
            f"drafter.num_layers={shape['layers']}",
            f"kernels.compile={'false' if args.no_compile else 'true'}",
            f"kernels.loss_chunk={args.loss_chunk}",
            f'kernels.precision="{precision}"',
            f'kernels.attention="{args.attention}"',
            f'drafter.objective="{objective}"',
            "optimizer.lr=1e-4",
            *layout_overrides(layout, shape["layers"], args.window),
        ],
    )
    base = dict(
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        vocab_size=shape["vocab"],
        num_target_layers=shape["target_layers"],
        rope_theta=1_000_000.0,
    )
    model_cfg = drafter_shape(cfg, base, mask_token_id=shape["vocab"] - 1)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    H, V = model_cfg.hidden_size, model_cfg.vocab_size
    head = TargetHead(
        torch.randn(V, H, device=device, dtype=dtype) * 0.02, torch.randn(V, H, device=device, dtype=dtype) * (4.0 / H)
    )
    state = DrafterCore.build(cfg, model_cfg, head, device, total_steps=100_000).state
    source = SyntheticSource(
        model_cfg, shape["seq_len"], device=device, with_target_labels=cfg.target.labels_from_target
    )
    batches = [source.batch(g) for g in range(2)]
    result = {
        "shape": name,
        **shape,
        "layout": layout,
        "precision": precision,
        "objective": objective,
        "fp8_recipe": drafter_precision.FP8_RECIPE if precision == "fp8" else None,
        "layer_types": model_cfg.layer_types,
        "sliding_window": model_cfg.sliding_window,
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "attention": state.drafter.attention.name,
        "compile": not args.no_compile,
        "trainable_params": state.drafter.num_parameters(),
        "loss_chunk": args.loss_chunk,
        "datasheet_tflops": peak_tflops["datasheet"],
        "matmul_measured_tflops": round(peak_tflops["measured"], 1),
    }
    print(
        f"[{name} {layout} {precision} {objective}] {result['trainable_params'] / 1e9:.3f} B trainable params; "
        "compiling ...",
        flush=True,
    )

    result["compile_s"] = round(warmup(state, batches[0]), 1)
    watch = RecompileWatch()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, metrics = [], None
    for i in range(args.warmup_steps + args.steps):
        batch = dataclasses.replace(batches[i % 2], g=1000 + i)
        start = time.perf_counter()
        metrics = train_step(state, batch)  # ends in a host sync (its metrics)
        seconds = time.perf_counter() - start
        if i >= args.warmup_steps:
            times.append(seconds)
    step_s = statistics.median(times)
    inputs = build_inputs(
        batches[0],
        num_anchors=shape["anchors"],
        block_size=shape["block_size"],
        mask_token_id=model_cfg.mask_token_id,
        gamma=state.settings.gamma,
        generator=anchor_generator(0, 1000, device),
    )
    pairs = {
        kind: attended_pairs(inputs, shape["block_size"], model_cfg.window(kind)) for kind in set(model_cfg.layer_types)
    }
    flops = model_flops(model_cfg, shape["seq_len"], shape["anchors"], pairs)
    all_pairs = sum(pairs[kind] for kind in model_cfg.layer_types) / model_cfg.num_hidden_layers  # per layer
    trained_positions = int((inputs.weights > 0).sum())
    result.update(
        step_s=round(step_s, 4),
        step_s_min=round(min(times), 4),
        step_s_max=round(max(times), 4),
        tokens_per_s=round(batches[0].num_tokens / step_s, 1),
        trained_positions_per_s=round(trained_positions / step_s, 1),
        sequences_per_s=round(1 / step_s, 3),
        peak_memory_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
        model_tflop_per_step=round(flops["total"] / 1e12, 2),
        flop_split_tflop={k: round(v / 1e12, 2) for k, v in flops.items()},
        achieved_tflops=round(flops["total"] / step_s / 1e12, 1),
        mfu=round(flops["total"] / step_s / 1e12 / (peak_tflops["datasheet"] or peak_tflops["measured"]), 4),
        mfu_of_measured=round(flops["total"] / step_s / 1e12 / peak_tflops["measured"], 4),
        mask_density=round(
            all_pairs
            / (
                inputs.anchors.numel()
                * shape["block_size"]
                * (inputs.context_len + inputs.anchors.numel() * shape["block_size"])
            ),
            4,
        ),
        recompiles=watch.count,
        last_loss=round(metrics["loss"], 4),
    )

    if not args.no_breakdown and objective == "dflash":  # (its loss part times DFlash's loss)
        result["breakdown_s"] = breakdown(state, batches[0], inputs, step_s)
    if args.profile and device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            train_step(state, dataclasses.replace(batches[0], g=99))
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)
    del state, head, batches, source
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def breakdown(state, batch, inputs, step_s) -> dict:
    """Where a step's time goes, each part timed alone at the step's shapes (approximate)."""
    import torch

    from services.drafter.modeling.anchors import anchor_generator, build_inputs
    from services.drafter.modeling.loss import chunked_cross_entropy

    s, cfg, device = state.settings, state.drafter.cfg, state.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def anchors_and_mask():
        inp = build_inputs(
            batch,
            num_anchors=s.num_anchors,
            block_size=cfg.block_size,
            mask_token_id=cfg.mask_token_id,
            gamma=s.gamma,
            generator=anchor_generator(0, 7, device),
        )
        state.drafter.build_masks(inp.anchors, inp.context_starts, inp.context_len)

    parts = {"anchors_blocks_mask": timed(anchors_and_mask, 5)}

    masks = state.drafter.build_masks(inputs.anchors, inputs.context_starts, inputs.context_len)
    q_len, kv_len = (
        inputs.anchors.numel() * cfg.block_size,
        inputs.context_len + inputs.anchors.numel() * cfg.block_size,
    )
    q = torch.randn(1, cfg.num_attention_heads, q_len, cfg.head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, cfg.num_key_value_heads, kv_len, cfg.head_dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)

    def attention_fwd_bwd():  # one pass per layer, with its type's mask
        for kind in cfg.layer_types:
            state.drafter.attention(q, k, v, masks[kind]).sum().backward()

    timed(attention_fwd_bwd, 2)  # compile the standalone kernels first
    parts["attention_fwd_bwd"] = timed(attention_fwd_bwd, 5)
    q = k = v = None  # free them (the closure above reads the names)

    rows = inputs.anchors.numel() * (cfg.block_size - 1)
    hidden = torch.randn(rows, cfg.hidden_size, device=device, dtype=dtype, requires_grad=True)
    labels, weights = inputs.labels.flatten(), inputs.weights.flatten()

    def loss_fwd_bwd():
        loss, _ = chunked_cross_entropy(hidden, state.loss_head, labels, weights, s.loss_chunk, state.chunk_fns)
        loss.backward()

    timed(loss_fwd_bwd, 1)
    parts["lm_head_loss_fwd_bwd"] = timed(loss_fwd_bwd, 3)
    hidden = None  # free it (the closure above reads the name)

    params = list(state.drafter.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)

    def optimizer():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        state.optimizer.step()

    parts["clip_optimizer"] = timed(optimizer, 3)
    state.optimizer.zero_grad(set_to_none=True)
    parts["rest"] = step_s - sum(parts.values())
    parts = {k: round(v, 4) for k, v in parts.items()}
    parts["fractions"] = {k: round(v / step_s, 3) for k, v in parts.items() if k != "fractions"}
    return parts


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch

    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    if args.fp8_recipe:  # a benchmark knob: the product's recipe is precision.FP8_RECIPE
        import services.drafter.modeling.precision

        services.drafter.modeling.precision.FP8_RECIPE = args.fp8_recipe
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --device cpu for a smoke run)")
    peak = {"measured": matmul_peak_tflops(device), "datasheet": datasheet_tflops(device)}
    yardstick = f"datasheet {peak['datasheet']}" if peak["datasheet"] else "none known: MFU is of the measured rate"
    print(f"bf16 matmul measured: {peak['measured']:.1f} TFLOP/s; datasheet dense bf16 peak: {yardstick}", flush=True)
    names = ["recipe", "large"] if args.shape == "all" else [args.shape]
    layouts = ["full", "hybrid"] if args.layout == "both" else [args.layout]
    precisions = args.precision.split(",")
    objectives = args.objective.split(",")
    results = []
    for name in names:
        runs = {}
        for layout in layouts:
            for precision in precisions:
                for objective in objectives:
                    r = bench_shape(name, shape_from_args(args, name), args, peak, layout, precision, objective)
                    results.append(r)
                    runs[layout, precision, objective] = r
                    print(json.dumps(r, indent=1), flush=True)
                    print(
                        f"[{name} {layout} {precision} {objective}] step {r['step_s'] * 1e3:.1f} ms | "
                        f"{r['tokens_per_s']:.0f} tok/s | "
                        f"{r['trained_positions_per_s']:.0f} trained positions/s | peak {r['peak_memory_gib']} GiB | "
                        f"{r['achieved_tflops']} TFLOP/s = MFU {r['mfu'] * 100:.1f}% "
                        f"({r['mfu_of_measured'] * 100:.1f}% of the measured matmul rate) | compile {r['compile_s']} s"
                        f" | recompiles {r['recompiles']}",
                        flush=True,
                    )
        for precision in precisions:
            if len(layouts) == 2:
                full, hybrid = runs["full", precision, objectives[0]], runs["hybrid", precision, objectives[0]]
                print(
                    f"[{name} {precision}] hybrid (window {args.window}) vs full: step "
                    f"{hybrid['step_s'] / full['step_s']:.3f}x, i.e. {full['step_s'] / hybrid['step_s']:.2f}x faster; "
                    f"attention TFLOP {hybrid['flop_split_tflop']['attention']} vs "
                    f"{full['flop_split_tflop']['attention']}",
                    flush=True,
                )
        for layout in layouts:
            base = runs[layout, precisions[0], objectives[0]]
            for precision, objective in [(p, o) for p in precisions for o in objectives][1:]:
                r = runs[layout, precision, objective]
                print(
                    f"[{name} {layout}] {precision} {objective} vs {precisions[0]} {objectives[0]}: "
                    f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}x tok/s "
                    f"({base['step_s'] * 1e3:.1f} -> {r['step_s'] * 1e3:.1f} ms), "
                    f"loss {base['last_loss']} vs {r['last_loss']}",
                    flush=True,
                )
    if args.out:
        Path(args.out).write_text(json.dumps({"peak_tflops": peak, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
