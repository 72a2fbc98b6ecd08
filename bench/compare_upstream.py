"""The project's greedy DFlash loop against z-lab's reference loop, on the same export, target and prompts.

`launcher eval` measures real acceptance with this project's own loop (services/drafter/acceptance/speculative.py).
This script checks those figures against z-lab's `dflash_generate` (dflash/model.py of
https://github.com/z-lab/dflash), which loads the export with its own `DFlashDraftModel` (config.json +
model.safetensors) and drafts with a KV cache on the drafter side. Both loops run greedy on the
held-out prompts `launcher eval` decodes (same run config, same count, same token limit, same stop
tokens), and the script prints, per loop: mean acceptance length per prompt and per step, tokens per
target forward, how many outputs equal the target's plain greedy output (HF generate); then how many
prompts the two loops agree on (same output; same tokens committed at every step).

z-lab's code is not part of this project: fetch the file yourself and pass its path, e.g.

    curl -L -o /tmp/zlab/model.py https://raw.githubusercontent.com/z-lab/dflash/<commit>/dflash/model.py
    python bench/compare_upstream.py --upstream /tmp/zlab/model.py --run-dir runs/latest \
        [--checkpoint runs/latest/export] [--prompts 32] [--max-new-tokens 128] [--json]

It needs the transformers version that file was written for (it imports Qwen3 internals and uses
DynamicCache.activate_past_recording). The file is used as it is; on a machine without CUDA its
timer (`_cuda_time`, which calls torch.cuda.synchronize) is replaced at runtime by a plain
perf_counter. Its drafter loads at the target's dtype (fp32 on CPU), as `launcher eval` loads ours.
The sha256 of the file is printed with the figures, so a result names the code it was measured with.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/compare_upstream.py` from a checkout

from services.drafter.acceptance.speculative import Decoded, speculative_generate, summarize  # noqa: E402
from services.eval.launcher_eval import load_weights  # noqa: E402
from services.eval.local_spec_eval import LocalSpecEval  # noqa: E402


def load_upstream(path: str):
    """z-lab's dflash/model.py as a module, with what this script calls checked up front."""
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"compare_upstream: error: --upstream {path}: no such file (fetch z-lab's dflash/model.py)")
    spec = importlib.util.spec_from_file_location("dflash_upstream_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    missing = [name for name in ("dflash_generate", "DFlashDraftModel") if not hasattr(module, name)]
    if missing:
        raise SystemExit(f"compare_upstream: error: {path} has no {', '.join(missing)}: not z-lab's dflash/model.py?")
    if not torch.cuda.is_available() and hasattr(module, "_cuda_time"):
        module._cuda_time = time.perf_counter  # its stats timer syncs CUDA
    return module, hashlib.sha256(path.read_bytes()).hexdigest()


def load_upstream_drafter(module, export: Path, dtype):
    """The export through upstream's loader; missing or unexpected tensors are an error, not random weights."""
    model, info = module.DFlashDraftModel.from_pretrained(str(export), dtype=dtype, output_loading_info=True)
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        raise SystemExit(f"compare_upstream: error: upstream's loader does not take {export} as it is: {bad}")
    return model.eval()


def upstream_generate(module, drafter, target, prompt: list[int], max_new_tokens: int, stop_ids) -> Decoded:
    """One prompt through z-lab's loop, as a Decoded (the prefill is a target forward, then one per step).
    target: the HF model of LocalSpecEval's Target, run with HF's own sdpa (upstream passes no document spans)."""
    ids = torch.tensor([prompt], dtype=torch.long, device=target.device)
    saved, target.config._attn_implementation = target.config._attn_implementation, "sdpa"
    with warnings.catch_warnings():  # transformers' past_key_values rename
        warnings.simplefilter("ignore", FutureWarning)
        out = module.dflash_generate(
            drafter, target, ids, max_new_tokens, list(stop_ids), temperature=0.0, return_stats=True
        )
    target.config._attn_implementation = saved
    steps = [int(n) for n in out.acceptance_lengths]
    return Decoded(out.output_ids[0, len(prompt) :].tolist(), steps, 1 + len(steps))


def compare(ours: list[Decoded], theirs: list[Decoded]) -> dict:
    """Per-prompt agreement of the two loops."""
    per_prompt = [
        abs(sum(a.steps) / max(1, len(a.steps)) - sum(b.steps) / max(1, len(b.steps))) for a, b in zip(ours, theirs)
    ]
    return {
        "prompts": len(ours),
        "same_output": sum(a.tokens == b.tokens for a, b in zip(ours, theirs)),
        "same_steps": sum(a.steps == b.steps for a, b in zip(ours, theirs)),
        "max_abs_diff_per_prompt": max(per_prompt, default=0.0),
    }


def main(argv=None) -> int:
    from services.decoding.acceptance_text import describe_prompts
    from services.run.config import load_config

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", required=True, help="path to z-lab's dflash/model.py (fetched by you)")
    p.add_argument("--run-dir", default="runs/latest", help="the run: its config.json names the target and the data")
    p.add_argument("--checkpoint", help="the export to compare (default: <run-dir>/export)")
    p.add_argument("--prompts", type=int, default=32, help="held-out prompts (launcher eval's default)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="launcher eval's default")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--per-prompt", action="store_true", help="also print both loops' acceptance for every prompt")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    args = p.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    module, digest = load_upstream(args.upstream)
    run_dir = Path(args.run_dir)
    export = Path(args.checkpoint or run_dir / "export")
    cfg = load_config(run_dir / "config.json")
    weights, model_cfg, what = load_weights(export)
    if not what.startswith("export"):
        raise SystemExit(
            f"compare_upstream: error: {export} is not an export (upstream loads config.json + "
            "model.safetensors): run `launcher export` first"
        )
    spec = LocalSpecEval(cfg, args.device, prompts=args.prompts, max_new_tokens=args.max_new_tokens)
    if not spec.prompts:
        raise SystemExit(f"compare_upstream: error: no chat prompts in the held-out data of {run_dir}")
    references = spec.references(len(spec.prompts))

    propose, ours, t0 = spec.proposer(weights, model_cfg), [], time.perf_counter()
    for prompt in spec.prompts:
        ours.append(
            speculative_generate(
                spec.verifier, propose, prompt, max_new_tokens=args.max_new_tokens, stop_ids=spec.stop_ids
            )
        )
    ours_s = time.perf_counter() - t0
    drafter, theirs, t0 = load_upstream_drafter(module, export, spec.dtype), [], time.perf_counter()
    for prompt in spec.prompts:
        theirs.append(upstream_generate(module, drafter, spec.target.model, prompt, args.max_new_tokens, spec.stop_ids))
    theirs_s = time.perf_counter() - t0

    result = {
        "drafter": what,
        "upstream_sha256": digest,
        "block_size": model_cfg.block_size,
        "max_new_tokens": args.max_new_tokens,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "project": summarize(ours, references, ours_s),
        "upstream": summarize(theirs, references, theirs_s),
        "agreement": compare(ours, theirs),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"{what}: {describe_prompts(len(spec.prompts), spec.held_out)}, block {model_cfg.block_size}, greedy, up to "
        f"{args.max_new_tokens} new tokens; upstream {args.upstream} (sha256 {digest[:12]})"
    )
    print(f"{'loop':<9} {'per prompt':>10} {'per step':>9} {'tok/fwd':>8} {'lossless':>9} {'steps':>6} {'seconds':>8}")
    for name in ("project", "upstream"):
        r = result[name]
        print(
            f"{name:<9} {r['acceptance_per_prompt']:>10.3f} {r['acceptance_per_step']:>9.3f} "
            f"{r['tokens_per_forward']:>8.3f} {r['lossless']:>5}/{r['prompts']:<3} {r['steps']:>6} "
            f"{r['seconds']:>8.1f}"
        )
    a = result["agreement"]
    print(
        f"agreement: same output {a['same_output']}/{a['prompts']}, same tokens at every step "
        f"{a['same_steps']}/{a['prompts']}, largest per-prompt difference in acceptance "
        f"{a['max_abs_diff_per_prompt']:.3f}"
    )
    if args.per_prompt:
        for i, (x, y) in enumerate(zip(ours, theirs)):
            print(
                f"  prompt {i:>3}: project {sum(x.steps) / max(1, len(x.steps)):.3f} ({len(x.steps)} steps)  "
                f"upstream {sum(y.steps) / max(1, len(y.steps)):.3f} ({len(y.steps)} steps)"
                + ("" if x.steps == y.steps else "  steps differ")
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
