"""Pack documents into rows of pack_len tokens, cache the result, and serve batch g.

Rules:
  - Splitting: a document longer than max_doc_len (data.max_doc_len, 0 = pack_len) is cut into
    pieces of max_doc_len tokens, [0, m), [m, 2m), ...; every piece is a separate document
    (positions restart at 0; it does not see the piece before it). Pieces are kept even if
    they hold no supervised token (they simply get no anchors).
  - Eval split (services/run/runspec.py HeldOut): data.eval_path if set, else a data.eval_fraction of
    the non-blank lines of data.path by line number (at least one when the fraction is > 0),
    chosen by a permutation seeded with run.seed; a held-out line that is bad holds nothing out.
  - Packing: documents, in an order shuffled with run.seed (file order if data.shuffle is off),
    go best-fit into rows: each into the row with the least room that still fits it, else a
    new row. Rows keep their documents' order of arrival.
  - Row layout: document ids 0, 1, 2 ... in the row; positions restart at 0 per document; the
    tail is padding: document id -1, loss_mask False, the pad token, positions 0, 1, 2 ...
  - Batch g of the train split: epoch = g // N, index = g % N, row = perm_epoch[index] where
    perm_epoch is a permutation of the N rows seeded with (run.seed, epoch) (identity if
    data.shuffle is off). Valid g: 0 <= g < N * run.epochs. Eval batch g is row g, 0 <= g < N_eval.
So batch g is a pure function of (dataset, tokenizer, config, seed, g): any target can build it.

Cache: <run_dir>/data-cache/<key>.safetensors, key = hash of the data files' size, mtime and
sha256, the tokenizer, the relevant config and FORMAT_VERSION. It is a hard link to the machine's
store of packed data (store_dir(): every run of the same key shares one build, so a second run on
the same data, or one that changes only the drafter, tokenizes nothing). Several targets may start
at once: one builds under an flock while the others wait, and the file appears by atomic rename,
read-only. The file is memory-mapped and rows are sliced from it, so the tokens are not held in RAM.

Published digests: next to the cache, <key>.digests.safetensors holds the token digest
(services.data.batch.token_digest) of every row of both splits. A drafter checks each batch it is
sent against the packed data where the cache is on its host, else against this file (copy it to
a drafter host's <run_dir>/data-cache/): content that a process which took a target's socket
over sent in its name is dropped (services/drafter/training/source.py).

Both files are read by services/data/packed_data.py (PackedData, PublishedDigests), shared with the drafter.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.data.batch import SPLITS
from services.data.packed_data import FORMAT_VERSION, PackedData, RowOrder, digests_path
from services.run import runspec
from services.run.config import Config, DataConfig
from services.run.files import cache_root, sha256_file
from services.target.batches.data import BadSamples, DataError, Document, read_documents

_PACK_SALT = 0x9AC4


@dataclass(frozen=True)
class Packing:
    """What packing reads of the run, taken from the config once: the data section, the value of every
    key that decides the packed tokens (the cache key: runspec.CACHE_KINDS), the held-out split, and
    the rows' order."""

    data: DataConfig
    content: dict  # dotted key -> value
    held_out: runspec.HeldOut
    order: RowOrder

    @classmethod
    def from_config(cls, cfg: Config) -> "Packing":
        return cls(
            cfg.data, runspec.values(cfg, runspec.CACHE_KINDS), runspec.HeldOut.of(cfg), RowOrder.from_config(cfg)
        )


def split_document(doc: Document, max_len: int) -> list[Document]:
    n = len(doc.input_ids)
    return [
        Document(doc.line, doc.input_ids[a : a + max_len], doc.loss_mask[a : a + max_len]) for a in range(0, n, max_len)
    ]


