"""The built-in demo: deterministic, idempotent, loadable by the target, and learnable data."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from services.run.config import load_config
from services.target.batches.packing import Packing, open_or_build
from services.target.batches.tokenizing import has_generation_markers
from services.target.model.model import load_target
from services.tools.demo import make_demo
from tests.launching import REPO

N = 1000


def _files(demo):
    model = Path(demo["model_path"])
    return {
        "data": Path(demo["data_path"]).read_bytes(),
        "tokenizer": (model / "tokenizer.json").read_bytes(),
        "config": json.loads((model / "config.json").read_text()),
        "weights": load_file(str(model / "model.safetensors")),
    }


@pytest.mark.inprocess
@pytest.mark.slow  # builds demos (a tokenizer, a target trained a few steps) here
def test_demo_is_deterministic_and_idempotent(tmp_path):
    a = make_demo(tmp_path / "a", num_conversations=N, target_steps=3)  # a few steps: training is deterministic too
    b = make_demo(tmp_path / "b", num_conversations=N, target_steps=3)
    fa, fb = _files(a), _files(b)
    assert fa["data"] == fb["data"] and fa["tokenizer"] == fb["tokenizer"] and fa["config"] == fb["config"]
    assert fa["weights"].keys() == fb["weights"].keys()
    assert all(torch.equal(fa["weights"][k], fb["weights"][k]) for k in fa["weights"])
    stamp = Path(a["data_path"]).stat().st_mtime_ns
    assert make_demo(tmp_path / "a", num_conversations=N, target_steps=3) == {**a, "reused": True}  # not rebuilt
    assert Path(a["data_path"]).stat().st_mtime_ns == stamp
    other = make_demo(tmp_path / "c", seed=1, num_conversations=N, target_steps=0)
    assert Path(other["data_path"]).read_bytes() != fa["data"]


@pytest.mark.processes
def test_demo_cli_prints_one_json_line(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.tools.demo",
            "--out",
            str(tmp_path / "d"),
            "--conversations",
            "50",
            "--target-steps",
            "0",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    demo = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(demo["model_path"], "config.json").is_file() and Path(demo["data_path"]).is_file()


@pytest.mark.inprocess
@pytest.mark.slow  # builds demos (a tokenizer, a target trained a few steps) here
def test_demo_target_and_data_load_with_its_overrides(tmp_path):
    demo = make_demo(tmp_path / "demo", num_conversations=N, target_steps=0)
    cfg = load_config(None, demo["overrides"] + ["data.eval_fraction=0.1"])
    assert cfg.target.model_path == demo["model_path"] and cfg.data.path == demo["data_path"]
    assert cfg.target.dtype == "float32" and cfg.drafter.num_layers == 1 and cfg.data.pack_len <= 512
    target = load_target(cfg.target, "cpu", cfg.drafter.num_layers)
    assert type(target.model).__name__ == "Qwen3ForCausalLM" and target.info.layer_ids == [2]
    tokenizer = AutoTokenizer.from_pretrained(demo["model_path"])
    assert tokenizer.mask_token == "<|MASK|>" and tokenizer.mask_token_id < target.info.vocab_size
    assert has_generation_markers(tokenizer)
    data = open_or_build(
        Packing.from_config(cfg), tmp_path / "run", tokenizer, target.info.vocab_size, log=lambda _m: None
    )
    assert data.bad_samples == 0 and data.num_batches() > 10 and data.num_batches("eval") >= 1

    # learnable: a trigram table from the train rows predicts most supervised eval tokens
    def triples(split):
        for g in range(data.num_batches(split)):
            row = data.batch(g, split)
            ids, mask, doc = row["input_ids"].tolist(), row["loss_mask"].tolist(), row["document_ids"].tolist()
            for j in range(2, len(ids)):
                if mask[j] and doc[j] == doc[j - 2]:
                    yield (ids[j - 2], ids[j - 1]), ids[j]

    table = defaultdict(Counter)
    for context, nxt in triples("train"):
        table[context][nxt] += 1
    results = [bool(table.get(c)) and table[c].most_common(1)[0][0] == nxt for c, nxt in triples("eval")]
    assert len(results) > 200 and sum(results) / len(results) > 0.5


@pytest.mark.inprocess
@pytest.mark.slow  # builds demos (a tokenizer, a target trained a few steps) here
def test_hybrid_demo_is_a_composite_checkpoint_whose_trained_weights_the_target_loads(tmp_path):
    """The hybrid demo: Qwen3_5ForConditionalGeneration on disk (text_config + vision_config, keys
    under model.language_model. / model.visual.), and the target's loader returns the text model
    with the trained weights (not freshly initialized ones where a key prefix was missed)."""
    from services.target.model.model import load_hf_model
    from services.tools.demo import build_model, conversations, torch_linear_attention, train_target

    demo = make_demo(tmp_path / "hybrid", num_conversations=N, target_steps=3, variant="hybrid")
    config = json.loads(Path(demo["model_path"], "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"] and "vision_config" in config
    assert {"linear_attention", "full_attention"} <= set(config["text_config"]["layer_types"])
    keys = load_file(str(Path(demo["model_path"]) / "model.safetensors")).keys()
    assert any(k.startswith("model.language_model.layers.") for k in keys) and "lm_head.weight" in keys
    assert any(k.startswith("model.visual.") for k in keys)

    tokenizer = AutoTokenizer.from_pretrained(demo["model_path"])  # the tokenizer the service loads
    assert tokenizer.mask_token == "<|MASK|>" and has_generation_markers(tokenizer)
    untrained = build_model(tokenizer, 0, "hybrid")
    with torch_linear_attention():  # the trained model, made again: the build is deterministic
        trained, _ = train_target(build_model(tokenizer, 0, "hybrid"), tokenizer, conversations(N, 0), 3, 0)
    loaded = load_hf_model(demo["model_path"], torch.float32, "sdpa", "cpu")
    assert type(loaded).__name__ == "Qwen3_5ForCausalLM"
    ids = torch.tensor([tokenizer("count from 3 to 9 , then spell apple").input_ids])
    with torch.no_grad():
        want = trained(input_ids=ids).logits
        got = loaded(input_ids=ids, doc_spans=[(0, ids.shape[1])]).logits
        fresh = untrained(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (fresh - want).abs().max() > 1e-3  # the control: three steps moved the weights

    cfg = load_config(None, demo["overrides"])
    target = load_target(cfg.target, "cpu", cfg.drafter.num_layers)
    assert target.path == "packed-reference" and target.info.layer_ids == [2]  # layer 2: full attention
