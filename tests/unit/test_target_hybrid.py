"""Hybrid targets (Qwen3.5 / Qwen3.6: Gated DeltaNet + full attention) on packed rows.

The reference is always transformers' own forward run on one document at a time. The packed row
must equal it in every captured layer, including the documents shorter than the conv kernel, and
the test must notice when the conv leak across documents is put back.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.target.model import hybrid
from services.target.model.model import Target, choose_path, decoder_layers, slow_path_warning
from services.target.model.row import RowSlot
from tests.tiny_targets import tiny_hybrid_config

TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
LAYERS = [0, 1, 2, 3]  # every layer captured: GDN, GDN, full attention, GDN (final norm)
LENGTHS = [9, 1, 3, 17, 2, 30, 6]  # documents shorter than the kernel (4) too
PAD = 5


def _hybrid(dtype=torch.float32, device="cpu"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_hybrid_config(TYPES, 160)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    from services.target.model.attention import PACKED_SDPA, register_packed_sdpa

    register_packed_sdpa()
    model.config._attn_implementation = PACKED_SDPA
    return model.to(device).eval().requires_grad_(False)


def _row(lengths, pad, seed=1):
    total = sum(lengths) + pad
    ids = torch.randint(0, 160, (total,), generator=torch.Generator().manual_seed(seed))
    pos = torch.cat([torch.arange(n) for n in lengths] + [torch.arange(pad)])
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((pad,), -1)])
    return ids, pos, doc


def _one_by_one(target, ids, lengths, dtype):
    """Each document through transformers' own forward, alone."""
    parts, start = [], 0
    for n in lengths:
        hidden, _ = target.capture(
            ids[start : start + n], torch.arange(n), torch.zeros(n, dtype=torch.long), out_dtype=dtype
        )
        parts.append(hidden)
        start += n
    return torch.cat(parts)


def _leaky_conv(x, weight, positions):
    """What transformers 5.x does on a packed row: one conv over the whole row."""
    k = weight.shape[1]
    return F.silu(F.conv1d(x.T[None], weight[:, None, :], padding=k - 1, groups=x.shape[1])[0, :, : x.shape[0]].T)


def test_document_conv_equals_conv_of_each_document_alone():
    gen = torch.Generator().manual_seed(2)
    lengths, c, k = [5, 1, 2, 9, 3], 12, 4
    x = torch.randn(sum(lengths), c, generator=gen)
    w = torch.randn(c, k, generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths])
    packed = hybrid.document_causal_conv(x, w, pos)
    alone = torch.cat([_leaky_conv(part, w, None) for part in torch.split(x, lengths)])
    torch.testing.assert_close(packed, alone, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hybrid.masked_tap_conv(x, w, pos), alone, rtol=1e-6, atol=1e-6)  # the compiled form
    leaky = _leaky_conv(x, w, pos)
    assert (leaky - alone).abs().max() > 1e-2  # the control: the plain row conv does leak


def test_reference_delta_rule_equals_transformers_chunked_kernel():
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    torch_chunk = inspect.unwrap(m.torch_chunk_gated_delta_rule)  # the pure-torch one, never a hub kernel
    gen = torch.Generator().manual_seed(3)
    lengths, h, dk, dv = [7, 70], 2, 8, 6
    s = sum(lengths)
    q, k = torch.randn(s, h, dk, generator=gen), torch.randn(s, h, dk, generator=gen)
    v = torch.randn(s, h, dv, generator=gen)
    g, beta = -torch.rand(s, h, generator=gen), torch.rand(s, h, generator=gen)
    cu = torch.tensor([0, 7, s], dtype=torch.int32)
    ours = hybrid.reference_delta_rule(q, k, v, g, beta, cu)
    for a, b in ((0, 7), (7, s)):
        theirs, _ = torch_chunk(
            q[None, a:b], k[None, a:b], v[None, a:b], g=g[None, a:b], beta=beta[None, a:b], use_qk_l2norm_in_kernel=True
        )
        torch.testing.assert_close(ours[a:b], theirs[0], rtol=1e-4, atol=1e-4)


