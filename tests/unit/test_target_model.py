"""The target model: loading, layer capture, early exit, packed rows, argmax labels.

Real tiny HF models (random weights) are built and saved on the fly; the reference is always
HF's own forward with output_hidden_states=True on a stock "sdpa" model.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from services.run.config import TargetConfig
from services.run.layers import default_layer_ids
from services.target.model.attention import PACKED_SDPA, varlen_attention
from services.target.model.model import (
    Target,
    TargetLoadError,
    document_spans,
    load_hf_model,
    load_target,
    packed_attention,
    resolve_layer_ids,
)

SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=160,
    max_position_embeddings=512,
)


def _save(tmp_path, config, name):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    path = tmp_path / name
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model_dir(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    config = Qwen3Config(head_dim=16, **SHAPE) if request.param == "qwen3" else LlamaConfig(**SHAPE)
    return _save(tmp, config, request.param)


def _reference(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


def _hf_hidden(ref, ids):
    with torch.no_grad():
        out = ref(input_ids=ids[None], output_hidden_states=True)
    return [h[0] for h in out.hidden_states], out.logits[0]


def _one_doc(n):
    return torch.arange(n), torch.zeros(n, dtype=torch.long)


def _packed(lengths, pad=0):
    pos = torch.cat([torch.arange(n) for n in lengths] + [torch.arange(pad)])
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((pad,), -1)])
    return pos, doc


# --- layer ids -------------------------------------------------------------------------------------


def test_default_layer_ids_follow_dflash():
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_layer_ids(36, 1) == [18]
    assert default_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert resolve_layer_ids([], 36, 5) == [1, 9, 17, 25, 33]
    assert resolve_layer_ids([17, 3], 36, 5) == [3, 17]  # explicit ids win, in layer order


def test_bad_layer_ids_are_named():
    with pytest.raises(TargetLoadError, match=r"\[6, -1\] out of range.*6 decoder layers"):
        resolve_layer_ids([1, 6, -1], 6, 3)
    with pytest.raises(TargetLoadError, match="4 decoder layers, too few for drafter.num_layers=3"):
        resolve_layer_ids([], 4, 3)  # 4 layers cannot spread 3 ids from 1 to 1
    with pytest.raises(TargetLoadError, match=r"target.layer_ids \[2, 2\] has duplicates"):
        resolve_layer_ids([2, 2], 6, 2)


def test_document_spans():
    assert document_spans(torch.tensor([0, 0, 1, 1, 1, 2, -1, -1])) == [(0, 2), (2, 5), (5, 6), (6, 8)]
    assert document_spans(torch.tensor([0, 0, 0])) == [(0, 3)]


# --- loading ---------------------------------------------------------------------------------------


def test_missing_model_dir_and_config_are_named(tmp_path):
    with pytest.raises(TargetLoadError, match=f"model directory not found: {tmp_path / 'nope'}"):
        load_hf_model(tmp_path / "nope", torch.float32, "sdpa", "cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TargetLoadError, match=f"no config.json in {tmp_path / 'empty'}"):
        load_hf_model(tmp_path / "empty", torch.float32, "sdpa", "cpu")
    with pytest.raises(TargetLoadError, match="target.dtype"):
        load_target(TargetConfig(model_path=str(tmp_path), dtype="int8"))


def test_load_target_uses_config(model_dir):
    target = load_target(TargetConfig(model_path=str(model_dir), dtype="float32"), "cpu", num_draft_layers=2)
    assert target.info.layer_ids == [1, 3]  # spread from 1 to L-3 = 3
    assert target.info.hidden_width == 2 * 64
    assert target.model.config._attn_implementation == PACKED_SDPA
    assert next(target.model.parameters()).dtype == torch.float32
    assert not any(p.requires_grad for p in target.model.parameters())
    with pytest.raises(TargetLoadError, match=r"\[9\] out of range"):
        load_target(TargetConfig(model_path=str(model_dir), dtype="float32", layer_ids=[1, 9]))


# --- capture ---------------------------------------------------------------------------------------


def test_capture_equals_hf_hidden_states(model_dir):
    target = Target(load_hf_model(model_dir, torch.float32, "sdpa", "cpu"), [0, 2, 5])
    ids = torch.randint(0, 160, (48,), generator=torch.Generator().manual_seed(1))
    hidden, labels = target.capture(ids, *_one_doc(48), out_dtype=torch.float32)
    assert labels is None and hidden.dtype == torch.float32 and hidden.shape == (48, 3 * 64)
    reference, _ = _hf_hidden(_reference(model_dir), ids)
    for k, layer in enumerate([0, 2, 5]):
        assert torch.equal(hidden[:, k * 64 : (k + 1) * 64], reference[layer + 1]), f"layer {layer}"
    bf16, _ = target.capture(ids, *_one_doc(48))  # the wire dtype
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, hidden.to(torch.bfloat16))


def test_early_exit_skips_upper_layers_and_matches_full_forward(model_dir):
    target = Target(load_hf_model(model_dir, torch.float32, "sdpa", "cpu"), [1, 3])
    calls = []
    target.layers[4].register_forward_hook(lambda *_: calls.append(1))
    ids = torch.randint(0, 160, (40,), generator=torch.Generator().manual_seed(2))
    early, none = target.capture(ids, *_one_doc(40), out_dtype=torch.float32)
    assert none is None and calls == []  # layers above the deepest never ran
    full, labels = target.capture(ids, *_one_doc(40), with_labels=True, out_dtype=torch.float32)
    assert calls == [1] and labels is not None  # the full forward did run them
    assert torch.equal(early, full)


def test_target_labels_equal_argmax_of_full_logits(model_dir):
    target = Target(load_hf_model(model_dir, torch.float32, "sdpa", "cpu"), [2], label_chunk=7)
    ids = torch.randint(0, 160, (45,), generator=torch.Generator().manual_seed(3))
    _, labels = target.capture(ids, *_one_doc(45), with_labels=True, out_dtype=torch.float32)
    _, logits = _hf_hidden(_reference(model_dir), ids)
    assert labels.dtype == torch.int64 and torch.equal(labels, logits.argmax(-1))


def test_packed_row_equals_documents_run_alone(model_dir):
    target = Target(load_hf_model(model_dir, torch.float32, "sdpa", "cpu"), [1, 3])
    lengths, pad = [11, 23, 5, 17], 8
    total = sum(lengths) + pad
    ids = torch.randint(0, 160, (total,), generator=torch.Generator().manual_seed(4))
    pos, doc = _packed(lengths, pad)
    packed, labels = target.capture(ids, pos, doc, with_labels=True, out_dtype=torch.float32)
    leaky, _ = target.capture(ids, *_one_doc(total), out_dtype=torch.float32)  # no isolation: control
    start = 0
    for n in lengths:
        alone, alone_labels = target.capture(
            ids[start : start + n], *_one_doc(n), with_labels=True, out_dtype=torch.float32
        )
        torch.testing.assert_close(packed[start : start + n], alone, rtol=1e-5, atol=1e-5)
        assert torch.equal(labels[start : start + n], alone_labels)
        if start > 0:  # later documents would see earlier ones without the block-diagonal mask
            assert (leaky[start : start + n] - alone).abs().max() > 1e-3
        start += n
    # HF's own packed-sequence path (eager attention, mask from the restarting positions) agrees
    eager = Target(load_hf_model(model_dir, torch.float32, "eager", "cpu"), [1, 3])
    via_hf, _ = eager.capture(ids, pos, doc, out_dtype=torch.float32)
    real = doc >= 0
    torch.testing.assert_close(via_hf[real], packed[real], rtol=1e-5, atol=1e-5)


# --- composite (multimodal) config -----------------------------------------------------------------


def test_composite_config_resolves_to_text_model(tmp_path, hf_torch_hybrid):
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    config = Qwen3_5Config(
        text_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=160,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        ),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64),
    )
    torch.manual_seed(0)
    full = Qwen3_5ForConditionalGeneration(config).eval()
    full.save_pretrained(tmp_path / "composite")
    target = load_target(TargetConfig(model_path=str(tmp_path / "composite"), dtype="float32", layer_ids=[1, 2]))
    assert type(target.model).__name__ == "Qwen3_5ForCausalLM"  # the text model only, no vision tower
    assert target.info.hidden_size == 64 and target.info.num_layers == 4
    assert target.path == "packed-reference"  # Gated DeltaNet layers, no CUDA kernels
    ids = torch.randint(0, 160, (30,), generator=torch.Generator().manual_seed(5))
    hidden, _ = target.capture(ids, *_one_doc(30), out_dtype=torch.float32)
    with torch.no_grad():
        reference = full.model.language_model(input_ids=ids[None], output_hidden_states=True).hidden_states
    torch.testing.assert_close(hidden[:, :64], reference[2][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hidden[:, 64:], reference[3][0], rtol=1e-4, atol=1e-4)
    pos, doc = _packed([12, 18])
    packed, _ = target.capture(ids, pos, doc, out_dtype=torch.float32)
    second, _ = target.capture(ids[12:], *_one_doc(18), out_dtype=torch.float32)
    torch.testing.assert_close(packed[12:], second, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_packed_capture(model_dir):
    target = load_target(TargetConfig(model_path=str(model_dir), dtype="bfloat16", layer_ids=[1, 3]), "cuda:0")
    lengths = [100, 300, 57]
    ids = torch.randint(0, 160, (sum(lengths),), generator=torch.Generator().manual_seed(6))
    pos, doc = _packed(lengths)
    packed, _ = target.capture(ids, pos, doc)
    assert packed.is_cuda and packed.dtype == torch.bfloat16
    start = 0
    for n in lengths:
        alone, _ = target.capture(ids[start : start + n], *_one_doc(n))
        torch.testing.assert_close(packed[start : start + n].float(), alone.float(), rtol=2e-2, atol=2e-2)
        start += n


def test_packed_attention_is_chosen_at_load_from_device_and_dtype(model_dir):
    """The varlen flash kernel takes fp16/bf16 only: a float32 target on CUDA must take the exact
    per-document SDPA path (before, its first capture raised 'FlashAttention only support fp16 and
    bf16'). The choice reads the loaded model, so it is checked here without a GPU."""
    cuda = torch.device("cuda")
    fp32 = load_hf_model(model_dir, torch.float32, "sdpa", "cpu")
    varlen, why = packed_attention(fp32, cuda)
    assert not varlen and "SDPA per document" in why and "float32" in why
    bf16 = load_hf_model(model_dir, torch.bfloat16, "sdpa", "cpu")
    assert packed_attention(bf16, cuda)[0] == (varlen_attention() is not None)
    assert packed_attention(bf16, torch.device("cpu")) == (False, "SDPA per document")
    with pytest.raises(TargetLoadError, match="target.attn_implementation=flash_attention_2 needs target.dtype"):
        load_target(TargetConfig(model_path=str(model_dir), dtype="float32", attn_implementation="flash_attention_2"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fp32_packed_capture_equals_each_document_alone(model_dir):
    target = load_target(TargetConfig(model_path=str(model_dir), dtype="float32", layer_ids=[1, 3]), "cuda:0")
    assert not target.varlen and "float32" in target.attention
    lengths, pad = [100, 300, 57], 31
    ids = torch.randint(0, 160, (sum(lengths) + pad,), generator=torch.Generator().manual_seed(8))
    pos, doc = _packed(lengths, pad)
    packed, labels = target.capture(ids, pos, doc, with_labels=True, out_dtype=torch.float32)
    assert packed.is_cuda and packed.dtype == torch.float32
    start = 0
    for n in lengths:
        alone, alone_labels = target.capture(
            ids[start : start + n], *_one_doc(n), with_labels=True, out_dtype=torch.float32
        )
        torch.testing.assert_close(packed[start : start + n], alone, rtol=1e-4, atol=1e-4)
        assert torch.equal(labels[start : start + n], alone_labels)
        start += n


def test_sliding_window_layers_keep_their_window_inside_each_document(tmp_path):
    config = Qwen3Config(head_dim=16, use_sliding_window=True, sliding_window=8, max_window_layers=2, **SHAPE)
    assert config.layer_types[4] == "sliding_attention"
    path = _save(tmp_path, config, "sliding")
    target = Target(load_hf_model(path, torch.float32, "sdpa", "cpu"), [1, 4])
    lengths = [20, 30]
    ids = torch.randint(0, 160, (50,), generator=torch.Generator().manual_seed(7))
    packed, _ = target.capture(ids, *_packed(lengths), out_dtype=torch.float32)
    reference = _reference(path)
    no_window = _save(tmp_path, Qwen3Config(head_dim=16, **SHAPE), "plain")  # same seed, same weights
    control = _reference(no_window)
    start = 0
    for n in lengths:
        hidden, _ = _hf_hidden(reference, ids[start : start + n])
        torch.testing.assert_close(packed[start : start + n, 64:], hidden[5], rtol=1e-5, atol=1e-5)
        wide, _ = _hf_hidden(control, ids[start : start + n])
        assert (packed[start : start + n, 64:] - wide[5]).abs().max() > 1e-3  # the window did matter
        start += n


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_capture_to_host_gives_pinned_copies(model_dir):
    from services.target.model.model import capture_to_host

    target = load_target(TargetConfig(model_path=str(model_dir), dtype="bfloat16", layer_ids=[1, 3]), "cuda:0")
    pos, doc = _packed([100, 156])
    row = {"input_ids": torch.randint(0, 160, (256,)), "position_ids": pos, "document_ids": doc}
    device_out = torch.empty(256, 128, dtype=torch.bfloat16, device="cuda")
    first, labels = capture_to_host(target, row, True, device_out)
    assert first.device.type == "cpu" and first.is_pinned() and labels.device.type == "cpu"
    assert torch.equal(first, device_out.cpu())
    second, _ = capture_to_host(target, row, False, device_out)
    assert torch.equal(first, second) and first.data_ptr() != second.data_ptr()  # the first is still held
