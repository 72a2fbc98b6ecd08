"""services/target/verify/decode.py on tiny random targets (fp32, CPU): after verify + commit(n) the KV cache
and the Gated DeltaNet conv / recurrent state are those of a session fed only the committed tokens,
for every n and both rollback methods; the one-token-per-forward greedy reference equals a full
no-cache forward (and HF generate on a dense target); attention on a KV cache is causal aligned
bottom-right; layers whose state cannot be rolled back are refused by name."""

import pytest
import torch

from services.decoding.decode_step import ROLLBACKS, rounding_tolerance
from services.drafter.acceptance.speculative import greedy_reference
from services.eval.verifier import LocalVerifier
from services.target.model.attention import sdpa_packed
from services.target.verify.decode import DecodeSession
from tests.greedy import hf_greedy_generate
from tests.tiny_targets import dense_target, hybrid_target, plain_hf, prompt

B = 6


def assert_same_state(a: DecodeSession, b: DecodeSession):
    # fla's kernels on CUDA compute in TF32 inside: agreement to 1e-3 there, to fp32 rounding on CPU
    tol = dict(rtol=2e-3, atol=2e-4) if a.target.device.type == "cuda" else dict(rtol=1e-5, atol=1e-6)
    assert a.length == b.length and not a.pending and not b.pending
    assert sorted(a.state.layers) == sorted(b.state.layers) == [0, 1, 2, 4, 5, 6]  # the Gated DeltaNet layers
    for i, sa in a.state.layers.items():
        sb = b.state.layers[i]
        torch.testing.assert_close(sa.conv, sb.conv, **tol)
        torch.testing.assert_close(sa.recurrent, sb.recurrent, **tol)
    written = [i for i, layer in enumerate(a.cache.layers) if layer.get_seq_length()]
    assert written == [i for i, layer in enumerate(b.cache.layers) if layer.get_seq_length()] == [3, 7]
    for i in written:
        la, lb = a.cache.layers[i], b.cache.layers[i]
        assert la.keys.shape[-2] == a.length
        torch.testing.assert_close(la.keys, lb.keys, **tol)
        torch.testing.assert_close(la.values, lb.values, **tol)


@pytest.mark.parametrize("rollback", ROLLBACKS)
def test_commit_leaves_the_state_of_only_the_committed_tokens(hybrid, rollback):
    p, block = prompt(1, 9), prompt(2, B)
    for n in range(1, B + 1):
        spec = DecodeSession(hybrid, rollback)
        spec.prefill(p)
        spec.verify(block)
        spec.commit(n)
        fed = DecodeSession(hybrid, rollback)
        fed.prefill(p + block[:n])
        assert_same_state(spec, fed)
        # and decoding goes on identically from there
        nxt = prompt(3 + n, 3)
        a, b = spec.verify(nxt), fed.verify(nxt)
        assert torch.equal(a.greedy, b.greedy)
        torch.testing.assert_close(a.features, b.features, rtol=1e-4, atol=1e-5)
        spec.commit(2)
        fed.commit(2)
        assert_same_state(spec, fed)


def test_rollback_methods_agree_and_the_rejected_tokens_mattered(hybrid):
    p, block = prompt(4, 7), prompt(5, B)
    sessions = [DecodeSession(hybrid, r) for r in ROLLBACKS]
    for s in sessions:
        s.prefill(p)
        s.verify(block)
    kept = sessions[0].state.layers[0]
    before = kept.recurrent.clone()
    for s in sessions:
        s.commit(2)
    tol = dict(rtol=2e-3, atol=2e-4) if hybrid.device.type == "cuda" else dict(rtol=1e-5, atol=1e-6)
    for i, a in sessions[0].state.layers.items():
        torch.testing.assert_close(a.recurrent, sessions[1].state.layers[i].recurrent, **tol)
    whole = DecodeSession(hybrid)
    whole.prefill(p + block)  # the state had the whole block been kept: different
    assert (whole.state.layers[0].recurrent - kept.recurrent).abs().max() > 1e-3
    assert (before - kept.recurrent).abs().max() > 1e-4


