"""`launcher regenerate`: every assistant turn rewritten by the target, turn by turn, with batched HF
generate; checked against one-prompt-at-a-time greedy decoding of a tiny real Qwen3 made on the spot.
Its chat-template options reach every prompt and its record, which `up` checks; --gpus is a plain list."""

import json
import re

import pytest
import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from launcher import process
from launcher.preflight import PreflightError, check_regenerated
from launcher.regen_record import record_path
from launcher.regenerate import interleave
from launcher.topology import GpuSpecError, parse_gpu_list
from services.data.data_lines import prompt_tokens, read_conversations, sample_path
from services.target.jobs import regenerate_shard
from services.target.jobs.regenerate_shard import HFEngine, regenerate
from services.tools.demo import CHAT_TEMPLATE
from tests.greedy import hf_greedy_generate as greedy_generate
from tests.launching import REPO, run_launcher
from tests.tiny_targets import tiny_hybrid_config

CHATS = [
    {"messages": [{"role": "user", "content": "count from 3 to 9"}, {"role": "assistant", "content": "3 4 5 6 7 8 9"}]},
    {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},
    {
        "messages": [
            {"role": "system", "content": "you are a helpful assistant ."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello !"},
            {"role": "user", "content": "spell river"},
            {"role": "assistant", "content": "r i v e r . done ."},
        ]
    },
    {
        "conversations": [
            {"from": "human", "value": "repeat after me : red stone"},
            {"from": "gpt", "value": "red stone"},
        ]
    },
]


# Qwen3-like: the generation prompt says so when enable_thinking is false; and this one refuses to
# render without the variable, so a prompt rendered without the options fails loudly
THINKING_TEMPLATE = (
    "{%- if enable_thinking is not defined -%}{{ raise_exception('enable_thinking is not set') }}"
    "{%- endif -%}"
    + CHAT_TEMPLATE.replace(
        "'<|im_start|>assistant\\n' -}}",
        "'<|im_start|>assistant\\n' -}}{%- if not enable_thinking -%}{{- 'no thinking .\\n' -}}{%- endif -%}",
    )
)


def make_model(tok_dir, out, chat_template=None, hybrid=False):
    """A tiny random Qwen3 (or, hybrid, a Qwen3.5 of Gated DeltaNet and full attention layers) with
    the test tokenizer, saved in `out`."""
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    if chat_template:
        tokenizer.chat_template = chat_template
    torch.manual_seed(0)
    sizes = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    if hybrid:
        from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

        cfg = tiny_hybrid_config(["linear_attention", "full_attention"] * 2, **sizes)
        model = Qwen3_5ForCausalLM(cfg).eval()
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**sizes, num_hidden_layers=2)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # decisive argmaxes: padding must not change a greedy token
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
    assert out[1] == CHATS[1]  # not chat: copied unchanged
    for record in (out[0], out[2], out[3]):
        messages = record["messages"]
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            # each turn is what the target writes after the turns before it *as regenerated*
            prompt = tokenizer.apply_chat_template(
                messages[:i], tokenize=True, add_generation_prompt=True, return_dict=True
            )["input_ids"]
            want = greedy_generate(model, list(prompt), 8, [tokenizer.eos_token_id])
            assert m["content"] == tokenizer.decode(want, skip_special_tokens=True).strip()
    assert [m["content"] for m in out[2]["messages"] if m["role"] == "user"] == ["hi", "spell river"]


