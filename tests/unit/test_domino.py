"""drafter.objective = "domino" (services/drafter/modeling/domino.py): the chunked loss and its gradients equal
autograd of the formula; decoding's rollout drafts what training's teacher-forced head predicts for
the same tokens; a Domino drafter trains, decodes losslessly on a real HF target (one prompt, packed
and padded alike), and exports in the layout SGLang's Domino drafters have, read back by `launcher eval`."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from services.drafter.acceptance.speculative import greedy_reference, speculative_generate
from services.drafter.checkpoints.export import export_weights
from services.drafter.modeling import domino
from services.drafter.training.train import WarmupCosine, train_step
from services.eval.launcher_eval import load_weights
from services.eval.verifier import LocalVerifier
from services.run.shapes import DrafterModelConfig
from tests.tiny_targets import DENSE_LAYER_IDS, prompt
from tests.unit.test_drafter_train import make
from tests.unit.test_speculative import random_drafter

B = 4
HEAD = dict(domino_emb_dim=8, domino_gru_dim=12)


@pytest.mark.parametrize("lam", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("chunk", [5, 4096])
def test_the_chunked_loss_and_its_gradients_are_autograd_of_the_formula(lam, chunk):
    g = torch.Generator().manual_seed(0)
    n, positions, hidden_size, emb, vocab = 6, 3, 16, 8, 40
    rows = n * positions
    h = torch.randn(rows, hidden_size, generator=g, requires_grad=True)
    u = torch.randn(rows, emb, generator=g, requires_grad=True)
    w2 = (0.1 * torch.randn(vocab, emb, generator=g)).requires_grad_()
    lm_head = torch.randn(vocab, hidden_size, generator=g)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    weights = torch.rand(n, positions, generator=g) * (torch.rand(n, positions, generator=g) > 0.3)

    loss, preds, base_preds = domino.domino_cross_entropy(h, u, w2, lm_head, labels, weights, lam, chunk)
    loss.backward()
    got = [loss.detach(), h.grad, u.grad, w2.grad]
    for t in (h, u, w2):
        t.grad = None

    base = h @ lm_head.t()
    final = base + u @ w2.t()
    w = weights.flatten() / weights.sum()
    ce = lambda logits: F.cross_entropy(logits, labels, reduction="none")  # noqa: E731
    want_loss = (w * ((1 - lam) * ce(final) + lam * ce(base))).sum()
    want_loss.backward()
    for a, b in zip(got, [want_loss.detach(), h.grad, u.grad, w2.grad]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert torch.equal(preds, final.argmax(-1)) and torch.equal(base_preds, base.argmax(-1))
    if lam == 1.0:  # all on the base logits: the head learns nothing yet
        assert got[2].abs().max() == 0 and got[3].abs().max() == 0


def test_the_loss_on_the_fp8_lm_head_stays_close_to_the_exact_loss_and_gradients():
    # real FP8 GEMMs (torch._scaled_mm runs on the CPU too), as kernels.precision = "fp8" trains Domino
    from services.drafter.modeling.loss import Fp8Head

    g = torch.Generator().manual_seed(3)
    n, positions, hidden_size, emb, vocab = 40, 7, 64, 16, 512
    rows = n * positions
    leaves = [
        torch.randn(rows, hidden_size, generator=g),
        torch.randn(rows, emb, generator=g),
        0.1 * torch.randn(vocab, emb, generator=g),
    ]
    lm_head = torch.randn(vocab, hidden_size, generator=g) / hidden_size**0.5
    labels = torch.randint(0, vocab, (rows,), generator=g)
    weights = torch.rand(n, positions, generator=g)
    runs = []
    for head in (lm_head, Fp8Head.of(lm_head)):
        h, u, w2 = (t.clone().requires_grad_() for t in leaves)
        loss, preds, _ = domino.domino_cross_entropy(h, u, w2, head, labels, weights, 0.3, chunk=100)
        loss.backward()
        runs.append((loss.detach(), h.grad, u.grad, w2.grad, preds))
    (exact, *grads, preds), (fp8, *fp8_grads, fp8_preds) = runs
    assert 0 < abs(fp8.item() - exact.item()) / exact.item() < 0.01
    for want, got in zip(grads, fp8_grads):
        assert 0 < float((got - want).norm() / want.norm()) < 0.1  # rounded, not far off
    assert (fp8_preds == preds).float().mean() > 0.9


def test_the_compiled_chunk_equals_the_eager_one_and_is_not_recompiled_as_lambda_moves():
    """kernels.compile on a GPU compiles the chunk (domino.chunk_function); lambda changes every step
    and must not recompile it while it stays above 0 (at 0 the chunk without the base CE is compiled
    once more). Checked here with inductor on the CPU."""
    from torch._dynamo.testing import CompileCounter

    args = chunk_args(rows=18, hidden_size=16, emb=8, vocab=40)
    counter = CompileCounter()
    counted = torch.compile(domino.domino_chunk, backend=counter, dynamic=False)
    for lam in (1.0, 0.4, 0.01):
        counted(*args, torch.tensor(lam), True, True)
    assert counter.frame_count == 1
    for _ in range(2):
        counted(*args, torch.tensor(0.0), True, False)
    assert counter.frame_count == 2
    compiled = domino.chunk_function(compile=True)
    for lam, with_base in ((1.0, True), (0.3, True), (0.0, False)):
        got = compiled(*args, torch.tensor(lam), True, with_base)
        want = domino.domino_chunk(*args, torch.tensor(lam), True, with_base)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def chunk_args(rows: int, hidden_size: int, emb: int, vocab: int, seed: int = 0) -> tuple:
    """(h, u, W2, lm_head, labels, scale) of one chunk, random."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(rows, hidden_size, generator=g),
        torch.randn(rows, emb, generator=g),
        0.1 * torch.randn(vocab, emb, generator=g),
        torch.randn(vocab, hidden_size, generator=g),
        torch.randint(0, vocab, (rows,), generator=g),
        torch.rand(rows, generator=g),
    )


