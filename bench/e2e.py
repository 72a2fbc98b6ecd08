"""The whole service on any topology, against what its roles can do alone, measured in one call.

    python bench/e2e.py --gpus 0:target,1:drafter --shape 27b-hybrid --steps 60 --out $OUT/e2e.json
    python bench/e2e.py --gpus 0:target,0:drafter --shape 8b --steps 200 --drafter-json $OUT/drafter.json
    python bench/e2e.py --gpus 0:target,0:drafter --share-gpus --shape 27b-hybrid --steps 40 --eval-every 10 --no-alone
    python bench/e2e.py --gpus 0:target,0:drafter --shape 27b-hybrid --config presets/qwen3.6-27b.toml \
        --drafter-json $OUT/drafter_fp8_27b.json data.pack_len=4096 target.quantize='"fp8"'    # the users' preset
    python bench/e2e.py ... --fp8-checkpoint target.quantize='"fp8"'    # the same from an FP8 checkpoint (27 GB)

1. Assets: a random-weight target of the shape (bench/shapes.py; hybrid shapes are saved as the
   composite Qwen3_5ForConditionalGeneration checkpoint, like the real Qwen3.6-27B) with the demo's
   tokenizer, and the demo's chat data (short documents: about 160 per 8192-token row).
2. A, the target alone: the worker's own capture path (load_target, the packed data cache,
   target.compile as the run's config sets it, capture_to_host) on the first rows of the same
   data, on GPU 0. B, the drafter alone, comes from
   a bench/drafter_step.py JSON of the same call when given (--drafter-json).
3. The service: `launcher up --gpus SPEC` (with --share-gpus when a GPU holds both roles).
It prints trained tok/s in steady state (metrics after --skip steps), the drafter data-wait, and
the efficiency against the ideal: separate GPUs, min(targets x A, drafters x B); shared GPUs, the
harmonic combination 1 / (1/A + 1/B) per GPU. Without B, the ideal is the target side's alone.
A runs in a child process, so its model and CUDA context are gone before the service starts.

With --eval-every E the run evaluates every E steps (held-out tau and real acceptance, verified by
the target worker), and the same run gives the eval on/off comparison: trained tok/s over the steps
whose log window holds no evaluation (off) and over all steps including the evaluations (on), drafter
rank 0's peak GPU memory before the first evaluation (off) and at the end (on), and the real-
acceptance eval's seconds per prompt (drafter-0's spec_eval events).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.shapes import HYBRID, SHAPES, checkpoint_config  # noqa: E402

COMMON = [
    "data.pack_len=8192",
    "run.epochs=20",
    "checkpoint.every=100000",
    "checkpoint.export_at_end=false",
    "log.every=1",
    "eval.every=0",
]


def make_assets(
    work: Path, shape: str, conversations: int, layers: int = 0, fp8_checkpoint: bool = False
) -> tuple[Path, Path]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5 import Qwen3_5ForConditionalGeneration

    from services.tools.demo import make_demo

    demo = make_demo(work / "demo", num_conversations=conversations)
    model_dir = work / (f"{shape}-random" + (f"-{layers}layers" if layers else "") + ("-fp8" if fp8_checkpoint else ""))
    if not (model_dir / "config.json").exists():
        config = checkpoint_config(shape)
        text = getattr(config, "text_config", config)
        if layers:  # the first `layers` decoder layers of the shape, same mix of layer types
            text.num_hidden_layers = layers
            if getattr(text, "layer_types", None):
                text.layer_types = text.layer_types[:layers]
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = (
                Qwen3_5ForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
                if shape in HYBRID
                else AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
            )
        if fp8_checkpoint:  # the published FP8 layout: half the bytes to write and to load
            from bench.fp8_checkpoint import save_fp8

            print(f"{save_fp8(model, model_dir)} decoder linears saved in FP8 blocks", flush=True)
        else:
            model.save_pretrained(model_dir, max_shard_size="5GB")
        del model
        torch.cuda.empty_cache()
        for f in Path(demo["model_path"]).iterdir():
            if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
                shutil.copy(f, model_dir / f.name)
    return model_dir, Path(demo["data_path"])


def scaled_layer_ids(ids: list[int], layers: int, kept: int) -> list[int]:
    """A config's target.layer_ids for a target of `layers` decoder layers, mapped to the same depths
    in its first `kept` (--layers): id i becomes round(i * (kept - 1) / (layers - 1)), so the first
    and last layers stay first and last. ValueError when two ids would meet."""
    mapped = [round(i * (kept - 1) / (layers - 1)) for i in ids]
    if len(set(mapped)) != len(mapped):
        raise ValueError(f"--layers {kept}: too few to map target.layer_ids {ids} to distinct layers ({mapped})")
    return mapped


def layer_overrides(shape: str, kept: int, config: str | None, overrides: list[str]) -> tuple[list[str], str]:
    """With --layers N: the run's target.layer_ids (a preset's, an override's) mapped proportionally
    onto the N layers kept, as an override, and the line that says so; ([], "") when all are in range."""
    from services.run.config import load_config

    text = checkpoint_config(shape)
    layers = getattr(text, "text_config", text).num_hidden_layers
    ids = load_config(config, overrides).target.layer_ids
    if not kept or not ids or max(ids) < kept:
        return [], ""
    mapped = scaled_layer_ids(ids, layers, kept)
    said = f"--layers {kept}: target.layer_ids {ids} (of {layers} layers) mapped proportionally to {mapped}"
    return [f"target.layer_ids={mapped}"], said


def target_alone(overrides: list[str], work: Path, rows: int, warmup: int, config: str | None = None) -> dict:
    """A: the target worker's capture path on the run's own packed rows, GPU 0, nothing else running."""
    import torch
    from transformers import AutoTokenizer

    from bench.timing import sync
    from services.run.config import load_config
    from services.target.batches.packing import Packing, open_or_build
    from services.target.model.model import capture_to_host, load_target

    cfg = load_config(config, overrides)
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    from services.target.model.compiled import compile_and_warm_up

    target = load_target(cfg.target, device, num_draft_layers=cfg.drafter.num_layers)
    tokenizer = AutoTokenizer.from_pretrained(cfg.target.model_path)
    data = open_or_build(Packing.from_config(cfg), work / "alone", tokenizer, target.info.vocab_size)
    compile_and_warm_up(target, cfg.target.compile, data.pack_len, cfg.target.labels_from_target)  # as the worker does
    out = torch.empty(data.pack_len, target.info.hidden_width, dtype=torch.bfloat16, device=device)
    docs = tokens = 0
    for g in range(warmup + rows):
        if g == warmup:
            sync()
            start = time.perf_counter()
        row = data.batch(g)
        capture_to_host(target, row, cfg.target.labels_from_target, out)
        if g >= warmup:
            tokens += int((row["document_ids"] >= 0).sum())
            docs += int(row["document_ids"].max()) + 1
    sync()
    seconds = time.perf_counter() - start
    result = {
        "tok_s": tokens / seconds,
        "rows": rows,
        "docs_per_row": docs / rows,
        "path": target.path,
        "compiled": bool(target.compiled),
    }
    del target, out
    torch.cuda.empty_cache()
    return result


def target_alone_in_child(overrides: list[str], work: Path, rows: int, warmup: int, config: str | None = None) -> dict:
    """target_alone in a spawned process: when it returns, its GPU memory is free for the service."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(target_alone, overrides, work, rows, warmup, config).result()


