"""The project's greedy DFlash decoding loop (services/drafter/acceptance/speculative.py) through a LocalVerifier on
tiny real HF targets made on the spot, a dense Qwen3 and a Qwen3.5 Gated DeltaNet hybrid: lossless
for any drafter (its output is the plain greedy output of the same target, one token per forward;
on the dense one also HF generate's), mostly-rejected drafts included (the rollback case), and the
acceptance figures exact on constructed drafters whose acceptance is known in advance; a difference
reads as a near-tie or a bug."""

import pytest
import torch

from services.decoding.decode_step import ROLLBACKS
from services.decoding.lossless import describe_lossless, first_difference
from services.drafter.acceptance.speculative import (
    Decoded,
    DrafterProposer,
    RepeatLast,
    eval_drafter,
    greedy_reference,
    speculative_generate,
    summarize,
)
from services.drafter.modeling.model import DrafterModelConfig
from services.drafter.modeling.target_head import TargetHead
from services.eval.verifier import LocalVerifier
from tests.greedy import hf_greedy_generate
from tests.tiny_targets import (
    DENSE_LAYER_IDS,
    HYBRID_LAYER_IDS,
    VOCAB,
    plain_hf,
    prompt,
)

B = 4
LAYERS = 4
LAYER_IDS = DENSE_LAYER_IDS


@pytest.fixture(scope="module")
def target(dense):
    return LocalVerifier(dense)


class Oracle:
    """Drafts the target's known greedy continuation, correct for the first `correct` drafts of every
    block and wrong after (its token + 1): each step must commit exactly correct + 1 tokens."""

    def __init__(self, sequence: list[int], correct: int, block_size: int = B):
        self.sequence, self.correct, self.block_size = sequence, correct, block_size

    def __call__(self, features, last_token, start):
        assert last_token == self.sequence[start] and features.shape[0] == start  # context: positions < start
        drafts = self.sequence[start + 1 : start + self.block_size] + [0] * self.block_size
        drafts = [t if j < self.correct else (t + 1) % VOCAB for j, t in enumerate(drafts[: self.block_size - 1])]
        return torch.tensor(drafts, device=features.device)


def decode(verifier, propose, p, max_new=16, stops=()):
    return speculative_generate(verifier, propose, p, max_new_tokens=max_new, stop_ids=stops)


def reference(verifier, p, max_new=16, stops=()):
    return greedy_reference(verifier, p, max_new, stops)


def random_drafter(target, layer_ids, block_size=B, seed=3, **shape):
    """A drafter of random weights for a tiny target; shape: more DrafterModelConfig fields (a Domino head)."""
    cfg = DrafterModelConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        num_target_layers=target.info.num_layers,
        num_hidden_layers=1,
        target_layer_ids=layer_ids,
        block_size=block_size,
        mask_token_id=VOCAB - 1,
        **shape,
    )
    model = target.model
    head = TargetHead(model.get_input_embeddings().weight.detach(), model.lm_head.weight.detach())
    torch.manual_seed(seed)
    return DrafterProposer(eval_drafter(None, cfg, target.device), head)


@pytest.mark.parametrize("correct, steps", [(0, [1] * 15), (2, [3] * 5), (B - 1, [4, 4, 4, 3])])
def test_acceptance_counts_on_constructed_drafters(target, correct, steps):
    p = prompt(1)
    ref = reference(target, p)
    assert len(ref.tokens) == 16 and len(set(ref.tokens)) > 3  # a varied greedy output, no early stop
    out = decode(target, Oracle(p + ref.tokens, correct), p)
    assert out.tokens == ref.tokens
    assert out.steps == steps  # the prefill's token is not a step
    assert out.target_forwards == len(steps) + 1
    s = summarize([out], [ref])
    assert s["acceptance_per_step"] == pytest.approx(sum(steps) / len(steps))
    assert s["tokens_per_forward"] == pytest.approx(16 / (len(steps) + 1))
    assert s["lossless"] == 1 and s["near_ties"] == 0 and s["differences"] == []