def test_at_lambda_zero_the_chunk_without_the_base_ce_gives_what_the_full_chunk_gives():
    """The second half of a run (lambda 0) skips the base CE and its softmax pass: the loss, both
    predictions and every gradient are the ones the chunk with the base term gives, bit for bit."""
    args = chunk_args(rows=30, hidden_size=16, emb=8, vocab=64, seed=5)
    lam = torch.tensor(0.0)
    full, skipped = domino.domino_chunk(*args, lam, True, True), domino.domino_chunk(*args, lam, True, False)
    assert full[0] > 0 and full[3].abs().sum() > 0
    for a, b in zip(full, skipped):
        assert torch.equal(a, b)
    with_lam = domino.domino_chunk(*args, torch.tensor(0.2), True, True)
    assert not torch.equal(with_lam[3], full[3])  # the base term does move the gradient when lambda > 0


def test_decoding_drafts_what_the_teacher_forced_head_predicts_for_those_tokens():
    """The GRU's alignment: rolled out, position k reads the first token and the drafts of positions
    1..k-1; teacher-forced with those drafts as the labels, training's logits pick the same tokens."""
    shape = DrafterModelConfig(
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size=50,
        num_target_layers=4,
        num_hidden_layers=1,
        target_layer_ids=[1],
        block_size=6,
        **HEAD,
    )
    from services.drafter.modeling.model import DFlashDrafter

    torch.manual_seed(1)
    drafter = DFlashDrafter(shape)
    embed, lm_head = torch.randn(50, 16), 0.02 * torch.randn(50, 16)  # base logits the correction can move
    z, first = torch.randn(7, 5, 16), torch.randint(0, 50, (7,))
    embed_tokens = lambda ids: F.embedding(ids, embed)  # noqa: E731
    drafts = domino.rollout(drafter, embed_tokens, lm_head, z, first)
    states = domino.teacher_states(drafter, embed_tokens, first, drafts)
    teacher = z @ lm_head.t() + domino.low_rank(drafter, z, states) @ drafter.embed_proj[2].weight.t()
    assert torch.equal(teacher.argmax(-1), drafts)
    plain = (z @ lm_head.t()).argmax(-1)
    assert not torch.equal(plain, drafts)  # the correction changed some drafts: the test can tell
    # a bf16 drafter (decoding on a GPU) rolls out with its GRU in fp32: mostly the same drafts (bf16 rounds)
    half = drafter.to(torch.bfloat16)
    bf16 = domino.rollout(half, lambda ids: F.embedding(ids, embed.bfloat16()), lm_head.bfloat16(), z.bfloat16(), first)
    assert bf16.dtype == torch.long and (bf16 == drafts).float().mean() > 0.8


