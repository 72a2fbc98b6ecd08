"""The DFlash block mask: semantics, dense == flex mask_mod == direct BlockMask, and the backends."""

import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from services.drafter.modeling.attention import (
    DenseAttention,
    FlexAttention,
    anchor_context_starts,
    block_tiles,
    document_starts,
    flex_block_mask,
    flex_mask_mod,
)
from tests.masks import dense_block_mask


def brute_force_mask(anchors, block_size, context_len, document_ids=None, window=None):
    """docs/dflash.md's rule, written as loops over (query, key). With a window W, the query at block
    offset k (position a + k) sees only keys less than W positions before it: context j with
    a + k - j < W, block offsets o with k - o < W (SpecForge's create_dflash_sdpa_mask)."""
    n = len(anchors)
    mask = torch.zeros(n * block_size, context_len + n * block_size, dtype=torch.bool)
    near = lambda query_pos, key_pos: window is None or query_pos - key_pos < window
    for i, a in enumerate(anchors.tolist()):
        if a < 0:
            continue
        for k in range(block_size):
            row = i * block_size + k
            for j in range(context_len):
                same_doc = document_ids is None or (j < len(document_ids) and document_ids[j] == document_ids[a])
                if j < a and same_doc and near(a + k, j):
                    mask[row, j] = True
            for o in range(block_size):
                if near(k, o):
                    mask[row, context_len + i * block_size + o] = True
    return mask


def random_case(seed, block_size, seq_len, num_anchors, num_docs, empty=3):
    gen = torch.Generator().manual_seed(seed)
    docs = torch.sort(torch.randint(0, num_docs, (seq_len,), generator=gen)).values
    docs[-5:] = -1  # padding at the end
    real = torch.nonzero(docs >= 0).flatten()
    k = min(num_anchors - empty, len(real))
    anchors = torch.sort(real[torch.randperm(len(real), generator=gen)[:k]]).values
    return torch.cat([anchors, torch.full((num_anchors - k,), -1)]), docs


def test_hand_checked_mask_with_two_documents_and_an_empty_block():
    docs = torch.tensor([0, 0, 0, 1, 1, 1, -1, -1])
    anchors = torch.tensor([1, 4, -1])
    m = dense_block_mask(anchors, block_size=2, context_len=8, document_ids=docs)
    block0 = [1, 0, 0, 0, 0, 0, 0, 0] + [1, 1, 0, 0, 0, 0]  # context before anchor 1 in doc 0, own block
    block1 = [0, 0, 0, 1, 0, 0, 0, 0] + [0, 0, 1, 1, 0, 0]  # doc 1 starts at 3: only key 3; own block
    empty = [0] * 14
    expected = torch.tensor([block0, block0, block1, block1, empty, empty], dtype=torch.bool)
    assert torch.equal(m, expected)


def test_without_documents_the_whole_prefix_is_visible():
    m = dense_block_mask(torch.tensor([3]), block_size=2, context_len=5)
    assert m[0].tolist() == [True, True, True, False, False, True, True]


def test_hand_checked_sliding_window_mask():
    """W = 3, B = 2: the anchor row (position a) sees a-2, a-1; the next row (a+1) sees only a-1; the
    window stops at the document start; the block stays whole (W >= B)."""
    docs = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1])
    m = dense_block_mask(torch.tensor([4, 6]), block_size=2, context_len=8, document_ids=docs, window=3)
    expected = [
        [0, 0, 1, 1, 0, 0, 0, 0] + [1, 1, 0, 0],  # block 0, k=0: keys 2, 3
        [0, 0, 0, 1, 0, 0, 0, 0] + [1, 1, 0, 0],  # block 0, k=1: key 3 only
        [0, 0, 0, 0, 0, 1, 0, 0] + [0, 0, 1, 1],  # block 1: document 1 starts at 5
        [0, 0, 0, 0, 0, 1, 0, 0] + [0, 0, 1, 1],
    ]
    assert torch.equal(m, torch.tensor(expected, dtype=torch.bool))
    # a window smaller than the block also bounds the block itself on the left (never on the right)
    m1 = dense_block_mask(torch.tensor([4]), block_size=3, context_len=5, window=1)
    assert m1.int().tolist() == [[0] * 5 + [1, 1, 1], [0] * 5 + [0, 1, 1], [0] * 5 + [0, 0, 1]]


