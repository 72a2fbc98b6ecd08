"""The training step in-process on CPU (dense attention, no compile): learning, bad batches, warmup."""

import dataclasses
import math

import pytest
import torch

from services.data.batch import BatchError
from services.drafter.modeling.target_head import TargetHead
from services.drafter.training.core import DrafterCore
from services.drafter.training.synthetic import SYNTHETIC_MODEL, SyntheticSource
from services.drafter.training.train import WarmupCosine, parameter_fingerprint, train_step
from services.drafter.training.warmup import warmup
from services.run.config import load_config
from tests.drafters import build_model_config


def make(*overrides, steps=40, device="cpu"):
    cfg = load_config(
        None,
        [
            "data.pack_len=256",
            "drafter.num_anchors=16",
            "drafter.num_layers=2",
            "kernels.compile=false",
            "optimizer.lr=3e-3",
            "optimizer.warmup_ratio=0.1",
            *overrides,
        ],
    )
    model_cfg = build_model_config(cfg, SYNTHETIC_MODEL, mask_token_id=SYNTHETIC_MODEL["vocab_size"] - 1)
    head = TargetHead.random(model_cfg.vocab_size, model_cfg.hidden_size, seed=0)
    state = DrafterCore.build(cfg, model_cfg, head, device, total_steps=steps).state
    source = SyntheticSource(
        model_cfg, cfg.data.pack_len, total_steps=steps, with_target_labels=cfg.target.labels_from_target
    )
    return state, source


@pytest.mark.slow
def test_loss_falls_and_tau_rises_on_synthetic_data():
    state, source = make()
    metrics = [train_step(state, batch) for batch in source]
    first, last = metrics[:5], metrics[-5:]
    mean = lambda ms, k: sum(m[k] for m in ms) / len(ms)
    assert mean(last, "loss") < mean(first, "loss") - 0.5
    assert mean(last, "tau") > mean(first, "tau") + 1.0
    assert all(math.isfinite(m["loss"]) and m["trained_blocks"] == 16 for m in metrics)
    assert state.step == 40 and state.micro_step == 40 and state.samples_done > 40
    assert metrics[-1]["lr"] < metrics[5]["lr"]  # cosine decay
    assert len(metrics[0]["accuracy_per_position"]) == 15


def test_dpace_position_weights_learn_too():
    """drafter.position_weights = "dpace": the same step with D-PACE's weights (services/drafter/modeling/loss.py)
    learns the synthetic data as the decay does; a bad value is named."""
    state, source = make(
        'drafter.objective="dflash"', 'drafter.position_weights="dpace"', "drafter.dpace_alpha=0.5", steps=24
    )
    assert state.settings.dpace_alpha == 0.5
    metrics = [train_step(state, batch) for batch in source]
    assert all(math.isfinite(m["loss"]) for m in metrics)
    mean = lambda ms, k: sum(m[k] for m in ms) / len(ms)  # noqa: E731
    assert mean(metrics[-4:], "loss") < mean(metrics[:4], "loss") - 0.4  # 4.9 -> 4.2 here
    assert mean(metrics[-4:], "tau") > mean(metrics[:4], "tau")
    with pytest.raises(Exception, match="drafter.position_weights must be one of decay, dpace"):
        make('drafter.position_weights="exp"', steps=1)


def test_labels_from_target_train_too():
    state, source = make("target.labels_from_target=true", steps=3)
    assert all(math.isfinite(train_step(state, b)["loss"]) for b in source)


def test_warmup_leaves_parameters_and_optimizer_untouched():
    state, source = make(steps=5)
    before = parameter_fingerprint(state.drafter)
    seconds = warmup(state, source.batch(0))
    assert seconds > 0
    assert parameter_fingerprint(state.drafter) == before
    assert all(p.grad is None for p in state.drafter.parameters())
    assert state.optimizer.state_dict()["state"] == {} and state.step == 0 and state.micro_step == 0
    train_step(state, source.batch(0))
    assert parameter_fingerprint(state.drafter) != before


def test_gradient_accumulation_steps_every_n_batches():
    state, source = make("optimizer.grad_accum=2", steps=4)
    before = parameter_fingerprint(state.drafter)
    train_step(state, source.batch(0))
    assert state.step == 0 and parameter_fingerprint(state.drafter) == before
    assert any(p.grad is not None for p in state.drafter.parameters())
    train_step(state, source.batch(1))
    assert state.step == 1 and state.micro_step == 2 and parameter_fingerprint(state.drafter) != before


def test_bad_batches_are_named_before_any_work():
    state, source = make("target.labels_from_target=false", steps=2)  # batches without target labels
    good = source.batch(0)
    bad_width = dataclasses.replace(good, hidden=good.hidden[:, :-1])
    with pytest.raises(BatchError, match="field 'hidden' has width 127, config expects 128"):
        train_step(state, bad_width)
    with pytest.raises(BatchError, match="field 'hidden' has dtype torch.float32"):
        train_step(state, dataclasses.replace(good, hidden=good.hidden.float()))
    short = source.batch(0).__class__(g=0, **{k: v[:128] for k, v in good.tensors().items()})
    with pytest.raises(BatchError, match="has 128 tokens, data.pack_len is 256"):
        train_step(state, short)
    out_of_vocab = dataclasses.replace(good, input_ids=good.input_ids.clone().fill_(500))
    with pytest.raises(BatchError, match=r"field 'input_ids' has ids outside \[0, 128\)"):
        train_step(state, out_of_vocab)
    split_doc = good.document_ids.clone()
    split_doc[-1] = 0
    with pytest.raises(BatchError, match="document id 0 appears in more than one run"):
        train_step(state, dataclasses.replace(good, document_ids=split_doc))
    state2, source2 = make("target.labels_from_target=true", steps=2)
    with pytest.raises(BatchError, match="field 'target_labels' is missing"):
        train_step(state2, source.batch(0))
    assert state.step == 0  # nothing was trained