@pytest.mark.parametrize("make", [dense_target, hybrid_target], ids=["dense", "hybrid"])
def test_greedy_reference_equals_a_full_forward_without_cache(make):
    target = make()
    p = prompt(6, 10)
    ref = greedy_reference(LocalVerifier(target), p, 14)
    assert len(ref.tokens) == 14 and len(set(ref.tokens)) > 3 and ref.target_forwards == 14
    ids = torch.tensor(p + ref.tokens)
    n = ids.shape[0]
    features, labels = target.capture(
        ids, torch.arange(n), torch.zeros(n, dtype=torch.long), with_labels=True, out_dtype=torch.float32
    )
    assert labels[len(p) - 1 : -1].tolist() == ref.tokens
    session = DecodeSession(target)  # the decoded features are the capture's, position by position
    parts = [session.prefill(p).features]
    for token in ref.tokens[:-1]:
        parts.append(session.verify([token]).features)
        session.commit(1)
    torch.testing.assert_close(torch.cat(parts), features[:-1], rtol=1e-4, atol=1e-5)
    assert all(m > t for m, t in zip(ref.margins, ref.tolerances))  # no near-tie on this model


def test_greedy_reference_equals_hf_generate_on_a_dense_target(dense):
    for seed in range(3):
        p = prompt(20 + seed, 4 + 5 * seed)
        ref = greedy_reference(LocalVerifier(dense), p, 20)
        with plain_hf(dense) as model:
            assert hf_greedy_generate(model, p, 20) == ref.tokens


def test_cached_attention_is_causal_bottom_right():
    class Module:
        num_key_value_groups, is_causal = 2, True

    gen = torch.Generator().manual_seed(7)
    q = torch.randn(1, 4, 3, 8, generator=gen)
    k, v = torch.randn(1, 2, 7, 8, generator=gen), torch.randn(1, 2, 7, 8, generator=gen)
    for window in (None, 3):
        got, _ = sdpa_packed(Module(), q, k, v, None, scaling=8**-0.5, doc_spans=[(0, 3)], sliding_window=window)
        kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        scores = (q @ kr.transpose(-1, -2)) * 8**-0.5
        i, j = torch.arange(4, 7)[:, None], torch.arange(7)[None]
        seen = (j <= i) if window is None else (j <= i) & (i - j < window)
        want = (scores.masked_fill(~seen, float("-inf")).softmax(-1) @ vr).transpose(1, 2)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_bad_use_and_unknown_recurrent_layers_are_refused(hybrid):
    s = DecodeSession(hybrid)
    with pytest.raises(RuntimeError, match="verify before prefill"):
        s.verify([1])
    s.prefill([1, 2, 3])
    s.verify([4, 5])
    with pytest.raises(ValueError, match=r"commit\(3\): the last verified block has 2 tokens"):
        s.commit(3)
    with pytest.raises(RuntimeError, match="commit"):
        s.verify([6])
    with pytest.raises(ValueError, match="rollback must be one of"):
        DecodeSession(hybrid, "snapshot")
    target = hybrid_target()
    target.model.config.layer_types[2] = "mamba"
    with pytest.raises(ValueError, match="layer 2 is of type 'mamba'"):
        DecodeSession(target)


def test_rounding_tolerance_follows_the_dtype():
    top = torch.tensor([0.5, 20.0])
    assert rounding_tolerance(top, torch.bfloat16).tolist() == pytest.approx([4 * 2**-7, 80 * 2**-7])
    assert rounding_tolerance(top, torch.float16).tolist() == pytest.approx([4 * 2**-10, 80 * 2**-10])
    assert rounding_tolerance(top, torch.float32)[1] == pytest.approx(80 * 2**-23)
