"""The recipe presets (presets/*.toml): loaded through the real config loader against the target
shapes they are for, and the 27B preset trained end to end on the CPU demo with its window scaled
down to the demo's documents."""

import json
import re
import subprocess

import pytest

from bench.shapes import text_config
from services.run.config import load_config
from tests.drafters import build_model_config, model_config_from_hf
from tests.launching import REPO, launcher_argv

PRESETS = REPO / "presets"


def test_qwen36_27b_preset_is_the_published_hybrid_recipe():
    cfg = load_config(PRESETS / "qwen3.6-27b.toml", ["target.model_path=/models/Qwen3.6-27B", "data.path=chat.jsonl"])
    assert cfg.target.model_path == "/models/Qwen3.6-27B"
    assert (cfg.data.pack_len, cfg.run.epochs) == (4096, 6)
    d, o = cfg.drafter, cfg.optimizer
    assert (o.lr, o.warmup_ratio, o.grad_clip, d.gamma, d.num_anchors) == (6e-4, 0.04, 1.0, 7.0, 512)
    assert (d.objective, cfg.kernels.precision) == ("domino", "fp8")  # the product's objective, FP8 linears
    # against the Qwen3.6-27B text shape (bench/shapes.py), as the drafter worker builds it
    m = build_model_config(cfg, model_config_from_hf(text_config("27b-hybrid")), cfg.drafter.mask_token_id)
    assert m.layer_types == ["sliding_attention"] * 4 + ["full_attention"] and m.sliding_window == 2048
    assert (m.num_attention_heads, m.num_key_value_heads, m.head_dim) == (32, 8, 128)
    assert (m.hidden_size, m.intermediate_size, m.num_hidden_layers, m.block_size) == (5120, 17408, 5, 16)
    assert m.mask_token_id == 248070 and m.target_layer_ids == [1, 16, 31, 46, 61]
    assert m.rope_theta == 1e7 and m.num_target_layers == 64


def test_qwen3_8b_preset_is_the_published_recipe():
    cfg = load_config(PRESETS / "qwen3-8b.toml", ["target.model_path=/models/Qwen3-8B"])
    assert (cfg.data.pack_len, cfg.run.epochs, cfg.optimizer.grad_accum) == (3072, 6, 4)
    m = build_model_config(cfg, model_config_from_hf(text_config("8b")), mask_token_id=151669)
    assert m.layer_types == ["full_attention"] * 5 and m.sliding_window is None
    assert (m.num_attention_heads, m.num_key_value_heads, m.head_dim, m.hidden_size) == (32, 8, 128, 4096)
    assert m.target_layer_ids == [1, 9, 17, 25, 33] and m.block_size == 16


@pytest.mark.parametrize("name", ["qwen3.6-27b.toml", "qwen3-8b.toml"])
def test_every_preset_number_names_its_source(name):
    for line in (PRESETS / name).read_text().splitlines():
        if re.match(r"^\w+ = .*\d", line) and not line.startswith(("name", "overrides")):
            assert "# [" in line, f"{name}: no source for {line!r}"


@pytest.mark.training
@pytest.mark.untimed  # the resolved config, the loss and tau, the export
def test_the_27b_preset_trains_on_the_demo_with_a_scaled_window(tmp_path):
    """The preset's layout and training recipe on the demo's tiny target: 5 layers (4 sliding + 1
    full), block 16; what cannot fit the demo is scaled: the window (2048 of a 4096 pack -> 48 of the
    demo's 512, shorter than most demo documents, so it bites), the ids of the 4-layer target, its
    mask token, and heads the 128-wide demo target can carry. At the demo's lr (3e-3) five layers did
    not learn in 120 steps (all-full did not either); 1e-3 does (tau 1.1 -> 2.4 in 80 steps)."""
    run_dir = tmp_path / "run"
    scaled = [
        "drafter.num_layers=5",
        "drafter.block_size=16",
        "drafter.sliding_window=48",
        "target.layer_ids=[0, 1, 2]",
        "drafter.mask_token_id=-1",
        "drafter.num_anchors=32",
        "drafter.overrides={num_attention_heads=4, num_key_value_heads=2, head_dim=32}",
        "optimizer.lr=1e-3",
        "run.max_steps=80",
        "log.every=1",
        "eval.num_prompts=8",  # the final real acceptance: lossless and above random on 8 prompts
        'kernels.precision="bf16"',  # the preset's FP8 linears need a GPU (tests/unit/test_drafter_precision.py)
    ]
    cmd = launcher_argv(
        "up",
        "--demo",
        "--device",
        "cpu",
        "--gpus",
        "0:target,1:drafter",
        "--config",
        str(PRESETS / "qwen3.6-27b.toml"),
        "--run-dir",
        str(run_dir),
        *scaled,
    )
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    resolved = json.loads((run_dir / "config.json").read_text())
    assert resolved["drafter"]["layer_types"] == ["sliding_attention"] * 4 + ["full_attention"]
    # --demo's own overrides (pack 512, lr, warmup, epochs) come after the file; the rest is the preset's
    assert (resolved["drafter"]["gamma"], resolved["optimizer"]["grad_clip"], resolved["run"]["name"]) == (
        7.0,
        1.0,
        "qwen3.6-27b-dflash",
    )
    steps = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if not m.get("eval")]
    first, last = (sum(m["loss"] for m in part) / len(part) for part in (steps[:5], steps[-5:]))
    assert len(steps) == 80 and last < first * 0.9, f"loss did not fall: {first:.3f} -> {last:.3f}"
    tau_first, tau_last = (sum(m["tau"] for m in part) / len(part) for part in (steps[:5], steps[-5:]))
    assert tau_last > tau_first + 0.5, f"tau did not rise: {tau_first:.2f} -> {tau_last:.2f}"
    export = json.loads((run_dir / "export" / "config.json").read_text())
    assert export["layer_types"] == ["sliding_attention"] * 4 + ["full_attention"]
    assert export["sliding_window"] == 48 and export["use_sliding_window"] is True and export["block_size"] == 16
    # real speculative decoding with the windows applied: lossless, and above the random-drafter control
    final = json.loads((run_dir / "acceptance.jsonl").read_text().splitlines()[-1])
    assert final["final"] and final["lossless"] == final["prompts"] > 0, final
    assert final["acceptance_per_prompt"] > final["random"]["acceptance_per_prompt"], final
