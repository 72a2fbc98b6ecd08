"""The drafter model against HF Qwen3 building blocks, and what it takes from a (tiny, random,
made-on-the-fly) HF target checkpoint: config, embedding, lm_head, mask token."""

import json

import pytest
import torch
from safetensors.torch import save_file

from services.drafter.modeling.anchors import build_inputs
from services.drafter.modeling.attention import DenseAttention
from services.drafter.modeling.model import DFlashDrafter, DrafterModelConfig
from services.drafter.modeling.target_head import from_target, resolve_mask_token_id
from services.drafter.training.synthetic import SyntheticSource
from services.run import runspec
from services.run.config import ConfigError, load_config
from services.run.layers import default_layer_ids
from services.run.runspec import target_fields_of
from tests.drafters import build_model_config

TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    rope_theta=50000.0,
)


def save_tokenizer(path, mask_token=None, added_mask=False):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(80)}
    vocab["[UNK]"] = 80
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", mask_token=mask_token)
    if added_mask:
        fast.add_special_tokens({"additional_special_tokens": ["<|MASK|>"]})
    fast.save_pretrained(path)
    return fast


def save_qwen3(path, tied: bool, shard: bool):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**TINY, tie_word_embeddings=tied))
    model.save_pretrained(path, max_shard_size="20KB" if shard else "10GB")
    save_tokenizer(path)
    return model


def config_for(path, *overrides):
    return load_config(
        None,
        [
            f"target.model_path={json.dumps(str(path))}",
            "drafter.num_layers=3",
            "data.pack_len=256",
            "drafter.num_anchors=16",
            *overrides,
        ],
    )


@pytest.mark.parametrize("tied,shard", [(True, True), (False, False), (False, True)])
def test_embed_and_lm_head_come_from_the_checkpoint(tmp_path, tied, shard):
    model = save_qwen3(tmp_path, tied, shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    model_cfg, head = from_target(runspec.resolve(config_for(tmp_path)))
    assert torch.equal(head.embed, model.model.embed_tokens.weight.detach())
    assert torch.equal(head.lm_head, model.lm_head.weight.detach())
    assert head.tied == tied
    assert model_cfg.hidden_size == 32 and model_cfg.vocab_size == 96 and model_cfg.num_target_layers == 8
    assert model_cfg.num_key_value_heads == 2 and model_cfg.head_dim == 8 and model_cfg.rope_theta == 50000.0
    assert model_cfg.target_layer_ids == default_layer_ids(8, 3) == [1, 3, 5]
    assert model_cfg.mask_token_id == 81  # no mask token, no <|MASK|>: len(tokenizer)
    drafter = DFlashDrafter(model_cfg)
    # the target's embedding and lm_head are not the drafter's (a Domino drafter's embed_proj is its own head)
    names = [k for k in drafter.state_dict() if not k.startswith("embed_proj.")]
    assert not any("embed" in k or "lm_head" in k for k in names)
    assert drafter.cfg.domino and any(k.startswith("embed_proj.") for k in drafter.state_dict())


def test_state_dict_uses_the_released_dflash_names():
    cfg = DrafterModelConfig(
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size=10,
        num_target_layers=8,
        num_hidden_layers=2,
        target_layer_ids=[1, 4, 5],
        block_size=4,
        mask_token_id=9,
    )
    per_layer = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
    ]
    expected = {f"layers.{i}.{n}" for i in range(2) for n in per_layer} | {
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
    }
    sd = DFlashDrafter(cfg).state_dict()
    assert set(sd) == expected
    assert sd["fc.weight"].shape == (16, 48)  # K*H -> H, no bias
    assert sd["layers.0.self_attn.k_proj.weight"].shape == (8, 16)


def test_default_layer_ids_match_dflash():
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_layer_ids(36, 1) == [18]
    assert default_layer_ids(28, 3) == [1, 13, 25]


