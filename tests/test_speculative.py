"""The project's greedy DFlash decoding loop (services/drafter/speculative.py) against a tiny real HF
Qwen3 target made on the spot: lossless for any drafter (its output is the target's plain greedy
output from HF generate), and the acceptance figures exact on constructed drafters whose
acceptance is known in advance."""
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from services.drafter.model import DrafterModelConfig
from services.drafter.speculative import (Decoded, DrafterProposer, RepeatLast, block_masks, eval_drafter,
                                          greedy_generate, speculative_generate, summarize)
from services.drafter.target_head import TargetHead

VOCAB, LAYERS, B = 96, 4, 4
LAYER_IDS = [1, 2]


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():                     # a spread of logits, so greedy output is not one token repeated
        model.lm_head.weight.mul_(20)
    return model


def prompt(seed: int, n: int = 12) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Oracle:
    """Drafts the target's known greedy continuation, correct for the first `correct` drafts of every
    block and wrong after (its token + 1): each step must commit exactly correct + 1 tokens."""

    def __init__(self, sequence: list[int], correct: int):
        self.sequence, self.correct = sequence, correct

    def __call__(self, features, last_token, start):
        assert last_token == self.sequence[start] and features.shape[0] == start   # context: positions < start
        drafts = self.sequence[start + 1:start + B] + [0] * B
        drafts = [t if j < self.correct else (t + 1) % VOCAB for j, t in enumerate(drafts[:B - 1])]
        return torch.tensor(drafts)


def decode(target, propose, p, max_new=16, stops=()):
    return speculative_generate(target, propose, p, block_size=B, layer_ids=LAYER_IDS, max_new_tokens=max_new,
                                stop_ids=stops)


@pytest.mark.parametrize("correct, steps", [(0, [1] * 15), (2, [3] * 5), (B - 1, [4, 4, 4, 3])])
def test_acceptance_counts_on_constructed_drafters(target, correct, steps):
    p = prompt(1)
    ref = greedy_generate(target, p, 16)
    assert len(ref) == 16 and len(set(ref)) > 3            # a varied greedy output, no early stop
    out = decode(target, Oracle(p + ref, correct), p)
    assert out.tokens == ref
    assert out.steps == steps                                # the prefill's token is not a step
    assert out.target_forwards == len(steps) + 1
    s = summarize([out], [ref])
    assert s["acceptance_per_step"] == pytest.approx(sum(steps) / len(steps))
    assert s["tokens_per_forward"] == pytest.approx(16 / (len(steps) + 1))
    assert s["lossless"] == 1


def test_summary_per_prompt_and_per_step():
    a = Decoded(tokens=list(range(9)), steps=[4, 4], target_forwards=3)        # 8 / 2 steps = 4.0
    b = Decoded(tokens=list(range(5)), steps=[1, 1, 1, 1], target_forwards=5)  # 4 / 4 steps = 1.0
    s = summarize([a, b], [list(range(9)), [9] * 5])
    assert s["acceptance_per_prompt"] == pytest.approx((4.0 + 1.0) / 2)
    assert s["acceptance_per_step"] == pytest.approx(12 / 6)
    assert s["tokens_per_forward"] == pytest.approx(14 / 8)
    assert s["lossless"] == 1 and s["prompts"] == 2 and s["steps"] == 6


def test_stop_token_ends_the_output_as_greedy_does(target):
    p = prompt(2)
    ref = greedy_generate(target, p, 16)
    stop = ref[5]                                           # a token the greedy output reaches
    want = ref[:ref.index(stop) + 1]
    assert greedy_generate(target, p, 16, [stop]) == want
    assert decode(target, Oracle(p + ref, B - 1), p, stops=[stop]).tokens == want
    assert decode(target, RepeatLast(B), p, stops=[stop]).tokens == want


def test_lossless_with_random_drafter_and_repeat_last(target):
    cfg = DrafterModelConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, vocab_size=VOCAB, num_target_layers=LAYERS, num_hidden_layers=1,
                             target_layer_ids=LAYER_IDS, block_size=B, mask_token_id=VOCAB - 1)
    head = TargetHead(target.get_input_embeddings().weight.detach(), target.lm_head.weight.detach())
    torch.manual_seed(3)
    drafter = DrafterProposer(eval_drafter(None, cfg, "cpu"), head)
    for seed in range(4):
        p = prompt(10 + seed, n=5 + 3 * seed)
        ref = greedy_generate(target, p, 24)
        for propose in (drafter, RepeatLast(B)):
            out = decode(target, propose, p, max_new=24)
            assert out.tokens == ref
            assert sum(out.steps) + 1 == len(ref) and all(1 <= s <= B for s in out.steps)


def test_a_sliding_window_drafter_drafts_as_it_was_trained(target):
    """Inference applies each sliding layer's window exactly as the training mask does (one block,
    anchored at the decoding position), and the window matters: the same weights with all layers
    full draft from other features. Decoding stays lossless."""
    import dataclasses

    from services.drafter.attention import DenseAttention
    from services.drafter.model import DFlashDrafter
    cfg = DrafterModelConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, vocab_size=VOCAB, num_target_layers=LAYERS, num_hidden_layers=2,
                             target_layer_ids=LAYER_IDS, block_size=B, mask_token_id=VOCAB - 1,
                             layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    head = TargetHead(target.get_input_embeddings().weight.detach(), target.lm_head.weight.detach())
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
        got = sliding.drafter(*args, block_masks(cfg, start, "cpu"))
        unwindowed = full.drafter(*args, {"full_attention": None})
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert (unwindowed - want).abs().max() > 1e-3                  # the window changed what was seen
    p = prompt(30, n=10)
    ref = greedy_generate(target, p, 20)
    assert decode(target, sliding, p, max_new=20).tokens == ref


def test_an_exported_sliding_window_drafter_loads_with_its_window(tmp_path):
    """`launcher eval --checkpoint EXPORT` reads the layout back: its windows, not all-full layers."""
    from services.drafter.export import export_weights
    from services.drafter.model import DFlashDrafter
    from services.drafter.speculative import load_weights
    cfg = DrafterModelConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, vocab_size=VOCAB, num_target_layers=LAYERS, num_hidden_layers=2,
                             target_layer_ids=LAYER_IDS, block_size=B, mask_token_id=VOCAB - 1,
                             layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    out = export_weights(DFlashDrafter(cfg).state_dict(), cfg, tmp_path / "export", dtype="float32")
    _, loaded, what = load_weights(out)
    assert what.startswith("export ") and loaded.layer_types == cfg.layer_types and loaded.sliding_window == 3
