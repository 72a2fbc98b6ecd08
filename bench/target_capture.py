"""Target supply on one GPU: the bare HF forward vs the worker's capture path.

    python bench/target_capture.py --shapes 8b,32b --seq 8192,32768 --out bench-target.json

Random-weight Qwen3 models of real shapes, built directly on the GPU in bf16 (no download).
For each shape and sequence length it times:
  (a) bare     HF forward of the whole row as one causal sequence, logits_to_keep=1
               (FINDINGS.md's baseline: sdpa, no packing)
  (b) capture  the worker's path (services.target.model.capture_to_host): packed documents, per-document
               causal SDPA, hooks on the K captured layers, stop after the deepest, copy into a
               pinned host buffer; with --docs single (one document per row) and packed
               (document lengths drawn from --doc-len)
  (c) labels   (b) packed, plus target argmax labels (full depth + chunked lm_head), with --labels
  d2h          the pinned device-to-host copy of the [S, K*H] capture alone
and prints tokens/s, TFLOP/s, MFU (against the bf16 matmul rate measured in the same run) and the ratio (b)/(a). Goal: >= 0.95.
FLOPs count what each path must compute: 2 x params of the layers run (plus lm_head for all rows in
(c), for one row in (a)) + causal attention (4 * n^2/2 * heads * head_dim per layer per document).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script from anywhere
from bench.timing import matmul_peak_tflops, sync, timed  # noqa: E402

SHAPES = {
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,   # CPU smoke test
                 num_key_value_heads=2, head_dim=64, vocab_size=4096, tie_word_embeddings=False),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
    "32b": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
}


def build_model(shape: str, device: str):
    from transformers import AutoModelForCausalLM, Qwen3Config
    from services.target.model import _register_packed_sdpa
    _register_packed_sdpa()
    cfg = Qwen3Config(max_position_embeddings=40960, **SHAPES[shape])
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


def set_attention(model, name: str) -> None:
    model.config._attn_implementation = name   # read at call time by the attention modules and mask code


def layer_params(model) -> tuple[int, int]:
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    return layer, model.lm_head.weight.numel()


def flops(model, doc_lens: list[int], layers_run: int, lm_rows: int) -> float:
    c = model.config
    per_layer, lm = layer_params(model)
    s = sum(doc_lens)
    attn = sum(4 * n * n / 2 * c.num_attention_heads * c.head_dim for n in doc_lens)
    return layers_run * (2 * per_layer * s + attn) + 2 * lm * lm_rows


def doc_lengths(seq: int, mode: str, lo: int, hi: int, gen: torch.Generator) -> list[int]:
    if mode == "single":
        return [seq]
    lens, left = [], seq
    while left > 0:
        n = min(left, int(torch.randint(lo, hi + 1, (1,), generator=gen)))
        lens.append(n)
        left -= n
    return lens


def row_of(doc_lens: list[int], vocab: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    s = sum(doc_lens)
    return {"input_ids": torch.randint(0, vocab, (s,), generator=gen),
            "position_ids": torch.cat([torch.arange(n) for n in doc_lens]),
            "document_ids": torch.cat([torch.full((n,), i) for i, n in enumerate(doc_lens)]),
            "loss_mask": torch.ones(s, dtype=torch.bool)}


def bench_shape(shape: str, seqs: list[int], args) -> list[dict]:
    from services.target.model import Target, capture_to_host, default_layer_ids
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(shape, device)
    L = model.config.num_hidden_layers
    ids = default_layer_ids(L, args.layers)
    target = Target(model, ids)
    gen = torch.Generator().manual_seed(0)
    peak = (args.peak_tflops or matmul_peak_tflops(device)) * 1e12
    results = []
    for seq in seqs:
        rec = {"shape": shape, "seq_len": seq, "layer_ids": ids, "hidden_width": target.info.hidden_width}
        single = row_of([seq], model.config.vocab_size, gen)

        set_attention(model, "sdpa")
        bare_ids = single["input_ids"].to(device)[None]
        t = timed(lambda: model(input_ids=bare_ids, use_cache=False, logits_to_keep=1), args.iters, args.warmup)
        f = flops(model, [seq], L, 1)
        rec["bare"] = {"s": t, "tok_s": seq / t, "tflops": f / t / 1e12, "mfu": f / t / peak}

        set_attention(model, "sdpa_packed")
        out = torch.empty(seq, target.info.hidden_width, dtype=torch.bfloat16, device=device)
        for mode in ("single", "packed"):
            lens = doc_lengths(seq, mode, args.doc_min, args.doc_max, gen)
            row = row_of(lens, model.config.vocab_size, gen)
            t = timed(lambda: capture_to_host(target, row, False, out), args.iters, args.warmup)
            f = flops(model, lens, ids[-1] + 1, 0)
            rec[f"capture_{mode}"] = {"s": t, "tok_s": seq / t, "tflops": f / t / 1e12, "mfu": f / t / peak,
                                      "docs": len(lens), "ratio_vs_bare": rec["bare"]["s"] / t}
            if mode == "packed" and args.labels:
                t = timed(lambda: capture_to_host(target, row, True, out), args.iters, args.warmup)
                f = flops(model, lens, L, seq)
                rec["labels_packed"] = {"s": t, "tok_s": seq / t, "tflops": f / t / 1e12, "mfu": f / t / peak,
                                        "ratio_vs_bare": rec["bare"]["s"] / t}

        def d2h():
            host = torch.empty(out.shape, dtype=out.dtype, pin_memory=device == "cuda")
            host.copy_(out, non_blocking=True)
            sync()
        t = timed(d2h, args.iters, args.warmup)
        nbytes = out.numel() * out.element_size()
        rec["d2h"] = {"s": t, "bytes": nbytes, "gb_s": nbytes / t / 1e9,
                      "share_of_capture": t / rec["capture_packed"]["s"]}
        rec["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else 0.0
        results.append(rec)
        print(format_record(rec), flush=True)
        del out
    del target, model
    if device == "cuda":
        torch.cuda.empty_cache()
    return results


def format_record(r: dict) -> str:
    def line(name, m):
        extra = f"  ratio {m['ratio_vs_bare']:.3f}" if "ratio_vs_bare" in m else ""
        docs = f"  ({m['docs']} docs)" if "docs" in m else ""
        return f"  {name:16s} {m['tok_s']:10.0f} tok/s  {m['tflops']:6.1f} TFLOP/s  MFU {m['mfu']:.1%}{extra}{docs}"
    rows = [f"{r['shape']} S={r['seq_len']} layers {r['layer_ids']} (width {r['hidden_width']}), peak mem {r['peak_mem_gb']:.1f} GB"]
    for name in ("bare", "capture_single", "capture_packed", "labels_packed"):
        if name in r:
            rows.append(line(name, r[name]))
    d = r["d2h"]
    rows.append(f"  d2h              {d['bytes'] / 1e6:8.0f} MB in {d['s'] * 1e3:.1f} ms = {d['gb_s']:.1f} GB/s, "
                f"{d['share_of_capture']:.1%} of the packed capture")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="8b,32b", help=f"comma list of {sorted(SHAPES)}")
    p.add_argument("--seq", default="8192,32768", help="comma list of packed row lengths")
    p.add_argument("--layers", type=int, default=5, help="captured layers K (DFLASH default spread)")
    p.add_argument("--doc-min", type=int, default=512)
    p.add_argument("--doc-max", type=int, default=4096)
    p.add_argument("--labels", action="store_true", help="also time capture + target argmax labels")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--peak-tflops", type=float, default=0.0, help="bf16 peak for MFU; 0 = measure an 8192^3 matmul in this run")
    p.add_argument("--out", default="", help="write all records as JSON here")
    args = p.parse_args()
    if not torch.cuda.is_available() and args.shapes != "tiny":
        sys.exit("this benchmark needs a CUDA GPU (only --shapes tiny runs on CPU, as a smoke test)")
    torch.set_grad_enabled(False)
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {device_name}", flush=True)
    records = []
    for shape in args.shapes.split(","):
        records += bench_shape(shape.strip(), [int(s) for s in args.seq.split(",")], args)
    if args.out:
        meta = {"torch": torch.__version__, "transformers": transformers.__version__, "device": device_name,
                "args": vars(args)}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=2)


if __name__ == "__main__":
    main()
