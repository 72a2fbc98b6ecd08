"""Reading JSONL data: chat formats, assistant-only loss masks, pre-tokenized lines, bad lines."""

from __future__ import annotations

import json

import numpy as np
import pytest

from services.target.batches.data import BadSamples, DataError, read_documents
from services.target.batches.tokenizing import chat_tokens, has_generation_markers
from services.tools.demo import CHAT_TEMPLATE, conversations
from tests.launching import REPO

VOCAB = 4096

MULTI_TURN = [
    {"role": "system", "content": "you are a helpful assistant ."},
    {"role": "user", "content": "count from 3 to 9"},
    {"role": "assistant", "content": "3 4 5 6 7 8 9"},
    {"role": "user", "content": "repeat after me : green river stone"},
    {"role": "assistant", "content": "green river stone"},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "hello ! i am a tiny demo model . how can i help you today ?"},
]

# A Qwen3-style template without generation markers: the last assistant turn gets an empty think block,
# so rendering a prefix of the conversation is not a prefix of the whole rendering.
QWEN3_LIKE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' and loop.last -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def _write(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _supervised_text(tokenizer, ids, mask):
    return tokenizer.decode([int(i) for i, m in zip(ids, mask) if m])


def _expected(messages, eos="<|im_end|>"):
    return "".join(m["content"] + eos for m in messages if m["role"] == "assistant")


# --- assistant masks ---------------------------------------------------------------------------------


def test_generation_template_masks_assistant_tokens_only(tokenizer):
    assert has_generation_markers(tokenizer)
    ids, mask = chat_tokens(tokenizer, MULTI_TURN)
    assert len(ids) == len(mask) and 0 < sum(mask) < len(mask)
    assert _supervised_text(tokenizer, ids, mask) == _expected(MULTI_TURN)


def test_content_search_fallback_agrees_with_generation_mask(tokenizer):
    with_markers = [chat_tokens(tokenizer, c["messages"]) for c in conversations(60, seed=7)]
    tokenizer.chat_template = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert not has_generation_markers(tokenizer)
    without = [chat_tokens(tokenizer, c["messages"]) for c in conversations(60, seed=7)]
    assert without == with_markers
    assert any(sum(1 for m in c["messages"] if m["role"] == "assistant") >= 2 for c in conversations(60, seed=7))


def test_content_search_on_a_template_that_is_not_prefix_stable(tokenizer):
    tokenizer.chat_template = QWEN3_LIKE
    ids, mask = chat_tokens(tokenizer, MULTI_TURN)
    assert _supervised_text(tokenizer, ids, mask) == _expected(MULTI_TURN)
    text = tokenizer.decode(ids)
    assert "<think>" in text and "<think>" not in _supervised_text(tokenizer, ids, mask)


def test_reply_that_repeats_the_prompt_is_masked_in_the_reply(tokenizer):
    tokenizer.chat_template = QWEN3_LIKE
    messages = [{"role": "user", "content": "green river stone"}, {"role": "assistant", "content": "green river stone"}]
    ids, mask = chat_tokens(tokenizer, messages)
    first_supervised = mask.index(1)
    assert "assistant" in tokenizer.decode(ids[:first_supervised])  # the prompt copy stays unsupervised
    assert _supervised_text(tokenizer, ids, mask) == "green river stone<|im_end|>"


# --- files ---------------------------------------------------------------------------------------


def test_reads_openai_sharegpt_and_pretokenized(tmp_path, tokenizer):
    sharegpt = {
        "conversations": [{"from": "human", "value": "count from 3 to 9"}, {"from": "gpt", "value": "3 4 5 6 7 8 9"}]
    }
    openai_parts = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "count from 3 to 9"}]},
            {"role": "assistant", "content": "3 4 5 6 7 8 9"},
        ]
    }
    path = _write(
        tmp_path / "mixed.jsonl",
        [
            {"messages": MULTI_TURN},
            sharegpt,
            "",
            openai_parts,
            {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, True]},
        ],
    )
    docs = read_documents(path, tokenizer, VOCAB, "fail", BadSamples())
    assert [d.line for d in docs] == [1, 2, 4, 5]  # the blank line 3 is not a sample
    assert _supervised_text(tokenizer, docs[0].input_ids, docs[0].loss_mask) == _expected(MULTI_TURN)
    assert np.array_equal(docs[1].input_ids, docs[2].input_ids)  # ShareGPT == OpenAI (text parts)
    assert np.array_equal(docs[1].loss_mask, docs[2].loss_mask)
    assert docs[3].input_ids.tolist() == [5, 6, 7, 8] and docs[3].loss_mask.tolist() == [False, False, True, True]
    assert all(d.input_ids.dtype == np.int32 and d.loss_mask.dtype == bool for d in docs)


