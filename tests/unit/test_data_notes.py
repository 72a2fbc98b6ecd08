"""Data that turns real acceptance off says so where the user looks: the `data:` line that `launcher
up` prints at the start, and `launcher status` and `report` show (from <run_dir>/data.json)."""

import json

import pytest
from transformers import AutoTokenizer, Qwen3Config

from launcher.report import describe_data, report
from services.run.config import dump_json, load_config
from services.run.runspec import HeldOut
from services.target.jobs import pack as pack_job

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there ."}]}
TOKENS = {"input_ids": list(range(5, 45)), "loss_mask": [0] * 10 + [1] * 30}  # its prompt: the first 10
NO_PROMPT = {"input_ids": list(range(5, 45)), "loss_mask": [1] * 40}  # supervised from the first token


@pytest.fixture
def model_dir(tok_dir, tmp_path):
    """A target folder as far as packing reads it: its config and tokenizer (no weights needed)."""
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    ).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def pack(capsys, tmp_path, model_dir, lines, *extra):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    cfg = load_config(None, [f"data.path={data}", f"target.model_path={model_dir}", "data.pack_len=64", *extra])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dump_json(cfg, run_dir / "config.json")
    code = pack_job.main(["--config", str(run_dir / "config.json"), "--run-dir", str(run_dir)])  # what `up` runs
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    return json.loads(out.out.strip().splitlines()[-1]), run_dir


def test_data_without_prompts_says_real_acceptance_is_off(capsys, tmp_path, model_dir):
    info, run_dir = pack(capsys, tmp_path, model_dir, [NO_PROMPT] * 6)
    assert info["prompts"] == 0
    text = describe_data(info)
    assert text.startswith("data: ") and "\nreal acceptance: off, the held-out data has no prompts" in text
    assert "eval.prompts" in text
    (run_dir / "data.json").write_text(json.dumps(info))  # what `launcher up` keeps
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0, "tau": 1.0}) + "\n")
    lines, _ = report(run_dir, out=tmp_path / "p.png")
    assert any(line.startswith("real acceptance: off, the held-out data has no prompts") for line in lines)


def test_pre_tokenized_lines_yield_their_tokens_before_the_first_supervised_one(capsys, tmp_path, model_dir):
    from transformers import AutoTokenizer

    from services.data.prompts import heldout_prompts

    info, run_dir = pack(capsys, tmp_path, model_dir, [TOKENS, NO_PROMPT, TOKENS], "eval.num_prompts=8")
    assert info["prompts"] == 2 and "real acceptance" not in describe_data(info)
    cfg = load_config(run_dir / "config.json")
    assert (
        heldout_prompts(HeldOut.of(cfg), cfg.data, AutoTokenizer.from_pretrained(model_dir), 8)
        == [TOKENS["input_ids"][:10]] * 2
    )


def test_a_bad_prompt_file_is_one_line_naming_file_and_line(capsys, tmp_path, model_dir):
    bad = tmp_path / "bench.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"nothing": 1}\n')
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(CHAT) + "\n")
    cfg = load_config(
        None, [f"data.path={data}", f"target.model_path={model_dir}", "data.pack_len=64", f'eval.prompts=["{bad}"]']
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dump_json(cfg, run_dir / "config.json")
    assert pack_job.main(["--config", str(run_dir / "config.json"), "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"eval.prompts: {bad}:2: expected 'messages', 'conversations', 'prompt' or 'input_ids'; got keys ['nothing']"
    )


def test_chat_data_counts_its_prompts_and_says_nothing_more(capsys, tmp_path, model_dir):
    info, _ = pack(capsys, tmp_path, model_dir, [TOKENS, CHAT, TOKENS, CHAT, CHAT], "eval.num_prompts=2")
    assert info["prompts"] == 2 and "real acceptance" not in describe_data(info)


def test_real_acceptance_turned_off_by_config_is_not_a_warning(capsys, tmp_path, model_dir):
    info, _ = pack(capsys, tmp_path, model_dir, [TOKENS] * 4, "eval.num_prompts=0")
    assert info["prompts"] is None and "real acceptance" not in describe_data(info)
