"""The real service on one GPU: `launcher up --gpus 0:target,0:drafter --share-gpus`.

A random-weight target of Qwen3-8B shape (36 layers, width 4096, vocab 151 936) with the demo's
tokenizer and chat data, and the DFlash recipe drafter (5 layers, S = 8192, 512 anchors, B = 16).
It prints trained tokens/s in steady state, the data-wait fraction, and, given the standalone
per-role figures measured in the same call (bench/target_capture.py, bench/drafter_step.py), the
pipeline efficiency C / (1 / (1/A + 1/B)): on one shared GPU the two roles take turns, so the
ideal is the harmonic combination of their standalone rates.

    python bench/e2e_one_gpu.py --work /tmp/e2e --steps 300 \
        --target-json $OUT/target_8b.json --drafter-json $OUT/drafter_recipe.json --out $OUT/e2e.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)


def make_target(work: Path, conversations: int) -> tuple[Path, Path]:
    """Qwen3-8B-shaped random weights + the demo tokenizer (its ids fit the 151 936 rows)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from services.demo import make_demo
    demo = make_demo(work / "demo", num_conversations=conversations)
    model_dir = work / "qwen3-8b-random"
    if not (model_dir / "config.json").exists():
        cfg = Qwen3Config(**QWEN3_8B, torch_dtype="bfloat16")
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
        model.save_pretrained(model_dir, max_shard_size="5GB")
        del model
        torch.cuda.empty_cache()
        for f in Path(demo["model_path"]).iterdir():
            if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
                shutil.copy(f, model_dir / f.name)
    return model_dir, Path(demo["data_path"])


def steady_rate(metrics: list[dict], skip: int) -> dict:
    """Tokens/s over the steps after `skip`: total tokens / total wall time of those log windows."""
    rows = [m for m in metrics if not m.get("eval") and m["step"] > skip]
    if len(rows) < 2:
        return {}
    tokens = [b["tokens_done"] - a["tokens_done"] for a, b in zip(rows, rows[1:])]
    seconds = sum(t / b["tokens_per_s"] for t, b in zip(tokens, rows[1:]) if b["tokens_per_s"] > 0)
    return {"steps_measured": len(rows) - 1, "tokens_per_s_wall": sum(tokens) / seconds,
            "data_wait_frac": sum(m["data_wait_frac"] for m in rows) / len(rows),
            "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"], "last_tau": rows[-1]["tau"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/e2e")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--conversations", type=int, default=60000)
    ap.add_argument("--target-json")
    ap.add_argument("--drafter-json")
    ap.add_argument("--out")
    a = ap.parse_args()
    work = Path(a.work)
    t0 = time.time()
    model_dir, data = make_target(work, a.conversations)
    print(f"target model + data ready in {time.time() - t0:.0f}s: {model_dir}", flush=True)
    run_dir = work / "run"
    cmd = [sys.executable, "-m", "launcher", "up", "--gpus", "0:target,0:drafter", "--share-gpus", "--device", "cuda",
           "--run-dir", str(run_dir), f'target.model_path="{model_dir}"', f'data.path="{data}"',
           "data.pack_len=8192", f"run.max_steps={a.steps}", "run.epochs=20", "run.checkpoint_every=100000",
           "run.export_at_end=false", "run.log_every=1"]
    t1 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t1
    print(proc.stdout[-3000:], proc.stderr[-2000:], flush=True)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()] \
        if (run_dir / "metrics.jsonl").exists() else []
    result = {"exit": proc.returncode, "launcher_wall_s": round(wall, 1), **steady_rate(metrics, skip=20)}
    for log in sorted((run_dir / "logs").glob("*.log")):
        ready = [line for line in log.read_text().splitlines() if '"event": "ready"' in line]
        if ready:
            result[f"{log.stem}_ready"] = ready[-1][:300]
    if a.target_json and a.drafter_json and "tokens_per_s_wall" in result:
        target = json.loads(Path(a.target_json).read_text())["records"][0]
        A = target["capture_packed"]["tok_s"]
        B = json.loads(Path(a.drafter_json).read_text())["results"][0]["tokens_per_s"]
        ideal = 1 / (1 / A + 1 / B)
        result.update(target_alone_tok_s=A, drafter_alone_tok_s=B, ideal_shared_tok_s=ideal,
                      efficiency=result["tokens_per_s_wall"] / ideal)
    print(json.dumps(result, indent=2), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
