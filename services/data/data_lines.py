"""The lines of a JSONL data file as both roles read them: which lines count (non-blank, within
data.max_line_bytes, UTF-8), one line's JSON, a chat line's messages (OpenAI or ShareGPT), a
conversation's prompt tokens, the held-out split's lines (the prompts of real acceptance), and a chat
file as `launcher regenerate` reads it. No torch, no tokenizer import: the launcher reads these too.

services/target/batches/data.py turns lines into training documents (its docstring: the line shapes and
what makes a line bad); services/data/prompts.py turns them into the eval's prompts.
"""

from __future__ import annotations

import json
from pathlib import Path

from services.run import runspec
from services.run.config import DataConfig

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}


class DataError(ValueError):
    """The dataset cannot be used; the message names the file (and line)."""


class SampleError(ValueError):
    """One line is bad; the reader adds file and line."""


# --- one line -> messages ------------------------------------------------------------------------


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: text only
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise SampleError(f"{where}: only text content parts are supported, got {str(part)[:80]!r}")
            parts.append(part["text"])
        return "".join(parts)
    raise SampleError(f"{where}: content must be a string, got {type(content).__name__}")


def normalize_messages(record: dict, need_reply: bool = True) -> list[dict]:
    """OpenAI or ShareGPT record -> [{"role", "content"}], checked; a training line (need_reply)
    must hold an assistant reply, a prompt need not."""
    if "messages" in record:
        raw, role_key, text_key, aliases = record["messages"], "role", "content", {r: r for r in ROLES}
        name = "messages"
    else:
        raw, role_key, text_key, aliases = record["conversations"], "from", "value", SHAREGPT_ROLES
        name = "conversations"
    if not isinstance(raw, list):
        raise SampleError(f"'{name}' must be a list, got {type(raw).__name__}")
    if not raw:
        raise SampleError(f"empty conversation ('{name}' is [])")
    messages = []
    for turn, m in enumerate(raw):
        where = f"{name}[{turn}]"
        if not isinstance(m, dict) or role_key not in m or text_key not in m:
            raise SampleError(f"{where}: expected an object with '{role_key}' and '{text_key}'")
        role = aliases.get(m[role_key]) if isinstance(m[role_key], str) else None
        if role is None:
            raise SampleError(f"{where}: unknown role {m[role_key]!r} (known: {', '.join(sorted(aliases))})")
        messages.append({"role": role, "content": _text(m[text_key], where)})
    if need_reply and not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        raise SampleError("no assistant reply: nothing to supervise")
    return messages