BAD_LINES = [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ({"body": "hello"}, "expected 'messages', 'conversations', 'text'"),
    ({"prompt": "hello"}, "a 'prompt' line needs its 'completion'"),
    ({"text": ["hello"]}, "'text' must be a string"),
    ({"messages": []}, "empty conversation"),
    (
        {"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]},
        "unknown role 'wizard'",
    ),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant reply"),
    ({"messages": [{"role": "user"}, {"role": "assistant", "content": "y"}]}, r"messages\[0\]: expected an object"),
    ({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "y"}]}, "content must be a string"),
    ({"conversations": [{"from": "alien", "value": "x"}]}, "unknown role 'alien'"),
    ({"input_ids": [1, 2, 3], "loss_mask": [1, 1]}, "'input_ids' has 3 entries but 'loss_mask' has 2"),
    ({"input_ids": [1, VOCAB], "loss_mask": [1, 1]}, "outside the vocabulary"),
    ({"input_ids": [1, 2], "loss_mask": [0, 0]}, "nothing to supervise"),
    ({"input_ids": [1, 2]}, "needs 'loss_mask'"),
]


def test_invalid_json_names_file_line_and_character_not_json_inner_line(tmp_path, tokenizer):
    path = tmp_path / "data.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}\n{"messages": [1,, 2]}\n')
    bad = BadSamples()
    read_documents(path, tokenizer, VOCAB, "skip", bad)
    assert bad.examples == [
        f"{path}:1: invalid JSON: Expecting ',' delimiter at the end of the line",
        f"{path}:2: invalid JSON: Expecting value at character 17",
    ]


@pytest.mark.parametrize("line,reason", BAD_LINES)
def test_bad_line_fails_naming_file_and_line(tmp_path, tokenizer, line, reason):
    path = _write(tmp_path / "data.jsonl", [{"messages": MULTI_TURN}, line])
    with pytest.raises(DataError, match=rf"{path}:2: .*{reason}"):
        read_documents(path, tokenizer, VOCAB, "fail", BadSamples())


def test_skip_counts_and_reports_every_bad_line(tmp_path, tokenizer):
    lines = [{"messages": MULTI_TURN}] + [line for line, _ in BAD_LINES] + [{"messages": MULTI_TURN}]
    path = _write(tmp_path / "data.jsonl", lines)
    bad = BadSamples()
    docs = read_documents(path, tokenizer, VOCAB, "skip", bad)
    assert [d.line for d in docs] == [1, len(lines)]
    assert bad.count == len(BAD_LINES)
    assert [e.split(": ", 1)[0] for e in bad.examples] == [f"{path}:{i}" for i in range(2, len(lines))]


def test_missing_file_and_missing_template(tmp_path, tokenizer):
    with pytest.raises(DataError, match=f"data file not found: {tmp_path / 'nope.jsonl'}"):
        read_documents(tmp_path / "nope.jsonl", tokenizer, VOCAB, "fail", BadSamples())
    tokenizer.chat_template = None
    path = _write(tmp_path / "d.jsonl", [{"messages": MULTI_TURN}])
    with pytest.raises(DataError, match=f"{path}:1: .*no chat template"):
        read_documents(path, tokenizer, VOCAB, "skip", BadSamples())  # not a per-line problem: never skipped


# --- hostile files (issue 19): each is one bad line, named, and skippable ----------------------------------


def _hostile(tmp_path, middle: bytes):
    good = (json.dumps({"messages": MULTI_TURN}) + "\n").encode()
    path = tmp_path / "hostile.jsonl"
    path.write_bytes(good + middle + b"\n" + good)
    return path


HOSTILE = [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply", {}),
    (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "not UTF-8", {}),
    (
        json.dumps({"input_ids": [1] * 5000, "loss_mask": [1] * 5000}).encode(),
        "longer than data.max_line_bytes=4096",
        {"max_line_bytes": 4096},
    ),
    (
        json.dumps({"input_ids": [1] * 500, "loss_mask": [1] * 500}).encode(),
        "document of 500 tokens is longer than data.max_doc_tokens=100",
        {"max_doc_tokens": 100},
    ),
]


@pytest.mark.parametrize("middle,reason,limits", HOSTILE, ids=["deep", "utf8", "long-line", "long-doc"])
def test_hostile_line_fails_naming_file_and_line_or_is_skipped(tmp_path, tokenizer, middle, reason, limits):
    path = _hostile(tmp_path, middle)
    with pytest.raises(DataError, match=rf"^{path}:2: .*{reason}.*data.on_bad_sample=skip"):
        read_documents(path, tokenizer, VOCAB, "fail", BadSamples(), **limits)
    bad = BadSamples()
    docs = read_documents(path, tokenizer, VOCAB, "skip", bad, **limits)
    assert [d.line for d in docs] == [1, 3] and bad.count == 1  # the line after the bad one is read as usual
    assert bad.examples[0].startswith(f"{path}:2: ") and reason in bad.examples[0]


