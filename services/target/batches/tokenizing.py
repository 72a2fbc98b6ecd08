"""Records to token ids and loss masks, many at a time (services/target/batches/data.py says what each line
shape supervises).

Packing tokenizes every line of the data before the first step. A fast tokenizer's batched call
encodes a whole list in Rust on every core, where one call per line runs on one core and pays the
trip into Rust each time (0.23 against 0.35 ms a chat line of code on 2 cores, the whole of
packing's reading with SmolLM2's tokenizer; docs/benchmarks.md). So each chat is rendered by its
template one by one (Python, and where a template rejects one conversation that line alone is
bad), and the rendered texts of a chunk of lines are tokenized in one call. Worker processes did
this before: each had to import transformers and unpickle the tokenizer first, and 16 of them on a
GPU host took about 50 s to send back their first chunk.
"""

from __future__ import annotations

import re

import numpy as np

from services.data.data_lines import SampleError, many_prompt_tokens

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

Tokens = tuple[list[int], list[int]]  # token ids, loss mask (0/1)


def has_generation_markers(tokenizer) -> bool:
    template = tokenizer.chat_template
    return isinstance(template, str) and bool(_GENERATION_TAG.search(template))


def chat_tokens(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> Tokens:
    """Token ids and assistant mask of one conversation; SampleError if the line is bad."""
    (result,) = many_chat_tokens(tokenizer, [messages], template_kwargs)
    if isinstance(result, SampleError):
        raise result
    return result


def many_chat_tokens(
    tokenizer, conversations: list[list[dict]], template_kwargs: dict | None = None
) -> list[Tokens | SampleError]:
    """Token ids and assistant mask (0/1) of each conversation, or the SampleError that makes it bad,
    in order, rendered with the tokenizer's chat template and data.chat_template_kwargs (e.g.
    enable_thinking: serving must render the same way)."""
    kwargs = template_kwargs or {}
    if has_generation_markers(tokenizer):
        return _marked_chats(tokenizer, conversations, kwargs)
    out: list[Tokens | SampleError | None] = [None] * len(conversations)
    rendered = []  # (index, text, assistant spans)
    for i, messages in enumerate(conversations):
        try:
            text = _render(tokenizer, messages, kwargs)
            rendered.append((i, text, _assistant_spans(tokenizer, messages, text)))
        except SampleError as exc:
            out[i] = exc
    if rendered:
        enc = tokenizer([text for _, text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True)
        for (i, _, spans), ids, offsets in zip(rendered, enc["input_ids"], enc["offset_mapping"]):
            out[i] = (list(ids), _span_mask(offsets, spans))
    return out


def _render(tokenizer, messages: list[dict], kwargs: dict) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception as exc:  # the template itself rejected the conversation (e.g. role order)
        raise SampleError(f"chat template failed: {exc}") from None


def _marked_chats(tokenizer, conversations: list[list[dict]], kwargs: dict) -> list[Tokens | SampleError]:
    """The template's {% generation %} markers give the assistant mask (transformers'
    return_assistant_tokens_mask), the whole list in one call; a call the template rejects is
    redone one conversation at a time, so only the rejected ones are bad."""
    try:
        enc = tokenizer.apply_chat_template(
            conversations, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **kwargs
        )
    except Exception as exc:
        if len(conversations) == 1:
            return [SampleError(f"chat template failed: {exc}")]
        return [result for messages in conversations for result in _marked_chats(tokenizer, [messages], kwargs)]
    return [(list(ids), list(mask)) for ids, mask in zip(enc["input_ids"], enc["assistant_masks"])]


def _assistant_spans(tokenizer, messages: list[dict], text: str) -> list[tuple[int, int]]:
    """Content search (services/target/batches/data.py): the character spans of the assistant replies in the
    rendered text, each with the eos_token that follows it."""
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
    return spans


def _span_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose first character lies in a span."""
    starts = np.array([a for a, _ in offsets], dtype=np.int64)
    mask = np.zeros(len(starts), dtype=bool)
    for a, b in spans:
        mask |= (starts >= a) & (starts < b)
    return mask.astype(np.int64).tolist()


def many_text_tokens(tokenizer, records: list[dict]) -> list[Tokens | SampleError]:
    """Plain-text lines (a base model's data): a {"text"} line supervises every token but the
    tokenizer's own special tokens (a BOS); a {"prompt", "completion"} line its completion only, the
    two tokenized apart (as `launcher regenerate` generated the completion: tokens after the prompt's,
    the prompt as raw text with the tokenizer's special tokens)."""
    out: list[Tokens | SampleError | None] = [None] * len(records)
    texts, prompts = [], []  # (index, text), (index, prompt, completion)
    for i, record in enumerate(records):
        if "text" in record:
            if isinstance(record["text"], str):
                texts.append((i, record["text"]))
            else:
                out[i] = SampleError(f"'text' must be a string, got {type(record['text']).__name__}")
            continue
        prompt, completion = record["prompt"], record.get("completion")
        if completion is None:
            out[i] = SampleError("a 'prompt' line needs its 'completion' to train on (`launcher regenerate` writes it)")
        elif not isinstance(prompt, str) or not isinstance(completion, str):
            out[i] = SampleError("'prompt' and 'completion' must be strings")
        else:
            prompts.append((i, prompt, completion))
    if texts:
        enc = tokenizer([t for _, t in texts], add_special_tokens=True, return_special_tokens_mask=True)
        for (i, _), ids, special in zip(texts, enc["input_ids"], enc["special_tokens_mask"]):
            out[i] = (list(ids), [0 if s else 1 for s in special])
    if prompts:
        heads = many_prompt_tokens(tokenizer, [p for _, p, _ in prompts])  # raw text, as regenerate read it
        tails = tokenizer([c for _, _, c in prompts], add_special_tokens=False)["input_ids"]
        for (i, _, _), head, tail in zip(prompts, heads, tails):
            out[i] = (list(head) + list(tail), [0] * len(head) + [1] * len(tail))
    return out
