"""Target capture per precision on one GPU: bf16 against FP8 on the same weights and rows, in one run.

    python bench/target_precision.py --shape 27b-hybrid --seq 8192 --mixes single,short --out precision.json
    python bench/target_precision.py --shape 8b --seq 8192 --mixes single,short
    python bench/target_precision.py --shape tiny --seq 256 --iters 1 --warmup 0     # CPU smoke test

Random-weight model of a real shape (bench/shapes.py; --keep-layers keeps the first L decoder
layers), timed on the worker's capture path (services.target.model.model.Target, capture_to_host) on a row
of one document ("single") or of packed documents (bench/target_capture.py's mixes). Precisions,
one after another on the same weights:
  bf16       the weights as they are
  fp8        target.quantize=fp8 on a bf16 checkpoint: the decoder linears quantized rowwise
             (services/target/model/fp8.py)
  fp8-block  what target.quantize=fp8 does with an FP8 checkpoint: each weight quantized in the
             published 128x128 blocks, kept block-scaled where this GPU runs that GEMM, else
             requantized rowwise (the printed summary says which)
Prints, per mix, tok/s of each precision and its ratio to bf16, the time quantizing took, then per
captured layer the relative error and the cosine (mean and minimum over tokens) of each FP8
precision against bf16 on the same row. Random weights: real checkpoints have outliers these lack,
so the drift of a real model is its own measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from bench.precision import decoder_linears, set_precision  # noqa: E402
from bench.shapes import SHAPES  # noqa: E402
from bench.target_capture import MIXES, build_model, doc_lengths, drift, row_of, set_attention  # noqa: E402
from bench.timing import sync, timed  # noqa: E402

PRECISIONS = ("bf16", "fp8", "fp8-block")


def keep_layers(model, n: int) -> None:
    """The first n decoder layers (0: all), with their per-layer types."""
    if n and n < model.config.num_hidden_layers:
        model.model.layers = model.model.layers[:n]
        model.config.num_hidden_layers = n
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:n]


def run(args) -> dict:
    from services.run.layers import default_layer_ids
    from services.target.model.model import Target, capture_to_host, decoder_layers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = build_model(args.shape, device)
    keep_layers(model, args.keep_layers)
    layers = decoder_layers(model)
    ids = default_layer_ids(len(layers), args.layers)
    bf16_linears = decoder_linears(layers)
    set_attention(model, "sdpa_packed")  # before Target: it picks the row's attention (varlen or not) from it
    target = Target(model, ids)
    hidden = model.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    rows = {mix: row_of(doc_lengths(args.seq, mix, gen), model.config.vocab_size, gen) for mix in args.mixes.split(",")}
    out = torch.empty(args.seq, target.info.hidden_width, dtype=torch.bfloat16, device=device)
    reference = {mix: capture_to_host(target, row, False, out)[0].clone() for mix, row in rows.items()}  # eager bf16
    result = {
        "shape": args.shape,
        "seq": args.seq,
        "decoder_layers": len(layers),
        "layer_ids": ids,
        "path": target.path,
        "precisions": {},
    }
    for precision in args.precision.split(","):
        start = time.perf_counter()
        summary = set_precision(model, layers, bf16_linears, precision)
        if args.compile:  # the layers hold other modules now: compile them again
            from services.target.model.compiled import compile_and_warm_up

            rec_compile = compile_and_warm_up(target, "on", args.seq, with_labels=False)
            summary += f", compiled in {rec_compile:.0f} s"
        sync()
        rec = {"summary": summary, "quantize_s": time.perf_counter() - start, "mixes": {}}
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for mix, row in rows.items():
            t = timed(lambda: capture_to_host(target, row, False, out), args.iters, args.warmup)
            got = capture_to_host(target, row, False, out)[0]
            rec["mixes"][mix] = {
                "s": t,
                "tok_s": args.seq / t,
                "docs": int(row["document_ids"].max()) + 1,
                "drift": drift(got, reference[mix], hidden),
            }
        rec["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else 0.0
        result["precisions"][precision] = rec
        print(
            f"{precision:10s} {summary} (quantized in {rec['quantize_s']:.1f} s, peak {rec['peak_mem_gb']:.1f} GB)",
            flush=True,
        )
    print(format_result(result), flush=True)
    return result


def format_result(r: dict) -> str:
    names = list(r["precisions"])
    lines = [
        f"{r['shape']} S={r['seq']}, {r['decoder_layers']} decoder layers, captured {r['layer_ids']}, "
        f"capture path {r['path']}",
        f"  {'mix':8s} {'docs':>5s}" + "".join(f"{n:>22s}" for n in names) + "   (tok/s, ratio to bf16)",
    ]
    mixes = list(next(iter(r["precisions"].values()))["mixes"])
    for mix in mixes:
        cells = []
        base = r["precisions"].get("bf16", {}).get("mixes", {}).get(mix)
        for n in names:
            m = r["precisions"][n]["mixes"][mix]
            ratio = f" ({m['tok_s'] / base['tok_s']:.2f}x)" if base else ""
            cells.append(f"{m['tok_s']:.0f}{ratio}".rjust(22))
        docs = r["precisions"][names[0]]["mixes"][mix]["docs"]
        lines.append(f"  {mix:8s} {docs:5d}" + "".join(cells))
    fp8_names = [n for n in names if n != "bf16"]
    for mix in mixes if fp8_names else []:
        lines.append(f"  drift against bf16 on the same row, mix {mix}: relative error / mean cosine / min cosine")
        lines.append(f"  {'layer':>7s}" + "".join(f"{n:>30s}" for n in fp8_names))
        for k, layer in enumerate(r["layer_ids"]):
            cells = [r["precisions"][n]["mixes"][mix]["drift"][k] for n in fp8_names]
            lines.append(
                f"  {layer:7d}"
                + "".join(f"{d['rel_err']:10.4f} {d['cos_mean']:9.5f} {d['cos_min']:9.5f}" for d in cells)
            )
    return "\n".join(lines)


@torch.no_grad()  # the whole benchmark; a decorator, so a test calling main() keeps its grad mode
def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="27b-hybrid", help=f"one of {SHAPES}")
    p.add_argument("--keep-layers", type=int, default=0, help="decoder layers kept (0 = all)")
    p.add_argument("--seq", type=int, default=8192, help="tokens per packed row")
    p.add_argument("--layers", type=int, default=5, help="captured layers K (DFLASH default spread)")
    p.add_argument("--mixes", default="single,short", help=f"comma list of document-length mixes {sorted(MIXES)}")
    p.add_argument("--precision", default=",".join(PRECISIONS), help=f"comma list of {PRECISIONS}")
    p.add_argument("--compile", action="store_true", help="compile the layers for each precision (target.compile)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default="", help="write the result as JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() and args.shape not in ("tiny", "tiny-hybrid"):
        sys.exit("this benchmark needs a CUDA GPU (only the tiny shapes run on CPU, as a smoke test)")
    if unknown := set(args.precision.split(",")) - set(PRECISIONS):
        sys.exit(f"--precision: unknown {sorted(unknown)} (known: {', '.join(PRECISIONS)})")
    import transformers

    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {device_name}", flush=True)
    result = run(args)
    result.update(torch=torch.__version__, transformers=transformers.__version__, device=device_name, args=vars(args))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
