"""Chat lines as messages (no torch, no tokenizer): the parsing every reader of chat JSONL shares.

Accepted chat shapes (services/target/data.py lists every line shape and tokenizes them):
  {"messages": [{"role": "user"|"assistant"|"system"|"tool", "content": "..."}, ...]}     OpenAI chat
  {"conversations": [{"from": "human"|"gpt"|"system"|..., "value": "..."}, ...]}           ShareGPT
A bad line is a SampleError (the reader adds file and line) or a DataError naming file:line.
"""
from __future__ import annotations

import json
from pathlib import Path

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                  "model": "assistant", "system": "system", "tool": "tool", "function": "tool", "observation": "tool"}


class DataError(ValueError):
    """The dataset cannot be used; the message names the file (and line)."""


class SampleError(ValueError):
    """One line is bad; the reader adds file and line."""


def parse_json_line(text: str):
    """One JSONL line's value; SampleError "invalid JSON: <what> at character N" (json's own
    "line 2 column 1" counts lines inside this one line, its newline included)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        where = "at the end of the line" if exc.pos >= len(text.rstrip()) else f"at character {exc.pos + 1}"
        raise SampleError(f"invalid JSON: {exc.msg} {where}") from None
    except RecursionError:        # json's C parser recurses once per level: 100 000 "[" exhaust the stack
        raise SampleError("invalid JSON: nested too deeply to parse") from None


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):   # OpenAI content parts: text only
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
        except ValueError as exc:                   # bad JSON, or a SampleError: nothing is written
            raise DataError(f"{path}:{number}: {exc}") from None
    return out


def assistant_turns(items: list[tuple[dict, list | None]]) -> int:
    """How many assistant turns read_conversations' items hold: what regeneration rewrites (its progress total)."""
    return sum(m["role"] == "assistant" for _, messages in items for m in messages or [])
