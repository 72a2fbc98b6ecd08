"""A session of rows (services/target/verify/row_sessions.py: the prompts of a real-acceptance evaluation
verified together on the target worker) makes each prompt's one-prompt session's decisions
(services/target/verify/decode.py DecodeSession), on tiny real HF targets in fp32 (no rounding ties):
the first token of each prompt, the greedy tokens of every block, the tokens committed and their
features; rows that leave midway free their place and the others go on. Dense Qwen3 and a Qwen3.5
Gated DeltaNet hybrid (fla's kernels on CUDA), in process: no worker, no socket."""

import pytest
import torch

from services.target.verify.decode import DecodeSession
from services.target.verify.row_sessions import RowSession, check_rows
from tests.tiny_targets import HYBRID_DEVICES, dense_target, hybrid_target, prompt

B = 4  # block: the last committed token + 3 drafts
DEVICES = ["cpu", pytest.param("cuda", marks=HYBRID_DEVICES[1].marks)]


def block_for(reference: list[int], at: int, last: int, right: int) -> list[int]:
    """The last token, then `right` drafts equal to the target's own continuation, then wrong ones."""
    drafts = (reference[at + 1 : at + B] + [0] * B)[: B - 1]
    return [last] + [t if j < right else (t + 1 + j) % 90 + 1 for j, t in enumerate(drafts)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_rows_make_each_prompts_own_session_decisions(kind, device, no_tf32):
    target = (dense_target if kind == "dense" else hybrid_target)(device=device)
    check_rows(target)
    prompts = [prompt(80 + i, n=n) for i, n in enumerate((11, 5, 17))]
    rows = RowSession(target, prompts, room=40)
    alone = [DecodeSession(target) for _ in prompts]
    firsts = [s.prefill(p) for s, p in zip(alone, prompts)]
    greedy, margin, tolerance, counts, features = rows.first
    assert greedy.tolist() == [int(f.greedy[-1]) for f in firsts]
    assert counts.tolist() == [len(p) for p in prompts]
    expected = torch.cat([f.features.cpu() for f in firsts])
    assert features.shape == expected.shape and torch.allclose(features, expected, atol=1e-4)
    references = [p + greedy_continuation(target, p, 30) for p in prompts]  # so drafts can be right on purpose
    at_ref = [len(p) for p in prompts]  # where each prompt's last committed token is in its reference
    lasts, active, accepted_lengths = greedy.tolist(), [0, 1, 2], set()
    for step in range(6):
        if step == 3:
            active = [0, 2]  # prompt 1 ends: its row leaves, the others move up
        blocks = [block_for(references[k], at_ref[k], lasts[k], right=(k + step) % B) for k in active]
        greedy, margin, tolerance, counts, features = rows.step(active, blocks)
        assert greedy.shape == (len(active) * B,) and counts.shape == (len(active),)
        at = 0
        for j, (k, block) in enumerate(zip(active, blocks)):
            one = alone[k].verify(block)
            drafts = block[1:]
            agree = next((i for i, d in enumerate(drafts) if d != int(one.greedy[i])), len(drafts))
            alone[k].commit(agree + 1)
            assert greedy[j * B : (j + 1) * B].tolist() == one.greedy.tolist(), (step, k)
            assert int(counts[j]) == agree + 1
            n = int(counts[j])
            assert torch.allclose(features[at : at + n], one.features[:n].cpu(), atol=1e-4), (step, k)
            at += n
            accepted_lengths.add(n)
            at_ref[k], lasts[k] = at_ref[k] + n, int(one.greedy[n - 1])
            assert lasts[k] == references[k][at_ref[k]]  # still on the target's own path
        assert at == features.shape[0]
    assert len(accepted_lengths) >= 3  # rows keeping 1 up to B tokens of their blocks: the rollbacks are real
    assert rows.starts == [at_ref[k] for k in active]


def greedy_continuation(target, prompt_ids: list[int], n: int) -> list[int]:
    """Plain greedy decoding, one token a forward, on a session of its own."""
    session = DecodeSession(target)
    tokens = [int(session.prefill(prompt_ids).greedy[-1])]
    while len(tokens) < n:
        tokens.append(int(session.verify(tokens[-1:]).greedy[0]))
        session.commit(1)
    return tokens


def test_a_row_that_left_or_never_was_is_named(dense):
    rows = RowSession(dense, [prompt(1, n=6), prompt(2, n=9)], room=8)
    first = rows.first[0].tolist()
    rows.step([1], [[first[1], 1, 2, 3]])  # prompt 0 ended: its row left
    with pytest.raises(ValueError, match=r"rows \[0\] are not in this session"):
        rows.step([0, 1], [[5, 1, 2, 3], [5, 1, 2, 3]])
    with pytest.raises(ValueError, match="room for"):  # past what the session holds
        for _ in range(8):
            rows.step([1], [[5, 1, 2, 3]])
