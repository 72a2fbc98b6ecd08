"""Target supply on one GPU: the bare HF forward vs the worker's capture path.

    python bench/target_capture.py --shapes 8b,32b --seq 8192,32768 --out bench-target.json
    python bench/target_capture.py --shapes 27b-hybrid --seq 8192 --mixes single,short,medium
    python bench/target_capture.py --shapes 27b-hybrid --seq 8192 --mixes single,medium --no-fla
    python bench/target_capture.py --shapes 27b-hybrid --seq 4096,8192 --mixes short \
        --precision bf16,fp8-rowwise,fp8-block --compile --recompile-rows 0 --iters 3

Random-weight models of real shapes (bench/shapes.py), built directly on the GPU in bf16 (no
download). For each shape and sequence length it times:
  (a) bare     HF forward of the whole row as one causal sequence, logits_to_keep=1
  (b) capture  the worker's path (services.target.model.model.capture_to_host) on a row of one
               document ("single") or packed documents of a length mix: "short" 50-300 tokens
               (chat turns), "medium" 512-4096; the path the target chose is printed with it
  (c) labels   (b) on the first packed mix, plus target argmax labels, with --labels
  d2h          the pinned device-to-host copy of the [S, K*H] capture alone
  (d) compiled (b) again with the decoder layers compiled (--compile; services/target/model/compiled.py):
               tok/s side by side with (b) in the same run, the compile seconds, the largest
               difference of the captured features from the eager ones on the same row, and the
               graphs compiled over --recompile-rows further rows of random document counts (0 = none)
The packed rows' full-attention layers run as the service runs them (attention= in the first line:
one varlen flash-attention call per row on CUDA in bf16); --attention-ab times (d) again with causal
SDPA per document, the path this bench measured by mistake before 2026-12-07 (its Target was made
before the model was switched to the packed attention, so it chose SDPA per document).
--profile FILE writes torch.profiler's kernel table of one capture of the last mix (eager, and
compiled with --compile) there.
and prints tokens/s, TFLOP/s, MFU (against the bf16 matmul rate measured in the same run) and the
ratio to (a) and to the single-document capture. --no-fla hides flash-linear-attention, so hybrid
models run on transformers' torch fallback (what a user without the kernels gets).
FLOPs count 2 x params of the layers run (plus lm_head for all rows in (c), for one row in (a))
+ causal attention (4 * n^2/2 * heads * head_dim per full-attention layer per document); the
Gated DeltaNet recurrence is not counted, so a hybrid's MFU is a slight underestimate.

--precision (comma list, default bf16) times (b) and (d) for each precision on the same rows, one
after another on the same random weights (bench/precision.py, as bench/target_precision.py does):
  bf16         the weights as built
  fp8-rowwise  target.quantize=fp8 on a bf16 checkpoint: the decoder linears quantized rowwise at load
  fp8-block    an FP8 checkpoint's layout: each weight in 128x128 blocks with its scales
               (dflash::fp8_block_mm), requantized rowwise where this GPU has no block-scaled GEMM
An FP8 precision's records are keyed capture_<mix>@<precision> (bf16's keep their old names). The
bf16 weights stay in memory beside one FP8 copy, or in host memory while FP8 runs where the two overfill
the GPU (the 27B hybrid at full depth on an 80 GB H100: a few seconds of copying per switch).
With --compile, dynamo's graph breaks over the compile and the compiled captures of each precision
(torch._dynamo.utils.counters["graph_break"], reset before) are printed and recorded (graph_breaks,
with their reasons), so an FP8 linear that splits the graph shows as more breaks than bf16's.
Roofline, per capture record: linear FLOPs (2 x the weights of the linears of the layers run, per
token) at the GEMM rate of the precision's layout, plus the attention FLOPs above at the bf16 rate;
the rates are 8192^3 GEMMs measured in the same run (bench/timing.py: matmul_peak_tflops for bf16,
fp8_matmul_tflops rowwise and block-scaled; not measured off CUDA, and then an FP8 record's roofline
is None and says why). It records roofline_s, roofline_tok_s and fraction = roofline_s / measured s.
The bound leaves out the Gated DeltaNet recurrence and short convolution, the norms, the activation
quantization of the FP8 linears, the elementwise work, memory traffic and launch overhead, so a
fraction well under 1 is expected; it says how much of the capture is GEMM-bound work.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from bench.precision import decoder_linears, gemm_layout, needs_offload, set_precision  # noqa: E402
from bench.shapes import SHAPES, text_config  # noqa: E402
from bench.timing import fp8_matmul_tflops, matmul_peak_tflops, sync, timed  # noqa: E402

MIXES = {"single": None, "short": (50, 300), "medium": (512, 4096)}
PRECISIONS = ("bf16", "fp8-rowwise", "fp8-block")


def hide_fla() -> None:
    """Make `import fla` fail from here on, before transformers looks for it."""
    import importlib.abc

    class _NoFla(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "fla" or name.startswith("fla."):
                raise ImportError("flash-linear-attention hidden by --no-fla")
            return None

    sys.meta_path.insert(0, _NoFla())


def build_model(shape: str, device: str):
    from transformers import AutoModelForCausalLM

    from services.target.model.attention import register_packed_sdpa

    register_packed_sdpa()
    cfg = text_config(shape)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


def set_attention(model, name: str) -> None:
    model.config._attn_implementation = name  # read at call time by the attention modules and mask code


def layer_params(layer) -> int:
    """Parameters of a decoder layer, an FP8Linear's weight (a buffer) counted as its [N, K]."""
    from services.target.model.fp8 import FP8Linear

    fp8 = sum(m.weight.numel() for m in layer.modules() if isinstance(m, FP8Linear))
    return sum(p.numel() for p in layer.parameters()) + fp8


