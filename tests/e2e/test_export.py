"""Export round trip: a drafter trained by a real process against a real (tiny, random) HF Qwen3
target, exported with `launcher export`, loaded by a small loader written here from the format
description only (config.json + model.safetensors, plain torch; services.drafter.modeling.model is not
used by it), reproduces the drafter's logits through the target's embedding and lm_head."""

import json
import math
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoConfig, Qwen3Config, Qwen3ForCausalLM

from tests.launching import REPO, drafter_env, run_launcher

pytestmark = pytest.mark.processes  # one drafter rank (synthetic data), `launcher export`

VOCAB, MASK_ID = 160, 159


# --- the independent loader ------------------------------------------------------------------------


def rms_norm(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, positions, theta):
    """x [heads, len, d]; rotate-half RoPE (Qwen3/HF layout)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions.float()[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


class ExportedDrafter:
    def __init__(self, path: Path):
        self.cfg = json.loads((path / "config.json").read_text())
        self.w = {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()}

    def __call__(self, context, context_pos, block_embeds, block_pos, visible):
        """context [C, K*H] target features; block_embeds [Q, H]; visible [Q, C+Q] bool -> hidden [Q, H].
        A layer whose layer_types entry is "sliding_attention" also hides every key sliding_window or
        more positions before the query (the engines' left window bound, as config.json states it)."""
        c, w = self.cfg, self.w
        eps, d, nh, nkv = c["rms_norm_eps"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
        ctx = rms_norm(context @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
        kv_pos = torch.cat([context_pos, block_pos])
        near = block_pos[:, None] - kv_pos[None, :] < (c["sliding_window"] or 0)
        x = block_embeds
        for i in range(c["num_hidden_layers"]):
            layer_visible = visible & near if c["layer_types"][i] == "sliding_attention" else visible
            p = lambda name: w[f"layers.{i}.{name}.weight"]
            h = rms_norm(x, p("input_layernorm"), eps)
            both = torch.cat([ctx, h])
            q = (h @ p("self_attn.q_proj").T).view(-1, nh, d).transpose(0, 1)
            k = (both @ p("self_attn.k_proj").T).view(-1, nkv, d).transpose(0, 1)
            v = (both @ p("self_attn.v_proj").T).view(-1, nkv, d).transpose(0, 1)
            q = rope(rms_norm(q, p("self_attn.q_norm"), eps), block_pos, c["rope_theta"])
            k = rope(rms_norm(k, p("self_attn.k_norm"), eps), kv_pos, c["rope_theta"])
            k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
            scores = (q @ k.transpose(1, 2)) / math.sqrt(d)
            attn = scores.masked_fill(~layer_visible, float("-inf")).softmax(-1) @ v
            x = x + attn.transpose(0, 1).reshape(len(x), nh * d) @ p("self_attn.o_proj").T
            h = rms_norm(x, p("post_attention_layernorm"), eps)
            x = x + (F.silu(h @ p("mlp.gate_proj").T) * (h @ p("mlp.up_proj").T)) @ p("mlp.down_proj").T
        return rms_norm(x, w["norm.weight"], eps)


def dflash_visibility(anchors, document_ids, block_size, context_len):
    """docs/dflash.md: block i (anchor a) sees context j < a in a's document, and its own whole block."""
    q = len(anchors) * block_size
    visible = torch.zeros(q, context_len + q, dtype=torch.bool)
    for i, a in enumerate(anchors.tolist()):
        rows = slice(i * block_size, (i + 1) * block_size)
        same_doc = document_ids[:a] == document_ids[a]
        visible[rows, :a] = same_doc
        visible[rows, context_len + i * block_size : context_len + (i + 1) * block_size] = True
    return visible


# --- the test ------------------------------------------------------------------------------------

HYBRID = ['drafter.layer_types=["sliding_attention", "full_attention"]', "drafter.sliding_window=5"]


def train_drafter(tmp, *extra):
    """A tiny random Qwen3 target on disk, and a drafter process trained against its head."""
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=False,
            rope_theta=5000.0,
        )
    )
    target.save_pretrained(tmp / "target")
    run = tmp / "run"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.drafter",
            "--run-dir",
            str(run),
            "--synthetic",
            "--device",
            "cpu",
            "--max-steps",
            "6",
            f"target.model_path={tmp / 'target'}",
            f"drafter.mask_token_id={MASK_ID}",
            "drafter.num_layers=2",
            "drafter.block_size=8",
            "data.pack_len=128",
            "drafter.num_anchors=8",
            "kernels.compile=false",
            "optimizer.lr=3e-3",
            *extra,
        ],
        cwd=REPO,
        env=drafter_env(),
        capture_output=True,
        text=True,
        timeout=180,
        umask=0o022,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return tmp, run


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A plain DFlash drafter: the layout of z-lab's released drafters (a Domino export adds its head's
    fields and tensors: tests/unit/test_domino.py, and the demos export one)."""
    return train_drafter(tmp_path_factory.mktemp("export"), 'drafter.objective="dflash"')


@pytest.fixture(scope="module")
def trained_hybrid(tmp_path_factory):
    """The same with a sliding layer (window 5, narrower than the block of 8) before a full one."""
    return train_drafter(tmp_path_factory.mktemp("export-hybrid"), *HYBRID)


def launcher_export(checkpoint, out, dtype="bfloat16", umask=0o022):
    res = run_launcher(
        "export",
        "--checkpoint",
        str(checkpoint),
        "--out",
        str(out),
        "--dtype",
        dtype,
        cwd=REPO,
        timeout=120,
        umask=umask,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return Path(out), res.stdout


def mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def drafter_and_inputs(run, target_dir, weights_dtype):
    """The drafter's own forward (services.drafter code) on a synthetic batch, and its inputs."""
    from services.drafter.modeling.anchors import anchor_generator, build_inputs
    from services.drafter.modeling.attention import DenseAttention
    from services.drafter.modeling.model import DFlashDrafter, DrafterModelConfig
    from services.drafter.training.synthetic import SyntheticSource

    ckpt = run / "checkpoints" / "latest"
    model_cfg = DrafterModelConfig(**json.loads((ckpt / "state.json").read_text())["model"])
    drafter = DFlashDrafter(model_cfg, attention=DenseAttention())
    weights = load_file(str(ckpt / "model.safetensors"))
    drafter.load_state_dict({k: v.to(weights_dtype).float() for k, v in weights.items()})
    head = load_file(str(target_dir / "model.safetensors"))
    embed, lm_head = head["model.embed_tokens.weight"], head["lm_head.weight"]
    batch = SyntheticSource(model_cfg, 128, seed=3).batch(5)
    inputs = build_inputs(
        batch,
        num_anchors=8,
        block_size=8,
        mask_token_id=MASK_ID,
        gamma=4.0,
        generator=anchor_generator(0, 5, torch.device("cpu")),
    )
    real = inputs.anchors >= 0
    with torch.no_grad():
        masks = drafter.build_masks(inputs.anchors, inputs.context_starts, inputs.context_len)
        out = drafter(
            inputs.hidden.float(),
            F.embedding(inputs.block_ids.flatten(), embed),
            inputs.context_positions,
            inputs.block_positions.flatten(),
            masks,
        )
    logits = out.view(len(real), 8, -1)[real] @ lm_head.T
    return logits, batch, inputs, embed, lm_head


