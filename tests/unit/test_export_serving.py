"""`launcher export`'s output: words first, then serving commands for the run's own target and drafter
(a Qwen3.5/3.6 hybrid target needs SGLang's extra_buffer; a drafter mixing sliding and full layers
needs vLLM's V2 model runner), kept in export.json."""

import json
import shlex
from pathlib import Path

import pytest
import torch

from services.drafter.checkpoints import export
from services.drafter.checkpoints.checkpoint import make_meta, write_checkpoint
from services.drafter.modeling.model import DFlashDrafter, DrafterModelConfig

TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    vocab_size=64,
    num_target_layers=4,
    num_hidden_layers=2,
    target_layer_ids=[1, 2],
    block_size=4,
    mask_token_id=3,
)
PLAIN = {"model_type": "qwen3", "layer_types": ["full_attention"] * 4}
HYBRID = {
    "model_type": "qwen3_5",
    "text_config": {"model_type": "qwen3_5_text", "layer_types": ["linear_attention", "full_attention"] * 2},
}


def target_folder(tmp_path: Path, config: dict) -> Path:
    folder = tmp_path / "my target"  # a space: the commands must quote it
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def commands(tmp_path, target_config, **drafter):
    target = target_folder(tmp_path, target_config)
    serve = export.serve_commands(tmp_path / "export", DrafterModelConfig(**{**TINY, **drafter}), str(target))
    return target, serve


def test_plain_target_and_drafter_serve_with_the_real_paths(tmp_path):
    target, serve = commands(tmp_path, PLAIN)
    assert serve["target"] == str(target)
    assert shlex.split(serve["vllm"])[:3] == ["vllm", "serve", str(target)]
    spec = json.loads(shlex.split(serve["vllm"])[4])
    assert spec == {"method": "dflash", "model": str(tmp_path / "export"), "num_speculative_tokens": 3}
    assert shlex.split(serve["sglang"]) == [
        "python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(target),
        "--speculative-algorithm",
        "DFLASH",
        "--speculative-draft-model-path",
        str(tmp_path / "export"),
    ]
    assert "<target>" not in serve["vllm"] + serve["sglang"]


def test_a_hybrid_target_gets_sglangs_extra_buffer(tmp_path):
    _, serve = commands(tmp_path, HYBRID)
    assert serve["sglang"].endswith(" --mamba-scheduler-strategy extra_buffer")
    assert "VLLM_USE_V2_MODEL_RUNNER" not in serve["vllm"]


def test_a_drafter_mixing_sliding_and_full_layers_gets_vllms_v2_runner(tmp_path):
    _, serve = commands(tmp_path, PLAIN, layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    assert serve["vllm"].startswith("VLLM_USE_V2_MODEL_RUNNER=1 vllm serve ")
    assert "extra_buffer" not in serve["sglang"]


@pytest.mark.parametrize("target_config", [PLAIN, HYBRID], ids=["plain", "hybrid"])
def test_export_prints_words_then_the_commands_export_json_keeps(tmp_path, capsys, target_config):
    target = target_folder(tmp_path, target_config)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"target": {"model_path": str(target)}}))
    cfg = DrafterModelConfig(**TINY)
    torch.manual_seed(0)
    weights = DFlashDrafter(cfg).state_dict()
    counters = {"step": 5, "micro_step": 5}
    write_checkpoint(
        run / "checkpoints",
        5,
        weights=weights,
        optimizer={},
        rng={},
        config={},
        keep=2,
        meta=make_meta(counters, cfg, world_size=1),
    )
    assert export.main(["--checkpoint", str(run), "--out", str(tmp_path / "export")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("exported step 5 (last of its run) from ") and not out[0].startswith("{"), out[0]
    record = json.loads((tmp_path / "export" / "export.json").read_text())
    assert record["serve"]["target"] == str(target)
    assert out[1] == f"vLLM:   {record['serve']['vllm']}" and out[2] == f"SGLang: {record['serve']['sglang']}"
    assert ("extra_buffer" in record["serve"]["sglang"]) == (target_config is HYBRID)


def test_checkpoints_this_version_does_not_read_are_refused_by_name(tmp_path, capsys):
    """A checkpoint whose model lists target_layer_ids out of order does not export (exit 2, the ids
    named); one whose state.json has no next_g does not resume (a config error naming next_g)."""
    from services.drafter.checkpoints.checkpoint import find_resume_point
    from services.run.config import ConfigError, load_config

    cfg = DrafterModelConfig(**TINY)
    weights = DFlashDrafter(cfg).state_dict()
    meta = make_meta({"step": 5, "micro_step": 5}, cfg, world_size=1)
    unsorted = tmp_path / "unsorted"
    write_checkpoint(
        unsorted / "checkpoints",
        5,
        weights=weights,
        optimizer={},
        rng={},
        config={},
        keep=2,
        meta={**meta, "model": {**meta["model"], "target_layer_ids": [2, 1]}},
    )
    assert export.main(["--checkpoint", str(unsorted), "--out", str(tmp_path / "x")]) == 2
    assert "target_layer_ids [2, 1] out of order" in capsys.readouterr().err
    no_position = tmp_path / "no-position"
    write_checkpoint(
        no_position / "checkpoints",
        5,
        weights=weights,
        optimizer={},
        rng={},
        config={},
        keep=2,
        meta={k: v for k, v in meta.items() if k != "next_g"},
    )
    with pytest.raises(ConfigError, match="records no data position"):
        find_resume_point(no_position, cfg, load_config(None, []).to_dict(), 1, warn=print)
