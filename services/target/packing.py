"""Pack documents into rows of pack_len tokens, cache the result, and serve batch g.

Rules:
  - Splitting: a document longer than max_doc_len (data.max_doc_len, 0 = pack_len) is cut into
    pieces of max_doc_len tokens, [0, m), [m, 2m), ...; every piece is a separate document
    (positions restart at 0; it does not see the piece before it). Pieces are kept even if
    they hold no supervised token (they simply get no anchors).
  - Eval split (services/runspec.py HeldOut): data.eval_path if set, else a data.eval_fraction of
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
sha256, the tokenizer, the relevant config and FORMAT_VERSION. Several targets may start at
once: one builds under an flock while the others wait, and the file appears by atomic rename.
The file is memory-mapped and rows are sliced from it, so the tokens are not held in RAM.

Published digests: next to the cache, <key>.digests.safetensors holds the token digest
(services.batch.token_digest) of every row of both splits. A drafter checks each batch it is
sent against the packed data where the cache is on its host, else against this file (copy it to
a drafter host's <run_dir>/data-cache/): content that a process which took a target's socket
over sent in its name is dropped (services/drafter/source.py).
"""
from __future__ import annotations

import bisect
import fcntl
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from services import runspec
from services.batch import SPLITS, document_starts, token_digest
from services.config import Config
from services.files import sha256_file
from services.target.data import BadSamples, DataError, Document, nonblank_lines, read_documents

FORMAT_VERSION = 2          # 2: the held-out split by line number (runspec.HeldOut.lines)
_PACK_SALT = 0x9AC4


def split_document(doc: Document, max_len: int) -> list[Document]:
    n = len(doc.input_ids)
    return [Document(doc.line, doc.input_ids[a:a + max_len], doc.loss_mask[a:a + max_len]) for a in range(0, n, max_len)]


