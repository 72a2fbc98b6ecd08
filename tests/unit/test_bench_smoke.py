"""The GPU benchmarks for sliding-window layers run on the CPU at a tiny shape (smoke tests), and the
attended-pair count behind their MFU matches the mask."""

import json

import pytest
import torch

from bench import drafter_step, flex_check
from services.drafter.modeling.anchors import build_inputs
from services.drafter.modeling.model import DrafterModelConfig
from services.drafter.training.synthetic import SyntheticSource
from tests.masks import dense_block_mask


@pytest.mark.parametrize("window", [None, 3, 12, 40])
def test_attended_pairs_count_what_the_mask_keeps(window):
    cfg = DrafterModelConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=64,
        num_target_layers=8,
        num_hidden_layers=1,
        target_layer_ids=[3],
        block_size=8,
        mask_token_id=63,
    )
    batch = SyntheticSource(cfg, 300).batch(2)
    inputs = build_inputs(
        batch, num_anchors=24, block_size=8, mask_token_id=63, gamma=4.0, generator=torch.Generator().manual_seed(0)
    )
    mask = dense_block_mask(inputs.anchors, 8, inputs.context_len, batch.document_ids, window)
    assert drafter_step.attended_pairs(inputs, 8, window) == int(mask.sum())


def test_drafter_step_compares_layouts_on_cpu(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert (
        drafter_step.main(
            [
                "--shape",
                "custom",
                "--hidden",
                "64",
                "--intermediate",
                "128",
                "--heads",
                "4",
                "--kv-heads",
                "2",
                "--head-dim",
                "16",
                "--layers",
                "5",
                "--seq-len",
                "512",
                "--anchors",
                "32",
                "--block-size",
                "8",
                "--vocab",
                "512",
                "--window",
                "48",
                "--layout",
                "both",
                "--device",
                "cpu",
                "--steps",
                "1",
                "--warmup-steps",
                "1",
                "--no-compile",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    full, hybrid = json.loads(out.read_text())["results"]
    assert full["layer_types"] == ["full_attention"] * 5 and full["sliding_window"] is None
    assert hybrid["layer_types"] == ["sliding_attention"] * 4 + ["full_attention"] and hybrid["sliding_window"] == 48
    assert hybrid["flop_split_tflop"]["attention"] <= full["flop_split_tflop"]["attention"]
    assert hybrid["mask_density"] < full["mask_density"] and hybrid["recompiles"] == 0
    assert "hybrid (window 48) vs full: step" in capsys.readouterr().out


def test_flex_check_windowed_masks_on_cpu():
    flex_check.RESULTS.clear()
    assert flex_check.main(["--device", "cpu"]) == 0
    assert len(flex_check.RESULTS) == 2 and all("window=" in r["check"] for r in flex_check.RESULTS)


def test_drafter_step_compares_objectives_on_cpu(tmp_path, capsys):
    """--objective dflash,domino: both run at the same shape and the ratio is printed."""
    out = tmp_path / "step.json"
    args = "--shape custom --hidden 64 --intermediate 128 --heads 4 --kv-heads 2 --head-dim 16 --layers 1"
    args += " --seq-len 256 --anchors 8 --block-size 4 --vocab 256 --device cpu --steps 1 --warmup-steps 1"
    assert drafter_step.main([*args.split(), "--no-compile", "--objective", "dflash,domino", "--out", str(out)]) == 0
    plain, domino = json.loads(out.read_text())["results"]
    assert (plain["objective"], domino["objective"]) == ("dflash", "domino")
    assert domino["trainable_params"] > plain["trainable_params"] and "breakdown_s" not in domino
    assert "bf16 domino vs bf16 dflash:" in capsys.readouterr().out