def test_the_curriculum_moves_the_loss_from_the_base_to_the_corrected_logits():
    assert [domino.lambda_base(p, 1.0, 0.5) for p in (0.0, 0.25, 0.5, 0.9)] == [1.0, 0.5, 0.0, 0.0]
    assert domino.lambda_base(0.1, 0.8, 0.2) == pytest.approx(0.4)
    schedule = WarmupCosine(warmup=2, total=10)
    assert [schedule.progress(s) for s in (0, 5, 10, 20)] == [0.0, 0.5, 1.0, 1.0]


@pytest.mark.slow
def test_a_domino_drafter_learns_and_reports_its_backbone_alone():
    state, source = make(
        'drafter.objective="domino"', "drafter.domino_emb_dim=32", "drafter.domino_gru_dim=48", steps=32
    )
    assert state.drafter.cfg.domino and state.drafter.prefix_gru.hidden_size == 48
    metrics = [train_step(state, batch) for batch in source]
    assert all(math.isfinite(m["loss"]) for m in metrics)
    lams = [m["lambda_base"] for m in metrics]
    assert lams[0] == 1.0 and lams == sorted(lams, reverse=True) and lams[-1] == 0.0  # default decay_ratio 0.5
    mean = lambda ms, k: sum(m[k] for m in ms) / len(ms)  # noqa: E731
    assert mean(metrics[-4:], "loss") < mean(metrics[:4], "loss") - 0.5
    assert mean(metrics[-4:], "tau") > mean(metrics[:4], "tau")
    assert all(1.0 <= m["base_tau"] <= B * 4 for m in metrics)


def test_the_warmup_compiles_the_loss_of_both_halves_of_the_curriculum():
    """Once lambda reaches 0 the loss chunk drops its base CE: a second graph. The warmup compiles it, so
    training and evaluating through the curriculum's end compile nothing (on the 27B preset's GPU run it
    had been one step of 3.5 s mid-run). The chunk is compiled here with a counting backend on the CPU."""
    from torch._dynamo.testing import CompileCounter

    from services.drafter.training.evaluate import evaluate
    from services.drafter.training.warmup import warmup

    state, source = make('drafter.objective="domino"', steps=8)
    counter = CompileCounter()
    state.domino_chunk = torch.compile(domino.domino_chunk, backend=counter, dynamic=False)
    batches = list(source)
    warmup(state, batches[0], with_eval=True)
    # with and without gradients (training, the held-out evaluation), lambda > 0 and lambda = 0; nothing trained
    assert state.step == 0 and counter.frame_count == 4
    lams = []
    for batch in batches:
        lams.append(train_step(state, batch)["lambda_base"])
        evaluate(state, [batch])
    assert lams[0] > 0 and lams[-1] == 0.0
    assert counter.frame_count == 4


def test_domino_settings_are_checked_by_name():
    with pytest.raises(Exception, match='drafter.objective = "domino" trains with drafter.position_weights = "decay"'):
        make('drafter.objective="domino"', 'drafter.position_weights="dpace"', steps=1)
    with pytest.raises(Exception, match="drafter.objective must be one of dflash, domino"):
        make('drafter.objective="eagle"', steps=1)
    with pytest.raises(Exception, match=r"drafter.domino_decay_ratio must be in \(0, 1\]"):
        make('drafter.objective="domino"', "drafter.domino_decay_ratio=0", steps=1)
    with pytest.raises(Exception, match="domino_gru_dim=0 do not fit drafter.objective='domino'"):
        make('drafter.objective="domino"', "drafter.overrides={domino_gru_dim=0}", steps=1)
    with pytest.raises(Exception, match="domino_emb_dim=8, domino_gru_dim=8 do not fit drafter.objective='dflash'"):
        make('drafter.objective="dflash"', "drafter.overrides={domino_emb_dim=8,domino_gru_dim=8}", steps=1)


def test_a_domino_drafter_decodes_losslessly_one_prompt_packed_and_padded_alike(dense):
    drafter = random_drafter(dense, DENSE_LAYER_IDS, B, **HEAD)
    plain = random_drafter(dense, DENSE_LAYER_IDS, B)
    assert drafter.cfg.domino and not plain.cfg.domino
    verifier = LocalVerifier(dense)
    for seed in range(2):
        p = prompt(70 + seed, n=6 + 4 * seed)
        ref = greedy_reference(verifier, p, 20)
        out = speculative_generate(verifier, drafter, p, max_new_tokens=20)
        assert out.tokens == ref.tokens and all(1 <= s <= B for s in out.steps)
    g = torch.Generator().manual_seed(2)
    lengths, lasts = [3, 11, 7], [5, 17, 42]
    features = torch.randn(len(lengths), 16, len(DENSE_LAYER_IDS) * 64, generator=g)
    alone = [drafter(features[i, :n], t, n).tolist() for i, (n, t) in enumerate(zip(lengths, lasts))]
    assert drafter.many([features[i, :n] for i, n in enumerate(lengths)], lasts) == alone
    assert drafter.padded(features, torch.tensor(lengths), torch.tensor(lasts), max(lengths)).tolist() == alone


