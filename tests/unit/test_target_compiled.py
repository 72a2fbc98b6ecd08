"""services/target/model/compiled.py: the target's decoder layers compiled for captures.

On tiny random targets (dense Qwen3 and the Qwen3.5 hybrid; fp32): captures through the compiled
layers equal the eager ones on rows of different document counts, and after the first row no graph
is compiled again (the row's boundaries reach the layers through the row slot, never as arguments).
CPU runs dynamo with the aot_eager backend (what decides recompiles is dynamo's guards; inductor's
C++ compile would only add minutes here); CUDA runs inductor, the workers' backend."""

import random

import pytest
import torch

from services.process.compile_setup import graphs_compiled
from services.target.model.compiled import compile_and_warm_up, warmup_row, why_not
from services.target.verify.decode import DecodeSession
from services.target.verify.row_sessions import RowSession
from services.target.verify.verifying import warm_up_verify
from tests.tiny_targets import HYBRID_DEVICES, VOCAB, cuda_with_kernels, dense_target, hybrid_target, prompt

S = 96


def backend(device: str) -> str:
    return "inductor" if device == "cuda" else "aot_eager"


def random_row(rng: random.Random) -> dict[str, torch.Tensor]:
    lengths, left, longest = [], S, rng.choice([3, 8, 24, S])
    while left:
        n = min(left, rng.randint(1, longest))
        lengths.append(n)
        left -= n
    return {
        "input_ids": torch.randint(0, VOCAB, (S,), generator=torch.Generator().manual_seed(rng.randint(0, 1 << 30))),
        "position_ids": torch.cat([torch.arange(n) for n in lengths]),
        "document_ids": torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]),
    }


def capture(target, row, labels=True):
    return target.capture(
        row["input_ids"], row["position_ids"], row["document_ids"], with_labels=labels, out_dtype=torch.float32
    )


@pytest.mark.parametrize("device", HYBRID_DEVICES)
@pytest.mark.parametrize("make", [dense_target, hybrid_target], ids=["dense", "hybrid"])
def test_compiled_capture_equals_eager_and_later_rows_compile_nothing_new(make, device):
    eager, compiled = make(device=device), make(device=device)
    assert compile_and_warm_up(compiled, "on", S, with_labels=True, backend=backend(device)) > 0
    assert compiled.compiled == backend(device)
    baseline = graphs_compiled()
    assert baseline > 0  # the warmup did compile
    rng = random.Random(0)
    counts = set()
    # fla's kernels on CUDA compute in TF32 inside: the fused layers' fp32 reassociation comes out of
    # them at 1e-3 (test_decode's tolerance there), and a label may flip on a near-tie
    fla = make is hybrid_target and device == "cuda"
    tol = (
        dict(rtol=2e-3, atol=2e-4)
        if fla
        else dict(rtol=1e-4, atol=1e-4)
        if device == "cuda"
        else dict(rtol=1e-5, atol=1e-5)
    )
    # 50 rows; the hybrid on CPU runs its plain-torch reference recurrence, piece by piece: 12 rows there
    rows = 12 if make is hybrid_target and device == "cpu" else 50
    for i in range(rows):
        row = random_row(rng)
        counts.add(int(row["document_ids"].max()) + 1)
        got, got_labels = capture(compiled, row, labels=i % 2 == 0)
        if i % 5 == 0:  # every 5th row against the eager layers
            want, want_labels = capture(eager, row)
            torch.testing.assert_close(got, want, **tol)
            if got_labels is not None:
                same = (got_labels == want_labels).float().mean()
                assert same >= 0.99 if fla else same == 1, (i, float(same))
    assert len(counts) > rows // 5  # rows really differed in document count
    assert graphs_compiled() == baseline  # 0 recompiles


@pytest.mark.skipif(not cuda_with_kernels(), reason="needs CUDA and flash-linear-attention")
@pytest.mark.parametrize("make", [dense_target, hybrid_target], ids=["dense", "hybrid"])
def test_cuda_bf16_compiled_packed_row_equals_documents_one_by_one(make):
    """The workers' path on the GPU: bf16, inductor, the varlen kernels. Each document of a packed
    row through the compiled layers equals that document run alone through the eager ones, within
    bf16 rounding, for documents shorter than the conv kernel too."""
    compiled, alone = make(device="cuda", dtype=torch.bfloat16), make(device="cuda", dtype=torch.bfloat16)
    assert compiled.varlen and compile_and_warm_up(compiled, "on", S, with_labels=True) > 0
    lengths = [30, 2, 17, 1, 40, 6]
    ids = torch.randint(0, VOCAB, (S,), generator=torch.Generator().manual_seed(11))
    pos = torch.cat([torch.arange(n) for n in lengths])
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    baseline = graphs_compiled()
    packed, labels = compiled.capture(ids, pos, doc, with_labels=True, out_dtype=torch.float32)
    assert graphs_compiled() == baseline
    start = 0
    for n in lengths:
        want, want_labels = alone.capture(
            ids[start : start + n],
            torch.arange(n),
            torch.zeros(n, dtype=torch.long),
            with_labels=True,
            out_dtype=torch.float32,
        )
        torch.testing.assert_close(packed[start : start + n], want, rtol=3e-2, atol=3e-2)
        # argmax of bf16 logits: a near-tie may flip, so most labels, not all
        assert (labels[start : start + n] == want_labels).float().mean() >= 0.8, n
        start += n


