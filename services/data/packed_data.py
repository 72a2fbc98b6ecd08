"""The run's packed data as a reader sees it: rows of a built cache file (PackedData), or only their
token digests (PublishedDigests), and which row batch g is. services/target/batches/packing.py builds both
files and says the rules (row layout, batch g's row, the cache key); a drafter reads them to check
the content a target sends (services/drafter/training/source.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from services.data.batch import SPLITS, document_starts, token_digest
from services.data.data_lines import DataError
from services.run.config import Config

FORMAT_VERSION = 2  # 2: the held-out split by line number (runspec.HeldOut.lines)


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


@dataclass(frozen=True)
class RowOrder:
    """What decides which row batch g reads (packing.py's rules): run.seed, data.shuffle, run.epochs."""

    seed: int
    shuffle: bool
    epochs: int

    @classmethod
    def from_config(cls, cfg: Config) -> "RowOrder":
        return cls(cfg.run.seed, cfg.data.shuffle, cfg.run.epochs)


class RowsByBatch:
    """The base of the packed data's readers: which row of a split batch g reads (row_of: packing.py's rules,
    decided by its RowOrder); a subclass says how many batches a split has (num_batches)."""

    order: RowOrder
    _perm: tuple[int, np.ndarray] | None = None

    def num_batches(self, split: str = "train") -> int:
        raise NotImplementedError

    def row_of(self, g: int, split: str = "train") -> int:
        n = self.num_batches(split)
        limit = n * self.order.epochs if split == "train" else n
        if split not in SPLITS or not 0 <= g < limit:
            raise IndexError(f"batch g={g} out of range for split {split!r}: 0 <= g < {limit}")
        if split == "eval" or not self.order.shuffle:
            return g % n
        epoch = g // n
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.order.seed, epoch]).permutation(n))
        return int(self._perm[1][g % n])


class PublishedDigests(RowsByBatch):
    """<key>.digests.safetensors: digest(g, split) without the packed data."""

    def __init__(self, path: str | Path, order: RowOrder):
        from safetensors.numpy import load_file

        self.path = Path(path)
        tensors = load_file(str(path))
        self.rows = {s: tensors[f"{s}_row_digests"] for s in SPLITS}
        self.order = order

    def num_batches(self, split: str = "train") -> int:
        return len(self.rows[split])

    def digest(self, g: int, split: str = "train") -> str:
        return bytes(self.rows[split][self.row_of(g, split)]).hex()


class PackedData(RowsByBatch):
    """Rows of a built cache file; batch(g, split) -> the tensors of services.data.batch.Batch minus hidden."""

    def __init__(self, path: str | Path, order: RowOrder):
        from safetensors import safe_open

        self.path = Path(path)
        self._file = safe_open(str(path), framework="np")
        meta = self._file.metadata()
        if int(meta["format"]) != FORMAT_VERSION:
            raise DataError(f"{path}: cache format {meta['format']}, expected {FORMAT_VERSION}")
        self.pack_len, self.pad_id = int(meta["pack_len"]), int(meta["pad_id"])
        self.bad_samples, self.bad_examples = int(meta["bad_samples"]), json.loads(meta["bad_examples"])
        self.order = order
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
        doc_ids = torch.from_numpy(
            np.concatenate([np.repeat(np.arange(len(lens)), lens), np.full(pad, -1)]).astype(np.int64)
        )
        positions = torch.arange(self.pack_len) - document_starts(doc_ids)  # restarts per document (and padding)
        tokens = np.concatenate([sp.tokens[t0:t1].astype(np.int64), np.full(pad, self.pad_id)])
        mask = np.concatenate([sp.loss_mask[t0:t1].astype(bool), np.zeros(pad, dtype=bool)])
        return {
            "input_ids": torch.from_numpy(tokens),
            "loss_mask": torch.from_numpy(mask),
            "position_ids": positions,
            "document_ids": doc_ids,
        }
