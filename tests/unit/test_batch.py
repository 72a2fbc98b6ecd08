"""The Batch contract's reading of a packed row: where its documents begin, one helper for every user."""

import numpy as np
import torch

from services.data.batch import FIELDS, count_documents, document_spans, document_starts, run_starts
from services.run import shapes

ROW = torch.tensor([0, 0, 1, 1, 1, 2, -1, -1])


def test_runs_of_a_packed_row():
    assert run_starts(ROW).tolist() == [True, False, True, False, False, True, True, False]
    assert document_starts(ROW).tolist() == [0, 0, 2, 2, 2, 5, 6, 6]
    assert document_spans(ROW) == [(0, 2), (2, 5), (5, 6), (6, 8)]  # padding is one more run
    assert int(count_documents(ROW)) == 3  # ... but not a document
    assert document_spans(torch.tensor([0, 0, 0])) == [(0, 3)]
    assert int(count_documents(torch.full((4,), -1))) == 0


def test_positions_restart_at_every_document_as_packing_lays_them_out():
    rng = np.random.default_rng(0)
    for _ in range(20):
        lens = rng.integers(1, 9, size=rng.integers(0, 6))
        pad = int(rng.integers(0, 5))
        ids = np.concatenate([np.repeat(np.arange(len(lens)), lens), np.full(pad, -1)])
        ids = torch.from_numpy(ids.astype(np.int64))
        n = int(lens.sum())
        by_lengths = np.concatenate([np.arange(n) - np.repeat(np.cumsum(lens) - lens, lens), np.arange(pad)])
        assert (torch.arange(n + pad) - document_starts(ids)).tolist() == by_lengths.tolist()
        assert int(count_documents(ids)) == (int(ids.max()) + 1 if n else 0)


def test_the_wire_dtype_by_name_is_the_batch_contracts():
    """The run spec (no torch) weighs a batch with shapes.HIDDEN_BYTES: the size of FIELDS["hidden"]."""
    assert FIELDS["hidden"] == getattr(torch, shapes.HIDDEN_DTYPE)
    assert torch.empty(0, dtype=FIELDS["hidden"]).element_size() == shapes.HIDDEN_BYTES
