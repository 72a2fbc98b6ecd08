"""`launcher regenerate`: every assistant turn rewritten by the target, turn by turn, with batched HF
generate; checked against one-prompt-at-a-time greedy decoding of a tiny real Qwen3 made on the spot."""
import json
import re
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from tests.greedy import hf_greedy_generate as greedy_generate
from services.target.regenerate import HFEngine, read_conversations, regenerate

REPO = Path(__file__).resolve().parents[2]
CHATS = [
    {"messages": [{"role": "user", "content": "count from 3 to 9"}, {"role": "assistant", "content": "3 4 5 6 7 8 9"}]},
    {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},
    {"messages": [{"role": "system", "content": "you are a helpful assistant ."},
                  {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello !"},
                  {"role": "user", "content": "spell river"}, {"role": "assistant", "content": "r i v e r . done ."}]},
    {"conversations": [{"from": "human", "value": "repeat after me : red stone"}, {"from": "gpt", "value": "red stone"}]},
]


def make_model(tok_dir, out):
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)            # decisive argmaxes: padding must not change a greedy token
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return model, tokenizer


def test_every_assistant_turn_is_the_targets_greedy_reply(tok_dir, tmp_path):
    model, tokenizer = make_model(tok_dir, tmp_path / "model")
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    items = read_conversations(data)
    engine = HFEngine(str(tmp_path / "model"), "cpu", temperature=0.0)
    out = regenerate(engine, items, max_new_tokens=8, batch_size=3)
    assert out[1] == CHATS[1]                                       # not chat: copied unchanged
    for record in (out[0], out[2], out[3]):
        messages = record["messages"]
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            # each turn is what the target writes after the turns before it *as regenerated*
            prompt = tokenizer.apply_chat_template(messages[:i], tokenize=True, add_generation_prompt=True,
                                                   return_dict=True)["input_ids"]
            want = greedy_generate(model, list(prompt), 8, [tokenizer.eos_token_id])
            assert m["content"] == tokenizer.decode(want, skip_special_tokens=True).strip()
    assert [m["content"] for m in out[2]["messages"] if m["role"] == "user"] == ["hi", "spell river"]


def test_launcher_regenerate_writes_the_lines_in_input_order(tok_dir, tmp_path):
    make_model(tok_dir, tmp_path / "model")
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    out = subprocess.run([sys.executable, "-m", "launcher", "regenerate", "--model", str(tmp_path / "model"),
                          "--data", str(data), "--out", str(tmp_path / "regen.jsonl"), "--device", "cpu",
                          "--max-new-tokens", "6"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Loading weights" not in out.stderr + out.stdout          # transformers' bars are silenced
    lines = [json.loads(t) for t in (tmp_path / "regen.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and lines[1] == CHATS[1]
    assert lines[3]["messages"][0] == {"role": "user", "content": "repeat after me : red stone"}
    # what it does, while and after: 4 assistant turns in 3 chat lines; the pre-tokenized line is named
    said = out.stdout
    assert "regenerating 4 assistant turns in 3 chat lines" in said and "regenerating: " in said, said
    assert re.search(r"^regenerated \d assistant turns in 3 chat lines in \dm\d\ds \(hf, the CPU\)$", said, re.M), said
    assert "1 pre-tokenized lines copied unchanged" in said and f"wrote {tmp_path / 'regen.jsonl'}: 4 lines" in said
    assert "target.labels_from_target=true" in said and "labels_from_target=false" not in said   # a copied line
    assert ".part" not in said + out.stderr and '"event"' not in said                        # no internal paths
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl", "model", "regen.jsonl"]


def test_all_chat_data_is_advised_data_labels_and_pre_tokenized_only_data_is_refused(tok_dir, tmp_path):
    make_model(tok_dir, tmp_path / "model")
    chat, tokens = tmp_path / "chat.jsonl", tmp_path / "tokens.jsonl"
    chat.write_text(json.dumps(CHATS[0]) + "\n")
    tokens.write_text(json.dumps(CHATS[1]) + "\n" + json.dumps(CHATS[1]) + "\n")
    def regen(data):
        return subprocess.run([sys.executable, "-m", "launcher", "regenerate", "--model", str(tmp_path / "model"),
                               "--data", str(data), "--out", str(tmp_path / "regen.jsonl"), "--device", "cpu",
                               "--max-new-tokens", "4"], cwd=REPO, capture_output=True, text=True, timeout=300)
    out = regen(chat)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "target.labels_from_target=false: every reply is now the target's own" in out.stdout
    assert "pre-tokenized" not in out.stdout.split("\n", 1)[1]
    (tmp_path / "regen.jsonl").unlink()
    out = regen(tokens)
    assert out.returncode == 2 and f"{tokens} has no chat lines (2 pre-tokenized lines)" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and not (tmp_path / "regen.jsonl").exists()


def test_a_broken_line_is_named_and_nothing_is_written(tok_dir, tmp_path):
    make_model(tok_dir, tmp_path / "model")
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps(CHATS[0]) + "\n\n" + '{"messages": [{"role": "user", "content": "hi"}\n')
    out = subprocess.run([sys.executable, "-m", "launcher", "regenerate", "--model", str(tmp_path / "model"),
                          "--data", str(data), "--out", str(tmp_path / "regen.jsonl"), "--device", "cpu"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"launcher: error: {data}:3: " in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert f"{data}:3: invalid JSON: Expecting ',' delimiter at the end of the line" in out.stderr, out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl", "model"]     # no output, no parts