def exported_logits(export_dir, batch, inputs, embed, lm_head):
    model = ExportedDrafter(export_dir)
    anchors = inputs.anchors[inputs.anchors >= 0]
    block_ids = inputs.block_ids[: len(anchors)]
    s = batch.seq_len
    block_pos = (batch.position_ids[anchors][:, None] + torch.arange(8)[None]).flatten()
    visible = dflash_visibility(anchors, batch.document_ids, 8, s)
    with torch.no_grad():
        out = model(
            batch.hidden.float(), batch.position_ids, F.embedding(block_ids.flatten(), embed), block_pos, visible
        )
    return out.view(len(anchors), 8, -1) @ lm_head.T


@pytest.mark.parametrize("dtype, tensor_dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16)])
def test_independent_loader_reproduces_the_drafters_logits(trained, tmp_path, dtype, tensor_dtype):
    target_dir, run = trained[0] / "target", trained[1]
    export, _ = launcher_export(run, tmp_path / f"export-{dtype}", dtype)
    tensors = load_file(str(export / "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {tensor_dtype}
    ours, batch, inputs, embed, lm_head = drafter_and_inputs(run, target_dir, tensor_dtype)
    theirs = exported_logits(export, batch, inputs, embed, lm_head)
    assert ours.shape == theirs.shape and ours.shape[0] >= 4
    assert torch.allclose(ours, theirs, atol=2e-4, rtol=1e-4), (ours - theirs).abs().max()
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_a_hybrid_export_round_trips_with_its_window(trained_hybrid, tmp_path):
    """Sliding + full layers: config.json carries the layout as vLLM and transformers read it, and the
    independent loader, applying the window from config.json, reproduces the drafter's logits, which
    differ from what the same weights give with the window ignored."""
    target_dir, run = trained_hybrid[0] / "target", trained_hybrid[1]
    export, _ = launcher_export(run, tmp_path / "export", "float32")
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] and cfg["sliding_window"] == 5
    assert cfg["use_sliding_window"] is True and cfg["is_causal"] is False
    hf = AutoConfig.from_pretrained(export)  # transformers keeps the window (use_sliding_window)
    assert hf.layer_types == ["sliding_attention", "full_attention"] and hf.sliding_window == 5

    ours, batch, inputs, embed, lm_head = drafter_and_inputs(run, target_dir, torch.float32)
    theirs = exported_logits(export, batch, inputs, embed, lm_head)
    assert ours.shape == theirs.shape and ours.shape[0] >= 4
    assert torch.allclose(ours, theirs, atol=2e-4, rtol=1e-4), (ours - theirs).abs().max()
    unwindowed = dict(cfg, layer_types=["full_attention"] * 2, sliding_window=None, use_sliding_window=False)
    (export / "config.json").write_text(json.dumps(unwindowed))
    assert not torch.allclose(ours, exported_logits(export, batch, inputs, embed, lm_head), atol=1e-3)


def test_export_layout_matches_the_released_drafters(trained, tmp_path):
    run = trained[1]
    export = run / "export"  # written by the run itself at the end
    assert sorted(p.name for p in export.iterdir()) == ["config.json", "export.json", "model.safetensors"]
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [1, 5]}  # 8 target layers, 2 draft
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == 8 and cfg["num_hidden_layers"] == 2
    assert cfg["layer_types"] == ["full_attention"] * 2 and cfg["is_causal"] is False and cfg["dtype"] == "bfloat16"
    assert cfg["sliding_window"] is None and cfg["use_sliding_window"] is False
    names = set(load_file(str(export / "model.safetensors")))
    per_layer = {
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "self_attn.q_norm",
        "self_attn.k_norm",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "input_layernorm",
        "post_attention_layernorm",
    }
    assert names == {f"layers.{i}.{n}.weight" for i in range(2) for n in per_layer} | {
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
    }  # no embedding, no lm_head
    hf = AutoConfig.from_pretrained(export)  # what SGLang / vLLM / transformers parse
    assert type(hf).__name__ == "Qwen3Config" and hf.hidden_size == 64 and hf.num_key_value_heads == 2
    assert hf.dflash_config["target_layer_ids"] == [1, 5] and hf.block_size == 8 and hf.num_target_layers == 8
    assert hf.rope_parameters["rope_theta"] == 5000.0


def test_export_refuses_a_corrupt_checkpoint_and_a_foreign_dir(trained, tmp_path):
    import shutil

    run = trained[1]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(run / "checkpoints" / "latest", ckpt)
    (ckpt / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes()[:-10])
    res = run_launcher("export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "x"), cwd=REPO, timeout=120)
    assert res.returncode == 2 and "is corrupt: model.safetensors has" in res.stderr and not (tmp_path / "x").exists()
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    res = run_launcher("export", "--checkpoint", str(run), "--out", str(foreign), cwd=REPO, timeout=120)
    assert res.returncode == 2 and "not a DFlash export" in res.stderr
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_export_files_are_readable_by_other_accounts_and_checkpoints_too(trained, tmp_path):
    """safetensors writes 0600 by itself; an engine under another account must read the export. Every
    file gets the mode of a new file here: 0644 under umask 022 (the fixture's), 0640 under 027."""
    run = trained[1]
    latest = run / "checkpoints" / "latest"
    for path in [*(run / "export").iterdir(), *latest.iterdir()]:
        assert mode(path) == 0o644, f"{path.name}: {oct(mode(path))}"
    export, _ = launcher_export(latest, tmp_path / "group-only", umask=0o027)
    assert {p.name: mode(p) for p in export.iterdir()} == {
        "config.json": 0o640,
        "export.json": 0o640,
        "model.safetensors": 0o640,
    }


def test_export_records_its_step_and_vllms_setting(trained, tmp_path):
    run = trained[1]
    auto = json.loads((run / "export" / "export.json").read_text())  # written by the run at its end
    serve = auto.pop("serve")  # the commands for the run's target
    assert (
        set(serve) == {"target", "vllm", "sglang"}
        and f"--speculative-draft-model-path {run / 'export'}" in serve["sglang"]
    )
    assert auto == {
        "step": 6,
        "last": True,
        "best": False,
        "best_step": None,
        "checkpoint": "step-00000006",
        "eval_tau": None,
        "block_size": 8,
        "num_speculative_tokens": 7,
        "target_layer_ids": [1, 5],
        "dtype": "bfloat16",
    }
    export, stdout = launcher_export(run / "checkpoints" / "latest", tmp_path / "by-hand")
    assert stdout.splitlines()[0].startswith("exported step 6 (last of its run) from ")  # words, not JSON
    assert '"num_speculative_tokens": 7' in stdout and f'"model": "{export}"' in stdout  # the vLLM command
    assert json.loads((export / "export.json").read_text())["checkpoint"] == "step-00000006"


def test_a_checkpoint_listing_its_layers_out_of_order_is_not_exported(trained, tmp_path):
    """The target concatenates captured layers in ascending order and a config listing them otherwise is
    refused (tests/unit/test_config.py); a checkpoint whose model config still lists them out of order
    (written before that check) is refused by export rather than exported in an order it was not trained in."""
    import shutil

    from services.drafter.checkpoints.export import ExportError, export_checkpoint
    from services.run.files import sha256_file

    ckpt = tmp_path / "checkpoints" / "step-00000001"
    shutil.copytree((trained[1] / "checkpoints" / "latest").resolve(), ckpt)
    state = json.loads((ckpt / "state.json").read_text())
    state["model"]["target_layer_ids"] = [5, 1]
    (ckpt / "state.json").write_text(json.dumps(state))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["state.json"] = {
        "bytes": (ckpt / "state.json").stat().st_size,
        "sha256": sha256_file(ckpt / "state.json"),
    }
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match=r"target_layer_ids \[5, 1\] out of order"):
        export_checkpoint(ckpt, tmp_path / "x")


def test_exporting_best_without_evaluation_names_what_to_export(trained, tmp_path):
    run = trained[1]
    res = run_launcher(
        "export", "--checkpoint", str(run / "checkpoints" / "best"), "--out", str(tmp_path / "x"), cwd=REPO, timeout=120
    )
    assert res.returncode == 2 and "eval.every > 0" in res.stderr
    assert f"export {run / 'checkpoints' / 'latest'} instead" in res.stderr