@pytest.mark.processes
def test_launcher_regenerate_writes_the_lines_in_input_order_then_its_sampled_passes(tok_dir, tmp_path):
    make_model(tok_dir, tmp_path / "model")
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    out = run_launcher(
        "regenerate",
        "--model",
        str(tmp_path / "model"),
        "--data",
        str(data),
        "--out",
        str(tmp_path / "regen.jsonl"),
        "--device",
        "cpu",
        "--max-new-tokens",
        "6",
        "--samples",
        "2",
        "--sample-temperature",
        "5",
        cwd=REPO,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Loading weights" not in out.stderr + out.stdout  # transformers' bars are silenced
    assert "torchao" not in out.stderr + out.stdout and "_pytree" not in out.stderr  # fp8 training's only
    lines = [json.loads(t) for t in (tmp_path / "regen.jsonl").read_text().splitlines()]
    assert len(lines) == 4 + 2 * 3 and lines[1] == CHATS[1]  # the first pass, then two of the 3 chat lines
    greedy, *sampled = lines[:4], lines[4:7], lines[7:]
    assert greedy[3]["messages"][0] == {"role": "user", "content": "repeat after me : red stone"}
    for chats in sampled:  # each sampled pass: the chat lines in input order, their own replies
        assert [c["messages"][:1] for c in chats] == [g["messages"][:1] for g in (greedy[0], greedy[2], greedy[3])]
    replies = [[m["content"] for c in chats for m in c["messages"] if m["role"] == "assistant"] for chats in sampled]
    assert replies[0] != replies[1] and replies[0] != [
        m["content"] for c in (greedy[0], greedy[2], greedy[3]) for m in c["messages"] if m["role"] == "assistant"
    ]
    # what it does, while and after: 4 assistant turns in 3 chat lines, 3 times; the pre-tokenized line is named
    said = out.stdout
    assert (
        "regenerating 12 replies (assistant turns of 3 chat lines, then 2 sampled at temperature 5.0)" in said
        and "regenerating: " in said
    ), said
    assert re.search(
        r"^regenerated \d+ replies \(assistant turns of 3 chat lines\) in \dm\d\ds \(hf, the CPU\)$", said, re.M
    ), said
    assert "1 pre-tokenized lines copied unchanged" in said
    # where the time went: every stage of the shard, and the rates while decoding
    assert re.search(
        r"^time: start [\d.]+ s, reading [\d.]+ s, model load [\d.]+ s, tokenizing [\d.]+ s, decoding [\d.]+ s "
        r"\([\d.]+ replies/s, [\d,]+ generated tok/s while decoding\)$",
        said,
        re.M,
    ), said
    assert f"wrote {tmp_path / 'regen.jsonl'}: 10 lines, in input order, then 2 sampled passes of its 3 lines" in said
    assert "target.labels_from_target=true" in said and "labels_from_target=false" not in said  # a copied line
    assert ".part" not in said + out.stderr and '"event"' not in said  # no internal paths
    assert "chat template with" not in said and "data.chat_template_kwargs" not in said  # no options given
    record = json.loads(record_path(tmp_path / "regen.jsonl").read_text())
    assert record["chat_template_kwargs"] == {} and (record["samples"], record["sample_temperature"]) == (2, 5.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "chat.jsonl",
        "model",
        "regen.jsonl",
        "regen.jsonl.regenerate.json",
    ]


@pytest.mark.processes
def test_all_chat_data_is_advised_data_labels_and_pre_tokenized_only_data_is_refused(tok_dir, tmp_path):
    make_model(tok_dir, tmp_path / "model")
    chat, tokens = tmp_path / "chat.jsonl", tmp_path / "tokens.jsonl"
    chat.write_text(json.dumps(CHATS[0]) + "\n")
    tokens.write_text(json.dumps(CHATS[1]) + "\n" + json.dumps(CHATS[1]) + "\n")

    def regen(data):
        return run_launcher(
            "regenerate",
            "--model",
            str(tmp_path / "model"),
            "--data",
            str(data),
            "--out",
            str(tmp_path / "regen.jsonl"),
            "--device",
            "cpu",
            "--max-new-tokens",
            "4",
            cwd=REPO,
            timeout=300,
        )

    out = regen(chat)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "target.labels_from_target=false: every reply is now the target's own" in out.stdout
    assert "pre-tokenized" not in out.stdout.split("\n", 1)[1]
    (tmp_path / "regen.jsonl").unlink()
    out = regen(tokens)
    assert out.returncode == 2 and f"{tokens} has no chat or plain-text lines (2 pre-tokenized lines)" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and not (tmp_path / "regen.jsonl").exists()


@pytest.mark.processes
def test_a_broken_line_is_named_and_nothing_is_written(tok_dir, tmp_path):
    make_model(tok_dir, tmp_path / "model")
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps(CHATS[0]) + "\n\n" + '{"messages": [{"role": "user", "content": "hi"}\n')
    out = run_launcher(
        "regenerate",
        "--model",
        str(tmp_path / "model"),
        "--data",
        str(data),
        "--out",
        str(tmp_path / "regen.jsonl"),
        "--device",
        "cpu",
        cwd=REPO,
        timeout=300,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"launcher: error: {data}:3: " in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert f"{data}:3: invalid JSON: Expecting ',' delimiter at the end of the line" in out.stderr, out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl", "model"]  # no output, no parts


def test_the_chat_template_options_reach_every_prompt(tok_dir, tmp_path, monkeypatch):
    from services.target.verify import slots

    make_model(tok_dir, tmp_path / "model", THINKING_TEMPLATE)
    items = read_conversations_of([CHATS[0], CHATS[2]], tmp_path)
    off = {"enable_thinking": False}
    engine = HFEngine(str(tmp_path / "model"), "cpu", temperature=0.0, template_kwargs=off)
    fed, decode = [], slots.decode_slots

    def spy(target, propose, prompts, **kw):  # the prompts the model is given
        fed.extend(prompts)
        return decode(target, propose, prompts, **kw)

    monkeypatch.setattr(slots, "decode_slots", spy)
    out = regenerate(engine, items, max_new_tokens=4, batch_size=8)
    tokenizer = engine.tokenizer
    want = [
        prompt_tokens(tokenizer, c["messages"][:i], off)
        for c in out
        for i, m in enumerate(c["messages"])
        if m["role"] == "assistant"
    ]
    assert sorted(fed) == sorted(want) and len(fed) == 3
    assert all(tokenizer.decode(p).endswith("<|im_start|>assistant\nno thinking .\n") for p in fed)
    on = prompt_tokens(tokenizer, CHATS[0]["messages"][:1], {"enable_thinking": True})
    assert not tokenizer.decode(on).endswith("no thinking .\n")  # the marker is the option's


def read_conversations_of(records, tmp_path):
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    return read_conversations(data)


def regenerate_cli(model, data, out, *extra):
    return run_launcher(
        "regenerate", "--model", str(model), "--data", str(data), "--out", str(out), *extra, cwd=REPO, timeout=300
    )


@pytest.mark.processes
def test_launcher_regenerate_renders_with_the_options_records_them_and_says_the_config_line(tok_dir, tmp_path):
    make_model(tok_dir, tmp_path / "model", THINKING_TEMPLATE)  # fails to render without enable_thinking
    data, regen = tmp_path / "chat.jsonl", tmp_path / "regen.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    out = regenerate_cli(
        tmp_path / "model",
        data,
        regen,
        "--device",
        "cpu",
        "--max-new-tokens",
        "4",
        "--template-kwarg",
        "enable_thinking=false",
        "--temperature",
        "0",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    said = out.stdout
    assert 'chat template with {"enable_thinking": false}' in said.splitlines()[0], said
    assert (
        "train with data.chat_template_kwargs = {enable_thinking = false} "
        "(in [data]: chat_template_kwargs = {enable_thinking = false})"
    ) in said, said
    record = json.loads(record_path(regen).read_text())
    assert record["chat_template_kwargs"] == {"enable_thinking": False}
    assert record["model"] == str((tmp_path / "model").resolve()) and record["data"] == str(data.resolve())
    assert (record["engine"], record["temperature"], record["max_new_tokens"]) == ("hf", 0.0, 4)
    assert (record["lines"], record["chat_lines"], record["turns"]) == (4, 3, 4)
    import hashlib

    assert record["sha256"] == hashlib.sha256(regen.read_bytes()).hexdigest()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "chat.jsonl",
        "model",
        "regen.jsonl",
        "regen.jsonl.regenerate.json",
    ]
    # what `up` makes of it: the same options pass, others are refused with the fix
    check_regenerated("data.path", str(regen), {"enable_thinking": False})
    with pytest.raises(
        PreflightError,
        match=re.escape(
            f'data.path {regen} was regenerated with chat_template_kwargs {{"enable_thinking": false}}, the run '
            "renders with {}: set data.chat_template_kwargs = {enable_thinking = false}"
        ),
    ):
        check_regenerated("data.path", str(regen), {})
    # without the options the template refuses to render: they are what made the run above work
    again = regenerate_cli(
        tmp_path / "model", data, tmp_path / "plain.jsonl", "--device", "cpu", "--max-new-tokens", "2"
    )
    assert again.returncode != 0 and "enable_thinking is not set" in again.stderr