@pytest.mark.parametrize("device", HYBRID_DEVICES)
def test_decoding_on_a_compiled_target_runs_the_eager_layers(device):
    compiled, eager = hybrid_target(device=device), hybrid_target(device=device)
    compile_and_warm_up(compiled, "on", S, with_labels=False, backend=backend(device))
    baseline = graphs_compiled()
    steps = []
    for target in (compiled, eager):
        session = DecodeSession(target)
        first = session.prefill(prompt(3))
        block = session.verify(prompt(4, 5))
        session.commit(2)
        steps.append((first.greedy, block.greedy, session.verify(prompt(5, 3)).greedy))
    assert all(torch.equal(a, b) for a, b in zip(*steps))
    assert graphs_compiled() == baseline  # decoding shapes never reached the compiler


@pytest.mark.parametrize("device", HYBRID_DEVICES)
def test_the_verify_warmup_leaves_captures_and_graphs_as_they_were(device):
    """The target worker runs made-up verify sessions before `ready` (the first real eval must not
    pay the kernels' first calls); the capture path is untouched by them."""
    target = hybrid_target(device=device)
    compile_and_warm_up(target, "on", S, with_labels=True, backend=backend(device))
    row = random_row(random.Random(3))
    before, before_labels = capture(target, row)
    baseline = graphs_compiled()
    assert warm_up_verify(target, 4).startswith("warmed up the verify path in ")
    assert target.slot.decode is None and graphs_compiled() == baseline
    after, after_labels = capture(target, row)
    assert torch.equal(before, after) and torch.equal(before_labels, after_labels)
    assert graphs_compiled() == baseline  # the capture after it reuses the warmup's graphs
    target.model.config.layer_types[2] = "mamba"
    assert warm_up_verify(target, 4).startswith("verify path not warmed up: decoding: layer 2 is of type 'mamba'")


@pytest.mark.skipif(not cuda_with_kernels(), reason="needs CUDA and flash-linear-attention")
def test_after_the_verify_warmup_an_evaluation_compiles_no_triton_kernel():
    """What a real evaluation asks after the warmup (prompts of lengths the warmup never saw, the
    plain greedy reference's 1-token blocks, drafted blocks accepted in part; one prompt a session
    and many as rows) compiles no Triton kernel, so its first verify pays no first call (one of a
    prompt past RECURRENT_TOKENS took over 30 s on an H200 when the warmup had only short prompts)."""
    from triton import knobs

    target = hybrid_target(device="cuda")
    assert warm_up_verify(target, 4).startswith("warmed up the verify path in ")
    compiled = []

    def before_compile(*, fn, **_):  # Triton calls it before compiling a kernel it has not in memory
        compiled.append(fn.name)
        return False  # go on and compile

    knobs.runtime.jit_cache_hook = before_compile
    try:
        rng = random.Random(1)
        for n in (5, 23, 90, 128, 201, 333):
            session = DecodeSession(target)
            session.prefill(prompt(n, n))
            for _ in range(3):
                session.verify(prompt(n + 1, 1))
                session.commit(1)
                session.verify(prompt(n + 2, 4))
                session.commit(rng.randint(1, 4))
        # and the rows of an evaluation's prompts verified together (row_sessions.py)
        rows = RowSession(target, [prompt(n, n) for n in (7, 45, 150, 260, 301)], room=24)
        for block in (1, 4, 4, 4):
            rows.step(rows.rows, [prompt(block + r, block) for r in rows.rows])
        rows.step(rows.rows[1:4], [prompt(9 + r, 4) for r in rows.rows[1:4]])  # rows that left
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_cache_hook = None
    assert compiled == []


def test_when_the_target_is_not_compiled():
    cpu = dense_target()
    assert why_not(cpu, "off") == "target.compile=off"
    assert "CUDA only" in why_not(cpu, "auto")
    assert why_not(cpu, "on") == ""
    assert compile_and_warm_up(cpu, "auto", S, with_labels=False) == 0.0 and not cpu.compiled
    per_document = hybrid_target()
    per_document.per_document = True
    with pytest.raises(ValueError, match="per-document"):
        compile_and_warm_up(per_document, "on", S, with_labels=False)
    row = warmup_row(S, VOCAB)
    assert row["input_ids"].shape == (S,) and int(row["document_ids"].max()) == 7
    assert row["position_ids"].tolist()[: S // 8 + 1] == list(range(S // 8)) + [0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
def test_compiled_bf16_capture_is_as_close_to_fp32_as_the_eager_one(device):
    """In bfloat16 the compiled layers round differently from the eager ones (fused kernels keep
    fp32 intermediates): judged against the same weights in float32, their error must be no larger
    than the eager layers' own (inductor on both devices; a 12-layer random Qwen3)."""
    import copy

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from services.target.model.attention import PACKED_SDPA, register_packed_sdpa
    from services.target.model.model import Target

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=12,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    register_packed_sdpa()
    cfg._attn_implementation = PACKED_SDPA
    fp32 = Qwen3ForCausalLM(cfg).eval().requires_grad_(False).to(device)
    layer_ids = [1, 4, 7, 11]
    reference, eager, compiled = (
        Target(m, layer_ids)
        for m in (fp32, copy.deepcopy(fp32).to(torch.bfloat16), copy.deepcopy(fp32).to(torch.bfloat16))
    )
    compile_and_warm_up(compiled, "on", 256, with_labels=False)
    row = warmup_row(256, 512)
    want, base, got = (capture(t, row, labels=False)[0] for t in (reference, eager, compiled))
    h = cfg.hidden_size
    for k in range(len(layer_ids)):
        cols = slice(k * h, (k + 1) * h)
        ref = want[:, cols]
        eager_err = float((base[:, cols] - ref).norm() / ref.norm())
        compiled_err = float((got[:, cols] - ref).norm() / ref.norm())
        assert 0 < eager_err < 0.05 and compiled_err <= 1.25 * eager_err, (layer_ids[k], eager_err, compiled_err)