def eval_on_off(run_dir: Path, metrics: list[dict], every: int, skip: int) -> dict:
    """The eval on/off comparison of one run with eval.every = every (module docstring)."""
    rows = [m for m in metrics if not m.get("eval") and not m.get("spec") and m["step"] > skip]
    after_eval = [m for m in rows if (m["step"] - 1) % every == 0 and m["step"] > 1]  # window holds an eval

    def rate(ms):
        tokens = sum(m["tokens_done"] - p["tokens_done"] for p, m in zip(ms, ms[1:]) if m["step"] == p["step"] + 1)
        seconds = sum(
            (m["tokens_done"] - p["tokens_done"]) / m["tokens_per_s"]
            for p, m in zip(ms, ms[1:])
            if m["step"] == p["step"] + 1 and m["tokens_per_s"] > 0
        )
        return tokens / seconds if seconds else None

    off = [m for m in rows if m not in after_eval]
    events = []
    log_file = run_dir / "logs" / "drafter-0.log"
    for line in log_file.read_text().splitlines() if log_file.exists() else []:
        if '"event": ' in line:
            try:
                events.append(json.loads(line.split(" ", 2)[2]))
            except (IndexError, json.JSONDecodeError):
                pass
    steps = [e for e in events if e.get("event") == "step"]
    specs = [e for e in events if e.get("event") == "spec_eval" and not e.get("final")]
    first_eval = every
    peak_off = max((e.get("gpu_mem_bytes", 0) for e in steps if e["step"] <= first_eval), default=0)
    peak_on = max((e.get("gpu_mem_bytes", 0) for e in steps), default=0)
    on, off_rate = rate(rows), rate(off)
    return {
        "eval_every": every,
        "tok_s_eval_off": off_rate,
        "tok_s_eval_on": on,
        "tok_s_ratio": on / off_rate if on and off_rate else None,
        "drafter0_peak_gib_eval_off": round(peak_off / 2**30, 3),
        "drafter0_peak_gib_eval_on": round(peak_on / 2**30, 3),
        "spec_evals": len(specs),
        "spec_seconds_per_prompt": [e.get("seconds_per_prompt") for e in specs],
        "spec_seconds": [e.get("seconds") for e in specs],
        "spec_skipped": [e.get("skipped") for e in specs],
        "spec_acceptance_per_step": [e.get("acceptance_per_step") for e in specs],
        "target_models_in_drafter0": [e.get("target_models_in_process") for e in specs],
    }