def one_chat_and_a_bare_model(tmp_path):
    """A one-line chat file, and tmp_path/model: a folder with a config.json and a tokenizer file,
    enough for the launcher's checks that come before any model loads."""
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps(CHATS[0]) + "\n")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "model" / "tokenizer.json").write_text("{}")
    return data


@pytest.mark.processes
def test_a_bad_template_kwarg_is_one_line(tok_dir, tmp_path):
    data = one_chat_and_a_bare_model(tmp_path)
    out = regenerate_cli(tmp_path / "model", data, tmp_path / "o.jsonl", "--device", "cpu", "--template-kwarg", "=1")
    assert out.returncode == 2 and out.stderr.strip() == (
        "launcher: error: --template-kwarg '=1': expected KEY=VALUE, e.g. enable_thinking=false"
    ), out.stderr


@pytest.mark.parametrize("samples", [["--samples", "-1"], ["--samples", "2", "--sample-temperature", "0"]])
def test_sampled_passes_without_a_count_or_a_temperature_are_one_line(tok_dir, tmp_path, samples):
    data = one_chat_and_a_bare_model(tmp_path)
    out = regenerate_cli(tmp_path / "model", data, tmp_path / "o.jsonl", "--device", "cpu", *samples)
    assert out.returncode == 2 and "sampled passes need --samples >= 1 and --sample-temperature > 0" in out.stderr
    assert out.stderr.count("\n") == 1 and not (tmp_path / "o.jsonl").exists(), out.stderr