def test_the_step_reports_how_many_supervised_tokens_the_anchors_can_and_did_train():
    state, source = make(steps=1)
    batch = source.batch(0)
    loss, doc = batch.loss_mask.tolist(), batch.document_ids.tolist()
    supervised = sum(loss)
    reachable = sum(1 for t in range(1, len(loss)) if loss[t] and loss[t - 1] and doc[t] == doc[t - 1] >= 0)
    m = train_step(state, batch)
    assert (m["supervised"], m["reachable"], m["sampled"]) == (supervised, reachable, 16)  # 16 = num_anchors
    assert m["coverage"] == pytest.approx(reachable / supervised) and 0.8 < m["coverage"] < 1.0


def test_empty_batch_trains_nothing_and_stays_finite():
    state, source = make(steps=2)
    batch = source.batch(0)
    batch.loss_mask[:] = False  # no valid anchor at all
    before = parameter_fingerprint(state.drafter)
    m = train_step(state, batch)
    assert m["loss"] == 0.0 and m["trained_blocks"] == 0 and m["grad_norm"] == 0.0
    assert m["supervised"] == m["reachable"] == m["sampled"] == 0 and m["coverage"] == 0.0
    assert all(torch.isfinite(p).all() for p in state.drafter.parameters())
    assert parameter_fingerprint(state.drafter) == before  # zero grads, no weight decay


def test_warmup_cosine_schedule():
    s = WarmupCosine(warmup=4, total=14, min_ratio=0.1)
    assert [s(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s(9) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay
    assert s(14) == pytest.approx(0.1) and s(100) == pytest.approx(0.1)


def test_the_lr_follows_the_batches_trained_so_a_resume_on_another_split_continues_the_curve():
    from services.drafter.training.train import make_scheduler
    from services.run.schedule import make_plan

    curve = lambda plan: make_scheduler(
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), plan.optimizer_steps, 0.1, 0.1, plan
    ).lr_lambdas[0]
    two = make_plan(400, 1, drafters=2, grad_accum=2)  # 100 steps of 4 batches
    by_steps = WarmupCosine(warmup=10, total=100, min_ratio=0.1)  # the same run, one unit per step
    assert [curve(two)(k) for k in range(100)] == pytest.approx([by_steps(k) for k in range(100)])
    one = make_plan(400, 1, drafters=1, grad_accum=2, first_step=40, first_g=160)  # 120 more steps of 2
    assert one.optimizer_steps == 160
    assert curve(one)(40) == pytest.approx(curve(two)(40))  # where the data is, not where the steps are
    assert curve(one)(100) == pytest.approx(curve(two)(70))  # 280 batches in, either way
    assert curve(one)(160) == pytest.approx(0.1)  # and it ends with the data
    sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    restarted = make_scheduler(sgd, 160, 0.1, 0.1).lr_lambdas[0]
    assert abs(restarted(40) - curve(two)(40)) > 0.1  # a step clock would have jumped


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(
                not torch.cuda.is_available(), reason="the fused-AdamW skip (found_inf) runs on CUDA only"
            ),
        ),
    ],
)
def test_a_non_finite_batch_is_skipped_named_and_never_reaches_the_weights(device):
    """inf in one captured layer's features: the optimizer step is skipped (weights and AdamW state
    untouched; on CUDA inside fused AdamW), the batch counts for nothing and names the layer; the
    next good batch trains."""
    state, source = make(steps=3, device=device)
    train_step(state, source.batch(0))
    before = parameter_fingerprint(state.drafter)
    steps_before = [s["step"].item() for s in state.optimizer.state.values()]
    bad = source.batch(1)
    ids = state.drafter.cfg.target_layer_ids
    width = bad.hidden.shape[1] // len(ids)
    bad.hidden[7, width * (len(ids) - 1)] = float("inf")  # the last captured layer only
    m = train_step(state, bad)
    assert m["skipped_step"] and m["nonfinite"] == f"non-finite hidden states of captured layer {ids[-1]}"
    assert m["tokens"] == m["trained_blocks"] == 0 and m["grad_norm"] == 0.0 and math.isfinite(m["loss"])
    assert parameter_fingerprint(state.drafter) == before
    assert [s["step"].item() for s in state.optimizer.state.values()] == steps_before
    assert all(torch.isfinite(p).all() for p in state.drafter.parameters())
    good = train_step(state, source.batch(2))
    assert not good["skipped_step"] and "nonfinite" not in good and parameter_fingerprint(state.drafter) != before


def test_non_finite_weights_are_never_written(tmp_path):
    from services.drafter.checkpoints import checkpoint as ckpt
    from services.drafter.checkpoints.export import ExportError, export_weights

    state, _ = make(steps=1)
    weights = state.drafter.state_dict()
    name = next(iter(weights))
    weights[name] = weights[name].clone().fill_(float("nan"))
    with pytest.raises(
        ValueError, match=f"checkpoint at step 5 not written: non-finite values in 1 weight tensor.*{name}"
    ):
        ckpt.write_checkpoint(tmp_path / "ck", 5, weights=weights, optimizer={}, rng={}, meta={}, config={}, keep=2)
    with pytest.raises(ExportError, match=f"export not written: non-finite values .*{name}"):
        export_weights(weights, state.drafter.cfg, tmp_path / "export")
    assert not (tmp_path / "export").exists() and not any((tmp_path / "ck").glob("step-*"))