def linear_params(layer) -> int:
    """Weights of the layer's linears (nn.Linear or FP8Linear): the GEMMs of the roofline."""
    from services.target.model.fp8 import FP8Linear

    return sum(m.weight.numel() for m in layer.modules() if isinstance(m, (nn.Linear, FP8Linear)))


def attention_flops(model, doc_lens: list[int], layers_run: int) -> float:
    c = model.config
    full = sum(1 for layer in model.model.layers[:layers_run] if hasattr(layer, "self_attn"))
    return full * sum(4 * n * n / 2 * c.num_attention_heads * c.head_dim for n in doc_lens)


def flops(model, doc_lens: list[int], layers_run: int, lm_rows: int) -> float:
    params = sum(layer_params(layer) for layer in model.model.layers[:layers_run])
    attn = attention_flops(model, doc_lens, layers_run)
    return 2 * params * sum(doc_lens) + attn + 2 * model.lm_head.weight.numel() * lm_rows


def roofline(model, doc_lens: list[int], layers_run: int, seconds: float, rates: dict, layout: str) -> dict:
    """The time bound of a capture: linear FLOPs at the GEMM rate of `layout` ("bf16", "rowwise",
    "block"; TFLOP/s in `rates`, None where not measured) + attention FLOPs at the bf16 rate."""
    linear = 2 * sum(linear_params(layer) for layer in model.model.layers[:layers_run]) * sum(doc_lens)
    attn = attention_flops(model, doc_lens, layers_run)
    out = {"linear_flops": linear, "attention_flops": attn, "gemm": layout}
    if not rates.get(layout) or not rates.get("bf16"):
        return out | {
            "roofline_s": None,
            "roofline_tok_s": None,
            "fraction": None,
            "roofline_note": f"no {layout} GEMM rate measured on this device",
        }
    bound = linear / (rates[layout] * 1e12) + attn / (rates["bf16"] * 1e12)
    return out | {"roofline_s": bound, "roofline_tok_s": sum(doc_lens) / bound, "fraction": bound / seconds}