def test_gpus_is_a_plain_list():
    assert parse_gpu_list("0-3") == [0, 1, 2, 3]
    assert parse_gpu_list("0,2,5") == parse_gpu_list("0+2+5") == [0, 2, 5]
    assert parse_gpu_list(" 4-5,1 ") == [4, 5, 1]
    assert parse_gpu_list("0-3", available=4) == [0, 1, 2, 3]
    for bad, needle in (
        ("0-x", "--gpus '0-x': '0-x' is not a GPU number or range like 0-4"),
        ("3-1", "--gpus '3-1': range '3-1' is empty or negative"),
        ("0-3:target", "without roles or hosts"),
        ("1,0-2", "GPU 1 is given twice"),
        ("", "--gpus is empty"),
    ):
        with pytest.raises(GpuSpecError, match=re.escape(needle)):
            parse_gpu_list(bad)
    with pytest.raises(GpuSpecError, match=re.escape("GPU 4 does not exist (this machine has 4: 0-3)")):
        parse_gpu_list("2-4", available=4)


@pytest.mark.processes
def test_launcher_regenerate_gpus_is_not_an_up_spec(tmp_path):
    """`--gpus 0-1 --device cuda` once failed with up's 'no drafter GPU'; now: a GPU list, checked against the GPUs."""
    data = one_chat_and_a_bare_model(tmp_path)
    bad = regenerate_cli(tmp_path / "model", data, tmp_path / "o.jsonl", "--device", "cuda", "--gpus", "0-x")
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "launcher: error: --gpus '0-x': '0-x' is not a GPU number or range like 0-4"
    ), bad.stderr
    if process.gpu_count():
        pytest.skip("this machine has a GPU: the no-GPU line is not reachable")
    out = regenerate_cli(tmp_path / "model", data, tmp_path / "o.jsonl", "--device", "cuda", "--gpus", "0-1")
    assert out.returncode == 2 and "drafter" not in out.stderr, out.stderr
    assert out.stderr.strip() == (
        "launcher: error: --device cuda but no NVIDIA GPU is visible; use --device cpu for a CPU run"
    ), out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl", "model"]


