"""Batched speculative decoding (services/eval/batched_decode.py): many prompts of different
lengths decoded at once, one packed target forward per step with no cache, must make exactly the
decisions of the cached one-prompt loop (speculative.py) on tiny real HF targets, dense and hybrid
(fp32 on CPU: no rounding ties): the same tokens, the same accepted lengths per step, the same
target forwards; the plain greedy outputs too; prompts that stop early leave the others going."""

import pytest
import torch

from services.drafter.acceptance.speculative import RepeatLast, greedy_reference, speculative_generate
from services.eval.batched_decode import PackedVerifier, decode_many
from services.eval.verifier import LocalVerifier
from tests.tiny_targets import DENSE_LAYER_IDS, HYBRID_LAYER_IDS, VOCAB, prompt
from tests.unit.test_speculative import random_drafter

B = 4


class ManyOracle:
    """Drafts each prompt's known greedy continuation: right for the first `correct[i]` drafts of every
    block, wrong after. It tells the prompts apart by their features (each prompt's own, computed alone)."""

    def __init__(self, packed, prompts: list[list[int]], sequences: list[list[int]], correct: list[int]):
        self.features = [packed.forward([p], [1])[0].features for p in prompts]
        self.sequences, self.correct, self.block_size, self.calls = sequences, correct, B, 0

    def many(self, contexts, last_tokens):
        self.calls += 1
        out = []
        for context, last in zip(contexts, last_tokens):
            (i,) = [
                k
                for k, f in enumerate(self.features)
                if context.shape[0] >= f.shape[0] and torch.allclose(context[: f.shape[0]], f, atol=1e-4)
            ]
            start, seq = context.shape[0], self.sequences[i]
            assert seq[start] == last
            drafts = (seq[start + 1 : start + B] + [0] * B)[: B - 1]
            out.append([t if j < self.correct[i] else (t + 1) % VOCAB for j, t in enumerate(drafts)])
        return out


def prompts():
    return [prompt(60 + i, n=5 + 4 * i) for i in range(4)]  # 5, 9, 13 and 17 tokens


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_batched_decoding_makes_the_cached_loops_decisions(kind, dense, hybrid):
    target = dense if kind == "dense" else hybrid
    layer_ids = DENSE_LAYER_IDS if kind == "dense" else HYBRID_LAYER_IDS
    cached, packed = LocalVerifier(target), PackedVerifier(target)
    drafter = random_drafter(target, layer_ids, B)
    ps = prompts()
    refs = [greedy_reference(cached, p, 14) for p in ps]
    batch_refs = decode_many(packed, None, ps, max_new_tokens=14)
    assert [r.tokens for r in batch_refs] == [r.tokens for r in refs]
    assert all(r.target_forwards == len(r.tokens) and r.steps == [1] * (len(r.tokens) - 1) for r in batch_refs)
    for propose in (drafter, RepeatLast(B)):
        one = [speculative_generate(cached, propose, p, max_new_tokens=14) for p in ps]
        many = decode_many(packed, propose, ps, max_new_tokens=14)
        assert [m.tokens for m in many] == [r.tokens for r in refs]  # lossless
        assert [m.steps for m in many] == [o.steps for o in one]
        assert [m.target_forwards for m in many] == [o.target_forwards for o in one]


def test_accepted_lengths_are_exact_per_prompt_and_drafted_in_one_call_per_step(dense):
    packed = PackedVerifier(dense)
    ps = prompts()
    refs = decode_many(packed, None, ps, max_new_tokens=16)
    oracle = ManyOracle(packed, ps, [p + r.tokens for p, r in zip(ps, refs)], correct=[0, 1, 2, 3])
    out = decode_many(packed, oracle, ps, max_new_tokens=16)
    assert [o.tokens for o in out] == [r.tokens for r in refs]
    assert out[0].steps == [1] * 15 and out[1].steps == [2] * 7 + [1] and out[2].steps == [3] * 5
    assert out[3].steps == [4, 4, 4, 3]
    assert oracle.calls == 15  # one drafter call per step, every unfinished prompt in it


def test_a_prompt_that_stops_early_leaves_the_others_decoding(dense):
    packed, cached = PackedVerifier(dense), LocalVerifier(dense)
    ps = prompts()
    refs = [greedy_reference(cached, p, 16) for p in ps]
    stop = refs[1].tokens[3]  # prompt 1 ends at its 4th token (or earlier)
    want = [greedy_reference(cached, p, 16, [stop]) for p in ps]
    got = decode_many(packed, RepeatLast(B), ps, max_new_tokens=16, stop_ids=[stop])
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert len(got[1].tokens) <= 4 and max(len(g.tokens) for g in got) == 16
    assert all(g.tokens[-1] == stop or len(g.tokens) == 16 for g in got)


def test_drafts_of_a_packed_batch_equal_each_prompt_drafted_alone(dense):
    drafter = random_drafter(dense, DENSE_LAYER_IDS, B)
    g = torch.Generator().manual_seed(2)
    contexts = [torch.randn(n, len(DENSE_LAYER_IDS) * 64, generator=g) for n in (3, 11, 7)]
    lasts = [5, 17, 42]
    alone = [drafter(c, t, c.shape[0]).tolist() for c, t in zip(contexts, lasts)]
    assert drafter.many(contexts, lasts) == alone


def test_the_default_batch_follows_the_target_kind_size_and_device(dense, hybrid, monkeypatch):
    from services.eval import local_spec_eval as spec_eval
    from services.target.verify import slot_cache

    free = {"bytes": 80 << 30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 140 << 30))
    cuda = torch.device("cuda")
    assert spec_eval.auto_batch(dense, torch.device("cpu"), 512) == 1  # CPU: the cached loop
    assert spec_eval.auto_batch(dense, cuda, 512) == spec_eval.AUTO_SLOTS > 1  # a KV-cache row each
    assert spec_eval.auto_batch(hybrid, cuda, 512) == spec_eval.AUTO_SLOTS  # rows with their recurrent state
    free["bytes"] = 64 << 20  # little free memory: fewer rows, and fewer still when they are longer
    long_rows, short_rows = spec_eval.auto_batch(dense, cuda, 1 << 16), spec_eval.auto_batch(dense, cuda, 512)
    assert 1 <= long_rows < short_rows < spec_eval.AUTO_SLOTS
    # a hybrid's Gated DeltaNet layer holds a state of fixed size, not 512 tokens of keys and values:
    # more rows fit than if all its layers were attention (test_slot_decode checks the bytes themselves)
    with_states = slot_cache.rows_that_fit(hybrid.model, cuda, 512, 1 << 30)
    cfg = hybrid.model.config.get_text_config()
    monkeypatch.setattr(cfg, "layer_types", ["full_attention"] * len(cfg.layer_types))
    assert with_states > slot_cache.rows_that_fit(hybrid.model, cuda, 512, 1 << 30)
    monkeypatch.setattr(spec_eval, "slot_decodable", lambda target: False)  # a target slots.py cannot run
    free["bytes"] = 80 << 30
    assert spec_eval.auto_batch(hybrid, cuda, 512) == spec_eval.AUTO_BATCH > 1  # packed, no cache
    params = sum(p.numel() for p in hybrid.model.parameters())
    monkeypatch.setattr(spec_eval, "AUTO_BATCH_MAX_PARAMS", params - 1)  # a recurrent target past the limit
    assert spec_eval.auto_batch(hybrid, cuda, 512) == 1