def pack_rows(lengths: list[int], pack_len: int) -> list[list[int]]:
    """Best-fit: each document (by index, in the given order) into the fullest row it still fits."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []            # sorted (room left, row)
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
    parts = [type(tokenizer).__name__, backend.to_str() if backend is not None else repr(tokenizer.get_vocab()),
             json.dumps(tokenizer.chat_template, sort_keys=True), json.dumps(tokenizer.special_tokens_map, sort_keys=True)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def cache_key(cfg: Config, tokenizer, vocab_size: int) -> str:
    d = cfg.data
    if not d.path:
        raise DataError("data.path is not set")
    if not Path(d.path).is_file():
        raise DataError(f"data file not found: {d.path}")
    if d.eval_path and not Path(d.eval_path).is_file():
        raise DataError(f"eval data file not found: {d.eval_path}")
    # every key marked as deciding batch g's tokens; data files by their contents, not their paths
    keys = runspec.values(cfg, runspec.CACHE_KINDS)
    files = set(runspec.keys_deciding(("path",)))
    parts = {"format": FORMAT_VERSION, "tokenizer": tokenizer_fingerprint(tokenizer), "vocab_size": vocab_size,
             **{k: (file_fingerprint(v) if v else None) if k in files else v for k, v in keys.items()}}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


# --- build ---------------------------------------------------------------------------------------

def _pack_split(docs: list[Document], cfg: Config, prefix: str) -> dict[str, np.ndarray]:
    d = cfg.data
    max_len = d.max_doc_len or d.pack_len
    pieces = [p for doc in docs for p in split_document(doc, max_len)]
    order = (np.random.default_rng([cfg.run.seed, _PACK_SALT]).permutation(len(pieces)) if d.shuffle
             else np.arange(len(pieces)))
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


def heldout_lines(cfg: Config) -> list[str]:
    """The text of the held-out split's lines (runspec.HeldOut), in the eval's order: the prompts of
    real acceptance (services/drafter/prompts.py). The split is by line number, as in build_index, so
    they are the packed eval split's lines, bad lines or not. Without a held-out split: the lines of
    data.path, last first."""
    held_out = runspec.HeldOut.of(cfg)
    lines = nonblank_lines(held_out.path or cfg.data.path, cfg.data.max_line_bytes)
    if held_out.source == "data.eval_fraction":
        chosen = held_out.lines([n for n, _ in lines])
        lines = [(n, text) for n, text in lines if n in chosen]
    elif held_out.source != "data.eval_path":
        lines = lines[::-1]
    return [text for _, text in lines if text is not None]


def build_index(cfg: Config, tokenizer, vocab_size: int) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    d = cfg.data
    bad = BadSamples()
    limits = dict(max_line_bytes=d.max_line_bytes, max_doc_tokens=d.max_doc_tokens,
                  template_kwargs=d.chat_template_kwargs)
    train = read_documents(d.path, tokenizer, vocab_size, d.on_bad_sample, bad, **limits)
    held_out = runspec.HeldOut.of(cfg)
    if held_out.source == "data.eval_path":
        evals = read_documents(held_out.path, tokenizer, vocab_size, d.on_bad_sample, bad, **limits)
    elif held_out.source == "data.eval_fraction":     # by line number: a bad line moves no other line
        nonblank = sorted([doc.line for doc in train] + [n for f, n in bad.lines if f == str(Path(d.path))])
        chosen = held_out.lines(nonblank)           # data.nonblank_lines, from what was just read
        evals = [doc for doc in train if doc.line in chosen]
        train = [doc for doc in train if doc.line not in chosen]
    else:
        evals = []
    if not train:
        raise DataError(f"{d.path}: no usable training documents ({bad.count} bad lines skipped)")
    tensors = {**_pack_split(train, cfg, "train"), **_pack_split(evals, cfg, "eval")}
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    meta = {"format": str(FORMAT_VERSION), "bad_samples": str(bad.count), "bad_examples": json.dumps(bad.examples),
            "pad_id": str(pad_id), "pack_len": str(d.pack_len),
            "train_samples": str(len(train)), "eval_samples": str(len(evals))}
    return tensors, meta


def open_or_build(cfg: Config, run_dir: str | Path, tokenizer, vocab_size: int, log=None) -> "PackedData":
    """The run's packed dataset: reuse <run_dir>/data-cache/<key>.safetensors or build it (once, locked)."""
    from safetensors.numpy import save_file
    log = log or logging.getLogger("target").info
    cache_dir = Path(run_dir) / "data-cache"
    cache_dir.mkdir(parents=True, exist_ok=True)
    key = cache_key(cfg, tokenizer, vocab_size)
    path = cache_dir / f"{key}.safetensors"
    with open(cache_dir / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)     # another target may be building this very index
        if not path.is_file():
            t0 = time.monotonic()
            tensors, meta = build_index(cfg, tokenizer, vocab_size)
            tmp = cache_dir / f".{key}.{os.getpid()}.tmp"
            save_file(tensors, str(tmp), metadata=meta)
            os.replace(tmp, path)
            log(f"data: built {path.name} in {time.monotonic() - t0:.1f}s")
        data = PackedData(path, cfg)
        digests = digests_path(path)
        if not digests.is_file():
            tmp = cache_dir / f".{key}.{os.getpid()}.digests.tmp"
            save_file({f"{s}_row_digests": data.row_digests(s) for s in SPLITS}, str(tmp))
            os.replace(tmp, digests)
    if data.bad_samples:
        log(f"data: skipped {data.bad_samples} bad lines; first: " + "; ".join(data.bad_examples[:3]))
    return data


# --- serve ---------------------------------------------------------------------------------------

class _Split:
    def __init__(self, f, prefix: str):
        self.tokens, self.loss_mask = f.get_slice(f"{prefix}_tokens"), f.get_slice(f"{prefix}_loss_mask")
        self.doc_lens = f.get_tensor(f"{prefix}_doc_lens").astype(np.int64)
        row_docs = f.get_tensor(f"{prefix}_row_docs").astype(np.int64)
        self.doc_start = np.concatenate([[0], np.cumsum(self.doc_lens)])
        self.row_start = np.concatenate([[0], np.cumsum(row_docs)])
        self.num_rows = len(row_docs)


