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

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from services.data.data_lines import (
    DataError,
    SampleError,
    each_nonblank,
    normalize_messages,
    parse_json_line,
    raw_tokens,
)

MAX_BAD_EXAMPLES = 20
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


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


# --- messages -> tokens + assistant mask ---------------------------------------------------------


def has_generation_markers(tokenizer) -> bool:
    template = tokenizer.chat_template
    return isinstance(template, str) and bool(_GENERATION_TAG.search(template))


def chat_tokens(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> tuple[list[int], list[int]]:
    """Token ids and assistant mask (0/1) of one conversation, with the tokenizer's chat template and
    data.chat_template_kwargs (e.g. enable_thinking: serving must render the same way)."""
    kwargs = template_kwargs or {}
    try:
        if has_generation_markers(tokenizer):
            enc = tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **kwargs
            )
            return list(enc["input_ids"]), list(enc["assistant_masks"])
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception as exc:  # the template itself rejected the conversation (e.g. role order)
        raise SampleError(f"chat template failed: {exc}") from None
    return _mask_by_content_search(tokenizer, messages, text)


def _mask_by_content_search(tokenizer, messages: list[dict], text: str) -> tuple[list[int], list[int]]:
    spans, pos = [], 0
    eos = tokenizer.eos_token or ""
    for turn, m in enumerate(messages):
        content = m["content"].strip()
        if not content:
            continue
        at = text.find(content, pos)
        if at < 0:
            if m["role"] == "assistant":
                raise SampleError(
                    f"assistant turn {turn}: reply not found verbatim in the chat template output; "
                    "use a chat template with {% generation %} markers"
                )
            continue  # templates may rewrite system/tool text; only assistant spans matter
        end = pos = at + len(content)
        if m["role"] == "assistant":
            rest = text[end:]
            gap = len(rest) - len(rest.lstrip(" \t\r\n"))
            if eos and rest[gap:].startswith(eos):
                end = pos = end + gap + len(eos)
            spans.append((at, end))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = np.array([a for a, _ in enc["offset_mapping"]], dtype=np.int64)
    mask = np.zeros(len(starts), dtype=bool)
    for a, b in spans:
        mask |= (starts >= a) & (starts < b)
    return list(enc["input_ids"]), mask.astype(np.int64).tolist()


def text_tokens(tokenizer, record: dict) -> tuple[list[int], list[int]]:
    """A plain-text line (the module docstring): its token ids and loss mask."""
    if "text" in record:
        if not isinstance(record["text"], str):
            raise SampleError(f"'text' must be a string, got {type(record['text']).__name__}")
        enc = tokenizer(record["text"], add_special_tokens=True, return_special_tokens_mask=True)
        return list(enc["input_ids"]), [0 if special else 1 for special in enc["special_tokens_mask"]]
    prompt, completion = record["prompt"], record.get("completion")
    if completion is None:
        raise SampleError("a 'prompt' line needs its 'completion' to train on (`launcher regenerate` writes one)")
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise SampleError("'prompt' and 'completion' must be strings")
    head = raw_tokens(tokenizer, prompt)
    tail = list(tokenizer(completion, add_special_tokens=False)["input_ids"])
    return head + tail, [0] * len(head) + [1] * len(tail)


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


def line_to_document(
    text: str, tokenizer, vocab_size: int, max_doc_tokens: int = 0, template_kwargs: dict | None = None
) -> tuple[np.ndarray, np.ndarray]:
    record = parse_json_line(text)
    if not isinstance(record, dict):
        raise SampleError(f"expected a JSON object, got {type(record).__name__}")
    if "input_ids" in record:
        ids, mask = pretokenized(record, vocab_size)
    elif "messages" in record or "conversations" in record:
        if not tokenizer.chat_template:
            raise DataError("the tokenizer has no chat template, needed for chat data")
        ids, mask = chat_tokens(tokenizer, normalize_messages(record), template_kwargs)
        ids, mask = np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)
        if ids.size and ids.max() >= vocab_size:
            raise SampleError(f"the tokenizer produced ids >= the model's vocab_size {vocab_size}")
        ids = ids.astype(np.int32)
    elif "text" in record or "prompt" in record:
        ids, mask = text_tokens(tokenizer, record)
        ids, mask = np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)
        if ids.size and ids.max() >= vocab_size:
            raise SampleError(f"the tokenizer produced ids >= the model's vocab_size {vocab_size}")
        ids = ids.astype(np.int32)
    else:
        raise SampleError(
            "expected 'messages', 'conversations', 'text', 'prompt' + 'completion', or 'input_ids' + "
            f"'loss_mask'; got keys {sorted(record)[:8]}"
        )
    if ids.size == 0:
        raise SampleError("empty document after tokenization")
    if max_doc_tokens and ids.size > max_doc_tokens:
        raise SampleError(f"document of {ids.size} tokens is longer than data.max_doc_tokens={max_doc_tokens}")
    if not mask.any():
        raise SampleError("no supervised tokens after tokenization")
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
    workers: int = 1,
    progress=None,
) -> list[Document]:
    """Every non-blank line of a JSONL file -> Document, in file order. Bad lines: raise (fail) or
    count in `bad` (skip). workers > 1: lines tokenized in that many processes (tokenizing.py), the
    same documents; 0: as many as suit the file (tokenizing_workers); progress(lines done, bytes
    read, file bytes) after each chunk of lines."""
    from services.target.tokenizing import LineConverter, converted_chunks, tokenizing_workers

    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    workers = workers or tokenizing_workers(path)
    convert = LineConverter(tokenizer, vocab_size, max_doc_tokens, template_kwargs)
    docs, done, size = [], 0, path.stat().st_size
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is one bad line, not a failed file
        for chunk in converted_chunks(convert, each_nonblank(f, max_line_bytes), workers):
            for lineno, ids, mask, problem in chunk:
                if problem is None:
                    docs.append(Document(lineno, ids, mask))
                    continue
                kind, message = problem
                if kind == "data":  # not a per-line problem (no chat template): never skipped
                    raise DataError(f"{path}:{lineno}: {message}")
                message = f"{path}:{lineno}: {message}"
                if on_bad == "fail":
                    raise DataError(message + " (set data.on_bad_sample=skip to skip bad lines)")
                bad.add(message, path, lineno)
            done += len(chunk)
            if progress:
                progress(done, f.tell(), size)
    return docs