def test_composite_config_resolves_to_text_config_and_language_model_tensors(tmp_path):
    from transformers import Qwen3VLConfig

    Qwen3VLConfig(text_config=dict(TINY)).save_pretrained(tmp_path)
    fields = target_fields_of(str(tmp_path))
    assert fields["hidden_size"] == 32 and fields["num_target_layers"] == 8 and fields["rope_theta"] == 50000.0
    embed, lm_head = torch.randn(96, 32), torch.randn(96, 32)
    save_file(
        {
            "model.language_model.embed_tokens.weight": embed,
            "lm_head.weight": lm_head,
            "model.visual.embed_tokens.weight": torch.randn(4, 32),
        },
        str(tmp_path / "model.safetensors"),
    )
    save_tokenizer(tmp_path, mask_token="[UNK]")
    model_cfg, head = from_target(runspec.resolve(config_for(tmp_path)))
    assert torch.equal(head.embed, embed) and torch.equal(head.lm_head, lm_head)
    assert model_cfg.mask_token_id == 80  # the tokenizer's own mask token


def test_mask_token_resolution(tmp_path):
    save_tokenizer(tmp_path / "a", added_mask=True)
    assert resolve_mask_token_id(-1, str(tmp_path / "a")) == 81
    assert resolve_mask_token_id(7, str(tmp_path / "nowhere")) == 7
    with pytest.raises(ConfigError, match="cannot load the tokenizer"):
        resolve_mask_token_id(-1, str(tmp_path / "nowhere"))


def test_bad_target_configs_are_named(tmp_path):
    save_qwen3(tmp_path, tied=False, shard=False)
    with pytest.raises(ConfigError, match=r"target.layer_ids \[8\] out of range: the target has 8 decoder layers"):
        from_target(runspec.resolve(config_for(tmp_path, "target.layer_ids=[1, 8]")))
    with pytest.raises(ConfigError, match="mask token id 96 is outside the embedding"):
        from_target(runspec.resolve(config_for(tmp_path, "drafter.mask_token_id=96")))
    with pytest.raises(ConfigError, match="drafter.overrides.hidden: not a drafter model field"):
        from_target(runspec.resolve(config_for(tmp_path, "drafter.overrides={hidden=3}")))
    with pytest.raises(ConfigError, match=r"model.embed_tokens.weight has shape \(96, 32\), config says \[96, 64\]"):
        from_target(runspec.resolve(config_for(tmp_path, "drafter.overrides={hidden_size=64}")))
    with pytest.raises(ConfigError, match="drafter.num_anchors=300 is larger than data.pack_len=256"):
        from_target(runspec.resolve(config_for(tmp_path, "drafter.num_anchors=300")))
    with pytest.raises(ConfigError, match="model directory not found"):
        from_target(runspec.resolve(config_for(tmp_path / "missing")))


