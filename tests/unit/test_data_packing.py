"""Packing, splitting, the deterministic batch index g, the eval split, and the on-disk cache."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from safetensors.numpy import load_file
from transformers import AutoTokenizer

from services.data.packed_data import RowOrder, digests_path
from services.run.config import load_config
from services.target.batches.data import DataError, Document
from services.target.batches.packing import Packing, cache_key, open_or_build, pack_rows, split_document
from services.tools.demo import conversations
from tests.launching import REPO

VOCAB = 4096


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in conversations(300, seed=2)))
    return path


def _cfg(data_file, *extra):
    return load_config(None, [f"data.path={data_file}", "data.pack_len=128", "run.epochs=3", *extra])


def _quiet(_msg):
    pass


def _documents(row):
    """The real documents of one row as tuples of token ids (split by document id)."""
    doc, ids = row["document_ids"].numpy(), row["input_ids"].numpy()
    return [tuple(ids[doc == d]) for d in range(doc.max() + 1)]


# --- pure helpers ----------------------------------------------------------------------------------


def test_split_document_into_separate_pieces():
    doc = Document(7, np.arange(10, dtype=np.int32), np.arange(10) % 2 == 0)
    pieces = split_document(doc, 4)
    assert [p.input_ids.tolist() for p in pieces] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [p.loss_mask.tolist() for p in pieces][2] == [True, False]
    assert all(p.line == 7 for p in pieces)
    assert len(split_document(doc, 10)) == 1


def test_pack_rows_best_fit():
    lengths = [60, 50, 70, 30, 20, 128, 10, 45]
    rows = pack_rows(lengths, 128)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))  # every document exactly once
    assert all(sum(lengths[i] for i in row) <= 128 for row in rows)
    assert rows == [[0, 1, 6], [2, 3, 4], [5], [7]]  # 30 goes to the fuller row (room 58), not row 0 (room 18 < 30)
    with pytest.raises(ValueError, match="129 tokens > pack_len 128"):
        pack_rows([129], 128)


# --- the packed dataset --------------------------------------------------------------------------


def test_rows_layout_and_every_document_once_per_epoch(tmp_path, data_file, tokenizer):
    cfg = _cfg(data_file)
    data = open_or_build(Packing.from_config(cfg), tmp_path / "run", tokenizer, VOCAB, log=_quiet)
    n = data.num_batches("train")
    assert n > 10 and data.num_batches("eval") == 0
    per_epoch, seen_per_epoch = [], []
    for epoch in range(3):
        seen = Counter()
        for g in range(epoch * n, (epoch + 1) * n):
            row = data.batch(g)
            assert all(row[k].shape == (128,) for k in ("input_ids", "loss_mask", "position_ids", "document_ids"))
            doc, pos, mask = row["document_ids"], row["position_ids"], row["loss_mask"]
            pad = doc < 0
            assert not mask[pad].any() and (row["input_ids"][pad] == tokenizer.pad_token_id).all()
            assert pad.sum() == 0 or pad[-int(pad.sum()) :].all()  # padding only at the tail
            for d in range(int(doc.max()) + 1):  # positions restart per doc
                assert pos[doc == d].tolist() == list(range(int((doc == d).sum())))
            seen.update(_documents(row))
        per_epoch.append([tuple(data.batch(g)["input_ids"][:8].tolist()) for g in range(epoch * n, (epoch + 1) * n)])
        assert sum(seen.values()) == 300  # 300 lines, none longer than pack_len
        seen_per_epoch.append(seen)
    assert seen_per_epoch[0] == seen_per_epoch[1] == seen_per_epoch[2]
    assert per_epoch[0] != per_epoch[1] and sorted(per_epoch[0]) == sorted(per_epoch[1])  # reshuffled rows
    with pytest.raises(IndexError, match=f"g={3 * n} out of range"):
        data.batch(3 * n)
    with pytest.raises(IndexError, match="out of range"):
        data.batch(-1)


def test_batch_g_is_a_pure_function_of_data_config_and_seed(tmp_path, data_file, tokenizer):
    a = open_or_build(Packing.from_config(_cfg(data_file)), tmp_path / "run-a", tokenizer, VOCAB, log=_quiet)
    b = open_or_build(Packing.from_config(_cfg(data_file)), tmp_path / "run-b", tokenizer, VOCAB, log=_quiet)
    other_seed = open_or_build(
        Packing.from_config(_cfg(data_file, "run.seed=1")), tmp_path / "run-a", tokenizer, VOCAB, log=_quiet
    )
    n = a.num_batches()
    for g in [0, 1, n - 1, n, 2 * n + 3]:
        ra, rb = a.batch(g), b.batch(g)
        assert all(np.array_equal(ra[k], rb[k]) for k in ra)
    assert any(not np.array_equal(a.batch(g)["input_ids"], other_seed.batch(g)["input_ids"]) for g in range(3))
    ordered = open_or_build(
        Packing.from_config(_cfg(data_file, "data.shuffle=false")), tmp_path / "run-a", tokenizer, VOCAB, log=_quiet
    )
    assert np.array_equal(ordered.batch(0)["input_ids"], ordered.batch(ordered.num_batches())["input_ids"])


def test_long_documents_are_split_into_pieces(tmp_path, tokenizer):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"input_ids": list(range(1, 301)), "loss_mask": [1] * 300}) + "\n")
    data = open_or_build(
        Packing.from_config(_cfg(path, "data.max_doc_len=100", "data.shuffle=false")),
        tmp_path / "run",
        tokenizer,
        VOCAB,
        log=_quiet,
    )
    rows = [data.batch(g) for g in range(data.num_batches())]
    pieces = sorted(doc for row in rows for doc in _documents(row))
    assert pieces == [tuple(range(1, 101)), tuple(range(101, 201)), tuple(range(201, 301))]
    for row in rows:
        for d in range(int(row["document_ids"].max()) + 1):
            assert row["position_ids"][row["document_ids"] == d][0] == 0


def test_eval_split_from_fraction_and_from_file(tmp_path, data_file, tokenizer):
    data = open_or_build(
        Packing.from_config(_cfg(data_file, "data.eval_fraction=0.1")), tmp_path / "run", tokenizer, VOCAB, log=_quiet
    )
    train = Counter(d for g in range(data.num_batches()) for d in _documents(data.batch(g)))
    evals = Counter(d for g in range(data.num_batches("eval")) for d in _documents(data.batch(g, "eval")))
    assert sum(evals.values()) == 30 and sum(train.values()) == 270
    whole = open_or_build(Packing.from_config(_cfg(data_file)), tmp_path / "run", tokenizer, VOCAB, log=_quiet)
    everything = Counter(d for g in range(whole.num_batches()) for d in _documents(whole.batch(g)))
    assert train + evals == everything  # a partition of the lines
    again = open_or_build(
        Packing.from_config(_cfg(data_file, "data.eval_fraction=0.1")), tmp_path / "other", tokenizer, VOCAB, log=_quiet
    )
    assert evals == Counter(d for g in range(again.num_batches("eval")) for d in _documents(again.batch(g, "eval")))
    with pytest.raises(IndexError, match="split 'eval'"):
        data.batch(data.num_batches("eval"), "eval")
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("".join(json.dumps(c) + "\n" for c in conversations(20, seed=9)))
    held = open_or_build(
        Packing.from_config(_cfg(data_file, f"data.eval_path={eval_file}")),
        tmp_path / "run",
        tokenizer,
        VOCAB,
        log=_quiet,
    )
    assert sum(len(_documents(held.batch(g, "eval"))) for g in range(held.num_batches("eval"))) == 20
    assert sum(len(_documents(held.batch(g))) for g in range(held.num_batches())) == 300


def test_bad_samples_are_counted_in_the_index(tmp_path, data_file, tokenizer):
    with open(data_file, "a") as f:
        f.write("{broken\n")
    with pytest.raises(DataError, match=f"{data_file}:301: invalid JSON"):
        open_or_build(Packing.from_config(_cfg(data_file)), tmp_path / "run", tokenizer, VOCAB, log=_quiet)
    logged = []
    data = open_or_build(
        Packing.from_config(_cfg(data_file, "data.on_bad_sample=skip")),
        tmp_path / "run",
        tokenizer,
        VOCAB,
        log=logged.append,
    )
    assert data.bad_samples == 1 and data.bad_examples[0].startswith(f"{data_file}:301: invalid JSON")
    assert any("skipped 1 bad lines" in m for m in logged)
    again = open_or_build(
        Packing.from_config(_cfg(data_file, "data.on_bad_sample=skip")), tmp_path / "run", tokenizer, VOCAB, log=_quiet
    )
    assert again.bad_samples == 1  # still reported when read from the cache


# --- the cache -------------------------------------------------------------------------------------


def test_cache_is_reused_and_invalidated(tmp_path, data_file, tokenizer, tok_dir):
    run, store = tmp_path / "run", tmp_path / "store"
    logged = []
    first = open_or_build(Packing.from_config(_cfg(data_file)), run, tokenizer, VOCAB, log=logged.append, store=store)
    assert sum("built" in m for m in logged) == 1
    assert first.path.parent == run / "data-cache" and first.path.suffix == ".safetensors"
    assert set(load_file(str(first.path))) >= {"train_tokens", "train_loss_mask", "train_doc_lens", "train_row_docs"}
    open_or_build(Packing.from_config(_cfg(data_file)), run, tokenizer, VOCAB, log=logged.append, store=store)
    assert sum("built" in m for m in logged) == 1  # reused, not rebuilt
    key = cache_key(Packing.from_config(_cfg(data_file)), tokenizer, VOCAB)
    assert cache_key(Packing.from_config(_cfg(data_file, "data.pack_len=256")), tokenizer, VOCAB) != key
    assert cache_key(Packing.from_config(_cfg(data_file, "data.max_doc_len=64")), tokenizer, VOCAB) != key
    assert cache_key(Packing.from_config(_cfg(data_file, "run.seed=5")), tokenizer, VOCAB) != key
    assert (
        cache_key(Packing.from_config(_cfg(data_file, "run.epochs=9")), tokenizer, VOCAB) == key
    )  # not a packing input
    tokenizer.chat_template = tokenizer.chat_template + " "
    assert cache_key(Packing.from_config(_cfg(data_file)), tokenizer, VOCAB) != key
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    assert cache_key(Packing.from_config(_cfg(data_file)), tokenizer, VOCAB) == key
    text = data_file.read_text()
    data_file.write_text(text.replace("count from", "count frum", 1))  # same size, new content
    assert cache_key(Packing.from_config(_cfg(data_file)), tokenizer, VOCAB) != key
    rebuilt = open_or_build(Packing.from_config(_cfg(data_file)), run, tokenizer, VOCAB, log=logged.append, store=store)
    assert sum("built" in m for m in logged) == 2 and rebuilt.path != first.path


def test_runs_of_the_same_data_share_one_build_through_the_store(tmp_path, data_file, tokenizer):
    """Another run folder on the same data and packing keys (a new drafter recipe, say) tokenizes
    nothing: its data-cache holds hard links to the store's read-only files. A store that cannot be
    written is said, and the run builds its own."""
    store, logged = tmp_path / "store", []
    first = open_or_build(
        Packing.from_config(_cfg(data_file)), tmp_path / "a", tokenizer, VOCAB, log=logged.append, store=store
    )
    second = open_or_build(
        Packing.from_config(_cfg(data_file, "drafter.num_anchors=8")),
        tmp_path / "b",
        tokenizer,
        VOCAB,
        log=logged.append,
        store=store,
    )
    assert sum("built" in m for m in logged) == 1 and any("reused from" in m for m in logged)
    for run in (first, second):
        for path in (run.path, digests_path(run.path)):
            stored = store / path.name
            assert path.stat().st_ino == stored.stat().st_ino and stat.S_IMODE(stored.stat().st_mode) == 0o444
    assert second.batch(3)["input_ids"].tolist() == first.batch(3)["input_ids"].tolist()
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the store's folder would be")
    logged.clear()
    own = open_or_build(
        Packing.from_config(_cfg(data_file)), tmp_path / "c", tokenizer, VOCAB, log=logged.append, store=blocked
    )
    assert any(f"the packed-data store {blocked} is not usable" in m for m in logged), logged
    assert own.path.is_file() and own.path.stat().st_ino != first.path.stat().st_ino
    assert own.batch(3)["input_ids"].tolist() == first.batch(3)["input_ids"].tolist()


BUILD_SCRIPT = """
import sys
from pathlib import Path
from transformers import AutoTokenizer
from services.run.config import load_config
from services.target.batches.packing import Packing, open_or_build
cfg = load_config(None, [f"data.path={sys.argv[1]}", "data.pack_len=128"])
tok = AutoTokenizer.from_pretrained(sys.argv[3])
data = open_or_build(Packing.from_config(cfg), sys.argv[2], tok, 4096, log=print, store=Path(sys.argv[4]))
print("ROWS", data.num_batches(), data.path.name)
"""


@pytest.mark.processes
def test_concurrent_targets_share_one_build(tmp_path, data_file, tok_dir):
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                BUILD_SCRIPT,
                str(data_file),
                str(tmp_path / "run"),
                str(tok_dir),
                str(tmp_path / "s"),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    results = {line for out, _ in outs for line in out.splitlines() if line.startswith("ROWS")}
    assert len(results) == 1  # same rows, same file for all three
    assert sum("built" in out for out, _ in outs) == 1  # exactly one of them built it
    leftovers = [p.name for p in (tmp_path / "run" / "data-cache").iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []


def test_published_digests_name_every_batch_as_the_packed_data_does(tmp_path, data_file, tokenizer):
    """<key>.digests.safetensors is written with the cache; a drafter checks batch content against
    the cache where it has it, else against those digests, else says it cannot."""
    from services.data.batch import token_digest
    from services.data.packed_data import PublishedDigests, digests_path
    from services.drafter.training.source import batch_content

    cfg = _cfg(data_file, "data.eval_fraction=0.1")
    data = open_or_build(Packing.from_config(cfg), tmp_path / "run", tokenizer, VOCAB, log=_quiet)
    published = PublishedDigests(digests_path(data.path), RowOrder.from_config(cfg))
    for split, limit in (("train", data.num_batches() * 3), ("eval", data.num_batches("eval"))):
        assert limit > 0
        for g in range(limit):
            assert (
                published.digest(g, split) == data.digest(g, split) == token_digest(data.batch(g, split)["input_ids"])
            )
    assert len({published.digest(g) for g in range(data.num_batches())}) == data.num_batches()
    content, how = batch_content(RowOrder.from_config(cfg), tmp_path / "run", data.key)
    assert how == "packed data" and content.digest(5) == data.digest(5)
    data.path.unlink()  # a drafter host with the digests only
    content, how = batch_content(RowOrder.from_config(cfg), tmp_path / "run", data.key)
    assert how == "published digests" and content.digest(5) == published.digest(5)
    assert batch_content(RowOrder.from_config(cfg), tmp_path / "run", "0" * 32) == (None, "off")


def test_launcher_ups_data_line_reads_the_store_lines_by_their_start():
    """A skipped line quotes data lines, which may hold any words: only the store's own lines count."""
    from services.target.jobs.pack import said_first

    skipped = 'data: skipped 1 bad lines; first: d.jsonl:3: invalid JSON ("built", "not usable")'
    said = [skipped, "data: packed data k.safetensors reused from /s"]
    assert said_first(said, "data: built ", "data: packed data ") == "packed data k.safetensors reused from /s"
    assert said_first(said, "data: the packed-data store ") == ""