def steady_rate(metrics: list[dict], skip: int) -> dict:
    """Tokens/s over the steps after `skip`: total tokens / total wall time of those log windows."""
    rows = [m for m in metrics if not m.get("eval") and not m.get("spec") and m["step"] > skip]
    if len(rows) < 2:
        return {}
    tokens = [b["tokens_done"] - a["tokens_done"] for a, b in zip(rows, rows[1:])]
    seconds = sum(t / b["tokens_per_s"] for t, b in zip(tokens, rows[1:]) if b["tokens_per_s"] > 0)
    return {
        "steps_measured": len(rows) - 1,
        "tokens_per_s": sum(tokens) / seconds,
        "data_wait_frac": sum(m["data_wait_frac"] for m in rows) / len(rows),
        "first_loss": rows[0]["loss"],
        "last_loss": rows[-1]["loss"],
        "last_tau": rows[-1]["tau"],
    }


def drafter_alone(path: Path, config: str | None, overrides: list[str]) -> float:
    """B: tok/s of the drafter_step result at the run's kernels.precision (the first result without one)."""
    from services.run.config import load_config

    precision = load_config(config, overrides).kernels.precision
    results = json.loads(path.read_text())["results"]
    return next((r for r in results if r.get("precision", precision) == precision), results[0])["tokens_per_s"]