def reference_block_outputs(drafter, inputs, embeds):
    """Each valid block on its own, with HF Qwen3 modules: keys = its context prefix + itself; in a
    sliding_attention layer, only keys less than sliding_window positions before the query."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import (
        Qwen3MLP,
        Qwen3RMSNorm,
        Qwen3RotaryEmbedding,
        apply_rotary_pos_emb,
    )

    c = drafter.cfg
    hf = Qwen3Config(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        head_dim=c.head_dim,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        rope_theta=c.rope_theta,
        rms_norm_eps=c.rms_norm_eps,
    )
    rotary = Qwen3RotaryEmbedding(hf)
    sd = drafter.state_dict()

    def norm(name, dim):
        n = Qwen3RMSNorm(dim, eps=c.rms_norm_eps)
        n.weight.data.copy_(sd[name])
        return n

    def lin(name, x):
        return x @ sd[name].t()

    ctx_all = norm("hidden_norm.weight", c.hidden_size)(lin("fc.weight", inputs.hidden.float()))
    B, heads, kv_heads, D = c.block_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    outs = {}
    for i, a in enumerate(inputs.anchors.tolist()):
        if a < 0:
            continue
        s0 = int(inputs.context_starts[i])
        ctx = ctx_all[s0:a]
        x = embeds[i * B : (i + 1) * B]
        pos = torch.cat([inputs.context_positions[s0:a], inputs.block_positions[i]])[None]
        cos, sin = rotary(x[None], pos)
        for layer in range(c.num_hidden_layers):
            p = f"layers.{layer}."
            h = norm(p + "input_layernorm.weight", c.hidden_size)(x)
            kv_in = torch.cat([ctx, h])
            q = norm(p + "self_attn.q_norm.weight", D)(
                lin(p + "self_attn.q_proj.weight", h).view(B, heads, D)
            ).transpose(0, 1)
            k = norm(p + "self_attn.k_norm.weight", D)(
                lin(p + "self_attn.k_proj.weight", kv_in).view(-1, kv_heads, D)
            ).transpose(0, 1)
            v = lin(p + "self_attn.v_proj.weight", kv_in).view(-1, kv_heads, D).transpose(0, 1)
            # q sits at the last B positions: rotate it with the tail of cos/sin
            q, _ = apply_rotary_pos_emb(q[None], q[None], cos[:, -B:], sin[:, -B:])
            _, k = apply_rotary_pos_emb(k[None], k[None], cos, sin)
            k = k[0].repeat_interleave(heads // kv_heads, 0)
            v = v.repeat_interleave(heads // kv_heads, 0)
            scores = q[0] @ k.transpose(1, 2) / D**0.5
            if c.layer_types[layer] == "sliding_attention":
                too_far = pos[0, -B:, None] - pos[0, None, :] >= c.sliding_window
                scores = scores.masked_fill(too_far, float("-inf"))
            attn = torch.softmax(scores, -1) @ v
            x = x + lin(p + "self_attn.o_proj.weight", attn.transpose(0, 1).reshape(B, heads * D))
            mlp = Qwen3MLP(hf)
            for n in ("gate_proj", "up_proj", "down_proj"):
                getattr(mlp, n).weight.data.copy_(sd[p + f"mlp.{n}.weight"])
            x = x + mlp(norm(p + "post_attention_layernorm.weight", c.hidden_size)(x))
        outs[i] = norm("norm.weight", c.hidden_size)(x)
    return outs


@pytest.mark.parametrize(
    "layer_types, window",
    [([], None), (["sliding_attention", "full_attention"], 3), (["full_attention", "sliding_attention"], 6)],
)
def test_drafter_forward_matches_a_per_block_hf_reference(layer_types, window):
    torch.manual_seed(0)
    cfg = DrafterModelConfig(
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=64,
        num_target_layers=8,
        num_hidden_layers=2,
        target_layer_ids=[1, 3, 5],
        block_size=4,
        mask_token_id=63,
        rope_theta=10000.0,
        layer_types=layer_types,
        sliding_window=window,
    )
    drafter = DFlashDrafter(cfg, attention=DenseAttention())
    for p in drafter.parameters():  # make norms non-trivial
        p.data.add_(torch.randn_like(p) * 0.05)
    batch = SyntheticSource(cfg, 120, seed=3).batch(1)
    inputs = build_inputs(
        batch, num_anchors=10, block_size=4, mask_token_id=63, gamma=4.0, generator=torch.Generator().manual_seed(0)
    )
    assert len(set(batch.document_ids[inputs.anchors[inputs.anchors >= 0]].tolist())) > 1  # several documents
    embeds = torch.randn(64, 32)[inputs.block_ids.flatten()]
    masks = drafter.build_masks(inputs.anchors, inputs.context_starts, inputs.context_len)
    with torch.no_grad():
        out = drafter(inputs.hidden.float(), embeds, inputs.context_positions, inputs.block_positions.flatten(), masks)
        ref = reference_block_outputs(drafter, inputs, embeds)
    assert len(ref) >= 5
    for i, expected in ref.items():
        torch.testing.assert_close(out[i * 4 : (i + 1) * 4], expected, atol=1e-5, rtol=1e-4)


def test_synthetic_model_config_and_overrides():
    from services.drafter.training.synthetic import SYNTHETIC_MODEL

    cfg = load_config(None, ["drafter.overrides={hidden_size=48, num_hidden_layers=1}", "target.layer_ids=[2]"])
    m = build_model_config(cfg, SYNTHETIC_MODEL, mask_token_id=5)
    assert m.hidden_size == 48 and m.num_hidden_layers == 1 and m.target_layer_ids == [2] and m.hidden_width == 48


def test_a_window_keeps_context_beyond_it_out():
    """One sliding layer, W = 5, B = 4: the block of anchor a sees context a-4 .. a-1 (its anchor row,
    at position a, counts itself in the window); changing the features of a-5 changes nothing,
    changing those of a-4 changes the block; with full attention a-5 is visible."""
    from services.drafter.modeling.attention import anchor_context_starts

    outputs = {}
    for kind, window in (("sliding_attention", 5), ("full_attention", None)):
        torch.manual_seed(0)
        cfg = DrafterModelConfig(
            hidden_size=32,
            intermediate_size=48,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            vocab_size=64,
            num_target_layers=8,
            num_hidden_layers=1,
            target_layer_ids=[3],
            block_size=4,
            mask_token_id=63,
            layer_types=[kind],
            sliding_window=window,
        )
        drafter = DFlashDrafter(cfg, attention=DenseAttention())
        anchors, a = torch.tensor([20]), 20
        hidden = torch.randn(32, 32)
        embeds, positions = torch.randn(4, 32), torch.arange(32)
        masks = drafter.build_masks(anchors, anchor_context_starts(anchors, None), 32)

        def run(h):
            with torch.no_grad():
                return drafter(h, embeds, positions, torch.arange(a, a + 4), masks)

        base = run(hidden)
        outputs[kind] = {}
        for j in (a - 5, a - 4):
            changed = hidden.clone()
            changed[j] += 1.0
            outputs[kind][j] = not torch.equal(run(changed), base)
    assert outputs["sliding_attention"] == {15: False, 16: True}
    assert outputs["full_attention"] == {15: True, 16: True}


@pytest.mark.parametrize(
    "layer_types, window, message",
    [
        (["full_attention", "sliding"], 8, r"layer_types\[1\] = 'sliding': unknown layer type"),
        (["sliding_attention", "full_attention"], None, "sliding_attention layers but sliding_window is not set"),
        (["sliding_attention", "full_attention"], 0, "sliding_window must be an integer > 0, got 0"),
        (["sliding_attention", "full_attention"], -1, "sliding_window must be an integer > 0, got -1"),
        (["full_attention", "full_attention"], 8, "sliding_window = 8 is set but no layer"),
        (["sliding_attention"], 8, "layer_types has 1 entries, but the drafter has 2 layers"),
    ],
)
def test_bad_attention_layouts_are_refused(layer_types, window, message):
    with pytest.raises(ValueError, match=message):
        DrafterModelConfig(
            hidden_size=32,
            intermediate_size=48,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            vocab_size=64,
            num_target_layers=8,
            num_hidden_layers=2,
            target_layer_ids=[3],
            layer_types=layer_types,
            sliding_window=window,
        )


def test_layout_errors_name_the_config_key():
    from services.drafter.training.synthetic import SYNTHETIC_MODEL

    with pytest.raises(ConfigError, match=r"drafter.layer_types\[0\] = 'swa': unknown layer type"):
        load_config(None, ["drafter.num_layers=2", 'drafter.layer_types=["swa", "full_attention"]'])
    with pytest.raises(
        ConfigError, match="drafter.layer_types has sliding_attention layers but drafter.sliding_window"
    ):
        load_config(None, ["drafter.num_layers=2", 'drafter.layer_types=["sliding_attention", "full_attention"]'])
    with pytest.raises(ConfigError, match="drafter.sliding_window must be > 0"):
        load_config(None, ["drafter.sliding_window=-4"])
    with pytest.raises(ConfigError, match="drafter.sliding_window = 64 is set but no layer"):
        load_config(None, ["drafter.sliding_window=64"])
    with pytest.raises(ConfigError, match="drafter.layer_types has 1 entries, but the drafter has 5 layers"):
        load_config(None, ['drafter.layer_types=["full_attention"]'])
    # drafter.overrides reach the model config, and are checked there
    cfg = load_config(None, ["drafter.num_layers=2", "drafter.overrides={sliding_window=16}"])
    with pytest.raises(ConfigError, match="drafter model config: sliding_window = 16 is set but no layer"):
        build_model_config(cfg, SYNTHETIC_MODEL, mask_token_id=5)
    cfg = load_config(
        None,
        [
            "drafter.num_layers=2",
            'drafter.layer_types=["sliding_attention", "full_attention"]',
            "drafter.sliding_window=16",
        ],
    )
    m = build_model_config(cfg, SYNTHETIC_MODEL, mask_token_id=5)
    assert m.layer_types == ["sliding_attention", "full_attention"] and m.sliding_window == 16
