"""Read JSONL training data: every line becomes one tokenized document (input_ids + loss_mask).

Accepted line shapes (one JSON object per line; blank lines are ignored):
  {"messages": [{"role": "user"|"assistant"|"system"|"tool", "content": "..."}, ...]}     OpenAI chat
  {"conversations": [{"from": "human"|"gpt"|"system"|..., "value": "..."}, ...]}           ShareGPT
  {"input_ids": [int, ...], "loss_mask": [0|1, ...]}                                       pre-tokenized
  {"text": "..."}                                                    plain text (a base model's data)
  {"prompt": "...", "completion": "..."}        a plain-text prompt and its continuation (regenerated)

Plain text needs no chat template: a {"text"} line supervises every token (the tokenizer's own
special tokens, a BOS, open it unsupervised), a {"prompt", "completion"} line its completion only,
the prompt and the completion tokenized apart (as `launcher regenerate` generated the completion:
tokens after the prompt's tokens).

Chat lines are formatted with the tokenizer's own chat template. The loss mask covers assistant
tokens only:
  - if the template has {% generation %} markers, transformers returns the assistant mask
    (return_assistant_tokens_mask) and that is used as is;
  - otherwise ("content search"): render the whole conversation once, find every message's
    content verbatim in the rendered text, in order, each search starting where the previous
    message's content ended (so an assistant reply that repeats the user's words is found in the
    reply, not in the prompt). An assistant span is its content plus the tokenizer's eos_token
    when that follows right after (optional whitespace between). Tokens whose first character
    lies in a span are supervised. An assistant reply the template rewrote (not found verbatim)
    makes the line bad: such templates need {% generation %} markers.

A bad line (invalid JSON, JSON nested deeper than Python can parse, invalid UTF-8, a line longer than
data.max_line_bytes, a document longer than data.max_doc_tokens, missing fields, unknown role,
empty conversation, no assistant reply, ids outside the vocabulary...) raises DataError
"FILE:LINE: reason" with data.on_bad_sample = "fail", or is counted and reported with "skip".
Nothing is dropped silently. The two limits exist because a single 50 MB line took a minute and
4 GB of memory to tokenize: a line over the limit is never read into memory whole.

Which lines count, one line's JSON and a chat's messages are services/data/data_lines.py's, shared with
the eval's prompts (services/data/prompts.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from services.data.data_lines import (
    DataError,
    SampleError,
    each_nonblank,
    normalize_messages,
    parse_json_line,
)
from services.target.batches.tokenizing import many_chat_tokens, many_text_tokens

MAX_BAD_EXAMPLES = 20


@dataclass
class Document:
    line: int  # 1-based line number in its file
    input_ids: np.ndarray  # int32 [n]
    loss_mask: np.ndarray  # bool [n]


@dataclass
class BadSamples:
    count: int = 0
    examples: list[str] = field(default_factory=list)  # the first MAX_BAD_EXAMPLES "file:line: reason"
    lines: list[tuple[str, int]] = field(default_factory=list)  # (file, line number) of every bad line

    def add(self, message: str, path: str | Path = "", line: int = 0) -> None:
        self.count += 1
        self.lines.append((str(path), line))
        if len(self.examples) < MAX_BAD_EXAMPLES:
            self.examples.append(message)


def pretokenized(record: dict, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    ids, mask = record["input_ids"], record.get("loss_mask")
    if mask is None:
        raise SampleError("pre-tokenized line needs 'loss_mask' next to 'input_ids'")
    if not isinstance(ids, list) or not isinstance(mask, list):
        raise SampleError("'input_ids' and 'loss_mask' must be lists")
    if len(ids) != len(mask):
        raise SampleError(f"'input_ids' has {len(ids)} entries but 'loss_mask' has {len(mask)}")
    if not all(type(i) is int for i in ids):
        raise SampleError("'input_ids' must hold integers only")
    if not all(v in (0, 1) for v in mask):  # True/False compare equal to 1/0
        raise SampleError("'loss_mask' must hold 0/1 (or true/false) only")
    arr = np.asarray(ids, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        raise SampleError(f"'input_ids' holds ids outside the vocabulary [0, {vocab_size})")
    if not any(mask):
        raise SampleError("'loss_mask' is all zero: nothing to supervise")
    return arr.astype(np.int32), np.asarray(mask, dtype=bool)


CHUNK_LINES = 1024  # lines tokenized in one batched call per kind (tokenizing.py)
CHUNK_CHARS = 8 << 20  # and at most about this much text: a chunk's tokens as Python objects stay ~300 MB


def lines_to_documents(
    texts: list[str], tokenizer, vocab_size: int, max_doc_tokens: int = 0, template_kwargs: dict | None = None
) -> list[tuple[np.ndarray, np.ndarray] | SampleError | DataError]:
    """Each line's (input_ids int32, loss_mask bool), or the SampleError that makes it bad, or the
    DataError that no line can fix (chat data and no chat template), in order. The lines' texts are
    tokenized together: one batched call per kind of line (services/target/batches/tokenizing.py)."""
    out: list = [None] * len(texts)
    chats, plain = [], []  # (index, messages), (index, record)
    for i, text in enumerate(texts):
        try:
            record = parse_json_line(text)
            if not isinstance(record, dict):
                raise SampleError(f"expected a JSON object, got {type(record).__name__}")
            if "input_ids" in record:
                out[i] = pretokenized(record, vocab_size)
            elif "messages" in record or "conversations" in record:
                if not tokenizer.chat_template:
                    raise DataError("the tokenizer has no chat template, needed for chat data")
                chats.append((i, normalize_messages(record)))
            elif "text" in record or "prompt" in record:
                plain.append((i, record))
            else:
                raise SampleError(
                    "expected 'messages', 'conversations', 'text', 'prompt' + 'completion', or 'input_ids' + "
                    f"'loss_mask'; got keys {sorted(record)[:8]}"
                )
        except (SampleError, DataError) as exc:
            out[i] = exc
    if chats:
        for (i, _), result in zip(chats, many_chat_tokens(tokenizer, [m for _, m in chats], template_kwargs)):
            out[i] = result if isinstance(result, SampleError) else _in_vocabulary(*result, vocab_size)
    if plain:
        for (i, _), result in zip(plain, many_text_tokens(tokenizer, [r for _, r in plain])):
            out[i] = result if isinstance(result, SampleError) else _in_vocabulary(*result, vocab_size)
    for i, result in enumerate(out):
        if isinstance(result, tuple):
            out[i] = _usable(*result, max_doc_tokens)
    return out


def line_to_document(
    text: str, tokenizer, vocab_size: int, max_doc_tokens: int = 0, template_kwargs: dict | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """One line's (input_ids, loss_mask); SampleError or DataError if it is bad."""
    (result,) = lines_to_documents([text], tokenizer, vocab_size, max_doc_tokens, template_kwargs)
    if isinstance(result, Exception):
        raise result
    return result


