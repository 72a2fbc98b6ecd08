"""Chunked weighted cross-entropy and the acceptance metrics."""

import pytest
import torch
import torch.nn.functional as F

from services.drafter.modeling.loss import (
    ChunkFns,
    Fp8Head,
    acceptance_metrics,
    chunked_cross_entropy,
    dpace_weights,
    softmax_minus_onehot,
)


def naive_loss(hidden, lm_head, labels, weights):
    logits = hidden @ lm_head.t()
    ce = F.cross_entropy(logits.float(), labels, reduction="none")
    return (ce * weights).sum() / weights.sum(), logits.argmax(-1)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_equals_full_logits_value_and_grads(chunk):
    torch.manual_seed(0)
    rows, H, V = 61, 16, 50
    hidden = torch.randn(rows, H, dtype=torch.float64, requires_grad=True)
    lm_head = torch.randn(V, H, dtype=torch.float64)
    labels = torch.randint(0, V, (rows,))
    weights = torch.rand(rows, dtype=torch.float64) * (torch.rand(rows) > 0.3)

    loss, preds = chunked_cross_entropy(hidden, lm_head, labels, weights, chunk=chunk)
    (3.0 * loss).backward()  # upstream scale reaches the grad
    grad = hidden.grad.clone()

    hidden.grad = None
    ref, ref_preds = naive_loss(hidden, lm_head, labels, weights.float())
    (3.0 * ref).backward()
    assert torch.allclose(loss.double(), ref.double(), rtol=1e-6)
    assert torch.allclose(grad, hidden.grad, rtol=1e-5, atol=1e-7)
    assert torch.equal(preds, ref_preds)


def test_the_compiled_chunks_give_the_eager_loss_and_grads():
    """kernels.compile compiles the chunk functions (one fused softmax-minus-one-hot pass on a GPU);
    inductor on the CPU here: the same loss, predictions and gradient as eager."""
    torch.manual_seed(1)
    rows, H, V = 40, 16, 96
    lm_head, labels = torch.randn(V, H), torch.randint(0, V, (rows,))
    weights = torch.rand(8, 5) * (torch.rand(8, 5) > 0.2)
    runs = []
    for fns in (None, ChunkFns(compile=True)):
        hidden = torch.randn(rows, H, generator=torch.Generator().manual_seed(2)).requires_grad_()
        loss, preds = chunked_cross_entropy(hidden, lm_head, labels, weights, chunk=16, fns=fns)
        loss.backward()
        runs.append((loss.detach(), preds, hidden.grad))
    assert runs[0][2].abs().sum() > 0
    for eager, compiled in zip(*runs):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-7)


def test_empty_batch_gives_zero_loss_and_zero_grads():
    hidden = torch.randn(10, 8, requires_grad=True)
    lm_head = torch.randn(20, 8)
    loss, _ = chunked_cross_entropy(hidden, lm_head, torch.zeros(10, dtype=torch.long), torch.zeros(10), chunk=3)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(hidden.grad, torch.zeros_like(hidden))


def test_no_grad_path_gives_the_same_loss():
    torch.manual_seed(1)
    hidden, lm_head = torch.randn(9, 8), torch.randn(20, 8)
    labels, weights = torch.randint(0, 20, (9,)), torch.rand(9)
    with torch.no_grad():
        loss, preds = chunked_cross_entropy(hidden, lm_head, labels, weights, chunk=4)
    ref, ref_preds = naive_loss(hidden, lm_head, labels, weights)
    assert torch.allclose(loss, ref, rtol=1e-5) and torch.equal(preds, ref_preds)


def test_fp8_lm_head_stays_close_to_the_exact_loss_and_grad():
    # real FP8 GEMMs (torch._scaled_mm runs on the CPU too): e4m3 rows and lm_head, e5m2 logit grads
    torch.manual_seed(2)
    rows, H, V = 300, 64, 512
    hidden = torch.randn(rows, H, requires_grad=True)
    lm_head = torch.randn(V, H) / H**0.5
    labels, weights = torch.randint(0, V, (rows,)), torch.rand(rows)
    head = Fp8Head.of(lm_head)
    assert head.weight.dtype == torch.float8_e4m3fn and head.weight_t.shape == (H, V)

    loss, _ = chunked_cross_entropy(hidden, head, labels, weights, chunk=128)
    loss.backward()
    grad, hidden.grad = hidden.grad.clone(), None
    ref, _ = naive_loss(hidden, lm_head, labels, weights)
    ref.backward()
    assert abs(loss.item() - ref.item()) / ref.item() < 0.01
    assert 0 < float((grad - hidden.grad).norm() / hidden.grad.norm()) < 0.1  # rounded, not far off


@pytest.mark.parametrize("lam", [0.0, 0.35, 1.0])
def test_the_fp8_gradients_bound_holds_for_both_objectives(lam):
    """The FP8 head scales the logits' gradient by the largest row weight instead of its amax
    (head_input_grad): every entry of DFlash's (lam 0: one softmax) and Domino's ((1 - lam) of the
    corrected softmax plus lam of the base one) gradient lies within it, from easy rows to hard ones."""
    g = torch.Generator().manual_seed(4)
    rows, vocab = 64, 300
    labels = torch.randint(0, vocab, (rows,), generator=g)
    sharp = torch.linspace(0.1, 30, rows)[:, None]  # near-uniform rows to near-one-hot ones
    final, base = (torch.randn(rows, vocab, generator=g) * sharp for _ in range(2))
    half = torch.arange(rows // 2)
    final[half, labels[half]] += 40  # half the rows predict their label with p ~ 1
    scale = torch.rand(rows, generator=g)
    parts = [
        softmax_minus_onehot(x, torch.logsumexp(x, -1), labels) * (w * scale)[:, None]
        for x, w in ((final, 1 - lam), (base, lam))
    ]
    grad = parts[0] + parts[1]
    assert grad.abs().amax() <= scale.max() and grad.abs().amax() > 0.5 * scale.max()


def test_fp8_lm_head_needs_dimensions_in_multiples_of_16():
    assert Fp8Head.of(torch.randn(50, 16)) is None  # the loss then stays in bf16


def test_acceptance_metrics_by_hand():
    labels = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    preds = torch.tensor(
        [
            [1, 2, 3, 4],  # 4 accepted
            [1, 9, 3, 4],  # 1 accepted (a miss ends the run)
            [9, 2, 3, 4],  # 0 accepted
            [1, 2, 3, 4],
        ]
    )  # empty block: weights 0, not counted
    weights = torch.ones(4, 4)
    weights[3] = 0
    weights[0, 3] = 0  # untrained position ends the run too: block 0 accepts 3
    m = acceptance_metrics(preds, labels, weights)
    assert m["trained_blocks"].item() == 3
    assert m["tau"].item() == pytest.approx(1 + (3 + 1 + 0) / 3)
    # per position k=1..4 over trained positions: k1 2/3, k2 2/3, k3 3/3, k4 2/2
    assert torch.allclose(m["accuracy_per_position"], torch.tensor([2 / 3, 2 / 3, 1.0, 1.0]))
    assert m["accuracy"].item() == pytest.approx(9 / 11)


def test_acceptance_metrics_with_nothing_trained():
    m = acceptance_metrics(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3))
    assert m["trained_blocks"].item() == 0 and m["tau"].item() == 1.0 and m["accuracy"].item() == 0.0


def test_dpace_weights_are_the_papers_closed_form_by_hand():
    """w_j = sum_{m>=j} prod_{i<=m} ((1 - a) q_i + a), q = exp(-CE); an untrained position has no
    weight and enters the products after it with confidence 0 (it cannot be accepted), smoothed to a."""
    q = torch.tensor([[0.8, 0.5, 0.2, 0.9], [0.6, 0.4, 0.3, 0.7]], dtype=torch.float64)
    trained = torch.tensor([[True, True, True, True], [True, True, False, True]])
    w = dpace_weights(-q.log(), trained, alpha=0.5)
    s = 0.5 * q + 0.5
    p0 = [s[0, 0], s[0, 0] * s[0, 1], s[0, 0] * s[0, 1] * s[0, 2], s[0, :].prod()]
    want0 = [sum(p0[j:]) for j in range(4)]
    p1 = [s[1, 0], s[1, 0] * s[1, 1], 0.0, s[1, 0] * s[1, 1] * 0.5 * s[1, 3]]  # position 2: q = 0, q~ = alpha
    want1 = [p1[0] + p1[1] + p1[3], p1[1] + p1[3], 0.0, p1[3]]
    assert torch.allclose(w[0].double(), torch.tensor([float(x) for x in want0], dtype=torch.float64), rtol=1e-5)
    assert torch.allclose(w[1].double(), torch.tensor([float(x) for x in want1], dtype=torch.float64), rtol=1e-5)
    assert (w[0, :-1] >= w[0, 1:]).all() and not w.requires_grad  # non-increasing, detached


@pytest.mark.parametrize("chunk", [5, 64])
def test_dpace_loss_is_its_weighted_ce_with_detached_weights(chunk):
    """The chunked loss with D-PACE weights (from the rows' own CE, after all chunks) against the
    full logits: the same value and gradient as sum(w.detach() * CE) / sum(w) by autograd."""
    torch.manual_seed(3)
    n, k, H, V = 9, 7, 16, 40  # 9 blocks of 7 trained positions
    hidden = torch.randn(n * k, H, dtype=torch.float64, requires_grad=True)
    lm_head = torch.randn(V, H, dtype=torch.float64)
    labels = torch.randint(0, V, (n * k,))
    weights = torch.ones(n, k) * (torch.rand(n, k) > 0.2)  # which positions are trained
    loss, _ = chunked_cross_entropy(hidden, lm_head, labels, weights, chunk=chunk, dpace_alpha=0.5)
    loss.backward()
    grad, hidden.grad = hidden.grad.clone(), None

    ce = F.cross_entropy((hidden @ lm_head.t()).float(), labels, reduction="none").view(n, k)
    w = dpace_weights(ce.detach(), weights > 0, 0.5)
    ref = (w * ce).sum() / w.sum()
    ref.backward()
    assert torch.allclose(loss.double(), ref.double(), rtol=1e-5)
    assert torch.allclose(grad, hidden.grad, rtol=1e-4, atol=1e-7)
    decay, _ = chunked_cross_entropy(hidden.detach(), lm_head, labels, weights, chunk=chunk)
    assert abs(decay.item() - loss.item()) > 1e-4  # the weights really are others than the given ones