def test_bad_windows_are_refused():
    for window in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="sliding window must be None or an int >= 1"):
            dense_block_mask(torch.tensor([3]), 2, 8, window=window)
        with pytest.raises(ValueError, match="sliding window must be None or an int >= 1"):
            flex_block_mask(torch.tensor([3] * 64), torch.zeros(64, dtype=torch.long), 2, 128, window=window)


@pytest.mark.parametrize("window", [None, 1, 3, 7, 20])
@pytest.mark.parametrize("block_size", [4, 10, 16])
def test_dense_mask_equals_brute_force(block_size, window):
    anchors, docs = random_case(1, block_size, seq_len=90, num_anchors=12, num_docs=4)
    assert torch.equal(
        dense_block_mask(anchors, block_size, 96, docs, window), brute_force_mask(anchors, block_size, 96, docs, window)
    )


def test_document_starts_and_contiguity_check():
    docs = torch.tensor([0, 0, 1, 1, 1, 2, -1, -1])
    assert document_starts(docs).tolist() == [0, 0, 2, 2, 2, 5, 6, 6]
    with pytest.raises(ValueError, match="document id 0 appears in more than one run"):
        dense_block_mask(torch.tensor([1]), 2, 8, torch.tensor([0, 0, 1, 1, 0, 0, -1, -1]))
    with pytest.raises(ValueError, match="padding"):
        dense_block_mask(torch.tensor([7]), 2, 8, docs)
    with pytest.raises(ValueError, match=r"anchor_positions must be -1 or in \[0, 8\)"):
        dense_block_mask(torch.tensor([9]), 2, 8, docs)


