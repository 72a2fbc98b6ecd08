"""Many prompts decoded at once on one KV cache, a row per prompt (services/target/verify/slots.py), must make
exactly the decisions of the cached one-prompt loop (speculative.py) on tiny real HF targets (fp32
on CPU: no rounding ties): the same tokens, the same accepted lengths per step, the same target
forwards; plain greedy too; rows that stop early leave the batch and the others go on. Dense Qwen3
and a Gemma-3-style target with sliding-window layers (a window shorter than the prompts)."""

import pytest
import torch
import torch.nn.functional as F

from services.drafter.acceptance.speculative import RepeatLast, greedy_reference, speculative_generate
from services.drafter.modeling.attention import padded_mask, visibility
from services.eval.verifier import LocalVerifier
from services.target.model.attention import PACKED_SDPA, register_packed_sdpa
from services.target.model.model import Target
from services.target.verify import slot_cache
from services.target.verify.slot_cache import SlotMasks, gemm_attention, row_bytes
from services.target.verify.slots import Slots, decode_slots, slot_decodable
from tests.tiny_targets import DENSE_LAYER_IDS, HYBRID_LAYER_IDS, VOCAB, dense_target, hybrid_target, prompt
from tests.unit.test_speculative import random_drafter

B = 4
NEW = 14


