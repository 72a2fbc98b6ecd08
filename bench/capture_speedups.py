"""How much faster could the target's forward be? Regional compile and FP8 linears, measured alone.

    python bench/capture_speedups.py --shape 27b-hybrid --layers 16 --seq 8192 --out speedups.json

Random-weight model of a real shape (bench/shapes.py; --layers keeps the first L decoder layers so a
27B-shaped stack fits a short run: the per-layer mix of Gated DeltaNet and full attention is kept),
one document of `seq` tokens, the backbone forward alone (no lm_head), bf16. Variants, timed in one
process one after another on the same weights:
  eager           transformers' layers as they are (the capture path's forward today)
  compiled        every decoder layer torch.compile'd on its own (regional compile, as torchtitan does)
  fp8             every nn.Linear inside the decoder layers as FP8 (e4m3) with rowwise scales:
                  weights quantized once, activations per row at run time, torch._scaled_mm
                  (services/target/model/fp8.py, what target.quantize=fp8 does to a bf16 checkpoint)
  fp8+compiled    both (the compiled layers fuse the activations' quantization)
For FP8 it also prints, per layer output, the relative error and cosine against bf16 on the same row.
This is a measurement of headroom, not the worker's path: the capture keeps eager bf16 unless a
variant pays (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.shapes import text_config  # noqa: E402
from bench.timing import timed  # noqa: E402
from services.target.model import fp8  # noqa: E402


def build(shape: str, layers: int):
    from transformers import AutoModelForCausalLM

    cfg = text_config(shape)
    if layers:
        cfg.num_hidden_layers = layers
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[:layers]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


@torch.no_grad()  # the whole benchmark; a decorator, so a test calling main() keeps its grad mode
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="27b-hybrid")
    p.add_argument("--layers", type=int, default=16, help="decoder layers kept (0 = all)")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--variants", default="eager,compiled,fp8,fp8+compiled")
    p.add_argument("--out", default="")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA GPU")
    import transformers

    model = build(args.shape, args.layers)
    backbone, layers = model.model, model.model.layers
    ids = torch.randint(0, model.config.vocab_size, (1, args.seq), device="cuda")
    run = lambda: backbone(input_ids=ids, use_cache=False, output_hidden_states=True)  # noqa: E731
    eager_forwards = [layer.forward for layer in layers]
    reference = None
    results = {
        "shape": args.shape,
        "layers": len(layers),
        "seq": args.seq,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(),
    }
    for variant in args.variants.split(","):
        if "fp8" in variant and not results.get("fp8_linears"):
            reference = [h.float() for h in run().hidden_states[1:]]
            summary = fp8.quantize_decoder(model, layers)
            results["fp8_linears"], results["fp8_summary"] = summary["rowwise"], str(summary)
            print(summary, flush=True)
        for layer, forward in zip(layers, eager_forwards):
            layer.forward = forward
        if "compiled" in variant:
            for layer in layers:
                layer.forward = torch.compile(layer.forward, dynamic=False)
        try:
            t0 = time.perf_counter()
            out = run()
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            t = timed(run, args.iters, warmup=1)
        except Exception as exc:  # one variant failing must not hide the others' figures
            results[variant] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(f"{variant:14s} failed: {results[variant]['error']}", flush=True)
            continue
        rec = {"s": t, "tok_s": args.seq / t, "first_call_s": first}
        if "fp8" in variant:
            drift = []
            for ref, h in zip(reference, out.hidden_states[1:]):
                h = h.float()
                drift.append(
                    {
                        "rel_err": float((h - ref).norm() / ref.norm()),
                        "cosine": float(torch.nn.functional.cosine_similarity(h, ref, dim=-1).mean()),
                    }
                )
            rec["drift_per_layer"] = drift
        results[variant] = rec
        base = results.get("eager", rec)["s"]
        print(
            f"{variant:14s} {rec['tok_s']:9.0f} tok/s  {base / t:5.3f}x eager  first call {first:6.1f} s"
            + (
                f"  drift last layer rel {rec['drift_per_layer'][-1]['rel_err']:.4f} cos "
                f"{rec['drift_per_layer'][-1]['cosine']:.5f}"
                if "fp8" in variant
                else ""
            ),
            flush=True,
        )
    results["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