@pytest.mark.parametrize(
    "block_size,seq_len,num_docs,window",
    [
        (8, 300, 3, None),
        (10, 700, 1, None),
        (16, 1400, 1, None),
        (16, 1400, 4, None),
        (32, 1000, 2, None),
        (256, 300, 2, None),
        # windows: wider than a tile, narrower than a tile, narrower than the block, anchors across q tiles
        (16, 1400, 1, 300),
        (16, 1400, 4, 100),
        (10, 700, 1, 129),
        (8, 300, 3, 5),
        (32, 1000, 2, 20),
        (256, 300, 2, 150),
    ],
)
def test_direct_block_mask_equals_create_block_mask(block_size, seq_len, num_docs, window):
    step = 128 // math.gcd(block_size, 128)
    num_anchors = -(-min(40, 3072 // block_size) // step) * step  # B 256: 12 anchors, 24 q tiles (the loops are slow)
    context_len = -(-seq_len // 128) * 128
    anchors, docs = random_case(block_size + seq_len, block_size, seq_len, num_anchors, num_docs)
    starts = anchor_context_starts(anchors, docs)
    mask_mod = flex_mask_mod(anchors, starts, block_size, context_len, window)
    q_len, kv_len = num_anchors * block_size, context_len + num_anchors * block_size

    # the flex mask_mod, evaluated element by element, is the dense mask
    q_idx, kv_idx = torch.arange(q_len)[:, None], torch.arange(kv_len)[None, :]
    dense = dense_block_mask(anchors, block_size, context_len, docs, window)
    assert torch.equal(mask_mod(0, 0, q_idx, kv_idx), dense)
    if window is not None and context_len <= 768:  # the Python loops are slow at larger shapes
        assert torch.equal(dense, brute_force_mask(anchors, block_size, context_len, docs, window))

    direct = flex_block_mask(anchors, starts, block_size, context_len, window=window)
    reference = create_block_mask(mask_mod, None, None, q_len, kv_len, device="cpu")
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(direct, name), getattr(reference, name)), name
    for name, count in (("kv_indices", "kv_num_blocks"), ("full_kv_indices", "full_kv_num_blocks")):
        for row, n in enumerate(getattr(direct, count)[0, 0].tolist()):
            assert torch.equal(getattr(direct, name)[0, 0, row, :n], getattr(reference, name)[0, 0, row, :n])
    assert torch.equal(direct.to_dense(), reference.to_dense())
    assert direct.seq_lengths == (q_len, kv_len)

    # every tile the BlockMask skips is all-False in the dense mask, every full tile all-True
    touched, full = block_tiles(anchors, starts, block_size, context_len, window=window)
    tiles = dense.view(q_len // 128, 128, kv_len // 128, 128)
    assert torch.equal(tiles.any(3).any(1), touched)
    assert torch.equal(tiles.all(3).all(1), full)


def test_direct_block_mask_has_full_tiles_for_long_contexts():
    # long single document, late anchors: some context tiles are fully visible to a whole q tile
    anchors, docs = random_case(5, 16, 1400, 48, 1, empty=0)
    starts = anchor_context_starts(anchors, docs)
    _, full = block_tiles(anchors, starts, 16, 1408)
    assert full.any()


def test_block_mask_requires_padded_shapes():
    with pytest.raises(ValueError, match="multiples of 128"):
        flex_block_mask(torch.tensor([1, 2, 3]), torch.zeros(3, dtype=torch.long), 16, 256)


def test_dense_backend_empty_rows_give_zero_not_nan():
    torch.manual_seed(0)
    anchors = torch.tensor([5, -1])
    mask = dense_block_mask(anchors, 4, 8)
    q = torch.randn(1, 4, 8, 8, requires_grad=True)
    k = torch.randn(1, 2, 16, 8, requires_grad=True)
    v = torch.randn(1, 2, 16, 8, requires_grad=True)
    out = DenseAttention()(q, k, v, mask)
    assert torch.isfinite(out).all()
    assert torch.equal(out[:, :, 4:], torch.zeros_like(out[:, :, 4:]))
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    assert torch.equal(q.grad[:, :, 4:], torch.zeros_like(q.grad[:, :, 4:]))
    # GQA: query heads 0,1 share kv head 0 -> same as repeating kv heads by hand
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, :4], k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask[:4]
    )
    assert torch.allclose(out[:, :, :4], ref, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [None, (["sliding_attention", "full_attention"], 20)])
@pytest.mark.parametrize("compile_layers", [False, True])
def test_compiled_flex_forward_equals_dense_forward_on_cpu(compile_layers, layout):
    """Compiled flex_attention (inference works on CPU) against dense SDPA, with GQA and empty blocks;
    called eagerly (its own compiled wrapper) or from inside compiled layers (captured by dynamo);
    all-full, and a sliding layer (window 20 < the context) before a full one. Flex has no backward
    on CPU: its gradients are checked on the GPU (bench/flex_check.py)."""
    from services.drafter.modeling.anchors import build_inputs
    from services.drafter.modeling.model import DFlashDrafter, DrafterModelConfig
    from services.drafter.training.synthetic import SyntheticSource
    from services.process.compile_setup import RecompileWatch

    torch.manual_seed(0)
    cfg = DrafterModelConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=64,
        num_target_layers=6,
        num_hidden_layers=2,
        target_layer_ids=[1, 3],
        block_size=16,
        mask_token_id=63,
        **({} if layout is None else {"layer_types": layout[0], "sliding_window": layout[1]}),
    )
    source = SyntheticSource(cfg, 200)
    dense_model = DFlashDrafter(cfg, attention=DenseAttention())
    flex_model = DFlashDrafter(cfg, attention=FlexAttention())
    flex_model.load_state_dict(dense_model.state_dict())
    if compile_layers:
        for layer in flex_model.layers:
            layer.compile(dynamic=False)
    table = torch.randn(64, 32)
    watch = None
    for g in (3, 4):
        batch = source.batch(g)
        # 4 valid anchors, 4 empty blocks; two blocks run past the end of their document
        doc = batch.document_ids
        ends = torch.nonzero((doc[:-1] >= 0) & (doc[1:] != doc[:-1])).flatten()
        fits = torch.nonzero((doc[:-15] >= 0) & (doc[15:] == doc[:-15])).flatten()  # whole block inside
        inside = [a for a in fits[::23].tolist() if all(abs(a - e + 3) > 2 for e in ends[:2].tolist())]
        chosen = torch.cat([ends[:2] - 3, torch.tensor(inside[:2])])
        batch.loss_mask[:] = False
        batch.loss_mask[chosen] = batch.loss_mask[chosen + 1] = True
        inputs = build_inputs(batch, num_anchors=8, block_size=16, mask_token_id=63, gamma=7.0)
        assert torch.equal(inputs.anchors[:4], torch.sort(chosen).values) and (inputs.anchors == -1).sum() == 4
        embeds = table[inputs.block_ids.flatten()]
        outs = []
        for model in (dense_model, flex_model):
            masks = model.build_masks(inputs.anchors, inputs.context_starts, inputs.context_len)
            with torch.no_grad():
                outs.append(
                    model(
                        inputs.hidden.float(), embeds, inputs.context_positions, inputs.block_positions.flatten(), masks
                    )
                )
        assert torch.isfinite(outs[1]).all()
        torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=1e-4)
        if watch is None:
            watch = RecompileWatch()  # a second batch must reuse the graphs
    assert watch.count == 0