@pytest.mark.parametrize("hybrid", [False, True])
def test_slot_regeneration_is_transformers_generate_and_samples_reproducibly(tok_dir, tmp_path, hybrid, request):
    """The hf engine decodes a target on rows of a KV cache (services/target/verify/slots.py; a hybrid's
    Gated DeltaNet state per row): greedy replies equal transformers' own batched, left-padded
    `generate`; sampling is seeded."""
    from transformers import AutoModelForCausalLM

    if hybrid:
        request.getfixturevalue("hf_torch_hybrid")  # transformers' reference: its pure-torch Gated DeltaNet
    make_model(tok_dir, tmp_path / "model", hybrid=hybrid)
    engine = HFEngine(str(tmp_path / "model"), "cpu", temperature=0.0)
    assert engine.slots is not None
    convs = [c["messages"][:-1] for c in (CHATS[0], CHATS[2])] + [[{"role": "user", "content": "spell stone"}]]
    got = engine.generate(convs, max_new_tokens=12, batch_size=2)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model", padding_side="left")
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in convs]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    want = [tokenizer.decode(row[batch["input_ids"].shape[1] :], skip_special_tokens=True).strip() for row in out]
    assert got == want and any(want)
    assert engine.generate(convs, max_new_tokens=12, batch_size=0) == want  # 0: as many as fit (32 on CPU)
    sampled = [HFEngine(str(tmp_path / "model"), "cpu", temperature=5.0).generate(convs, 12, 2) for _ in range(2)]
    assert sampled[0] == sampled[1] != got  # the same seed, the same draws; not the greedy replies


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_batch_takes_the_rows_half_the_free_gpu_memory_holds(tok_dir, tmp_path):
    make_model(tok_dir, tmp_path / "model")
    engine = HFEngine(str(tmp_path / "model"), "cuda", temperature=0.0)
    few = engine.rows_that_fit(capacity=1 << 20)  # a million-token row: few fit
    assert 1 <= few < engine.rows_that_fit(capacity=256) <= 3072


def test_a_base_model_continues_plain_text_lines_and_trains_on_them(tok_dir, tmp_path):
    """A target without a chat template (a pretrained base model): {"prompt"} and {"text"} lines are
    continued as plain text and written as {"prompt", "completion"}, the completion the target's
    greedy continuation of the prompt's tokens; training reads such lines (the completion
    supervised, the prompt not) and {"text"} lines (every token)."""
    from services.target.batches.data import line_to_document

    model, _ = make_model(tok_dir, tmp_path / "base")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "base")
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path / "base")  # no template: a base model
    data = tmp_path / "plain.jsonl"
    lines = [{"prompt": "count from 3 to", "id": 7}, {"text": "spell river : r i"}, CHATS[1]]
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    engine = HFEngine(str(tmp_path / "base"), "cpu", temperature=0.0)
    out = regenerate(engine, read_conversations(data), max_new_tokens=6, batch_size=0)
    assert out[2] == CHATS[1]  # pre-tokenized: copied
    assert out[0]["id"] == 7 and out[0]["prompt"] == "count from 3 to" and out[1]["prompt"] == "spell river : r i"
    for line, text in zip(out[:2], ("count from 3 to", "spell river : r i")):
        ids = tokenizer(text)["input_ids"]
        want = greedy_generate(model, ids, 6, stop_ids=[tokenizer.eos_token_id])
        assert line["completion"] == tokenizer.decode(want, skip_special_tokens=True) and line["completion"].strip()
        doc_ids, mask = line_to_document(json.dumps(line), tokenizer, len(tokenizer))
        assert list(doc_ids[: len(ids)]) == ids and not mask[: len(ids)].any() and mask[len(ids) :].all()
    doc_ids, mask = line_to_document(json.dumps(lines[1]), tokenizer, len(tokenizer))
    assert list(doc_ids) == tokenizer(lines[1]["text"])["input_ids"] and mask.all()
    with pytest.raises(ValueError, match="'completion'"):
        line_to_document(json.dumps(lines[0]), tokenizer, len(tokenizer))
    # a target that ends the text at once: its greedy first token made the end of text
    first = greedy_generate(model, tokenizer(lines[0]["prompt"])["input_ids"], 1, stop_ids=[])[0]
    engine.tokenizer.eos_token = tokenizer.convert_ids_to_tokens(first)
    counts = {}
    out = regenerate(engine, read_conversations(data), max_new_tokens=6, batch_size=0, counts=counts)
    assert out[0] == {"id": 7, "text": lines[0]["prompt"]} and counts["empty"] >= 1  # the line still trains
    doc_ids, mask = line_to_document(json.dumps(out[0]), tokenizer, len(tokenizer))
    assert list(doc_ids) == tokenizer(lines[0]["prompt"])["input_ids"] and mask.any()


