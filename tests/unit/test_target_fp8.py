"""FP8 targets: the FP8 linear against bf16, checkpoints in the published block-scaled layout (made
here from tiny random models: a dense Qwen3 and the composite Qwen3.5 hybrid) loaded through
load_target, the captured features' drift from bf16, and malformed checkpoints refused in one line.

Shapes have partial blocks (hidden 160 = 128 + 32, intermediate 288 = 2 x 128 + 32), as the layout
allows. The bounds on FP8's error: e4m3 keeps 3 mantissa bits, so each element of an operand is off
by at most 2^-4 of its value (about 2.5 % RMS), and a product of two quantized operands by about
3.5 % RMS (measured: 3.5 %): one linear's output within 0.1, while a wrong scale (a factor 2, a
block read transposed) is off by 50 % or more. A captured layer is the sum of the errors of the
quantized GEMMs run before it, two in sequence per decoder layer (attention in and out, MLP in and
out): about sqrt(2 x 3) x 3.5 % = 8.6 % after three layers of these random models (measured 4-9 %),
so features within 0.15, cosine above 0.98.
"""

import json
import logging
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from services.run.config import ConfigError, TargetConfig
from services.target.model import fp8, fp8_checkpoint
from services.target.model.model import decoder_layers, load_causal_lm, load_target

E4M3 = torch.float8_e4m3fn
BLOCK = 128
VOCAB = 96
SPEC = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
    "modules_to_not_convert": ["lm_head"],
}


# --- a block-scaled checkpoint, written the way the published ones are ---------------------------


def block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block by block: scale = amax / 448, fp8 = w / scale (the reference for the layout)."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=E4M3)
    scale = torch.empty(math.ceil(n / BLOCK), math.ceil(k / BLOCK))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            tile = w[rows, cols].float()
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / 448
            q[rows, cols] = (tile / scale[i, j]).to(E4M3)
    return q, scale