def test_a_block_past_its_documents_end_sees_nothing_of_the_next_document():
    """Anchor 3 tokens before the end of document 0 with B = 8, document 1 supervised from its start:
    the block trains a+1..a+3 only, and its output does not change when everything of document 1
    (features and tokens) changes."""
    from services.drafter.modeling.anchors import build_inputs
    from services.drafter.modeling.model import DFlashDrafter, DrafterModelConfig
    from services.drafter.training.synthetic import SyntheticSource

    torch.manual_seed(0)
    cfg = DrafterModelConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=64,
        num_target_layers=6,
        num_hidden_layers=2,
        target_layer_ids=[1, 3],
        block_size=8,
        mask_token_id=63,
    )
    model = DFlashDrafter(cfg, attention=DenseAttention())
    table = torch.randn(64, 32)
    batch = SyntheticSource(cfg, 200).batch(1)
    doc = batch.document_ids
    end = int(torch.nonzero(doc == 0).max())  # last token of document 0
    assert doc[end + 8] == 1
    batch.loss_mask[:] = False
    batch.loss_mask[end - 3 : end + 9] = True  # anchors end-3..end-1 and end+1..end+7

    def block_output(b):
        inputs = build_inputs(b, num_anchors=16, block_size=8, mask_token_id=63, gamma=4.0)
        i = inputs.anchors.tolist().index(end - 3)
        mask = model.attention.build_mask(inputs.anchors, inputs.context_starts, 8, inputs.context_len)
        with torch.no_grad():
            out = model(
                inputs.hidden.float(),
                table[inputs.block_ids.flatten()],
                inputs.context_positions,
                inputs.block_positions.flatten(),
                mask,
            )
        return out[i * 8 : (i + 1) * 8], inputs.weights[i]

    before, weights = block_output(batch)
    assert (weights[:3] > 0).all() and (weights[3:] == 0).all()  # a+4.. is document 1: no loss
    later = doc > 0
    batch.hidden[later] = torch.randn(int(later.sum()), batch.hidden.shape[1]).to(batch.hidden.dtype)
    batch.input_ids[later] = (batch.input_ids[later] + 7) % 63
    after, _ = block_output(batch)
    assert torch.equal(before, after)
