"""Lines of a JSONL file to documents, in one process or several, in file order either way.

Tokenizing is most of packing's time, one line after another on one core: 80 000 regenerated
conversations took about two minutes before the first training step (docs/benchmarks.md). With
workers > 1 the lines go in chunks to that many processes (spawned: no fork of a process that
may hold threads), each with its own copy of the tokenizer; the results come back chunk by chunk
in order, at most AHEAD chunks per worker in flight, so memory stays bounded on any file size.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import pickle
import sys
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from services.data.data_lines import DataError, SampleError

CHUNK_LINES = 256
AHEAD = 4  # chunks in flight per worker
PARALLEL_BYTES = 16 << 20  # a smaller file is tokenized in this process: starting workers costs more
MAX_WORKERS = 16


def tokenizing_workers(path: str | Path) -> int:
    """Processes to tokenize `path` with: the CPUs this process may use (its affinity: a container's
    or taskset's share), at most MAX_WORKERS, and 1 for a small file."""
    if Path(path).stat().st_size < PARALLEL_BYTES:
        return 1
    return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0))))


class LineConverter:
    """One chunk of (line number, text or SampleError) -> (line number, ids, mask, problem) each,
    problem None or (kind, message): "sample" for a bad line, "data" for what no line can fix."""

    def __init__(self, tokenizer, vocab_size: int, max_doc_tokens: int, template_kwargs: dict | None):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.max_doc_tokens, self.template_kwargs = max_doc_tokens, template_kwargs

    def __call__(self, chunk: list) -> list[tuple]:
        from services.target.data import line_to_document

        out = []
        for lineno, text in chunk:
            try:
                if isinstance(text, SampleError):
                    raise text
                ids, mask = line_to_document(
                    text, self.tokenizer, self.vocab_size, self.max_doc_tokens, self.template_kwargs
                )
                out.append((lineno, ids, mask, None))
            except SampleError as exc:
                out.append((lineno, None, None, ("sample", str(exc))))
            except DataError as exc:
                out.append((lineno, None, None, ("data", str(exc))))
        return out


_CONVERT: LineConverter | None = None  # a worker's converter, installed once (not sent with every chunk)


def _install(convert: LineConverter) -> None:
    global _CONVERT
    _CONVERT = convert


def _convert(chunk: list) -> list[tuple]:
    return _CONVERT(chunk)


def _sendable(convert: LineConverter) -> bool:
    """Whether the converter (its tokenizer) pickles, as a spawned worker needs; one that does not
    is tokenized in this process, and said."""
    try:
        pickle.dumps(convert)
        return True
    except Exception as exc:  # a tokenizer class of a model's own code may hold what does not pickle
        print(f"data: tokenizing in one process: the tokenizer does not pickle ({exc})", file=sys.stderr, flush=True)
        return False


def converted_chunks(convert: LineConverter, lines, workers: int):
    """convert's results for `lines` (an iterator), chunk by chunk, in order."""
    chunks = iter(lambda: list(itertools.islice(lines, CHUNK_LINES)), [])
    if workers <= 1 or not _sendable(convert):
        yield from map(convert, chunks)
        return
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=spawn, initializer=_install, initargs=(convert,)) as pool:
        pending = deque()
        try:
            for chunk in chunks:
                pending.append(pool.submit(_convert, chunk))
                if len(pending) >= AHEAD * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:  # a bad line with on_bad_sample=fail stops reading: drop what is queued
            pool.shutdown(cancel_futures=True)