def block_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = torch.empty(q.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            out[rows, cols] = q[rows, cols].float() * scale[i, j]
    return out


def dense_model(layers: int = 3, width: int = 160, intermediate: int = 288, head_dim: int = 32):
    """A random Qwen3; many wide layers make the decoder's linears outweigh the rest, as in a 27B."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=width,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return Qwen3ForCausalLM(cfg).eval()


def hybrid_model():
    """The composite multimodal checkpoint of the Qwen3.5 / 3.6 family (text under model.language_model.)."""
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen3_5Config(
        text_config=dict(
            hidden_size=160,
            intermediate_size=288,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            vocab_size=VOCAB,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        ),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=160),
        tie_word_embeddings=False,
    )
    return Qwen3_5ForConditionalGeneration(config).eval()


def write_fp8_checkpoint(
    model: nn.Module, path, extra: tuple[str, ...] = ()
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """save_pretrained, then every nn.Linear but lm_head as float8_e4m3fn + weight_scale_inv (a
    composite's vision tower too), and `extra` [288, 160] FP8 weights the text model does not have
    (MTP layers, as the Qwen3.5 family ships them). Returns the FP8 tensors."""
    model.save_pretrained(path)
    tensors = load_file(str(path / "model.safetensors"))
    linears = [name + ".weight" for name, m in model.named_modules() if isinstance(m, nn.Linear) and name != "lm_head"]
    tensors.update({key: torch.randn(288, 160) * 0.02 for key in extra})
    quantized = {}
    for key in linears + list(extra):
        quantized[key] = block_quantize(tensors[key])
        tensors[key], tensors[key + "_scale_inv"] = quantized[key]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = SPEC
    (path / "config.json").write_text(json.dumps(config))
    return quantized


@pytest.fixture(scope="module")
def dense_fp8(tmp_path_factory):
    path = tmp_path_factory.mktemp("dense-fp8")
    return path, write_fp8_checkpoint(dense_model(), path)


@pytest.fixture(scope="module")
def hybrid_fp8(tmp_path_factory):
    path = tmp_path_factory.mktemp("hybrid-fp8")
    return path, write_fp8_checkpoint(hybrid_model(), path, extra=("mtp.layers.0.mlp.up_proj.weight",))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach(), want.detach()
    return float((got.float() - want.float()).norm() / want.float().norm())


def one_doc(n: int):
    return torch.arange(n), torch.zeros(n, dtype=torch.long)


# --- quantization and the FP8 linear ------------------------------------------------------------


def test_block_quantization_is_the_published_layout_with_partial_blocks():
    w = torch.randn(288, 160) * 0.02
    w[5, 7] = 0.9  # one block with an outlier
    q, scale = fp8.quantize_blocks(w, (BLOCK, BLOCK))
    want_q, want_scale = block_quantize(w)
    assert q.dtype == E4M3 and scale.shape == (3, 2)
    assert torch.equal(scale, want_scale) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(fp8.dequantize(q, scale, (BLOCK, BLOCK)), block_dequantize(q, scale))
    # e4m3's widest step is 32 units at the top (256..448), so no element is off by more than 16 x scale
    error = (w - block_dequantize(q, scale)).abs()
    assert (error <= 16 * scale.repeat_interleave(BLOCK, 0)[:288].repeat_interleave(BLOCK, 1)[:, :160]).all()
    rows, row_scale = fp8.quantize_rows(w)
    assert row_scale.shape == (288, 1) and ((w - rows.float() * row_scale).abs() <= 16 * row_scale).all()
    zero, zero_scale = fp8.quantize_rows(torch.zeros(3, 32))  # all-zero rows: zeros, not NaN
    assert torch.isfinite(zero_scale).all() and not zero.float().any()


@pytest.mark.parametrize("layout", ["rowwise", "block"])
def test_fp8_linear_is_close_to_the_bf16_one(layout):
    torch.manual_seed(1)
    linear = nn.Linear(160, 288, bias=True).to(torch.bfloat16)
    x = torch.randn(2, 37, 160, dtype=torch.bfloat16)
    want = x.float() @ linear.weight.float().t() + linear.bias.float()
    if layout == "rowwise":
        kernels = [fp8.runs_kernel("rowwise", 288, 160, "cpu", torch.bfloat16), False]
        layers = [fp8.FP8Linear.rowwise_of(linear.weight, linear.bias, k) for k in kernels]
    else:
        q, scale = block_quantize(linear.weight)
        layers = [fp8.FP8Linear(q, scale, (BLOCK, BLOCK), linear.bias, False)]
    outs = [layer(x) for layer in layers]
    for out in outs:
        assert out.shape == (2, 37, 288) and out.dtype == torch.bfloat16
        assert 1e-3 < rel_err(out, want) < 0.1  # quantized for real, and within e4m3's error
    if len(outs) == 2:  # torch._scaled_mm and the plain math: the same operands
        assert rel_err(outs[0], outs[1]) < 5e-3


def test_quantize_decoder_swaps_the_decoder_linears_only():
    model = dense_model().to(torch.bfloat16)
    layers = decoder_layers(model)
    linears = sum(isinstance(m, nn.Linear) for layer in layers for m in layer.modules())
    summary = fp8.quantize_decoder(model, layers)
    assert summary["rowwise"] == linears == 7 * 3 and summary["kept"] == 0
    assert sum(isinstance(m, fp8.FP8Linear) for m in model.modules()) == linears
    assert isinstance(model.lm_head, nn.Linear) and model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert "21 decoder linears in FP8 (21 quantized rowwise)" in str(summary)


@pytest.mark.parametrize("precision", ["fp8-rowwise", "fp8-block"])
def test_the_benchmarks_precision_switch_offloading_layer_by_layer_computes_as_all_at_once(precision):
    from bench.precision import decoder_linears, set_precision

    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(0))
    outputs, summaries = [], []
    for offload in (False, True):
        model = dense_model().to(torch.bfloat16)
        layers = decoder_layers(model)
        linears = decoder_linears(layers)
        bf16 = model(ids).logits
        summaries.append(set_precision(model, layers, linears, precision, offload))
        outputs.append(model(ids).logits)
        assert set_precision(model, layers, linears, "bf16", offload) == "bf16"
        assert torch.equal(model(ids).logits, bf16)  # the bf16 linears are back, untouched
        assert not any(isinstance(m, fp8.FP8Linear) for m in model.modules())
    assert summaries[0] == summaries[1] and "21 decoder linears in FP8" in summaries[1]
    assert torch.equal(outputs[0], outputs[1]) and not torch.equal(outputs[0], bf16)


# --- FP8 checkpoints ------------------------------------------------------------------------------


def test_dense_fp8_checkpoint_loads_its_exact_weights(dense_fp8, capfd):
    from transformers import Qwen3ForCausalLM

    path, quantized = dense_fp8
    capfd.readouterr()
    target = load_target(TargetConfig(model_path=str(path), dtype="float32", layer_ids=[1, 2]))
    assert "weight_scale_inv" not in capfd.readouterr().err  # read here, not an "unexpected key" report
    assert "_keys_to_ignore_on_load_unexpected" not in Qwen3ForCausalLM.__dict__  # transformers' class as it was
    params = dict(target.model.named_parameters())
    assert len(quantized) == 21
    for key, (q, scale) in quantized.items():
        assert torch.equal(params[key], block_dequantize(q, scale)), key
    original = load_file(str(path / "model.safetensors"))
    assert torch.equal(params["lm_head.weight"], original["lm_head.weight"])  # kept in high precision
    bf16 = load_target(TargetConfig(model_path=str(path), dtype="bfloat16", layer_ids=[1, 2]))
    q, scale = quantized["model.layers.2.mlp.down_proj.weight"]
    assert torch.equal(bf16.model.model.layers[2].mlp.down_proj.weight, block_dequantize(q, scale).to(torch.bfloat16))


def test_composite_hybrid_fp8_checkpoint_loads_the_text_model(hybrid_fp8):
    path, quantized = hybrid_fp8
    target = load_target(TargetConfig(model_path=str(path), dtype="float32", layer_ids=[1, 2]))
    assert type(target.model).__name__ == "Qwen3_5ForCausalLM" and target.path == "packed-reference"
    assert type(target.model)._keys_to_ignore_on_load_unexpected == [r"^mtp.*", r"^model.visual.*"]  # restored
    params = dict(target.model.named_parameters())
    text = {k: v for k, v in quantized.items() if k.startswith("model.language_model.")}
    assert len(text) == 2 * (5 + 3) + 2 * (4 + 3)  # Gated DeltaNet and attention layers, with their MLPs
    assert any(k.startswith("model.visual.") for k in quantized) and "mtp.layers.0.mlp.up_proj.weight" in quantized
    for key, (q, scale) in text.items():
        name = key.replace("model.language_model.", "model.")
        name = name if name in params else name.replace(".linear_attn.", ".linear_attn.layer.")  # the packed stand-in
        assert torch.equal(params[name], block_dequantize(q, scale)), key
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3))
    hidden, _ = target.capture(ids, *one_doc(40), out_dtype=torch.float32)
    assert torch.isfinite(hidden).all() and hidden.shape == (40, 2 * 160)


def loaded_then_quantized(path, dtype: torch.dtype) -> nn.Module:
    """The FP8 load done the plain way: the whole model loaded (an FP8 checkpoint dequantized), then its
    decoder put in FP8, all at once."""
    model = load_causal_lm(path, dtype, "cpu")
    checkpoint = fp8_checkpoint.BlockScaledCheckpoint.open(path)
    fp8.quantize_decoder(
        model, decoder_layers(model), checkpoint.blocks_of(checkpoint.parameters_of(model)) if checkpoint else None
    )
    return model


@pytest.mark.parametrize("which", ["dense FP8", "hybrid FP8", "dense bf16"])
def test_the_fp8_load_layer_by_layer_gives_the_model_quantized_after_loading(which, dense_fp8, hybrid_fp8, tmp_path):
    """target.quantize = "fp8" puts each decoder layer in FP8 as it reaches the device, so the device
    never holds the decoder whole in bf16; every weight, scale and buffer is the plain way's, bit for bit."""
    if which == "dense bf16":
        dense_model().save_pretrained(tmp_path / "bf16")
        path = tmp_path / "bf16"
    else:
        path = (dense_fp8 if which.startswith("dense") else hybrid_fp8)[0]
    for dtype in (torch.bfloat16, torch.float32):
        got = load_causal_lm(path, dtype, "cpu", fp8=True).state_dict()
        want = loaded_then_quantized(path, dtype).state_dict()
        assert got.keys() == want.keys()
        for key, tensor in want.items():
            if tensor is None:
                assert got[key] is None, key
                continue
            same = got[key].dtype == tensor.dtype and got[key].shape == tensor.shape
            assert same and torch.equal(got[key].view(torch.uint8), tensor.view(torch.uint8)), key
        assert any(t is not None and t.dtype == E4M3 for t in got.values()), "no FP8 weight loaded"


def test_the_fp8_load_says_how_far_it_is(dense_fp8, caplog, monkeypatch):
    """A 27B's layer-by-layer FP8 load takes minutes: it logs its progress (every PROGRESS_S; 0 here,
    so every layer) and its end."""
    monkeypatch.setattr(fp8_checkpoint, "PROGRESS_S", 0.0)
    with caplog.at_level(logging.INFO, logger="target"):
        load_causal_lm(dense_fp8[0], torch.float32, "cpu", fp8=True)
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("FP8 load: ")]
    assert progress[0].startswith("FP8 load: 1 of 3 decoder layers on cpu, ")
    assert progress[-1].startswith("FP8 load: 3 decoder layers on cpu in ") and len(progress) == 4


def test_the_benchmarks_fp8_checkpoint_of_a_composite_hybrid_loads_with_its_blocks(tmp_path):
    """bench/fp8_checkpoint.save_fp8 (how bench/e2e.py --fp8-checkpoint writes the 27B at half the
    bytes): shards, an index, every decoder linear in FP8 blocks and nothing of the vision tower; the
    service loads the text model from it with those blocks, each weight exactly fp8 x scale."""
    from bench.fp8_checkpoint import save_fp8

    model = hybrid_model()
    count = save_fp8(model, tmp_path / "fp8", shard_bytes=200_000)
    files = sorted((tmp_path / "fp8").glob("*.safetensors"))
    index = json.loads((tmp_path / "fp8" / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(files) > 1 and set(index.values()) == {f.name for f in files}
    # every decoder linear but the Gated DeltaNet's in_proj_a / in_proj_b (4 heads wide here, not a
    # multiple of 16: they stay bf16 as the service keeps them; the 27B's 48 heads are FP8)
    assert count == 2 * (5 + 3) + 2 * (4 + 3) - 2 * 2 and not any(".visual." in k for k in index)
    checkpoint = fp8_checkpoint.BlockScaledCheckpoint.open(tmp_path / "fp8")
    target = load_target(TargetConfig(model_path=str(tmp_path / "fp8"), dtype="float32", quantize="fp8"))
    layers = [m for m in target.model.modules() if isinstance(m, fp8.FP8Linear)]
    assert len(layers) == count and not any(m.rowwise for m in layers)
    original = dict(model.named_parameters())
    key = "model.language_model.layers.1.mlp.down_proj.weight"
    q, scale = checkpoint.read(key)
    assert torch.equal(q, fp8.quantize_blocks(original[key].float(), (BLOCK, BLOCK))[0])
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(8))
    hidden, _ = target.capture(ids, *one_doc(24), out_dtype=torch.float32)
    assert torch.isfinite(hidden).all()


@pytest.mark.parametrize("which", ["dense", "hybrid"])
def test_fp8_target_capture_drifts_from_bf16_by_a_small_measured_amount(which, dense_fp8, hybrid_fp8, tmp_path):
    """A bf16 checkpoint with target.quantize=fp8 (rowwise) against the same checkpoint in bf16 (dense);
    an FP8 checkpoint with its blocks against its dequantized bf16 weights (dense and hybrid)."""
    path, _ = dense_fp8 if which == "dense" else hybrid_fp8
    if which == "dense":
        dense_model().save_pretrained(tmp_path / "bf16")
    ids = torch.randint(0, VOCAB, (36,), generator=torch.Generator().manual_seed(4))
    pos = torch.cat([torch.arange(16), torch.arange(20)])  # a packed row of two documents
    doc = torch.cat([torch.zeros(16, dtype=torch.long), torch.ones(20, dtype=torch.long)])

    def capture(model_path, quantize):
        target = load_target(
            TargetConfig(model_path=str(model_path), dtype="bfloat16", quantize=quantize, layer_ids=[1, 2])
        )
        return target, target.capture(ids, pos, doc)[0]

    for model_path in (tmp_path / "bf16", path) if which == "dense" else (path,):
        _, ref = capture(model_path, "none")
        target, got = capture(model_path, "fp8")
        layouts = {m.rowwise for m in target.model.modules() if isinstance(m, fp8.FP8Linear)}
        assert layouts == ({True} if model_path != path else {False})  # bf16: rowwise; FP8 checkpoint: its blocks
        for k in range(2):
            cols = slice(k * 160, (k + 1) * 160)
            drift = rel_err(got[:, cols], ref[:, cols])
            cosine = float(
                torch.nn.functional.cosine_similarity(got[:, cols].float(), ref[:, cols].float(), dim=-1).min()
            )
            print(f"{which} {model_path.name} layer {k + 1}: rel err {drift:.4f}, min cosine {cosine:.5f}")
            assert 1e-3 < drift < 0.15 and cosine > 0.98


def test_fp8_checkpoint_requantized_rowwise_where_blocks_do_not_run(dense_fp8):
    path, _ = dense_fp8
    blocks = load_target(TargetConfig(model_path=str(path), dtype="bfloat16", quantize="fp8", layer_ids=[1, 2]))
    target = load_target(TargetConfig(model_path=str(path), dtype="bfloat16", layer_ids=[1, 2]))
    checkpoint = fp8_checkpoint.BlockScaledCheckpoint.open(path)
    summary = fp8.quantize_decoder(
        target.model, target.layers, checkpoint.blocks_of(checkpoint.parameters_of(target.model)), keep_blocks=False
    )
    assert summary["requantized"] == 21 and "requantized rowwise" in str(summary)
    assert all(m.rowwise for m in target.model.modules() if isinstance(m, fp8.FP8Linear))
    ids = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(5))
    a, b = blocks.capture(ids, *one_doc(30))[0], target.capture(ids, *one_doc(30))[0]
    assert 1e-3 < rel_err(b, a) < 0.15


# --- malformed checkpoints ------------------------------------------------------------------------


def _broken_copy(path, tmp_path, edit) -> str:
    out = tmp_path / "broken"
    out.mkdir()
    (out / "config.json").write_text((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


@pytest.mark.parametrize(
    "fault, words",
    [
        (
            "missing-scale",
            r"model\.layers\.1\.mlp\.up_proj\.weight is float8_e4m3fn but "
            r"model\.layers\.1\.mlp\.up_proj\.weight_scale_inv is missing",
        ),
        (
            "scale-shape",
            r"model\.layers\.0\.self_attn\.k_proj\.weight_scale_inv is F32 \[2, 2\], expected float32 \[1, 2\]",
        ),
        ("e5m2", r"model\.layers\.0\.mlp\.gate_proj\.weight is F8_E5M2"),
    ],
)
def test_a_malformed_fp8_checkpoint_is_one_line_naming_the_tensor_and_file(fault, words, dense_fp8, tmp_path):
    path, _ = dense_fp8

    def edit(t):
        if fault == "missing-scale":
            del t["model.layers.1.mlp.up_proj.weight_scale_inv"]
        elif fault == "scale-shape":
            t["model.layers.0.self_attn.k_proj.weight_scale_inv"] = torch.ones(2, 2)
        else:
            key = "model.layers.0.mlp.gate_proj.weight"
            t[key] = t[key].float().to(torch.float8_e5m2)

    broken = _broken_copy(path, tmp_path, edit)
    with pytest.raises(ConfigError, match=words) as info:
        load_target(TargetConfig(model_path=broken, dtype="float32", layer_ids=[1, 2]))
    message = str(info.value)
    assert "\n" not in message and f"{broken}/model.safetensors" in message


def test_an_unsupported_fp8_config_names_the_key(dense_fp8, tmp_path):
    path, _ = dense_fp8
    broken = _broken_copy(path, tmp_path, lambda t: None)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = dict(SPEC, activation_scheme="static")
    (tmp_path / "broken" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"config\.json: quantization_config\.activation_scheme = 'static'"):
        load_target(TargetConfig(model_path=broken, dtype="float32", layer_ids=[1, 2]))
    with pytest.raises(ConfigError, match="target.quantize must be one of none, fp8, got 'int8'"):
        load_target(TargetConfig(model_path=str(path), quantize="int8", layer_ids=[1, 2]))


def test_eval_takes_the_target_precision_to_verify_with(tmp_path, capsys):
    """launcher eval --set target.quantize=...: the run's config with that key changed, checked as any
    override is (a drafter trained on FP8 features, verified by the bf16 target or the reverse)."""
    from services.eval import launcher_eval as eval_cli
    from services.run.config import Config, dump_json

    dump_json(Config(), tmp_path / "config.json")
    assert eval_cli.main(["--run-dir", str(tmp_path), "--set", "target.quantize=int8"]) == 2
    assert "eval: error: target.quantize must be one of none, fp8, got 'int8'" in capsys.readouterr().err
    assert eval_cli.main(["--run-dir", str(tmp_path), "--set", "target.quantize=fp8"]) == 2  # no checkpoint here
    assert "target.quantize" not in capsys.readouterr().err


@pytest.mark.parametrize("quantized", [False, True])
def test_the_near_tie_rounding_covers_an_fp8_targets_amplified_rounding(quantized):
    """Two forwards that round differently (a block against one token, two GEMMs' sum orders) differ
    by a unit of bf16 here and there. In bf16 the logits then move by a few units of bf16 rounding; an
    FP8 target requantizes every linear's input to e4m3, where such a difference flips roundings 16x
    coarser, so its logits move about 4x more (rounding_tolerance's sqrt(eps * E4M3_EPS)). Measured on
    a random model: one unit of bf16 on a tenth of the embeddings' elements, the largest logit change
    in units of bf16 at the top-1 logit's magnitude: within the target's near-tie tolerance, and for
    FP8 beyond bf16's (so without the wider rounding a rounding difference would read as a bug)."""
    from services.decoding.decode_step import rounding_tolerance
    from services.target.model.model import Target

    torch.manual_seed(1)
    model = dense_model(layers=3, width=256, intermediate=512).to(torch.bfloat16)
    if quantized:
        fp8.quantize_decoder(model, decoder_layers(model))
    assert Target(model, [1]).fp8_linears == quantized
    embeddings = model.get_input_embeddings()(torch.randint(0, VOCAB, (1, 64)))
    up = torch.nextafter(embeddings, torch.full_like(embeddings, math.inf))  # one unit of bf16 up
    bumped = torch.where(torch.rand(embeddings.shape) < 0.1, up, embeddings)
    with torch.no_grad():
        logits, moved = (model(inputs_embeds=e).logits[0].float() for e in (embeddings, bumped))
    change = (moved - logits).abs().amax(-1)
    top1 = logits.amax(-1)
    bf16_rounding = rounding_tolerance(top1, torch.bfloat16)
    assert torch.all(change <= rounding_tolerance(top1, torch.bfloat16, fp8=quantized))
    assert bool(torch.any(change > bf16_rounding)) == quantized


def test_few_token_steps_are_off_unless_asked_and_never_where_the_kernel_cannot_run():
    """The few-token kernel is off in the service; asked for on the CPU (no triton kernel there) it
    stays off and the layer computes as before; a mode that does not exist is refused by name."""
    model = dense_model()
    fp8.quantize_decoder(model, decoder_layers(model))
    layers = [m for m in model.modules() if isinstance(m, fp8.FP8Linear)]
    assert layers and not any(layer.few for layer in layers)
    x = torch.randn(3, layers[0].in_features)
    before = layers[0](x)
    assert fp8.few_token_steps(model, "quantized") == 0 and not any(layer.few for layer in layers)
    assert torch.equal(layers[0](x), before)
    with pytest.raises(ValueError, match="few-token mode 'fast'"):
        fp8.few_token_steps(model, "fast")


def test_the_few_token_decode_gemm_is_the_default_and_named_when_misspelled(dense_fp8, caplog):
    """target.fp8_decode_gemm = "few-token", the default, sends an FP8 target's decoding steps through
    the kernel's quantized mode where it runs (not on the CPU: there the scaled path stays, and the log
    says 0); "scaled" leaves every linear on the scaled GEMM; a value that does not exist is named."""
    from services.run.config import load_config

    assert load_config(None, []).target.fp8_decode_gemm == "few-token"
    path, _ = dense_fp8
    with caplog.at_level(logging.INFO, logger="target"):
        target = load_target(TargetConfig(model_path=str(path), dtype="bfloat16", quantize="fp8"))
    assert "target.fp8_decode_gemm=few-token: 0 FP8 linears" in caplog.text
    assert not any(m.few for m in target.model.modules() if isinstance(m, fp8.FP8Linear))
    with pytest.raises(ConfigError, match="target.fp8_decode_gemm must be one of scaled, few-token, got 'fast'"):
        load_config(None, ['target.fp8_decode_gemm="fast"'])


# --- on the GPU: torch's scaled GEMMs against the plain math -------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
def test_cuda_rowwise_fp8_gemm_runs_and_agrees_with_the_plain_math():
    if torch.cuda.get_device_capability() < (8, 9):
        model = dense_model().to("cuda", torch.bfloat16)
        with pytest.raises(ConfigError, match="this GPU runs no FP8 GEMM"):
            fp8.quantize_decoder(model, decoder_layers(model))
        return
    torch.manual_seed(2)
    weight = torch.randn(1024, 5120, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(1000, 5120, device="cuda", dtype=torch.bfloat16)
    assert fp8.runs_kernel("rowwise", 1024, 5120, "cuda:0", torch.bfloat16)
    got, want = (fp8.FP8Linear.rowwise_of(weight, None, kernel)(x) for kernel in (True, False))
    assert rel_err(got, want) < 5e-3 and 1e-3 < rel_err(got, x.float() @ weight.float().t()) < 0.1


@needs_cuda
def test_cuda_block_scaled_gemm_where_it_runs_agrees_with_the_plain_math():
    """Where the probe finds the block-scaled GEMM, it agrees on another shape and row count than the
    probe's; where it does not, loading an FP8 checkpoint requantizes rowwise (said in the summary)."""
    torch.manual_seed(3)
    weight = torch.randn(3072, 5120, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(999, 5120, device="cuda", dtype=torch.bfloat16)
    q, scale = fp8.quantize_blocks(weight, (BLOCK, BLOCK))
    runs = fp8.runs_kernel("block", 3072, 5120, "cuda:0", torch.bfloat16)
    print(f"block-scaled FP8 GEMM on {torch.cuda.get_device_name()}, torch {torch.__version__}: {runs}")
    if runs:
        got, want = (fp8.FP8Linear(q, scale, (BLOCK, BLOCK), None, kernel)(x) for kernel in (True, False))
        assert rel_err(got, want) < 5e-3
    model = dense_model().to("cuda", torch.bfloat16)
    blocks = {
        name + ".weight": (*fp8.quantize_blocks(m.weight, (BLOCK, BLOCK)), (BLOCK, BLOCK))
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
    }
    summary = fp8.quantize_decoder(model, decoder_layers(model), blocks.get)
    assert summary["block"] + summary["requantized"] == 21 and summary["plain"] == 0


def test_the_block_scaled_gemm_is_one_op_with_the_output_shape_for_the_compiler():
    """dynamo does not trace torch._scaled_mm_v2 (F.scaled_mm's); the block GEMM is an op of its own,
    whose fake gives the compiler the output's shape and dtype without running it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        xq = torch.empty(8, 256, dtype=torch.float8_e4m3fn)
        w = torch.empty(384, 256, dtype=torch.float8_e4m3fn)
        out = torch.ops.dflash.fp8_block_mm(xq, w, torch.empty(8, 2), torch.empty(4, 3), torch.bfloat16)
    assert out.shape == (8, 384) and out.dtype == torch.bfloat16


@needs_cuda
def test_cuda_block_scaled_linear_compiles_whole_and_computes_as_eager():
    """A compiled FP8 linear of 128 x 128 blocks is one graph (fullgraph: a break is an error) and
    gives the eager layer's output."""
    if not fp8.runs_kernel("block", 3072, 5120, "cuda:0", torch.bfloat16):
        pytest.skip("no block-scaled FP8 GEMM on this GPU")
    torch.manual_seed(4)
    weight = torch.randn(3072, 5120, device="cuda", dtype=torch.bfloat16) * 0.02
    layer = fp8.FP8Linear(*fp8.quantize_blocks(weight, (BLOCK, BLOCK)), (BLOCK, BLOCK), None, True)
    x = torch.randn(4096, 5120, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(layer, fullgraph=True)
    assert rel_err(compiled(x), layer(x)) < 1e-2


def cuda_peak(load) -> int:
    """The device memory `load()` peaks at above what was allocated before it (what it returns dropped)."""
    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loaded = load()
    peak = torch.cuda.max_memory_allocated() - start
    del loaded
    torch.cuda.empty_cache()
    return peak


@needs_cuda
def test_cuda_the_fp8_load_peaks_at_about_half_the_plain_loads(tmp_path):
    """Layer by layer, the device holds the FP8 decoder and one layer in bf16 at most, never the bf16
    model: from an FP8 checkpoint of 24 wide layers, target.quantize = "fp8" peaks at under 0.7 of the
    plain load's peak (which holds the whole model in bf16), side by side in one process."""
    path = tmp_path / "deep-fp8"
    write_fp8_checkpoint(dense_model(layers=24, width=512, intermediate=1536, head_dim=128), path)
    # a first load asks torch once per weight shape whether the FP8 GEMM runs, and sets up cuBLAS:
    # fixed costs, not the load's, which at this size would blur the ratio
    cuda_peak(lambda: load_target(TargetConfig(model_path=str(path), quantize="fp8"), "cuda:0"))
    plain = cuda_peak(lambda: load_causal_lm(path, torch.bfloat16, "cuda:0"))
    layerwise = cuda_peak(lambda: load_target(TargetConfig(model_path=str(path), quantize="fp8"), "cuda:0"))
    assert layerwise < 0.7 * plain, (layerwise, plain)
    target = load_target(TargetConfig(model_path=str(path), quantize="fp8"), "cuda:0")
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3))
    assert torch.isfinite(target.capture(ids, *one_doc(40))[0]).all()


@needs_cuda
def test_cuda_fp8_checkpoint_loads_and_captures_close_to_bf16(dense_fp8):
    path, _ = dense_fp8
    ids = torch.randint(0, VOCAB, (64,), generator=torch.Generator().manual_seed(6))
    ref, got = (
        load_target(
            TargetConfig(model_path=str(path), dtype="bfloat16", quantize=q, layer_ids=[1, 2]), "cuda:0"
        ).capture(ids, *one_doc(64))[0]
        for q in ("none", "fp8")
    )
    assert got.is_cuda and 1e-3 < rel_err(got, ref) < 0.15


@needs_cuda
@pytest.mark.parametrize("layout", ["rowwise", "block"])
def test_cuda_few_token_fp8_gemm_is_the_weight_only_math_eager_compiled_and_graphed(layout):
    """A decoding step's few tokens: the Triton kernel equals x (bf16) times the dequantized weight
    at 1, 13 and 64 rows (64 the most it takes), with partial tiles on both weight dimensions;
    torch.compile traces it and a CUDA graph replays it; 65 rows take the scaled GEMM."""
    from services.target.model import fp8_few_tokens

    if not fp8_few_tokens.available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs triton and an FP8 GPU")
    torch.manual_seed(4)
    weight = torch.randn(1000, 1040, device="cuda") * 0.02  # neither a multiple of 64 nor of 128
    q, scale = fp8.quantize_rows(weight) if layout == "rowwise" else fp8.quantize_blocks(weight, (BLOCK, BLOCK))
    block = (1, 1040) if layout == "rowwise" else (BLOCK, BLOCK)
    layer = fp8.FP8Linear(q, scale, None if layout == "rowwise" else block, None, kernel=False)
    assert not layer.few and fp8.few_token_steps(layer, "weight-only") == 1  # off unless asked
    exact = fp8.dequantize(q, scale, block)
    for rows in (1, 13, 64):
        x = torch.randn(rows, 1040, device="cuda", dtype=torch.bfloat16)
        assert rel_err(layer(x), x.float() @ exact.t()) < 4e-3
    compiled = torch.compile(layer, dynamic=True)
    x = torch.randn(16, 1040, device="cuda", dtype=torch.bfloat16)
    assert rel_err(compiled(x), layer(x)) < 1e-3  # inductor may add the split-K partials in another order
    graph, static_x = torch.cuda.CUDAGraph(), x.clone()
    compiled(static_x)  # compiled and warm before capture
    with torch.cuda.graph(graph):
        static_out = compiled(static_x)
    static_x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(static_out, compiled(static_x))
    many = torch.randn(fp8_few_tokens.MAX_TOKENS + 1, 1040, device="cuda", dtype=torch.bfloat16)
    got = layer(many)
    layer.few = ""
    assert torch.equal(got, layer(many))  # the same path as a layer without the kernel


@needs_cuda
@pytest.mark.parametrize("layout", ["rowwise", "block"])
def test_cuda_few_token_fp8_gemm_quantized_gives_the_scaled_gemms_numbers(layout):
    """The quantized mode quantizes x as the scaled GEMM does, so at 1-64 tokens it gives the plain
    math's numbers (and the scaled GEMM's where it runs) up to the order of the sums: a batch of few
    rows and one of many compute alike."""
    from services.target.model import fp8_few_tokens

    if not fp8_few_tokens.available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs triton and an FP8 GPU")
    torch.manual_seed(5)
    weight = torch.randn(1000, 1040, device="cuda") * 0.02
    q, scale = fp8.quantize_rows(weight) if layout == "rowwise" else fp8.quantize_blocks(weight, (BLOCK, BLOCK))
    block = (1, 1040) if layout == "rowwise" else (BLOCK, BLOCK)
    layer = fp8.FP8Linear(q, scale, None if layout == "rowwise" else block, None, kernel=False)
    assert fp8.few_token_steps(layer, "quantized") == 1 and layer.few == "quantized"
    for rows in (1, 13, 64):
        x = torch.randn(rows, 1040, device="cuda", dtype=torch.bfloat16)
        got = layer(x)
        layer.few = ""
        want = layer(x)  # the plain math: x quantized the same way, float32 sums
        layer.few = "quantized"
        assert rel_err(got, want) < 2e-3
    with pytest.raises(ValueError, match="few-token mode"):
        fp8.few_token_steps(layer, "fast")


@needs_cuda
def test_cuda_fp8_target_with_the_few_token_decode_gemm_computes_as_the_scaled_one(dense_fp8):
    """A decoding step of 16 tokens on an FP8 target with target.fp8_decode_gemm = "few-token": every
    FP8 linear takes the kernel (quantized mode) and the logits are the scaled GEMM's, up to the
    order of the sums; 65 tokens and more keep the scaled GEMM."""
    from services.target.model import fp8_few_tokens

    if not fp8_few_tokens.available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs triton and an FP8 GPU")
    path, _ = dense_fp8
    targets = [
        load_target(
            TargetConfig(
                model_path=str(path),
                dtype="bfloat16",
                quantize="fp8",
                fp8_decode_gemm=gemm,
                layer_ids=[1, 2],
                attn_implementation="eager",
            ),
            "cuda:0",
        )
        for gemm in ("scaled", "few-token")
    ]
    layers = [m for m in targets[1].model.modules() if isinstance(m, fp8.FP8Linear)]
    assert layers and all(m.few == "quantized" for m in layers)
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(7)).cuda()
    with torch.no_grad():
        scaled, few = (t.model(input_ids=ids).logits.float() for t in targets)
    assert rel_err(few, scaled) < 5e-3


# --- the benchmark, as a CPU smoke test -----------------------------------------------------------


def test_precision_benchmark_runs_on_cpu_at_the_tiny_shape(tmp_path, capsys):
    from bench import target_precision

    out = tmp_path / "precision.json"
    result = target_precision.main(
        [
            "--shape",
            "tiny",
            "--keep-layers",
            "4",
            "--layers",
            "1",
            "--seq",
            "64",
            "--mixes",
            "single",
            "--iters",
            "1",
            "--warmup",
            "0",
            "--out",
            str(out),
        ]
    )
    assert json.loads(out.read_text())["precisions"].keys() == {"bf16", "fp8", "fp8-block"}
    runs = result["precisions"]
    assert "quantized rowwise" in runs["fp8"]["summary"] and "block scales" in runs["fp8-block"]["summary"]
    for name in ("fp8", "fp8-block"):
        drift = runs[name]["mixes"]["single"]["drift"]
        assert len(drift) == 1 and all(1e-3 < d["rel_err"] < 0.2 and d["cos_mean"] > 0.98 for d in drift)
    assert all(d["rel_err"] == 0 for d in runs["bf16"]["mixes"]["single"]["drift"])  # bf16 against itself
    assert "drift against bf16 on the same row" in capsys.readouterr().out


def test_capture_benchmark_times_each_precision_with_a_roofline_on_cpu(capsys):
    from bench import target_capture

    argv = "--shapes tiny --seq 64 --layers 1 --mixes short --precision bf16,fp8-rowwise,fp8-block"
    (rec,) = target_capture.main([*argv.split(), "--iters", "1", "--warmup", "0"])
    assert rec["gemm_tflops"]["bf16"] > 0  # measured on the CPU too; the FP8 rates are CUDA's only
    assert rec["gemm_tflops"]["rowwise"] is None and rec["gemm_tflops"]["block"] is None
    for key, gemm in [
        ("capture_short", "bf16"),
        ("capture_short@fp8-rowwise", "rowwise"),
        ("capture_short@fp8-block", "block"),
    ]:
        m = rec[key]
        assert m["tok_s"] > 0 and m["gemm"] == gemm and m["linear_flops"] > 0
        if gemm == "bf16":
            assert 0 < m["fraction"] and m["roofline_tok_s"] > 0
        else:
            assert m["fraction"] is None and "no " + gemm + " GEMM rate" in m["roofline_note"]
    assert "block scales" in rec["precision_summary"]["fp8-block"]
    assert "roofline (block GEMM)" in capsys.readouterr().out
    assert rec["attention"] == "SDPA per document"  # the service's packed attention here, not the bare sdpa


@needs_cuda
def test_cuda_capture_benchmark_times_the_services_varlen_attention_beside_sdpa_per_document(capsys):
    """The bench's compiled capture runs the row's full-attention layers as the service does (one
    varlen call per row) and, with --attention-ab, times SDPA per document on the same row beside it."""
    from bench import target_capture

    argv = "--shapes tiny-hybrid --seq 512 --layers 2 --mixes short --compile --recompile-rows 0 --attention-ab"
    (rec,) = target_capture.main([*argv.split(), "--iters", "2", "--warmup", "1"])
    assert rec["attention"].startswith("varlen flash attention")
    m = rec["compiled_short"]
    assert m["per_document_attention_tok_s"] > 0 and m["varlen_vs_per_document"] > 0
    assert "SDPA per document instead" in capsys.readouterr().out
