"""Prompt-set files for real acceptance (`launcher eval --prompts FILE`, eval.prompts): every line
shape a benchmark ships, rendered as training renders its chats, and a bad line named by file and line."""

import gzip
import json

import pytest

from services.data.data_lines import many_prompt_tokens, prompt_tokens, raw_tokens
from services.data.prompts import PromptFileError, interleave, prompt_sets, read_prompt_file, set_name
from services.run.config import load_config
from services.run.runspec import HeldOut

USER = [{"role": "user", "content": "add two numbers"}]


def write(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_every_line_shape_becomes_the_prompt_a_server_would_see(tmp_path, tokenizer):
    rendered = prompt_tokens(tokenizer, USER)
    assert rendered[-3:] != tokenizer("add two numbers")["input_ids"][-3:]  # the template's generation prompt
    path = write(
        tmp_path / "bench.jsonl",
        [
            {"messages": USER},
            {"messages": USER + [{"role": "assistant", "content": "a + b"}]},  # the answer is the target's to give
            {"conversations": [{"from": "human", "value": "add two numbers"}]},
            {"prompt": "add two numbers", "task_id": "x/0"},  # HumanEval's own lines
            json.dumps("add two numbers"),
            "",
            {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]},  # pre-tokenized: before the answer
            {"input_ids": [9, 10]},
        ],
    )
    assert read_prompt_file(path, tokenizer, {}) == [rendered] * 5 + [[5, 6], [9, 10]]
    assert read_prompt_file(path, tokenizer, {}, limit=2) == [rendered] * 2


def test_prompts_tokenized_in_one_batch_are_those_tokenized_one_by_one(tokenizer):
    """Regeneration tokenizes its prompts in one batch per kind; chats and plain texts mixed keep
    their order and each gets the ids of its own call."""
    chats = [USER, [{"role": "user", "content": "reverse a list, then sort it " * 7}], USER[:1]]
    texts = ["def add(a, b):", "import os\n\nclass Walker:"]
    prompts = [texts[0], chats[0], chats[1], texts[1], chats[2]]
    expected = [raw_tokens(tokenizer, p) if isinstance(p, str) else prompt_tokens(tokenizer, p) for p in prompts]
    assert many_prompt_tokens(tokenizer, prompts) == expected
    assert len({len(e) for e in expected}) > 2  # rows of different lengths: no padding crept in
    assert many_prompt_tokens(tokenizer, []) == []


def test_gzip_files_read_as_they_ship_and_sets_are_named_by_file(tmp_path, tokenizer):
    path = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def f(x):\n"}) + "\n")
    other = write(tmp_path / "other.jsonl", [{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}])
    assert set_name(path) == "HumanEval" and set_name(other) == "other"
    cfg = load_config(None, [])
    sets = prompt_sets(HeldOut.of(cfg), cfg.data, tokenizer, [str(path), str(other), str(other)], limit=0)
    assert [(s.name, len(s.prompts)) for s in sets] == [("HumanEval", 1), ("other", 3), ("other'", 3)]
    prompts, names = interleave(sets)
    assert names == ["HumanEval", "other", "other'", "other", "other'", "other", "other'"]
    assert prompts[1] == sets[1].prompts[0] and prompts[3] == sets[1].prompts[1]


def test_the_runs_template_options_render_the_prompts(tmp_path, tokenizer):
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}{% if enable_thinking is defined and not enable_thinking %}"
        "<assistant>[no think]{% else %}<assistant>{% endif %}{% endif %}"
    )
    path = write(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    plain = read_prompt_file(path, tokenizer, {})
    off = read_prompt_file(path, tokenizer, {"enable_thinking": False})
    assert off != plain and tokenizer.decode(off[0]).endswith(tokenizer.decode(tokenizer("[no think]")["input_ids"]))


@pytest.mark.parametrize(
    "line, reason",
    [
        ("{not json", "invalid JSON"),
        ({"nothing": 1}, "expected 'messages', 'conversations', 'prompt' or 'input_ids'; got keys ['nothing']"),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, "only an assistant turn"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "unknown role 'wizard'"),
        ({"input_ids": [1, "x"]}, "'input_ids' must be a list of token ids"),
        ({"input_ids": [1, 2], "loss_mask": [1]}, "'loss_mask' must be a list as long as 'input_ids'"),
        ({"input_ids": [1, 2], "loss_mask": [1, 1]}, "empty prompt"),
        ([1, 2], "expected a JSON object or string, got list"),
    ],
)
def test_a_bad_line_names_file_and_line(tmp_path, tokenizer, line, reason):
    path = write(tmp_path / "bench.jsonl", [{"prompt": "fine"}, line])
    with pytest.raises(PromptFileError) as err:
        read_prompt_file(path, tokenizer, {})
    assert str(err.value).startswith(f"{path}:2: ") and reason in str(err.value)


def test_missing_empty_and_undecodable_files_are_named(tmp_path, tokenizer):
    for path, reason in (
        (tmp_path / "none.jsonl", "prompt file not found"),
        (write(tmp_path / "e.jsonl", [""]), "no prompts"),
    ):
        with pytest.raises(PromptFileError, match=reason):
            read_prompt_file(path, tokenizer, {})
    bad = tmp_path / "b.jsonl.gz"
    bad.write_bytes(b"not gzip at all")
    with pytest.raises(PromptFileError, match=str(bad)):
        read_prompt_file(bad, tokenizer, {})