def digests_path(cache: Path) -> Path:
    return cache.with_name(cache.name.replace(".safetensors", ".digests.safetensors"))


class _RowOrder:
    """Which row of a split batch g is (the rules above); needs num_batches(), seed, shuffle, epochs."""
    seed: int
    shuffle: bool
    epochs: int
    _perm: tuple[int, np.ndarray] | None = None

    def num_batches(self, split: str = "train") -> int:
        raise NotImplementedError

    def row_of(self, g: int, split: str = "train") -> int:
        n = self.num_batches(split)
        limit = n * self.epochs if split == "train" else n
        if split not in SPLITS or not 0 <= g < limit:
            raise IndexError(f"batch g={g} out of range for split {split!r}: 0 <= g < {limit}")
        if split == "eval" or not self.shuffle:
            return g % n
        epoch = g // n
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(n))
        return int(self._perm[1][g % n])


class PublishedDigests(_RowOrder):
    """<key>.digests.safetensors: digest(g, split) without the packed data."""

    def __init__(self, path: str | Path, cfg: Config):
        from safetensors.numpy import load_file
        self.path = Path(path)
        tensors = load_file(str(path))
        self.rows = {s: tensors[f"{s}_row_digests"] for s in SPLITS}
        self.seed, self.shuffle, self.epochs = cfg.run.seed, cfg.data.shuffle, cfg.run.epochs

    def num_batches(self, split: str = "train") -> int:
        return len(self.rows[split])

    def digest(self, g: int, split: str = "train") -> str:
        return bytes(self.rows[split][self.row_of(g, split)]).hex()


class PackedData(_RowOrder):
    """Rows of a built cache file; batch(g, split) -> the tensors of services.batch.Batch minus hidden."""

    def __init__(self, path: str | Path, cfg: Config):
        from safetensors import safe_open
        self.path = Path(path)
        self._file = safe_open(str(path), framework="np")
        meta = self._file.metadata()
        if int(meta["format"]) != FORMAT_VERSION:
            raise DataError(f"{path}: cache format {meta['format']}, expected {FORMAT_VERSION}")
        self.pack_len, self.pad_id = int(meta["pack_len"]), int(meta["pad_id"])
        self.bad_samples, self.bad_examples = int(meta["bad_samples"]), json.loads(meta["bad_examples"])
        self.seed, self.shuffle, self.epochs = cfg.run.seed, cfg.data.shuffle, cfg.run.epochs
        self.splits = {s: _Split(self._file, s) for s in SPLITS}
        self._perm: tuple[int, np.ndarray] | None = None

    def num_batches(self, split: str = "train") -> int:
        """Train: batches per epoch. Eval: all eval batches."""
        return self.splits[split].num_rows

    @property
    def key(self) -> str:
        """The cache key (the file's name): drafters find the same data by it."""
        return self.path.name.removesuffix(".safetensors")

    def digest(self, g: int, split: str = "train") -> str:
        """token_digest of batch g's input_ids."""
        return token_digest(self.batch(g, split)["input_ids"])

    def row_digests(self, split: str) -> np.ndarray:
        """[rows, 16] uint8: the token digest of every row of a split, in row order."""
        out = np.zeros((self.num_batches(split), 16), dtype=np.uint8)
        for r in range(len(out)):
            out[r] = np.frombuffer(bytes.fromhex(token_digest(self.row(r, split)["input_ids"])), dtype=np.uint8)
        return out

    def batch(self, g: int, split: str = "train") -> dict[str, torch.Tensor]:
        """input_ids, loss_mask, position_ids, document_ids of batch g: [pack_len] each."""
        return self.row(self.row_of(g, split), split)

    def row(self, r: int, split: str = "train") -> dict[str, torch.Tensor]:
        sp = self.splits[split]
        d0, d1 = sp.row_start[r], sp.row_start[r + 1]
        t0, t1 = int(sp.doc_start[d0]), int(sp.doc_start[d1])
        lens = sp.doc_lens[d0:d1]
        pad = self.pack_len - (t1 - t0)
        doc_ids = torch.from_numpy(np.concatenate([np.repeat(np.arange(len(lens)), lens), np.full(pad, -1)])
                                   .astype(np.int64))
        positions = torch.arange(self.pack_len) - document_starts(doc_ids)     # restarts per document (and padding)
        tokens = np.concatenate([sp.tokens[t0:t1].astype(np.int64), np.full(pad, self.pad_id)])
        mask = np.concatenate([sp.loss_mask[t0:t1].astype(bool), np.zeros(pad, dtype=bool)])
        return {"input_ids": torch.from_numpy(tokens), "loss_mask": torch.from_numpy(mask),
                "position_ids": positions, "document_ids": doc_ids}