def prompt_tokens(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a conversation up to the assistant's next turn (the chat template's generation
    prompt), rendered with data.chat_template_kwargs as training renders its chats."""
    return list(
        tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=True, **(template_kwargs or {})
        )["input_ids"]
    )


def many_prompt_tokens(tokenizer, prompts: list, template_kwargs: dict | None = None) -> list[list[int]]:
    """prompt_tokens of each chat (a list of messages) and raw_tokens of each plain text, in order,
    rendered and tokenized in one batched call per kind: one call per prompt costs the template's
    setup and a trip into the Rust tokenizer each time (0.39 against 0.19 ms a prompt on 2 cores,
    and the batch spreads over every core)."""
    out: list[list[int]] = [[] for _ in prompts]
    chats = [i for i, p in enumerate(prompts) if isinstance(p, list)]
    texts = [i for i, p in enumerate(prompts) if not isinstance(p, list)]
    if chats:
        ids = tokenizer.apply_chat_template(
            [prompts[i] for i in chats],
            tokenize=True,
            add_generation_prompt=True,
            return_dict=True,
            **(template_kwargs or {}),
        )["input_ids"]
        for i, row in zip(chats, ids):
            out[i] = list(row)
    if texts:
        for i, row in zip(texts, tokenizer([prompts[i] for i in texts], add_special_tokens=True)["input_ids"]):
            out[i] = list(row)
    return out


def raw_tokens(tokenizer, text: str) -> list[int]:
    """Token ids of plain text as a base model reads it (the tokenizer's own special tokens, a BOS, included)."""
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def parse_json_line(text: str):
    """One JSONL line's value; SampleError "invalid JSON: <what> at character N" (json's own
    "line 2 column 1" counts lines inside this one line, its newline included)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        where = "at the end of the line" if exc.pos >= len(text.rstrip()) else f"at character {exc.pos + 1}"
        raise SampleError(f"invalid JSON: {exc.msg} {where}") from None
    except RecursionError:  # json's C parser recurses once per level: 100 000 "[" exhaust the stack
        raise SampleError("invalid JSON: nested too deeply to parse") from None


# --- lines of a file ------------------------------------------------------------------------------


def _lines(f, max_line_bytes: int):
    """(line number, bytes of the line or None when it is longer than max_line_bytes).

    A line over the limit is skipped in bounded pieces, never held in memory whole."""
    lineno = 0
    while True:
        raw = f.readline(max_line_bytes + 1)
        if not raw:
            return
        lineno += 1
        if len(raw) <= max_line_bytes or raw.endswith(b"\n") and len(raw) == max_line_bytes + 1:
            yield lineno, raw
            continue
        while raw and not raw.endswith(b"\n"):
            raw = f.readline(1 << 20)
        yield lineno, None


def each_nonblank(f, max_line_bytes: int):
    """(line number, text) of every line that is not blank; for a bad line (too long, not UTF-8) a
    SampleError instead of the text. read_documents and nonblank_lines number lines alike by it."""
    for lineno, raw in _lines(f, max_line_bytes):
        if raw is None:
            yield lineno, SampleError(f"line longer than data.max_line_bytes={max_line_bytes}")
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield lineno, SampleError(f"not UTF-8 ({exc})")
            continue
        if text.strip():
            yield lineno, text


def nonblank_lines(path: str | Path, max_line_bytes: int = 8 << 20) -> list[tuple[int, str | None]]:
    """(line number, text) of every line of a JSONL file that read_documents does not skip as blank,
    numbered as read_documents numbers them; text None for a line that is too long or not UTF-8
    (a bad line). The held-out split is taken over these (runspec.HeldOut.lines); packing's
    build_index has the same numbers from read_documents: its documents' lines and the bad ones."""
    with open(path, "rb") as f:
        return [
            (lineno, None if isinstance(text, SampleError) else text)
            for lineno, text in each_nonblank(f, max_line_bytes)
        ]


def heldout_lines(held_out: runspec.HeldOut, data: DataConfig) -> list[str]:
    """The text of the held-out split's lines, in the eval's order: the prompts of real acceptance
    (services/data/prompts.py). The split is by line number, as in packing's build_index, so they are
    the packed eval split's lines, bad lines or not. Without a held-out split: the lines of data.path,
    last first."""
    lines = nonblank_lines(held_out.path or data.path, data.max_line_bytes)
    if held_out.source == "data.eval_fraction":
        chosen = held_out.lines([n for n, _ in lines])
        lines = [(n, text) for n, text in lines if n in chosen]
    elif held_out.source != "data.eval_path":
        lines = lines[::-1]
    return [text for _, text in lines if text is not None]


# --- a chat file, for `launcher regenerate` ---------------------------------------------------------


def read_conversations(path: str | Path, shard: int = 0, num_shards: int = 1) -> list[tuple[dict, list | None]]:
    """(record, messages or None for non-chat lines) of this shard's non-blank lines, in file order.
    A line that is not JSON, or a chat that is malformed, is a DataError naming file:line."""
    out = []
    lines = [(n, t) for n, t in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1) if t.strip()]
    for number, text in lines[shard::num_shards]:
        try:
            record = parse_json_line(text)
            chat = isinstance(record, dict) and ("messages" in record or "conversations" in record)
            out.append((record, normalize_messages(record) if chat else None))
        except ValueError as exc:  # bad JSON, or a SampleError: nothing is written
            raise DataError(f"{path}:{number}: {exc}") from None
    return out


def plain_prompt(record) -> str | None:
    """The text a base model continues: a non-chat line's "prompt", else its "text"; None for other
    lines (chat, pre-tokenized)."""
    if not isinstance(record, dict) or "messages" in record or "conversations" in record:
        return None
    return next((record[k] for k in ("prompt", "text") if isinstance(record.get(k), str)), None)


def plain_lines(items: list[tuple[dict, list | None]]) -> int:
    """How many of read_conversations' items are plain-text lines (a base model continues them)."""
    return sum(messages is None and plain_prompt(record) is not None for record, messages in items)


def replies_to_write(items: list[tuple[dict, list | None]]) -> int:
    """What regeneration writes for read_conversations' items (its progress total): every assistant
    turn of the chat lines, and one completion per plain-text line."""
    return sum(m["role"] == "assistant" for _, messages in items for m in messages or []) + plain_lines(items)


def regenerable(items: list[tuple[dict, list | None]]) -> list[tuple[dict, list | None]]:
    """The items regeneration rewrites (chat and plain-text lines), without the pre-tokenized ones."""
    return [(r, messages) for r, messages in items if messages is not None or plain_prompt(r) is not None]


def sample_path(out: Path, k: int) -> Path:
    """Where a regeneration shard writes its k-th sampled pass (`launcher regenerate --samples`)."""
    return out.with_name(f"{out.name}.sample{k}")