def test_the_export_has_sglangs_domino_fields_and_launcher_eval_reads_it_back(tmp_path, dense):
    drafter = random_drafter(dense, DENSE_LAYER_IDS, B, **HEAD).drafter
    weights = {k: v.detach().clone() for k, v in drafter.state_dict().items()}
    assert {"prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight", "embed_proj.2.weight"} <= set(
        weights
    )
    out = export_weights(weights, drafter.cfg, tmp_path / "export", dtype="float32")
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["DFlashDraftModel"]
    assert {k: conf["dflash_config"][k] for k in ("projector_type", "emb_dim", "gru_hidden_dim")} == {
        "projector_type": "domino",
        "emb_dim": 8,
        "gru_hidden_dim": 12,
    }
    assert conf["dflash_config"]["shift_label"] is False and conf["dflash_config"]["pure_draft_prefix_len"] == 0
    kept = json.loads((out / "export.json").read_text())
    assert "SGLang's DFlash worker" in kept["serve"]["note"]
    loaded, shape, _, _ = load_weights(out)
    assert shape == drafter.cfg and all(torch.equal(loaded[k], weights[k]) for k in weights)
    assert "projector_type" not in random_drafter(dense, DENSE_LAYER_IDS, B).cfg.to_hf()["dflash_config"]
    shifted = {**conf, "dflash_config": {**conf["dflash_config"], "shift_label": True}}
    with pytest.raises(ValueError, match="shift_label true or pure_draft_prefix_len > 0"):
        DrafterModelConfig.from_hf(shifted)


def test_launcher_status_shows_the_backbone_alone_beside_the_corrected_tau():
    from launcher.progress import describe_window

    window = {"step": 20, "loss": 1.5, "tau": 4.7, "coverage": 0.9, "tokens_per_s": 17.3, "steps": 10}
    assert "τ 4.70 coverage" in describe_window(window)
    assert "τ 4.70 (backbone alone 3.71) coverage 90%" in describe_window({**window, "base_tau": 3.71})


def test_fp8_converts_the_layers_and_leaves_the_head_in_bf16():
    pytest.importorskip("torchao")
    from services.drafter.modeling.model import DFlashDrafter
    from services.drafter.modeling.precision import apply_precision

    shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    cfg = DrafterModelConfig(
        **shape,
        vocab_size=256,
        num_target_layers=4,
        num_hidden_layers=1,
        target_layer_ids=[1],
        block_size=4,
        domino_emb_dim=16,
        domino_gru_dim=32,  # multiples of 16: FP8 would take them, but for the name
    )
    drafter = apply_precision(DFlashDrafter(cfg), "fp8", torch.device("cpu"), emulate=True)
    assert (
        type(drafter.fc).__name__ == "Float8Linear" and type(drafter.layers[0].mlp.up_proj).__name__ == "Float8Linear"
    )
    assert type(drafter.embed_proj[0]) is torch.nn.Linear and type(drafter.embed_proj[2]) is torch.nn.Linear


def test_the_default_head_is_specforges_and_smaller_for_a_narrow_drafter():
    from services.run.runspec import domino_head

    assert domino_head(0, 0, 4096) == {"domino_emb_dim": 256, "domino_gru_dim": 1024}  # SpecForge's
    assert domino_head(0, 0, 576) == {"domino_emb_dim": 256, "domino_gru_dim": 1024}  # SmolLM2's width
    assert domino_head(0, 0, 128) == {"domino_emb_dim": 64, "domino_gru_dim": 256}  # the CPU demo's
    assert domino_head(32, 48, 4096) == {"domino_emb_dim": 32, "domino_gru_dim": 48}  # as set
    state, _ = make(steps=1)  # the default objective is Domino's, its head sized by the drafter's width
    m = state.drafter.cfg
    assert m.domino and (m.domino_emb_dim, m.domino_gru_dim) == tuple(domino_head(0, 0, m.hidden_size).values())