def test_summary_per_prompt_and_per_step():
    a = Decoded(tokens=list(range(9)), steps=[4, 4], target_forwards=3)  # 8 / 2 steps = 4.0
    b = Decoded(tokens=list(range(5)), steps=[1, 1, 1, 1], target_forwards=5)  # 4 / 4 steps = 1.0
    refs = [Decoded(list(range(9)), [], 9, [1.0] * 9, [0.1] * 9), Decoded([9] * 5, [], 5, [1.0] * 5, [0.1] * 5)]
    b.margins, b.tolerances = [2.0] * 5, [0.1] * 5
    s = summarize([a, b], refs)
    assert s["acceptance_per_prompt"] == pytest.approx((4.0 + 1.0) / 2)
    assert s["acceptance_per_step"] == pytest.approx(12 / 6)
    assert s["tokens_per_forward"] == pytest.approx(14 / 8)
    assert s["lossless"] == 1 and s["prompts"] == 2 and s["steps"] == 6
    assert s["differences"] == [{"index": 1, "position": 0, "margin": 1.0, "tolerance": 0.1, "near_tie": False}]


def test_a_difference_reads_as_near_tie_or_bug():
    ref = dict(ref_margins=[3.0, 0.004, 2.0], ref_tolerances=[0.03, 0.03, 0.03])
    # differs at position 1, where the reference's margin (0.004) is within its tolerance: a near-tie
    tie = first_difference([5, 7, 1], [5, 8, 1], [3.0, 0.5, 2.0], [0.03] * 3, **ref)
    assert tie == {"position": 1, "margin": 0.004, "tolerance": 0.03, "near_tie": True}
    # at position 2 both forwards were sure: a bug
    bug = first_difference([5, 8, 2], [5, 8, 1], [3.0, 0.5, 2.5], [0.03] * 3, **ref)
    assert bug == {"position": 2, "margin": 2.0, "tolerance": 0.03, "near_tie": False}
    # the verify forward's own margin counts too: there it was a tie
    assert first_difference([5, 8, 2], [5, 8, 1], [3.0, 0.5, 0.01], [0.03] * 3, **ref)["near_tie"]
    assert first_difference([5, 8, 1], [5, 8, 1], [], [], [], []) is None
    out = Decoded([5, 7, 1], [1, 1], 3, [3.0, 0.5, 2.0], [0.03] * 3)
    refs = Decoded([5, 8, 1], [1, 1], 3, ref["ref_margins"], ref["ref_tolerances"])
    same = Decoded([5, 8, 1], [1, 1], 3, [3.0, 0.5, 2.0], [0.03] * 3)
    s = summarize([same, out, same], [refs] * 3)
    assert (s["lossless"], s["near_ties"], describe_lossless(s)) == (2, 1, "lossless 2/3 (1 near-tie)")
    assert s["differences"][0]["index"] == 1 and all(d["near_tie"] for d in s["differences"])
    s = summarize([Decoded([5, 8, 2], [1, 1], 3, [3.0, 0.5, 2.5], [0.03] * 3)], [refs])
    assert describe_lossless(s) == "lossless 0/1 (1 NOT near-ties: a bug)" and not s["differences"][0]["near_tie"]


def test_stop_token_ends_the_output_as_greedy_does(target, dense):
    p = prompt(2)
    ref = reference(target, p).tokens
    stop = ref[5]  # a token the greedy output reaches
    want = ref[: ref.index(stop) + 1]
    assert reference(target, p, stops=[stop]).tokens == want
    with plain_hf(dense) as model:
        assert hf_greedy_generate(model, p, 16, [stop]) == want
    assert decode(target, Oracle(p + ref, B - 1), p, stops=[stop]).tokens == want
    assert decode(target, RepeatLast(B), p, stops=[stop]).tokens == want


def test_lossless_with_random_drafter_and_repeat_last(target, dense):
    drafter = random_drafter(dense, LAYER_IDS)
    for seed in range(3):
        p = prompt(10 + seed, n=5 + 3 * seed)
        ref = reference(target, p, 24)  # equal to HF generate: test_decode.py
        for propose in (drafter, RepeatLast(B)):
            out = decode(target, propose, p, max_new=24)
            assert out.tokens == ref.tokens
            assert sum(out.steps) + 1 == len(ref.tokens) and all(1 <= s <= B for s in out.steps)


