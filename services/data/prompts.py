"""The eval's prompts, as token ids rendered the way training renders its chats
(data.chat_template_kwargs), in named sets:

  - prompt files (`launcher eval --prompts FILE`, eval.prompts): JSONL (or .jsonl.gz), one prompt a
    line: {"messages": [...]} or {"conversations": [...]} (a final assistant turn is dropped: the
    target answers it), {"prompt": "text"} or a bare JSON string (one user turn; raw text when the
    tokenizer has no chat template), or pre-tokenized {"input_ids": [...]} (with a "loss_mask": the
    tokens before the first supervised one). The set is named after the file (HumanEval.jsonl.gz ->
    HumanEval); HumanEval's own file reads as it ships, by its "prompt" field.
  - otherwise the run's held-out lines (data_lines.heldout_lines): a chat up to its last assistant turn,
    a pre-tokenized line's tokens before its first supervised one.

And the tokens that end an output.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from services.data.data_lines import heldout_lines, normalize_messages, parse_json_line, prompt_tokens, raw_tokens
from services.run.config import DataConfig
from services.run.runspec import HeldOut

HELD_OUT = "held-out"


class PromptFileError(ValueError):
    """A prompt file cannot be read; the message names the file and line."""


@dataclass
class PromptSet:
    name: str
    prompts: list[list[int]]


def _before_supervised(record: dict) -> list[int]:
    """A pre-tokenized line's prompt: its ids before the first supervised token (all without a loss_mask)."""
    ids, mask = record["input_ids"], record.get("loss_mask")
    if not isinstance(ids, list) or not all(type(i) is int and i >= 0 for i in ids):
        raise ValueError("'input_ids' must be a list of token ids")
    if mask is None:
        return ids
    if not isinstance(mask, list) or len(mask) != len(ids):
        raise ValueError("'loss_mask' must be a list as long as 'input_ids'")
    return ids[: next((i for i, m in enumerate(mask) if m), len(ids))]


def file_prompt(record, tokenizer, template_kwargs: dict) -> list[int]:
    """The prompt of one line of a prompt file (module docstring); ValueError says what is wrong."""
    if isinstance(record, str):
        record = {"prompt": record}
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object or string, got {type(record).__name__}")
    if "input_ids" in record:
        return _before_supervised(record)
    if "messages" in record or "conversations" in record:
        messages = normalize_messages(record, need_reply=False)
        if messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        if not messages:
            raise ValueError("the conversation holds only an assistant turn: no prompt")
        return prompt_tokens(tokenizer, messages, template_kwargs)
    if isinstance(record.get("prompt"), str):
        if not tokenizer.chat_template:  # a base model: the text itself
            return raw_tokens(tokenizer, record["prompt"])
        return prompt_tokens(tokenizer, [{"role": "user", "content": record["prompt"]}], template_kwargs)
    raise ValueError(f"expected 'messages', 'conversations', 'prompt' or 'input_ids'; got keys {sorted(record)[:8]}")


def set_name(path: str | Path) -> str:
    name = Path(path).name
    for suffix in (".gz", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name or str(path)


def read_prompt_file(path: str | Path, tokenizer, template_kwargs: dict, limit: int = 0) -> list[list[int]]:
    """The first `limit` (0: all) prompts of a prompt file; PromptFileError "FILE:LINE: reason"."""
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"prompt file not found: {path}")
    prompts = []
    try:
        with gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8") as f:
            for number, text in enumerate(f, 1):
                if not text.strip():
                    continue
                try:
                    prompt = file_prompt(parse_json_line(text), tokenizer, template_kwargs)
                except ValueError as exc:
                    raise PromptFileError(f"{path}:{number}: {exc}") from None
                if not prompt:
                    raise PromptFileError(f"{path}:{number}: empty prompt")
                prompts.append(prompt)
                if limit and len(prompts) >= limit:
                    break
    except (OSError, UnicodeDecodeError) as exc:  # not gzip, not UTF-8, unreadable
        raise PromptFileError(f"{path}: {exc}") from None
    if not prompts:
        raise PromptFileError(f"{path}: no prompts")
    return prompts


def heldout_prompts(held_out: HeldOut, data: DataConfig, tokenizer, limit: int) -> list[list[int]]:
    """Up to `limit` prompts of the held-out lines (data_lines.heldout_lines): a chat up to its last
    assistant turn, with the chat template's generation prompt; a pre-tokenized line's tokens before
    its first supervised one; a plain-text line's prompt, or the first half of its text (at most 512
    tokens). Other lines are skipped."""
    prompts = []
    for text in heldout_lines(held_out, data):
        if len(prompts) >= limit:
            break
        try:
            record = json.loads(text)
            if "input_ids" in record:
                prompt = _before_supervised(record)
            elif isinstance(record.get("prompt"), str):  # a base model's prompt + completion line
                prompt = raw_tokens(tokenizer, record["prompt"])
            elif isinstance(record.get("text"), str):  # plain text: its first half, at most 512 tokens
                ids = raw_tokens(tokenizer, record["text"])
                prompt = ids[: min(len(ids) // 2, 512)]
            else:
                messages = normalize_messages(record)
                turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
                prompt = (
                    prompt_tokens(tokenizer, messages[: turns[-1]], data.chat_template_kwargs) if turns[-1] > 0 else []
                )
        except Exception:  # a bad line: the packed data counted it already
            continue
        if prompt:
            prompts.append(prompt)
    return prompts


def prompt_sets(held_out: HeldOut, data: DataConfig, tokenizer, files: list[str], limit: int) -> list[PromptSet]:
    """The sets to decode: the files' (at most `limit` prompts each, 0: all), else the held-out set
    (at most `limit`). Prompts render with data.chat_template_kwargs, as training did."""
    if not files:
        return [PromptSet(HELD_OUT, heldout_prompts(held_out, data, tokenizer, limit))]
    sets, names = [], set()
    for path in files:
        name = set_name(path)
        while name in names:  # two files of one name: both kept, apart
            name += "'"
        names.add(name)
        sets.append(PromptSet(name, read_prompt_file(path, tokenizer, data.chat_template_kwargs, limit)))
    return sets


def interleave(sets: list[PromptSet]) -> tuple[list[list[int]], list[str]]:
    """(prompts, their set names) round-robin over the sets: an evaluation cut short by its time
    budget has decoded some of every set, not the first set only."""
    prompts, names = [], []
    for i in range(max((len(s.prompts) for s in sets), default=0)):
        for s in sets:
            if i < len(s.prompts):
                prompts.append(s.prompts[i])
                names.append(s.name)
    return prompts, names


def stop_token_ids(tokenizer, model) -> list[int]:
    """The tokenizer's eos and the HF model's generation_config eos ids."""
    ids = {tokenizer.eos_token_id}
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos])
    return sorted(i for i in ids if i is not None)