# --- `launcher up` builds the index before any worker starts ------------------------------------

def prepare(cfg: Config, run_dir: str | Path) -> "PackedData":
    """Tokenize and pack cfg.data into the run's cache, with the tokenizer and vocabulary of the
    target's config, not its weights: a bad line stops the run in seconds, before a 27B model
    loads, and the target workers then open the same cache file (same key)."""
    from transformers import AutoTokenizer
    vocab_size = runspec.target_fields_of(cfg.target.model_path)["vocab_size"]     # as the run spec reads it
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.target.model_path)
    except Exception as exc:        # one line naming the folder, not transformers' traceback
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ModelFilesError(f"target.model_path: cannot load the config and tokenizer of {cfg.target.model_path}: "
                              f"{type(exc).__name__}: {first}") from None
    return open_or_build(cfg, run_dir, tokenizer, vocab_size, log=lambda msg: None)


class ModelFilesError(DataError):
    """The target folder's config or tokenizer does not load (named by its key, not as data)."""


def eval_prompt_count(cfg: Config) -> int | None:
    """How many prompts real acceptance will decode in training (run.eval_prompts' files, read and
    checked now, else the held-out lines'); None when it is off (run.spec_eval_prompts = 0)."""
    from transformers import AutoTokenizer
    from services.drafter.prompts import prompt_sets
    if cfg.run.spec_eval_prompts <= 0:
        return None
    tokenizer = AutoTokenizer.from_pretrained(cfg.target.model_path)
    return sum(len(s.prompts) for s in prompt_sets(cfg, tokenizer, cfg.run.eval_prompts, cfg.run.spec_eval_prompts))


def main(argv=None) -> int:
    """python -m services.target.packing --config FILE --run-dir DIR: one JSON line, or one error line, exit 2."""
    import argparse

    from services.config import load_config
    from services.drafter.prompts import PromptFileError
    p = argparse.ArgumentParser(prog="python -m services.target.packing", description="build the run's data index")
    p.add_argument("--config", required=True)
    p.add_argument("--run-dir", required=True)
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config)
        data = prepare(cfg, args.run_dir)
    except (DataError, runspec.SpecError) as exc:
        print(exc if isinstance(exc, (ModelFilesError, runspec.SpecError)) else f"data: {exc}", file=sys.stderr,
              flush=True)
        return 2
    try:                # real acceptance's prompts: None when it is off by config (run.spec_eval_prompts = 0)
        prompts = eval_prompt_count(cfg)
    except PromptFileError as exc:
        print(f"run.eval_prompts: {exc}", file=sys.stderr, flush=True)
        return 2
    print(json.dumps({"train_rows": data.num_batches("train"), "eval_rows": data.num_batches("eval"),
                      "bad_samples": data.bad_samples, "bad_examples": data.bad_examples[:3],
                      "prompts": prompts}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