def test_chunked_delta_rule_equals_the_rule_token_by_token():
    """The CPU path's chunked form against the definition: documents shorter than a chunk, exactly
    one chunk, spanning several, one token; and the state really restarts at each document."""
    gen = torch.Generator().manual_seed(7)
    lengths, h, dk, dv, chunk = [1, 8, 3, 17, 9, 16, 2], 3, 8, 5, 8
    s = sum(lengths)
    q, k = torch.randn(s, h, dk, generator=gen), torch.randn(s, h, dk, generator=gen)
    v = torch.randn(s, h, dv, generator=gen)
    g, beta = -2 * torch.rand(s, h, generator=gen), torch.rand(s, h, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    want = hybrid.token_by_token_delta_rule(q, k, v, g, beta, cu)
    torch.testing.assert_close(
        hybrid.reference_delta_rule(q, k, v, g, beta, cu, chunk=chunk), want, rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(hybrid.reference_delta_rule(q, k, v, g, beta, cu), want, rtol=1e-5, atol=1e-5)
    one_document = hybrid.reference_delta_rule(q, k, v, g, beta, torch.tensor([0, s], dtype=torch.int32), chunk=chunk)
    assert (one_document[lengths[0] :] - want[lengths[0] :]).abs().max() > 1e-2  # the control: no restart, no match


def test_paths_chosen_at_load():
    model = _hybrid()
    slot = RowSlot()
    assert choose_path(model, decoder_layers(model), torch.device("cpu"), slot) == "packed-reference"
    assert all(layer.linear_attn.row is slot for layer in decoder_layers(model) if hasattr(layer, "linear_attn"))
    target = Target(_hybrid(), LAYERS, packed_recurrent=False)
    assert target.path == "per-document" and target.warning == ""  # only CUDA runs warn about the slow path
    assert Target(_hybrid(), LAYERS).path == "packed-reference"
    if hybrid.fla_delta_rule() is None:  # CUDA without the kernels: per-document, and it says so
        model = _hybrid()
        assert choose_path(model, decoder_layers(model), torch.device("cuda"), RowSlot()) == "per-document"
    warning = slow_path_warning("per-document", torch.device("cuda"))
    assert "per-document" in warning and "pip install fla-core" in warning
    assert slow_path_warning("packed-varlen", torch.device("cuda")) == ""


def test_plain_forward_through_packed_layers_is_one_document(hf_torch_hybrid):
    ids = torch.randint(0, 160, (1, 25), generator=torch.Generator().manual_seed(6))
    plain, model = _hybrid(), _hybrid()
    Target(model, LAYERS)  # installs the packed layers
    for m in (plain, model):
        m.config._attn_implementation = "sdpa"
    want = plain(input_ids=ids).logits
    torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)


def test_packed_hybrid_row_equals_documents_run_one_by_one(monkeypatch, hf_torch_hybrid):
    ids, pos, doc = _row(LENGTHS, PAD)
    reference = _one_by_one(Target(_hybrid(), LAYERS, packed_recurrent=False), ids, LENGTHS, torch.float32)
    packed_target = Target(_hybrid(), LAYERS)
    assert packed_target.path == "packed-reference" and not packed_target.per_document
    packed, _ = packed_target.capture(ids, pos, doc, out_dtype=torch.float32)
    real = doc >= 0
    torch.testing.assert_close(packed[real], reference, rtol=1e-4, atol=1e-4)

    monkeypatch.setattr(hybrid, "document_causal_conv", _leaky_conv)  # put the leak back
    leaky, _ = packed_target.capture(ids, pos, doc, out_dtype=torch.float32)
    h = tiny_hybrid_config(TYPES, 160).hidden_size
    first_gdn = (leaky[real][:, :h] - reference[:, :h]).abs().amax(dim=1)
    assert first_gdn.max() > 1e-3  # layer 0 already differs (exact: ~1e-8) ...
    assert first_gdn[: LENGTHS[0]].max() < 1e-6  # ... but never in the first document


def test_packed_hybrid_labels_equal_one_by_one(hf_torch_hybrid):
    ids, pos, doc = _row([20, 3, 11], 0, seed=4)
    packed_target = Target(_hybrid(), LAYERS)
    _, labels = packed_target.capture(ids, pos, doc, with_labels=True, out_dtype=torch.float32)
    alone = Target(_hybrid(), LAYERS, packed_recurrent=False)
    start = 0
    for n in (20, 3, 11):
        _, want = alone.capture(
            ids[start : start + n],
            torch.arange(n),
            torch.zeros(n, dtype=torch.long),
            with_labels=True,
            out_dtype=torch.float32,
        )
        assert torch.equal(labels[start : start + n], want)
        start += n


@pytest.mark.skipif(
    not torch.cuda.is_available() or hybrid.fla_delta_rule() is None, reason="needs CUDA and flash-linear-attention"
)
def test_cuda_varlen_packed_row_equals_documents_one_by_one(monkeypatch):
    lengths = [300, 2, 57, 1, 640, 3, 129]
    ids, pos, doc = _row(lengths, 40, seed=5)
    target = Target(_hybrid(torch.bfloat16, "cuda"), LAYERS)
    assert target.path == "packed-varlen"
    packed, _ = target.capture(ids, pos, doc)
    reference = _one_by_one(
        Target(_hybrid(torch.bfloat16, "cuda"), LAYERS, packed_recurrent=False), ids, lengths, torch.bfloat16
    )
    real = (doc >= 0).cuda()
    torch.testing.assert_close(packed[real].float(), reference.float(), rtol=3e-2, atol=3e-2)
    monkeypatch.setattr(hybrid, "document_causal_conv", _leaky_conv)
    leaky, _ = target.capture(ids, pos, doc)
    assert (leaky[real].float() - reference.float()).abs().max() > 0.1