def pack_rows(lengths: list[int], pack_len: int) -> list[list[int]]:
    """Best-fit: each document (by index, in the given order) into the fullest row it still fits."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (room left, row)
    for d, n in enumerate(lengths):
        if n > pack_len:
            raise ValueError(f"document {d} has {n} tokens > pack_len {pack_len}")
        k = bisect.bisect_left(free, (n, -1))
        if k < len(free):
            room, r = free.pop(k)
        else:
            room, r = pack_len, len(rows)
            rows.append([])
        rows[r].append(d)
        if room - n > 0:
            bisect.insort(free, (room - n, r))
    return rows


# --- cache key -----------------------------------------------------------------------------------


def file_fingerprint(path: str | Path) -> dict:
    path = Path(path)
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256_file(path)}


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    parts = [
        type(tokenizer).__name__,
        backend.to_str() if backend is not None else repr(tokenizer.get_vocab()),
        json.dumps(tokenizer.chat_template, sort_keys=True),
        json.dumps(tokenizer.special_tokens_map, sort_keys=True),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def cache_key(packing: Packing, tokenizer, vocab_size: int) -> str:
    d = packing.data
    if not d.path:
        raise DataError("data.path is not set")
    if not Path(d.path).is_file():
        raise DataError(f"data file not found: {d.path}")
    if d.eval_path and not Path(d.eval_path).is_file():
        raise DataError(f"eval data file not found: {d.eval_path}")
    # every key marked as deciding batch g's tokens; data files by their contents, not their paths
    keys = packing.content
    files = set(runspec.keys_deciding(("path",)))
    parts = {
        "format": FORMAT_VERSION,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "vocab_size": vocab_size,
        **{k: (file_fingerprint(v) if v else None) if k in files else v for k, v in keys.items()},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


# --- build ---------------------------------------------------------------------------------------


def _pack_split(docs: list[Document], packing: Packing, prefix: str) -> dict[str, np.ndarray]:
    d = packing.data
    max_len = d.max_doc_len or d.pack_len
    pieces = [p for doc in docs for p in split_document(doc, max_len)]
    order = (
        np.random.default_rng([packing.order.seed, _PACK_SALT]).permutation(len(pieces))
        if d.shuffle
        else np.arange(len(pieces))
    )
    pieces = [pieces[i] for i in order]
    rows = pack_rows([len(p.input_ids) for p in pieces], d.pack_len)
    flat = [pieces[i] for row in rows for i in row]
    cat = (lambda xs, dt: np.concatenate(xs).astype(dt)) if flat else (lambda xs, dt: np.zeros(0, dtype=dt))
    return {
        f"{prefix}_tokens": cat([p.input_ids for p in flat], np.int32),
        f"{prefix}_loss_mask": cat([p.loss_mask for p in flat], np.bool_),
        f"{prefix}_doc_lens": np.array([len(p.input_ids) for p in flat], dtype=np.int32),
        f"{prefix}_row_docs": np.array([len(row) for row in rows], dtype=np.int32),
    }


def build_index(
    packing: Packing, tokenizer, vocab_size: int, progress=None
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """progress(file, lines, bytes read, file bytes) while the data files are tokenized."""
    d = packing.data
    bad = BadSamples()
    limits = dict(
        max_line_bytes=d.max_line_bytes, max_doc_tokens=d.max_doc_tokens, template_kwargs=d.chat_template_kwargs
    )

    def read(path):
        said = (lambda *done: progress(path, *done)) if progress else None
        return read_documents(path, tokenizer, vocab_size, d.on_bad_sample, bad, **limits, progress=said)

    train = read(d.path)
    held_out = packing.held_out
    if held_out.source == "data.eval_path":
        evals = read(held_out.path)
    elif held_out.source == "data.eval_fraction":  # by line number: a bad line moves no other line
        nonblank = sorted([doc.line for doc in train] + [n for f, n in bad.lines if f == str(Path(d.path))])
        chosen = held_out.lines(nonblank)  # data_lines.nonblank_lines, from what was just read
        evals = [doc for doc in train if doc.line in chosen]
        train = [doc for doc in train if doc.line not in chosen]
    else:
        evals = []
    if not train:
        raise DataError(f"{d.path}: no usable training documents ({bad.count} bad lines skipped)")
    tensors = {**_pack_split(train, packing, "train"), **_pack_split(evals, packing, "eval")}
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    meta = {
        "format": str(FORMAT_VERSION),
        "bad_samples": str(bad.count),
        "bad_examples": json.dumps(bad.examples),
        "pad_id": str(pad_id),
        "pack_len": str(d.pack_len),
        "train_samples": str(len(train)),
        "eval_samples": str(len(evals)),
    }
    return tensors, meta


def store_dir() -> Path:
    """This machine's packed data, shared by every run of the same data, tokenizer and packing keys
    (the content key says so): $DFLASH_CACHE_DIR/packed-data, else ~/.cache/dflash/packed-data."""
    return cache_root() / "packed-data"


def open_or_build(
    packing: Packing,
    run_dir: str | Path,
    tokenizer,
    vocab_size: int,
    log=None,
    store: Path | None = None,
    progress=None,
) -> "PackedData":
    """The run's packed dataset, <run_dir>/data-cache/<key>.safetensors (and its digests): a link to
    the machine's store (store_dir(), or `store`), built there once if no run has built it yet. A
    store that cannot be written (read-only, full, another filesystem than the run's without room)
    is said in one line and the run builds its own copy."""
    log = log or logging.getLogger("target").info
    cache_dir = Path(run_dir) / "data-cache"
    cache_dir.mkdir(parents=True, exist_ok=True)
    key = cache_key(packing, tokenizer, vocab_size)
    path = cache_dir / f"{key}.safetensors"
    with _locked(cache_dir / f"{key}.link.lock"):  # another target may be linking (or building) it
        if not path.is_file():
            store = store_dir() if store is None else store
            try:
                built = _build(packing, Path(store), key, tokenizer, vocab_size, log, progress)
                for source in (built, digests_path(built)):
                    _link(source, cache_dir / source.name)
            except OSError as exc:
                log(f"data: the packed-data store {store} is not usable ({exc}); building in the run folder")
                _build(packing, cache_dir, key, tokenizer, vocab_size, log, progress)
        data = PackedData(path, packing.order)
    if data.bad_samples:
        log(f"data: skipped {data.bad_samples} bad lines; first: " + "; ".join(data.bad_examples[:3]))
    return data


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _build(packing: Packing, folder: Path, key: str, tokenizer, vocab_size: int, log, progress=None) -> Path:
    """<folder>/<key>.safetensors and its digests, built unless there (under the folder's lock for
    the key); read-only, since runs hold them as hard links."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{key}.safetensors"
    with _locked(folder / f"{key}.lock"):
        if not path.is_file():
            t0 = time.monotonic()
            tensors, meta = build_index(packing, tokenizer, vocab_size, progress)
            tmp = folder / f".{key}.{os.getpid()}.tmp"
            save_file(tensors, str(tmp), metadata=meta)
            os.chmod(tmp, 0o444)
            os.replace(tmp, path)
            log(f"data: built {path.name} in {time.monotonic() - t0:.1f}s")
        else:
            log(f"data: packed data {path.name} reused from {folder}")
        digests = digests_path(path)
        if not digests.is_file():
            data = PackedData(path, packing.order)
            tmp = folder / f".{key}.{os.getpid()}.digests.tmp"
            save_file({f"{s}_row_digests": data.row_digests(s) for s in SPLITS}, str(tmp))
            os.chmod(tmp, 0o444)
            os.replace(tmp, digests)
    return path


def _link(source: Path, dest: Path) -> None:
    """dest as a hard link to source, or a copy where they are on different filesystems."""
    if dest.is_file():
        return
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.link")
    try:
        os.link(source, tmp)
    except OSError:
        shutil.copyfile(source, tmp)
    os.replace(tmp, dest)