@pytest.mark.processes
def test_a_line_over_the_limit_is_never_read_whole(tmp_path):
    """A 50 MB line with the default 8 MiB limit: skipped without its bytes ever being in memory
    (in a fresh process, so the peak RSS measured is this read's alone)."""
    import subprocess
    import sys

    good = json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}).encode() + b"\n"
    path = tmp_path / "long.jsonl"
    path.write_bytes(good + b'{"input_ids": [' + b"1," * (25 << 20) + b"1]}\n" + good)
    # VmHWM: this process's peak (ru_maxrss would carry the pytest parent's peak over the exec)
    code = (
        "import re, sys; from services.target.batches.data import BadSamples, read_documents\n"
        "peak = lambda: int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1])\n"
        "before = peak()\n"
        "bad = BadSamples(); docs = read_documents(sys.argv[1], None, 10, 'skip', bad)\n"
        "grown = (peak() - before) // 1024\n"
        "print([d.line for d in docs], bad.count, grown)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120, cwd=REPO)
    lines, count, grown_mb = out.stdout.rsplit(" ", 2) if out.returncode == 0 else (out.stderr, 0, 0)
    assert lines == "[1, 3]" and count == "1", out.stdout + out.stderr
    assert int(grown_mb) < 30, f"peak memory grew by {grown_mb} MB reading past a 50 MB line"


# --- tokenized in batches (services/target/batches/tokenizing.py) -------------------------------------------------

REJECTING = "{%- if messages[0]['content'] == 'reject me' -%}{{- raise_exception('no, not this one') -}}{%- endif -%}"
NO_MARKERS = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, NO_MARKERS], ids=["generation-markers", "content-search"])
def test_lines_tokenized_in_batches_equal_each_line_alone(tmp_path, tokenizer, monkeypatch, template):
    """read_documents (chunks of 5 lines here, then of 600 characters, each tokenized in one batched
    call per kind) gives the documents, bad lines, progress and first failure that each line gives
    alone (line_to_document), chat and plain-text lines mixed, and a conversation the template
    rejects spoils only its own line."""
    from services.target.batches import data

    monkeypatch.setattr(data, "CHUNK_LINES", 5)
    tokenizer.chat_template = REJECTING + template
    rejected = {"messages": [{"role": "user", "content": "reject me"}, {"role": "assistant", "content": "no"}]}
    plain = [{"text": "spell river : r i"}, {"prompt": "count from 3 to", "completion": " 9"}]
    lines = [{"messages": MULTI_TURN}, *conversations(7, seed=3), rejected, *plain] + [line for line, _ in BAD_LINES]
    path = _write(tmp_path / "data.jsonl", lines * 2)
    with open(path, "ab") as f:
        f.write(
            b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n' + json.dumps({"messages": MULTI_TURN}).encode()
        )
    bad, seen = BadSamples(), []
    docs = read_documents(path, tokenizer, VOCAB, "skip", bad, progress=lambda *done: seen.append(done))
    alone, alone_bad = [], []
    for n, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        try:
            alone.append((n, *data.line_to_document(raw.decode(), tokenizer, VOCAB)))
        except (ValueError, UnicodeDecodeError) as exc:
            alone_bad.append((n, str(exc)))
    assert [d.line for d in docs] == [n for n, *_ in alone] and len(docs) == 2 * (1 + 7 + 2) + 1
    for d, (_, ids, mask) in zip(docs, alone):
        assert np.array_equal(d.input_ids, ids) and np.array_equal(d.loss_mask, mask)
    assert bad.lines == [(str(path), n) for n, _ in alone_bad]
    assert bad.count == 2 * (len(BAD_LINES) + 1) + 1
    assert [e.split(": ", 1)[1] for e in bad.examples[: len(BAD_LINES) + 1]] == [
        reason for _, reason in alone_bad[: len(BAD_LINES) + 1]
    ]
    assert "chat template failed: no, not this one" in bad.examples[0]
    assert seen[-1] == (2 * len(lines) + 2, path.stat().st_size, path.stat().st_size) and len(seen) > 2
    monkeypatch.setattr(data, "CHUNK_CHARS", 600)  # a chunk also ends once it holds 600 characters of text
    fewer, seen_fewer = BadSamples(), []
    again = read_documents(path, tokenizer, VOCAB, "skip", fewer, progress=lambda *done: seen_fewer.append(done))
    assert [(d.line, d.input_ids.tolist()) for d in again] == [(d.line, d.input_ids.tolist()) for d in docs]
    assert fewer.lines == bad.lines and len(seen_fewer) > len(seen) and seen_fewer[-1] == seen[-1]
    first_bad = 1 + 7 + 1
    with pytest.raises(DataError, match=rf"^{path}:{first_bad}: .*no, not this one"):
        read_documents(path, tokenizer, VOCAB, "fail", BadSamples())