def sliding_target(seed: int = 0, device: str = "cpu") -> Target:
    """A tiny Gemma-3-shaped target: sliding-window layers (window 6) around one full-attention layer."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=6,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    model = Gemma3ForCausalLM(cfg).to(device)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # a spread of logits, so greedy output varies
    register_packed_sdpa()
    model.config._attn_implementation = PACKED_SDPA
    return Target(model.eval().requires_grad_(False), DENSE_LAYER_IDS)


@pytest.fixture(scope="module")
def sliding():
    return sliding_target()


def prompts():
    # 13, 5, 17 and 9 tokens: the prefill takes rows by length, so not in row order
    return [prompt(60 + i, n=n) for i, n in enumerate((13, 5, 17, 9))]


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("kind", ["dense", "sliding"])
def test_slot_decoding_makes_the_cached_loops_decisions(kind, device, dense, sliding, no_tf32):
    if device == "cuda":  # fp32 on CUDA: the same kernels as bf16 serving (strided cache reads), no ties
        target = dense_target(device="cuda") if kind == "dense" else sliding_target(device="cuda")
    else:
        target = dense if kind == "dense" else sliding
    assert slot_decodable(target)
    cached = LocalVerifier(target)
    ps = prompts()
    refs = [greedy_reference(cached, p, NEW) for p in ps]
    assert len({tuple(r.tokens) for r in refs}) > 1  # varied outputs: a real comparison
    slot_refs = decode_slots(target, None, ps, max_new_tokens=NEW)
    assert [r.tokens for r in slot_refs] == [r.tokens for r in refs]
    assert all(r.target_forwards == len(r.tokens) and r.steps == [1] * (len(r.tokens) - 1) for r in slot_refs)
    for propose in (random_drafter(target, DENSE_LAYER_IDS, B), RepeatLast(B)):
        one = [speculative_generate(cached, propose, p, max_new_tokens=NEW) for p in ps]
        many = decode_slots(target, propose, ps, max_new_tokens=NEW)
        assert [m.tokens for m in many] == [r.tokens for r in refs]  # lossless
        assert [m.steps for m in many] == [o.steps for o in one]
        assert [m.target_forwards for m in many] == [o.target_forwards for o in one]
        for m, o in zip(many, one):
            assert m.margins == pytest.approx(o.margins, rel=1e-4, abs=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("kind", ["dense", "sliding", "hybrid"])
def test_cuda_graphed_steps_make_the_eager_steps_decisions(kind, no_tf32, capfd):
    """The graphed steps (a graph per shape, replayed; rows leave in place) against the same steps
    run eagerly, fp32: the same tokens, steps and margins; and the graphs were really used."""
    make = {"dense": dense_target, "sliding": sliding_target, "hybrid": hybrid_target}[kind]
    target = make(device="cuda")
    ids = HYBRID_LAYER_IDS if kind == "hybrid" else DENSE_LAYER_IDS
    ps = prompts()
    refs = decode_slots(target, None, ps, max_new_tokens=NEW, graphs=False)
    stop = refs[1].tokens[3]  # prompt 1 ends early: rows leave, the graphs of fewer rows follow
    proposers = [None, random_drafter(target, ids, B), RepeatLast(B)]
    if kind == "hybrid":  # rows keeping 1, 3 or 4 tokens of a block in one step: the commit graphs' work
        proposers.append(DeviceRowOracle([p + r.tokens for p, r in zip(ps, refs)], [0, 2, 3, 4], B, "cuda"))
    for propose in proposers:
        eager = decode_slots(target, propose, ps, max_new_tokens=NEW, stop_ids=[stop], graphs=False)
        graphed = decode_slots(target, propose, ps, max_new_tokens=NEW, stop_ids=[stop])
        assert [g.tokens for g in graphed] == [e.tokens for e in eager]
        assert [g.steps for g in graphed] == [e.steps for e in eager]
        for g, e in zip(graphed, eager):
            assert g.margins == pytest.approx(e.margins, rel=1e-5, abs=1e-5)
    assert "CUDA graphs off" not in capfd.readouterr().err


COMPILED = [
    pytest.param("cpu", "hybrid", id="cpu-hybrid"),  # full attention and Gated DeltaNet layers (aot_eager)
    *(
        pytest.param(
            "cuda",
            kind,
            id=f"cuda-{kind}",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        )
        for kind in ("dense", "sliding", "hybrid")
    ),
]


@pytest.mark.parametrize("device,kind", COMPILED)
def test_compiled_steps_make_the_eager_steps_decisions(device, kind, no_tf32, capfd):
    """Target.compile_steps (compiled.py: every layer compiled for the decoding steps, dynamic shapes)
    against the eager layers, fp32: the same tokens, steps and margins, plain and with drafts, rows
    leaving early; on CUDA inside the CUDA graphs, with inductor; and the compiled layers really ran."""
    import torch._dynamo

    make = {"dense": dense_target, "sliding": sliding_target, "hybrid": hybrid_target}[kind]
    target = make(device=device)
    ids = HYBRID_LAYER_IDS if kind == "hybrid" else DENSE_LAYER_IDS
    ps = prompts()
    refs = decode_slots(target, None, ps, max_new_tokens=NEW, graphs=False)
    stop = refs[1].tokens[3]  # prompt 1 ends early: fewer rows, a new shape for the compiled layers
    proposers = [None, random_drafter(target, ids, B)] if device == "cuda" else []  # CPU: the oracle alone (CI time)
    if kind == "hybrid":  # rows keeping 1, 3 or 4 tokens of a block in one step
        proposers.append(DeviceRowOracle([p + r.tokens for p, r in zip(ps, refs)], [0, 2, 3, 4], B, device))
    eager = [decode_slots(target, p, ps, max_new_tokens=NEW, stop_ids=[stop], graphs=False) for p in proposers]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    target.compile_steps("inductor" if device == "cuda" else "aot_eager")
    for propose, want in zip(proposers, eager):
        got = decode_slots(target, propose, ps, max_new_tokens=NEW, stop_ids=[stop])
        assert [g.tokens for g in got] == [w.tokens for w in want]
        assert [g.steps for g in got] == [w.steps for w in want]
        for g, w in zip(got, want):
            assert g.margins == pytest.approx(w.margins, rel=1e-4, abs=1e-4)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # compiled layers ran
    assert "CUDA graphs off" not in capfd.readouterr().err


def test_rows_that_stop_early_leave_and_the_others_go_on(dense):
    cached = LocalVerifier(dense)
    ps = prompts()
    refs = [greedy_reference(cached, p, 16) for p in ps]
    stop = refs[1].tokens[3]  # prompt 1 ends at its 4th token (or earlier)
    want = [greedy_reference(cached, p, 16, [stop]) for p in ps]
    steps = []
    got = decode_slots(dense, RepeatLast(B), ps, max_new_tokens=16, stop_ids=[stop], on_step=steps.append)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert len(got[1].tokens) <= 4 and max(len(g.tokens) for g in got) == 16
    assert sum(steps) == sum(len(g.tokens) for g in got)  # on_step counts every new token once
    # plain decoding reads the device back every few steps only: the rows that ended meanwhile keep
    # nothing past their stop token, and the count of new tokens is still exact
    steps = []
    plain = decode_slots(dense, None, ps, max_new_tokens=16, stop_ids=[stop], on_step=steps.append)
    assert [g.tokens for g in plain] == [w.tokens for w in want]
    assert [g.steps for g in plain] == [w.steps for w in want]
    for g, w in zip(plain, want):
        assert g.margins == pytest.approx(w.margins, rel=1e-4, abs=1e-4)
    assert sum(steps) == sum(len(g.tokens) for g in plain)


@pytest.mark.parametrize("kind", ["dense", "sliding", "hybrid"])
def test_fewer_rows_than_prompts_make_the_same_decisions(kind, dense, sliding, hybrid):
    """Continuous batching (decode_slots' rows): 6 prompts on 2 rows, each finished row taking the
    next prompt (a hybrid's row its Gated DeltaNet state anew), against one row per prompt: the same
    tokens, steps, forwards and margins, plain and with drafts (kept in part, a share per row, on
    the hybrid); every token counted."""
    target = {"dense": dense, "sliding": sliding, "hybrid": hybrid}[kind]
    ps = prompts() + [prompt(70, n=11), prompt(71, n=6)]
    refs = [greedy_reference(LocalVerifier(target), p, NEW) for p in ps]
    stop = refs[1].tokens[2]  # some prompts end early, at different steps: rows free at different times
    block = 6
    if kind == "hybrid":  # rows keeping different shares of their blocks
        firsts = [len(p) - 1 for p in ps]
        drafts = RowOracle([p + r.tokens for p, r in zip(ps, refs)], [0, 2, 3, 4, 1, 5], block, firsts)
    else:
        drafts = RepeatLast(block)
    for propose in (None, drafts):
        want = decode_slots(target, propose, ps, max_new_tokens=NEW, stop_ids=[stop])
        counted, ended = [], []
        got = decode_slots(
            target,
            propose,
            ps,
            max_new_tokens=NEW,
            stop_ids=[stop],
            rows=2,
            on_step=counted.append,
            on_done=ended.append,
        )
        assert [g.tokens for g in got] == [w.tokens for w in want]
        assert [g.steps for g in got] == [w.steps for w in want]
        assert [g.target_forwards for g in got] == [w.target_forwards for w in want]
        for g, w in zip(got, want):
            assert g.margins == pytest.approx(w.margins, rel=1e-4, abs=1e-4)
        assert sum(counted) == sum(len(g.tokens) for g in got) and sum(ended) == len(ps)
    assert len({len(w.tokens) for w in want}) > 1  # replies of different lengths: rows really refilled


def test_padded_drafts_equal_each_prompt_drafted_alone(dense):
    drafter = random_drafter(dense, DENSE_LAYER_IDS, B)
    g = torch.Generator().manual_seed(2)
    lengths = [3, 11, 7]
    width = len(DENSE_LAYER_IDS) * 64
    features = torch.randn(len(lengths), 16, width, generator=g)
    lasts = [5, 17, 42]
    alone = [drafter(features[i, :n], t, n).tolist() for i, (n, t) in enumerate(zip(lengths, lasts))]
    assert drafter.padded(features, torch.tensor(lengths), torch.tensor(lasts), max(lengths)).tolist() == alone
    assert RepeatLast(B).padded(features, torch.tensor(lengths), torch.tensor(lasts), max(lengths)).tolist() == [
        [t] * (B - 1) for t in lasts
    ]


@pytest.mark.parametrize("window", [None, 2, 5])
def test_the_padded_mask_is_the_training_mask_row_by_row(window):
    anchors = torch.tensor([3, 9, 0])
    context_len = 10
    mask = padded_mask(anchors, B, context_len, window).expand(-1, -1, B, -1)  # full attention: one row, broadcast
    assert mask.shape == (3, 1, B, context_len + B)
    q = torch.arange(B)[:, None]
    kv = torch.arange(context_len + B)[None, :]
    for b, a in enumerate(anchors):
        want = visibility(a[None], torch.tensor([0]), B, context_len, window)(q, kv)
        assert torch.equal(mask[b, 0], want), (b, window)


class RowOracle:
    """Drafts each prompt's known greedy continuation, right for the first correct[i] drafts of prompt
    i's blocks and wrong after: the rows of one step keep different numbers of their block's tokens.
    A row is known by its next position and last token (the test checks no two prompts share one)."""

    def __init__(self, sequences: list[list[int]], correct: list[int], block_size: int, firsts=None):
        """firsts[i]: the first position of sequence i a block may start at (its prompt's last); 0 by default."""
        self.block_size, self.sequences, self.correct = block_size, sequences, correct
        firsts = firsts or [0] * len(sequences)
        keys = [(pos, seq[pos], i) for i, seq in enumerate(sequences) for pos in range(firsts[i], len(seq))]
        self.row_of = {(pos, t): i for pos, t, i in keys}
        assert len(self.row_of) == len(keys), "two prompts share a (position, token)"

    def drafts(self, i: int, start: int) -> list[int]:
        seq = self.sequences[i] + [0] * self.block_size
        return [
            t if j < self.correct[i] else (t + 1) % VOCAB
            for j, t in enumerate(seq[start + 1 : start + self.block_size])
        ]

    def __call__(self, features, last_token, start):  # the one-prompt loop's drafter
        return torch.tensor(self.drafts(self.row_of[start, last_token], start))

    def padded(self, features, starts, last_tokens, context_len):  # slots.py's
        rows = [self.row_of[s, t] for s, t in zip(starts.tolist(), last_tokens.tolist())]
        return torch.tensor([self.drafts(i, s) for i, s in zip(rows, starts.tolist())], device=features.device)


class DeviceRowOracle(RowOracle):
    """RowOracle's drafts made from device tensors alone (no host read: a CUDA graph captures it).
    A row is found by table[next position, last token]."""

    def __init__(self, sequences: list[list[int]], correct: list[int], block_size: int, device, firsts=None):
        super().__init__(sequences, correct, block_size, firsts)
        width = max(map(len, sequences)) + block_size
        self.table = torch.zeros(width, VOCAB, dtype=torch.long)
        self.known = torch.zeros(len(sequences), width, dtype=torch.long)  # 0 past each sequence's end
        for (pos, t), i in self.row_of.items():
            self.table[pos, t] = i
        for i, seq in enumerate(sequences):
            self.known[i, : len(seq)] = torch.tensor(seq)
        self.table, self.known = self.table.to(device), self.known.to(device)
        self.right = torch.tensor(correct, device=device)

    def padded(self, features, starts, last_tokens, context_len):
        i = self.table[starts, last_tokens]  # [b] the prompt of each row
        j = torch.arange(self.block_size - 1, device=starts.device)
        t = self.known[i[:, None], starts[:, None] + 1 + j]
        return torch.where(j < self.right[i][:, None], t, (t + 1) % VOCAB)


def test_a_device_oracle_drafts_as_the_host_one(hybrid):
    ps = prompts()
    sequences = [p + greedy_reference(LocalVerifier(hybrid), p, NEW).tokens for p in ps]
    host, device = RowOracle(sequences, [0, 2, 3, 4], 6), DeviceRowOracle(sequences, [0, 2, 3, 4], 6, "cpu")
    starts, last = torch.tensor([13, 7, 20, 9]), torch.tensor([sequences[i][s] for i, s in enumerate((13, 7, 20, 9))])
    assert torch.equal(device.padded(None, starts, last, 0), host.padded(torch.zeros(1), starts, last, 0))


def test_a_hybrids_rows_keep_their_gated_deltanet_state_through_any_acceptance(hybrid):
    """A Gated DeltaNet hybrid on KV-cache rows (its recurrent state per row: hybrid_states.RowStates) makes
    the one-prompt loop's decisions: plain greedy; a drafter right for 0, 2, 3 or 4 tokens of a block
    of 6, a different number per row in the same step (0: every draft rejected); and rows that stop
    early and leave the batch."""
    assert slot_decodable(hybrid)
    cached, block = LocalVerifier(hybrid), 6
    ps = prompts()
    refs = [greedy_reference(cached, p, NEW) for p in ps]
    assert len({tuple(r.tokens) for r in refs}) > 1
    assert [r.tokens for r in decode_slots(hybrid, None, ps, max_new_tokens=NEW)] == [r.tokens for r in refs]
    oracle = RowOracle([p + r.tokens for p, r in zip(ps, refs)], [0, 2, 3, 4], block)
    stop = refs[1].tokens[5]
    for propose, stops in ((oracle, ()), (oracle, [stop])):
        one = [speculative_generate(cached, propose, p, max_new_tokens=NEW, stop_ids=stops) for p in ps]
        many = decode_slots(hybrid, propose, ps, max_new_tokens=NEW, stop_ids=stops)
        assert [m.tokens for m in many] == [o.tokens for o in one]
        assert [m.steps for m in many] == [o.steps for o in one]
        for m, o in zip(many, one):
            assert m.margins == pytest.approx(o.margins, rel=1e-4, abs=1e-4)
    assert {s for o in one for s in o.steps} >= {1, 3, 4, 5}  # rows kept different shares of their blocks


def test_a_recurrent_layer_the_service_does_not_run_is_not_slot_decodable(hybrid):
    layer = next(layer for layer in hybrid.layers if hasattr(layer, "linear_attn"))
    swapped, layer.linear_attn = layer.linear_attn, layer.linear_attn.layer  # transformers' own module
    try:
        assert not slot_decodable(hybrid)
        with pytest.raises(ValueError, match="attention and Gated DeltaNet layers only"):
            decode_slots(hybrid, None, prompts(), max_new_tokens=4)
    finally:
        layer.linear_attn = swapped


@pytest.mark.skipif(not torch.cuda.is_available(), reason="varlen flash attention runs on CUDA")
def test_cuda_packed_row_of_a_sliding_window_target_equals_its_documents_alone():
    """Training's capture and the packed evaluation run a sliding-window layer as one varlen
    flash-attention call with a window over the row (not SDPA document by document, which left the
    GPU idle building cuDNN plans): each document's features as if it were alone."""
    target = sliding_target()
    target.model.to("cuda", torch.bfloat16)
    target.device = torch.device("cuda")
    from services.target.model.model import packed_attention

    target.varlen, _ = packed_attention(target.model, target.device)
    assert target.varlen
    docs = [prompt(70 + i, n=n) for i, n in enumerate((9, 23, 4, 17))]  # longer and shorter than the window
    ids = torch.tensor([t for d in docs for t in d])
    positions = torch.cat([torch.arange(len(d)) for d in docs])
    documents = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor([len(d) for d in docs]))
    row, _ = target.capture(ids, positions, documents, out_dtype=torch.float32)
    first = 0
    for d in docs:
        alone, _ = target.capture(torch.tensor(d), torch.arange(len(d)), torch.zeros(len(d), dtype=torch.long))
        torch.testing.assert_close(row[first : first + len(d)], alone.float(), atol=3e-2, rtol=3e-2)
        first += len(d)


@pytest.mark.parametrize("kind", ["dense", "sliding", "hybrid"])
def test_a_rows_memory_is_what_the_automatic_batch_counts(kind, dense, sliding, hybrid):
    """slot_cache.row_bytes, which sizes a batch when the user leaves it to us (rows_that_fit), against the
    tensors a row holds once it decoded a block: keys and values of the attention layers only, the
    drafter's features, a Gated DeltaNet layer's conv window and state (counted twice: its copy while
    a block commits). A hybrid's recurrent layers keep no keys."""
    target = {"dense": dense, "sliding": sliding, "hybrid": hybrid}[kind]
    ps = prompts()
    slots = Slots(target, ps, NEW + B)
    slots.prefill(ps)
    starts = torch.tensor([len(p) for p in ps])
    slots.step(torch.randint(VOCAB, (len(ps), B)), starts, int(starts.max()) + B)
    slots.commit_block(torch.full((len(ps),), 2, device=slots.device))
    held = [*slots.cache.keys.values(), *slots.cache.values.values(), slots.features]
    recurrent = []
    if slots.states is not None:
        held += list(slots.states.conv.values())
        recurrent = list(slots.states.recurrent.values())
    cfg = target.model.config.get_text_config()
    attention = sum(not hasattr(layer, "linear_attn") for layer in target.layers)
    assert len(slots.cache.keys) == attention and len(recurrent) == len(target.layers) - attention
    nbytes = sum(t.numel() * t.element_size() for t in held + 2 * recurrent)
    counted = row_bytes(cfg, 4, slots.capacity, target.info.hidden_width) - 3 * VOCAB * 4  # less the logits
    assert counted * len(ps) == nbytes


def few_query_inputs(device, dtype, rows=1, kv_heads=4, groups=6, q=16, length=300):
    """A decoding step's attention inputs: q tokens of each row at its own positions (rows of different
    lengths), the masks SlotMasks makes for them."""
    gen = torch.Generator().manual_seed(0)
    starts = torch.tensor([length - q - 7 * r for r in range(rows)])
    positions = (starts[:, None] + torch.arange(q)).to(device)
    masks = SlotMasks(positions, length, gemm=device == "cuda")
    make = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    query = make(rows, kv_heads * groups, q, 64)
    key, value = make(rows, kv_heads, length, 64), make(rows, kv_heads, length, 64)
    return masks, query, key, value


@pytest.mark.parametrize("window", [None, 40])
def test_gemm_attention_is_sdpa_with_the_slot_masks(window):
    """The two-GEMM attention of a decoding step against SDPA on the same rows and masks (fp32 on the
    CPU: the math; the bf16 path and its speed are the CUDA test's and docs/benchmarks.md's)."""
    masks, query, key, value = few_query_inputs("cpu", torch.float32, rows=2)
    b, heads, q, d = query.shape
    rows = query.reshape(b, key.shape[1], heads // key.shape[1] * q, d)
    bias = masks.bias(window, heads // key.shape[1], query.dtype)
    want = torch.nn.functional.scaled_dot_product_attention(rows, key, value, attn_mask=bias, scale=0.125)
    got = gemm_attention(rows, key, value, bias, 0.125)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert not slot_cache.gemm_attention_applies(rows)  # CPU decoding keeps SDPA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows,applies", [(1, True), (16, True), (17, False)])
def test_cuda_bf16_decoding_steps_of_few_rows_take_the_gemm_attention(rows, applies):
    """bf16 on CUDA: a step of up to 16 rows of 4 key heads (64) takes the two GEMMs, as close to SDPA as
    bf16 outputs allow, whether it feeds 1 token a row or a 16-token block; more rows keep SDPA."""
    for q in (1, 16):
        masks, query, key, value = few_query_inputs("cuda", torch.bfloat16, rows=rows, q=q)
        b, heads, _, d = query.shape
        packed = query.reshape(b, key.shape[1], heads // key.shape[1] * q, d)
        assert slot_cache.gemm_attention_applies(packed) == applies
        out, _ = masks.attend(None, query, key, value, None, 0.125)
        bias = masks.bias(None, heads // key.shape[1], query.dtype)
        want = torch.nn.functional.scaled_dot_product_attention(
            packed.float(), key.float(), value.float(), attn_mask=bias.float(), scale=0.125
        )
        want = want.reshape(b, heads, q, -1).transpose(1, 2)
        assert (out.float() - want).abs().max() < 2e-2, (rows, q)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_slot_decoding_with_the_gemm_attention_is_lossless(monkeypatch):
    """bf16 decoding of a few rows through the two-GEMM attention (counted): the drafted decoding gives
    the plain greedy decoding's tokens, as with SDPA; and so do the compiled, graphed steps."""
    calls = []
    real = slot_cache.gemm_attention
    monkeypatch.setattr(slot_cache, "gemm_attention", lambda *a: calls.append(1) or real(*a))
    target = dense_target(device="cuda", dtype=torch.bfloat16)
    ps = prompts()
    refs = decode_slots(target, None, ps, max_new_tokens=NEW, graphs=False)
    many = decode_slots(target, RepeatLast(B), ps, max_new_tokens=NEW, graphs=False)
    assert [m.tokens for m in many] == [r.tokens for r in refs]
    assert calls
    target.compile_steps("inductor")  # traced by inductor (the GEMM writing fp32), inside CUDA graphs
    compiled_refs = decode_slots(target, None, ps, max_new_tokens=NEW)  # compiled layers round their own way
    compiled = decode_slots(target, RepeatLast(B), ps, max_new_tokens=NEW)
    assert [m.tokens for m in compiled] == [r.tokens for r in compiled_refs]


class PaddedDeviceRowOracle(DeviceRowOracle):
    """DeviceRowOracle asked about any position a row may sit at, past its sequence too: a row that
    ended waits in the batch until rows leave in bulk, and is still drafted for meanwhile."""

    def __init__(self, sequences, correct, block_size, device, firsts, extra: int):
        super().__init__(sequences, correct, block_size, device, firsts)
        self.table = F.pad(self.table, (0, 0, 0, extra))
        self.known = F.pad(self.known, (0, extra))


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_row_cut_at_its_limit_after_a_full_block_stays_inside_its_slot(dense, device, no_tf32):
    """Regression (a Domino drafter's eval ended in a CUDA device-side assert, `index out of bounds`):
    the longest prompt's row accepts whole blocks and reaches max_new_tokens first, with every draft of
    its last block accepted; the other rows go on, so it waits in the batch (too few rows ended to
    leave). Its position moved by the drafts accepted rather than by the one token it committed, and
    its next block was written past the slot's capacity. Now it moves by what it committed: lossless,
    and the one-prompt loop's decisions."""
    if device == "cuda":
        dense = dense_target(device="cuda")
    block, new = 4, 14
    ps = [prompt(80, n=17), prompt(81, n=6)]
    cached = LocalVerifier(dense)
    refs = [greedy_reference(cached, p, new) for p in ps]
    # the drafter knows the target's continuation past the limit too, as a good one does
    sequences = [p + greedy_reference(cached, p, new + block).tokens for p in ps]
    correct = [block - 1, 1]  # the longest row takes whole blocks, the other 2 tokens a step
    firsts = [len(p) - 1 for p in ps]  # a block starts at a prompt's last token or later
    one = [
        speculative_generate(cached, RowOracle(sequences, correct, block, firsts), p, max_new_tokens=new) for p in ps
    ]
    assert one[0].steps[-1] == 1 and max(one[0].steps) == block  # cut at its limit after full blocks
    assert len(one[1].steps) > len(one[0].steps)  # the other goes on after it ended
    drafts = PaddedDeviceRowOracle(sequences, correct, block, device, firsts, extra=4 * block)
    rows = [0] + [1] * 8  # 9 rows, the second prompt 8 times: one row ended of 9 does not leave
    got = decode_slots(dense, drafts, [ps[i] for i in rows], max_new_tokens=new)
    assert [g.tokens for g in got] == [refs[i].tokens for i in rows]
    assert [g.steps for g in got] == [one[i].steps for i in rows]


def test_drafts_outside_the_vocabulary_stop_the_decoding_with_a_named_error(dense):
    """A draft id the target's embedding has no row for never reaches a kernel: it is counted on the
    device and the decoding stops with an error that says what is wrong (on CUDA it would otherwise
    be a device-side assert)."""

    class OutOfVocabulary(RepeatLast):
        def padded(self, features, starts, last_tokens, context_len):
            return torch.full((len(last_tokens), self.block_size - 1), VOCAB + 3, dtype=torch.long)

    with pytest.raises(ValueError, match=f"outside the target's vocabulary of {VOCAB}"):
        decode_slots(dense, OutOfVocabulary(B), prompts(), max_new_tokens=NEW)