def doc_lengths(seq: int, mix: str, gen: torch.Generator) -> list[int]:
    if MIXES[mix] is None:
        return [seq]
    lo, hi = MIXES[mix]
    lens, left = [], seq
    while left > 0:
        n = min(left, int(torch.randint(lo, hi + 1, (1,), generator=gen)))
        lens.append(n)
        left -= n
    return lens


def row_of(doc_lens: list[int], vocab: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    s = sum(doc_lens)
    return {
        "input_ids": torch.randint(0, vocab, (s,), generator=gen),
        "position_ids": torch.cat([torch.arange(n) for n in doc_lens]),
        "document_ids": torch.cat([torch.full((n,), i) for i, n in enumerate(doc_lens)]),
        "loss_mask": torch.ones(s, dtype=torch.bool),
    }


def bench_shape(shape: str, seqs: list[int], args) -> list[dict]:
    from services.run.layers import default_layer_ids
    from services.target.model.model import Target, capture_to_host, decoder_layers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(shape, device)
    L = model.config.num_hidden_layers
    ids = default_layer_ids(L, args.layers)
    layers = decoder_layers(model)
    bf16_linears = decoder_linears(layers)  # kept: set_precision puts them back between precisions
    precisions = args.precision.split(",")
    offload = any(p != "bf16" for p in precisions) and needs_offload(bf16_linears)
    if offload:
        print("bf16 weights and an FP8 copy overfill this GPU: bf16 waits in host memory during FP8", flush=True)
    target = None  # made after the first bare forward: that one is transformers' own, unmodified
    gen = torch.Generator().manual_seed(0)
    rates = {"bf16": args.peak_tflops or matmul_peak_tflops(device)}  # TFLOP/s, measured in this run
    if any(p != "bf16" for p in precisions):
        rates |= {layout: fp8_matmul_tflops(device, layout) for layout in ("rowwise", "block")}
    peak = rates["bf16"] * 1e12
    print("GEMM rates (8192^3, TFLOP/s): " + ", ".join(f"{k} {fmt_rate(v)}" for k, v in rates.items()), flush=True)
    results = []
    for seq in seqs:
        rec = {"shape": shape, "seq_len": seq, "layer_ids": ids, "hidden_width": len(ids) * model.config.hidden_size}
        rec["gemm_tflops"] = rates
        single = row_of([seq], model.config.vocab_size, gen)

        set_precision(model, layers, bf16_linears, "bf16", offload)
        if target is not None:
            target.slot.compiled = False
        set_attention(model, "sdpa")
        bare_ids = single["input_ids"].to(device)[None]
        t = timed(lambda: model(input_ids=bare_ids, use_cache=False, logits_to_keep=1), args.iters, args.warmup)
        f = flops(model, [seq], L, 1)
        rec["bare"] = {"s": t, "tok_s": seq / t, "tflops": f / t / 1e12, "mfu": f / t / peak}
        set_attention(model, "sdpa_packed")  # before Target: it picks the row's attention (varlen or not) from it
        target = target or Target(model, ids)  # hybrid models: installs the packed Gated DeltaNet
        out = torch.empty(seq, target.info.hidden_width, dtype=torch.bfloat16, device=device)
        rec["path"], rec["attention"] = target.path, target.attention
        rows = {}  # mix -> (document lengths, row): every precision and (d) time the same rows
        for mix in args.mixes.split(","):
            lens = doc_lengths(seq, mix, gen)
            rows[mix] = lens, row_of(lens, model.config.vocab_size, gen)
        for precision in precisions:
            sfx = "" if precision == "bf16" else f"@{precision}"  # bf16's keys are the ones before --precision
            summary = set_precision(model, layers, bf16_linears, precision, offload)
            rec.setdefault("precision_summary", {})[precision] = summary
            if precision != "bf16":
                print(f"  {precision}: {summary}", flush=True)
            layout = gemm_layout(layers)
            target.slot.compiled = False  # eager first; (d) compiles the layers as they now are
            for mix, (lens, row) in rows.items():
                t = timed(lambda: capture_to_host(target, row, False, out), args.iters, args.warmup)
                f = flops(model, lens, ids[-1] + 1, 0)
                m = rec[f"capture_{mix}{sfx}"] = {
                    "s": t,
                    "tok_s": seq / t,
                    "tflops": f / t / 1e12,
                    "mfu": f / t / peak,
                    "docs": len(lens),
                    "ratio_vs_bare": rec["bare"]["s"] / t,
                }
                if f"capture_single{sfx}" in rec:
                    m["ratio_vs_single"] = rec[f"capture_single{sfx}"]["s"] / t
                m |= roofline(model, lens, ids[-1] + 1, t, rates, layout)
                if mix != "single" and args.labels and precision == "bf16" and "labels_packed" not in rec:
                    t = timed(lambda: capture_to_host(target, row, True, out), args.iters, args.warmup)
                    f = flops(model, lens, L, seq)
                    rec["labels_packed"] = {
                        "s": t,
                        "tok_s": seq / t,
                        "tflops": f / t / 1e12,
                        "mfu": f / t / peak,
                        "ratio_vs_bare": rec["bare"]["s"] / t,
                    }
            if precision == precisions[0]:
                d2h_record(rec, out, device, args, sfx)
                if args.profile:
                    profile(target, row, out, args.profile, f"{shape} S={seq} {precision} eager")
            if args.compile:
                compiled_records(target, rec, seq, model, ids, out, gen, peak, args, rows, sfx, rates, layout)
        set_precision(model, layers, bf16_linears, "bf16", offload)
        rec["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else 0.0
        results.append(rec)
        print(format_record(rec), flush=True)
        out = None  # free it (the closures above read the name)
    target = model = bf16_linears = layers = None
    if device == "cuda":
        torch.cuda.empty_cache()
    return results


def fmt_rate(v) -> str:
    return "not measured" if v is None else f"{v:.1f}"


def d2h_record(rec: dict, out: torch.Tensor, device: str, args, sfx: str) -> None:
    def d2h():
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=device == "cuda")
        host.copy_(out, non_blocking=True)
        sync()

    t = timed(d2h, args.iters, args.warmup)
    nbytes = out.numel() * out.element_size()
    last = rec[f"capture_{args.mixes.split(',')[-1]}{sfx}"]
    rec["d2h"] = {"s": t, "bytes": nbytes, "gb_s": nbytes / t / 1e9, "share_of_capture": t / last["s"]}


def drift(got: torch.Tensor, ref: torch.Tensor, hidden: int) -> list[dict]:
    """Per captured layer (columns of `hidden`): relative error, mean and minimum cosine over tokens."""
    out = []
    for k in range(ref.shape[1] // hidden):
        g, r = got[:, k * hidden : (k + 1) * hidden].float(), ref[:, k * hidden : (k + 1) * hidden].float()
        cos = torch.nn.functional.cosine_similarity(g, r, dim=-1)
        out.append(
            {"rel_err": float((g - r).norm() / r.norm()), "cos_mean": float(cos.mean()), "cos_min": float(cos.min())}
        )
    return out


def compiled_records(
    target, rec: dict, seq: int, model, ids, out, gen, peak, args, rows: dict, sfx: str = "", rates=None, layout="bf16"
) -> None:
    """(d): the same rows through the compiled layers, then rows of random document counts; the
    graph breaks dynamo counted over the compile and these captures (torch._dynamo.utils.counters)."""
    from torch._dynamo.utils import counters

    from services.process.compile_setup import graphs_compiled
    from services.target.model.compiled import compile_and_warm_up
    from services.target.model.model import capture_to_host

    torch._dynamo.reset()  # the layers may hold other modules than at the last compile: start afresh
    counters["graph_break"].clear()
    rec[f"compile_s{sfx}"] = compile_and_warm_up(target, "on", seq, with_labels=False)
    for mix, (lens, row) in rows.items():
        target.slot.compiled = False
        want = capture_to_host(target, row, False, out)[0].clone()
        target.slot.compiled = True
        got = capture_to_host(target, row, False, out)[0].clone()
        t = timed(lambda: capture_to_host(target, row, False, out), args.iters, args.warmup)
        f = flops(model, lens, ids[-1] + 1, 0)
        eager = rec[f"capture_{mix}{sfx}"]
        rec[f"compiled_{mix}{sfx}"] = {
            "s": t,
            "tok_s": seq / t,
            "tflops": f / t / 1e12,
            "mfu": f / t / peak,
            "docs": len(lens),
            "ratio_vs_eager": eager["s"] / t,
            "drift_vs_eager": drift(got, want, model.config.hidden_size),
        } | roofline(model, lens, ids[-1] + 1, t, rates or {}, layout)
        if args.attention_ab and target.varlen:  # the same compiled layers with SDPA per document beside it
            target.varlen = False
            try:
                per_doc = timed(lambda: capture_to_host(target, row, False, out), args.iters, args.warmup)
            finally:  # the later rows and precisions run the service's attention again
                target.varlen = True
            ab = {"per_document_attention_tok_s": seq / per_doc, "varlen_vs_per_document": per_doc / t}
            rec[f"compiled_{mix}{sfx}"] |= ab
    breaks = counters["graph_break"]
    rec[f"graph_breaks{sfx}"] = {"total": sum(breaks.values()), "reasons": {k[:300]: v for k, v in breaks.items()}}
    before = graphs_compiled()
    for _ in range(args.recompile_rows):
        mix = ["single", "short", "medium"][int(torch.randint(0, 3, (1,), generator=gen))]
        capture_to_host(target, row_of(doc_lengths(seq, mix, gen), model.config.vocab_size, gen), False, out)
    rec[f"recompiles{sfx}"] = {"rows": args.recompile_rows, "graphs_compiled": graphs_compiled() - before}
    if args.profile:
        profile(target, row, out, args.profile, f"compiled {len(lens)} docs{sfx}")


def profile(target, row, out, path: str, title: str) -> None:
    from torch.profiler import ProfilerActivity

    from services.target.model.model import capture_to_host

    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        capture_to_host(target, row, False, out)
        sync()
    table = prof.key_averages().table(
        sort_by="cuda_time_total" if torch.cuda.is_available() else "cpu_time_total",
        row_limit=30,
        max_name_column_width=70,
    )
    with open(path, "a") as f:
        f.write(f"== {title}\n{table}\n")


def format_record(r: dict) -> str:
    def line(name, m):
        extra = f"  vs bare {m['ratio_vs_bare']:.3f}" if "ratio_vs_bare" in m else ""
        extra += f"  vs single {m['ratio_vs_single']:.3f}" if "ratio_vs_single" in m else ""
        extra += f"  vs eager {m['ratio_vs_eager']:.3f}" if "ratio_vs_eager" in m else ""
        docs = f"  ({m['docs']} docs)" if "docs" in m else ""
        text = f"  {name:26s} {m['tok_s']:10.0f} tok/s  {m['tflops']:6.1f} TFLOP/s  MFU {m['mfu']:.1%}{extra}{docs}"
        if "per_document_attention_tok_s" in m:
            text += f"\n  {'':26s} SDPA per document instead: {m['per_document_attention_tok_s']:10.0f} tok/s"
            text += f" (varlen {m['varlen_vs_per_document']:.3f}x)"
        if "roofline_s" in m:
            text += f"\n  {'':26s} roofline ({m['gemm']} GEMM) " + (
                f"{m['roofline_tok_s']:10.0f} tok/s, fraction {m['fraction']:.1%}"
                if m["fraction"] is not None
                else m["roofline_note"]
            )
        return text

    rows = [
        f"{r['shape']} S={r['seq_len']} layers {r['layer_ids']} (width {r['hidden_width']}), "
        f"capture path {r['path']}, attention {r['attention']}, peak mem {r['peak_mem_gb']:.1f} GB"
    ]
    for name in ["bare"] + [k for k in r if k.startswith(("capture_", "compiled_"))] + ["labels_packed"]:
        if name in r:
            rows.append(line(name, r[name]))
    for name in [k for k in r if k.startswith("compiled_")]:
        m = r[name]
        rows.append(f"  {name}: per captured layer, relative error / mean cosine against the eager capture")
        for layer, d in zip(r["layer_ids"], m["drift_vs_eager"]):
            rows.append(f"    layer {layer:3d}  {d['rel_err']:.4f} / {d['cos_mean']:.5f}")
    for key in [k for k in r if k.startswith("recompiles")]:
        sfx = key.removeprefix("recompiles")
        breaks = r[f"graph_breaks{sfx}"]
        rows.append(
            f"  compile{sfx:19s} {r[f'compile_s{sfx}']:.1f} s before the first row; "
            f"{r[key]['graphs_compiled']} graphs compiled over {r[key]['rows']} later rows; "
            f"graph breaks {breaks['total']}"
            + (f" ({breaks['total'] - r['graph_breaks']['total']:+d} vs bf16)" if sfx and "graph_breaks" in r else "")
        )
        rows += [f"    {n} x {reason.splitlines()[0][:160]}" for reason, n in breaks["reasons"].items()]
    d = r["d2h"]
    rows.append(
        f"  d2h                        {d['bytes'] / 1e6:8.0f} MB in {d['s'] * 1e3:.1f} ms = {d['gb_s']:.1f} GB/s, "
        f"{d['share_of_capture']:.1%} of the packed capture"
    )
    return "\n".join(rows)


@torch.no_grad()  # the whole benchmark; a decorator, so a test calling main() keeps its grad mode
def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="8b,32b", help=f"comma list of {SHAPES}")
    p.add_argument("--seq", default="8192,32768", help="comma list of packed row lengths")
    p.add_argument("--layers", type=int, default=5, help="captured layers K (DFLASH default spread)")
    p.add_argument("--mixes", default="single,medium", help=f"comma list of document-length mixes {sorted(MIXES)}")
    p.add_argument("--no-fla", action="store_true", help="hide flash-linear-attention (the torch fallback)")
    p.add_argument("--labels", action="store_true", help="also time capture + target argmax labels")
    p.add_argument("--compile", action="store_true", help="also time the capture with compiled layers (d)")
    p.add_argument("--recompile-rows", type=int, default=20, help="rows of random document counts after (d)")
    p.add_argument(
        "--attention-ab",
        action="store_true",
        help="(d) again with SDPA per document in place of varlen attention (this bench's path before 2026-12-07)",
    )
    p.add_argument("--profile", default="", help="append torch.profiler kernel tables here")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument(
        "--peak-tflops", type=float, default=0.0, help="bf16 peak for MFU; 0 = measure an 8192^3 matmul in this run"
    )
    p.add_argument(
        "--precision", default="bf16", help=f"comma list of {PRECISIONS}, each timed on the same rows in this run"
    )
    p.add_argument("--out", default="", help="write all records as JSON here")
    args = p.parse_args(argv)
    if unknown := set(args.precision.split(",")) - set(PRECISIONS):
        sys.exit(f"--precision: unknown {sorted(unknown)} (known: {', '.join(PRECISIONS)})")
    if not torch.cuda.is_available() and not set(args.shapes.split(",")) <= {"tiny", "tiny-hybrid"}:
        sys.exit("this benchmark needs a CUDA GPU (only the tiny shapes run on CPU, as a smoke test)")
    if args.no_fla:
        hide_fla()
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {device_name}", flush=True)
    records = []
    for shape in args.shapes.split(","):
        records += bench_shape(shape.strip(), [int(s) for s in args.seq.split(",")], args)
    if args.out:
        meta = {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "device": device_name,
            "args": vars(args),
        }
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=2)
    return records


if __name__ == "__main__":
    main()