@pytest.mark.parametrize("rollback", ROLLBACKS)
def test_hybrid_target_decodes_losslessly_whatever_is_rejected(hybrid, rollback):
    """A Gated DeltaNet hybrid: a random drafter (drafts mostly rejected: the state rolls back nearly
    every step), the reference's own continuation (all accepted), and one right for 2 tokens then
    wrong; every output equals plain greedy decoding and the steps are the ones known in advance."""
    verifier, block = LocalVerifier(hybrid, rollback), 6
    drafter = random_drafter(hybrid, HYBRID_LAYER_IDS, block)
    for seed in range(2):
        p = prompt(40 + seed, n=6 + 5 * seed)
        ref = reference(verifier, p, 18)
        assert len(set(ref.tokens)) > 3
        rejected = decode(verifier, drafter, p, max_new=18)
        assert rejected.tokens == ref.tokens and sum(s == 1 for s in rejected.steps) > len(rejected.steps) / 2
        accepted = decode(verifier, Oracle(p + ref.tokens, block - 1, block), p, max_new=18)
        assert accepted.tokens == ref.tokens and accepted.steps == [6, 6, 5]
        partly = decode(verifier, Oracle(p + ref.tokens, 2, block), p, max_new=18)
        assert partly.tokens == ref.tokens and partly.steps == [3] * 5 + [2]
        s = summarize([rejected, accepted, partly], [ref] * 3)
        assert s["lossless"] == 3 and s["differences"] == []


def test_a_sliding_window_drafter_drafts_as_it_was_trained(target, dense):
    """Inference applies each sliding layer's window exactly as the training mask does (one block,
    anchored at the decoding position), and the window matters: the same weights with all layers
    full draft from other features. Decoding stays lossless."""
    import dataclasses

    from services.drafter.modeling.attention import DenseAttention
    from services.drafter.modeling.model import DFlashDrafter

    cfg = DrafterModelConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        num_target_layers=LAYERS,
        num_hidden_layers=2,
        target_layer_ids=LAYER_IDS,
        block_size=B,
        mask_token_id=VOCAB - 1,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=3,
    )
    head = TargetHead(dense.model.get_input_embeddings().weight.detach(), dense.model.lm_head.weight.detach())
    torch.manual_seed(5)
    trained = DFlashDrafter(cfg, attention=DenseAttention()).eval()
    weights = trained.state_dict()
    start = 9
    features = torch.randn(start, len(LAYER_IDS) * 64, generator=torch.Generator().manual_seed(6))
    block = torch.full((B,), VOCAB - 1)
    block[0] = 7
    args = (features, head.embed_tokens(block), torch.arange(start), torch.arange(start, start + B))
    with torch.no_grad():
        want = trained(*args, trained.build_masks(torch.tensor([start]), torch.tensor([0]), start))
        sliding = DrafterProposer(eval_drafter(weights, cfg, "cpu"), head)
        full_cfg = dataclasses.replace(cfg, layer_types=["full_attention"] * 2, sliding_window=None)
        full = DrafterProposer(eval_drafter(weights, full_cfg, "cpu"), head)
        unwindowed = full.drafter(*args, {"full_attention": None})
        want_tokens = (want[1:] @ head.lm_head.t()).argmax(-1).tolist()
        # alone, and packed after another prompt's context (services/eval/batched_decode.py): the same drafts
        got = sliding(features, 7, start).tolist()
        packed = sliding.many([torch.randn(5, features.shape[1]), features], [3, 7])[1]
    assert got == want_tokens and packed == want_tokens
    assert (unwindowed - want).abs().max() > 1e-3  # the window changed what was seen
    p = prompt(30, n=10)
    ref = reference(target, p, 20).tokens
    assert decode(target, sliding, p, max_new=20).tokens == ref


def test_an_exported_sliding_window_drafter_loads_with_its_window(tmp_path):
    """`launcher eval --checkpoint EXPORT` reads the layout back: its windows, not all-full layers."""
    from services.drafter.checkpoints.export import export_weights
    from services.drafter.modeling.model import DFlashDrafter
    from services.eval.launcher_eval import load_weights

    cfg = DrafterModelConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        num_target_layers=LAYERS,
        num_hidden_layers=2,
        target_layer_ids=LAYER_IDS,
        block_size=B,
        mask_token_id=VOCAB - 1,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=3,
    )
    out = export_weights(DFlashDrafter(cfg).state_dict(), cfg, tmp_path / "export", dtype="float32")
    _, loaded, what, _ = load_weights(out)
    assert what.startswith("export ") and loaded.layer_types == cfg.layer_types and loaded.sliding_window == 3