def ideal(spec: str, a: float, b: float | None) -> float:
    """Separate GPUs: the slower role's sum. A GPU holding both roles: the two take turns."""
    from launcher.topology import parse_gpu_spec

    workers = parse_gpu_spec(spec, share_gpus=True)
    gpus: dict = {}
    for w in workers:
        gpus.setdefault(w.gpu, []).append(w.role)
    shared = [g for g, roles in gpus.items() if len(set(roles)) > 1]
    if shared and b:
        return sum(1 / (1 / a + 1 / b) for _ in shared)
    supply = a * sum(1 for w in workers if w.role == "target")
    return min(supply, b * sum(1 for w in workers if w.role == "drafter")) if b else supply


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", default="0:target,1:drafter")
    ap.add_argument("--shape", default="8b", choices=SHAPES)
    ap.add_argument("--work", default="/tmp/e2e")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument(
        "--layers",
        type=int,
        default=0,
        help="keep the shape's first N decoder layers (0: all); a config's target.layer_ids beyond them are "
        "mapped proportionally onto the N (the output says so)",
    )
    ap.add_argument("--skip", type=int, default=10, help="steps left out of the steady-state rate")
    ap.add_argument("--conversations", type=int, default=60000)
    ap.add_argument("--alone-rows", type=int, default=8, help="rows timed for A")
    ap.add_argument("--drafter-json", help="bench/drafter_step.py output of this call: B")
    ap.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="evaluate every N steps (held-out tau + real acceptance) and report eval on/off",
    )
    ap.add_argument("--spec-prompts", type=int, default=4, help="real-acceptance prompts per evaluation")
    ap.add_argument(
        "--share-gpus", action="store_true", help="accepted for clarity: a GPU that holds both roles is always shared"
    )
    ap.add_argument("--no-alone", action="store_true", help="skip A, the target alone (saves a model load)")
    ap.add_argument("--timeout", type=float, default=540)
    ap.add_argument("--config", help="a run config (TOML, e.g. a preset) under the overrides, as for `up`")
    ap.add_argument(
        "--fp8-checkpoint",
        action="store_true",
        help="save the random target as an FP8 checkpoint (128 x 128 blocks, as Qwen3.6-27B-FP8): half the "
        "bytes of bf16, so the 27B's 64 layers fit a device call; run it with target.quantize='\"fp8\"'",
    )
    ap.add_argument("--out")
    ap.add_argument("overrides", nargs="*", help="extra section.key=value for the run")
    a = ap.parse_args()
    work = Path(a.work)
    t0 = time.time()
    model_dir, data = make_assets(work, a.shape, a.conversations, a.layers, a.fp8_checkpoint)
    print(f"assets ready in {time.time() - t0:.0f}s: {model_dir}", flush=True)
    overrides = [f'target.model_path="{model_dir}"', f'data.path="{data}"', f"run.max_steps={a.steps}", *COMMON]
    if a.eval_every > 0:
        overrides += [
            f"eval.every={a.eval_every}",
            "data.eval_fraction=0.01",
            f"eval.num_prompts={a.spec_prompts}",
            "eval.max_new_tokens=64",
            "eval.budget_s=30",
        ]
    overrides += a.overrides
    mapped, said = layer_overrides(a.shape, a.layers, a.config, overrides)
    if said:
        print(said, flush=True)
    overrides += mapped
    alone = None if a.no_alone else target_alone_in_child(overrides, work, a.alone_rows, 2, a.config)
    print(f"A (target alone): {alone}", flush=True)
    b = drafter_alone(Path(a.drafter_json), a.config, overrides) if a.drafter_json else None

    run_dir = work / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    from launcher.topology import parse_gpu_spec

    workers = parse_gpu_spec(a.gpus, share_gpus=True)
    share = ["--share-gpus"] if len({w.gpu for w in workers}) < len(workers) else []
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke test of this script
    cmd = [
        sys.executable,
        "-m",
        "launcher",
        "up",
        "--gpus",
        a.gpus,
        *share,
        "--device",
        device,
        "--run-dir",
        str(run_dir),
        *(["--config", a.config] if a.config else []),
        *overrides,
    ]
    t1 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, out, err = "timeout", str(exc.stdout or "")[-3000:], str(exc.stderr or "")[-2000:]
    print(out[-3000:], err[-2000:], flush=True)
    metrics_file = run_dir / "metrics.jsonl"
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    result = {
        "gpus": a.gpus,
        "shape": a.shape,
        "exit": code,
        "launcher_wall_s": round(time.time() - t1, 1),
        "target_alone": alone,
        "drafter_alone_tok_s": b,
        **({"layer_ids_mapped": said} if said else {}),
        **steady_rate(metrics, a.skip),
    }
    if a.eval_every > 0:
        result["eval_on_off"] = eval_on_off(run_dir, metrics, a.eval_every, a.skip)
    if alone:
        result["ideal_tok_s"] = ideal(a.gpus, alone["tok_s"], b)
    if "tokens_per_s" in result and alone:
        result["efficiency"] = result["tokens_per_s"] / result["ideal_tok_s"]
    print(json.dumps(result, indent=2), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