@pytest.mark.processes
def test_cut_prompts_continues_prompts_cut_from_the_text_lines_and_says_so_in_the_record(tok_dir, tmp_path):
    """`launcher regenerate --cut-prompts N` on a base model's {"text"} documents: N prompts cut at line
    ends from the documents in turn (kept beside the output), each continued by the target into a
    {"prompt", "completion"} line; a file with no text long enough to cut from is one line, exit 2."""
    from services.data.text_prompts import cut_prompts

    make_model(tok_dir, tmp_path / "base")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "base")
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path / "base")
    docs = ["".join(f"count {i} to {i + 1}\n" for i in range(d, d + 20)) for d in range(2)]
    data, out = tmp_path / "text.jsonl", tmp_path / "regen.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    done = regenerate_cli(
        tmp_path / "base", data, out, "--device", "cpu", "--max-new-tokens", "3", "--cut-prompts", "5"
    )
    assert done.returncode == 0, done.stderr
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    want = [p["prompt"] for p in cut_prompts(docs, 5)]
    assert len(lines) == 5 and [x.get("prompt", x.get("text")) for x in lines] == want
    assert all(x["prompt"] in docs[k % 2] and x["prompt"].endswith("\n") for k, x in enumerate(lines) if "prompt" in x)
    assert any(x.get("completion") for x in lines)  # the target's continuations
    assert [json.loads(x)["prompt"] for x in (tmp_path / "regen.jsonl.prompts.jsonl").read_text().splitlines()] == want
    record = json.loads((tmp_path / "regen.jsonl.regenerate.json").read_text())
    assert record["data"] == str(data.resolve()) and record["cut_prompts"] == 5
    data.write_text(json.dumps({"text": "one line"}) + "\n")
    refused = regenerate_cli(tmp_path / "base", data, out, "--device", "cpu", "--cut-prompts", "5")
    assert refused.returncode == 2 and f'--cut-prompts 5: {data} has no {{"text"}} line of 8 lines' in refused.stderr
    refused = regenerate_cli(tmp_path / "base", data, out, "--device", "cpu", "--cut-prompts", "-1")
    assert refused.returncode == 2 and "--cut-prompts -1: a count of prompts" in refused.stderr


def test_each_sampled_pass_of_a_shard_draws_from_its_own_seed(tok_dir, tmp_path, capsys):
    """regenerate_shard --samples: pass k of shard i from seed SAMPLE_SEED * k + i, so a rerun writes
    the same replies, and the passes (and the shards) differ from each other."""
    make_model(tok_dir, tmp_path / "model")
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CHATS))

    def shard(out, index):
        argv = ["--model", str(tmp_path / "model"), "--data", str(data), "--out", str(out), "--device", "cpu"]
        argv += ["--max-new-tokens", "6", "--samples", "2", "--sample-temperature", "5", "--shard", f"{index}/1"]
        assert regenerate_shard.main(argv) == 0
        return [sample_path(out, k).read_text() for k in (1, 2)]

    first, again = shard(tmp_path / "a.jsonl", 0), shard(tmp_path / "b.jsonl", 0)
    assert first == again and first[0] != first[1]
    assert len(first[0].splitlines()) == 3  # the chat lines; the pre-tokenized one only in the first pass
    final = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert final["samples"] == 2 and final["turns"] == 3 * 4


def test_the_shards_of_a_pass_interleave_back_into_input_order():
    shards = ["0\n3\n6\n", "1\n4\n", "2\n5\n"]  # 7 lines over 3 shards: i, i+3, ...
    assert interleave(shards) == [str(i) for i in range(7)]
    assert interleave([""]) == []