def _in_vocabulary(ids: list[int], mask: list[int], vocab_size: int) -> tuple[np.ndarray, np.ndarray] | SampleError:
    arr = np.asarray(ids, dtype=np.int64)
    if arr.size and arr.max() >= vocab_size:
        return SampleError(f"the tokenizer produced ids >= the model's vocab_size {vocab_size}")
    return arr.astype(np.int32), np.asarray(mask, dtype=bool)


def _usable(ids: np.ndarray, mask: np.ndarray, max_doc_tokens: int) -> tuple[np.ndarray, np.ndarray] | SampleError:
    if ids.size == 0:
        return SampleError("empty document after tokenization")
    if max_doc_tokens and ids.size > max_doc_tokens:
        return SampleError(f"document of {ids.size} tokens is longer than data.max_doc_tokens={max_doc_tokens}")
    if not mask.any():
        return SampleError("no supervised tokens after tokenization")
    return ids, mask


def read_documents(
    path: str | Path,
    tokenizer,
    vocab_size: int,
    on_bad: str,
    bad: BadSamples,
    max_line_bytes: int = 8 << 20,
    max_doc_tokens: int = 0,
    template_kwargs: dict | None = None,
    progress=None,
) -> list[Document]:
    """Every non-blank line of a JSONL file -> Document, in file order, a chunk of lines tokenized at a
    time (_chunks). Bad lines: raise (fail) or count in `bad` (skip). progress(lines done, bytes read, file
    bytes) after each chunk."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    docs, done, size = [], 0, path.stat().st_size
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is one bad line, not a failed file
        for chunk in _chunks(each_nonblank(f, max_line_bytes)):
            texts = [text for _, text in chunk if not isinstance(text, SampleError)]
            results = iter(lines_to_documents(texts, tokenizer, vocab_size, max_doc_tokens, template_kwargs))
            for lineno, text in chunk:
                result = text if isinstance(text, SampleError) else next(results)
                if isinstance(result, tuple):
                    docs.append(Document(lineno, *result))
                    continue
                if isinstance(result, DataError):  # not a per-line problem (no chat template): never skipped
                    raise DataError(f"{path}:{lineno}: {result}")
                message = f"{path}:{lineno}: {result}"
                if on_bad == "fail":
                    raise DataError(message + " (set data.on_bad_sample=skip to skip bad lines)")
                bad.add(message, path, lineno)
            done += len(chunk)
            if progress:
                progress(done, f.tell(), size)
    return docs


def _chunks(lines):
    """The (line number, text) pairs in lists of CHUNK_LINES, or fewer once they hold CHUNK_CHARS of text."""
    chunk, chars = [], 0
    for lineno, text in lines:
        chunk.append((lineno, text))
        chars += len(text) if isinstance(text, str) else 0
        if len(chunk) >= CHUNK_LINES or chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk
