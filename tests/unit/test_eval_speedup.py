"""`launcher eval`'s wall-clock speedup over the target alone (services/eval/speedup.py), forced on a CPU
(it is off there by default; on by default on CUDA, where a GPU is) with the demo's tokenizer and a
random target and drafter: the figures of each set and of all of them are in the JSON line and
consistent, the two paths decode the same tokens, a failed timing is reported without costing the
acceptance figures, and the table says it; the demo's last lines (launcher/commands.py demo_speedup)
say it too."""

import functools
import json

import pytest
import torch

from launcher import commands
from services.decoding import decode_progress
from services.decoding.acceptance_text import SPEEDUP_NOTE, speedup_summary, tables
from services.drafter.acceptance.speculative import eval_drafter
from services.drafter.checkpoints.export import export_weights
from services.drafter.modeling.target_head import from_target
from services.eval import launcher_eval, speedup
from services.process import torchao_gate
from services.run import runspec
from services.run.config import dump_json, load_config
from services.run.eval_options import SPEEDUP_PROMPTS
from tests.assets import random_demo

SETS = {"chat": 3, "plain": 2}  # prompts per file: --speedup-prompts 2 times all of one, part of the other
# (device, options, prompts timed per set): forced on a CPU; on CUDA by default, with CUDA graphs
TIMINGS = [("cpu", ["--speedup-prompts", "2"], 2)] + [("cuda", [], SPEEDUP_PROMPTS)] * torch.cuda.is_available()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(run dir, export of a random drafter, the two prompt files) of the random demo."""
    demo, root = random_demo(), tmp_path_factory.mktemp("speedup")
    cfg = load_config(None, demo["overrides"] + ["drafter.block_size=4"])
    (root / "run").mkdir()
    dump_json(cfg, root / "run" / "config.json")
    model_cfg, _ = from_target(runspec.resolve(cfg))
    torch.manual_seed(0)
    weights = eval_drafter(None, model_cfg, "cpu").state_dict()
    export = export_weights(weights, model_cfg, root / "export", dtype="float32")
    chats = [json.loads(line) for line in open(demo["data_path"]).read().splitlines()[: sum(SETS.values())]]
    (root / "chat.jsonl").write_text("".join(json.dumps({"messages": c["messages"]}) + "\n" for c in chats[:3]))
    plain = [{"prompt": c["messages"][0]["content"]} for c in chats[3:]]
    (root / "plain.jsonl").write_text("".join(json.dumps(p) + "\n" for p in plain))
    return root / "run", export, [str(root / "chat.jsonl"), str(root / "plain.jsonl")]


def evaluate(run, capsys, monkeypatch, *extra, device="cpu") -> tuple[int, dict, str]:
    """`launcher eval --json` in this process: (exit code, its record, its stderr)."""
    monkeypatch.setattr(torchao_gate, "hide", lambda: None)  # the child's; this process keeps torchao
    run_dir, export, files = run
    argv = ["--run-dir", str(run_dir), "--checkpoint", str(export), "--device", device, "--json", "--no-controls"]
    argv += [f"--prompts={f}" for f in files] + ["--max-new-tokens", "12", "--threads", "1"]
    threads = torch.get_num_threads()
    try:
        code = launcher_eval.main(argv + list(extra))
    finally:
        torch.set_num_threads(threads)  # main sets its own
    out, err = capsys.readouterr()
    return code, json.loads(out.strip().splitlines()[-1]) if code == 0 else {}, err


@pytest.mark.parametrize("device, options, per_set", TIMINGS, ids=[t[0] for t in TIMINGS])
def test_the_speedup_is_recorded_per_set_and_consistent(run, capsys, monkeypatch, device, options, per_set):
    every_step = functools.partial(decode_progress.Progress, every=0)  # its 10 s, shortened to a line a step
    monkeypatch.setattr(decode_progress, "Progress", every_step)
    code, record, err = evaluate(run, capsys, monkeypatch, *options, device=device)
    assert code == 0, err
    for phase in ("chat, target alone (warm-up pass)", "plain, drafter (timed pass)"):
        assert f"eval: speedup, {phase} " in err  # the progress lines of the timing
    assert record["lossless"] == record["prompts"] == sum(SETS.values())  # the acceptance figures as ever
    for name, size in SETS.items():
        figures = record["sets"][name]["speedup"]
        assert figures["prompts_timed"] == min(per_set, size) and figures["batch"] == 1
        assert figures["device"].split(":")[0] == device  # e.g. "cuda:0 (NVIDIA H200)"
        assert figures["target_alone_s"] > 0 and figures["speculative_s"] > 0
        assert figures["speedup"] == pytest.approx(figures["target_alone_s"] / figures["speculative_s"], abs=1e-3)
        # greedy is lossless: both paths decode the same tokens
        assert figures["identical_outputs"] == figures["prompts_timed"]
        assert figures["target_alone_tokens"] == figures["speculative_tokens"] > 0
        assert figures["speculative_tokens_per_s"] == pytest.approx(
            figures["speculative_tokens"] / figures["speculative_s"], abs=0.1
        )
    overall = record["speedup"]
    assert overall["prompts_timed"] == sum(min(per_set, size) for size in SETS.values())
    assert overall["prompts_per_set"] == per_set
    assert overall["target_alone_s"] == pytest.approx(sum(record["sets"][n]["speedup"]["target_alone_s"] for n in SETS))
    assert overall["speedup"] == pytest.approx(overall["target_alone_s"] / overall["speculative_s"], abs=1e-3)
    assert f"eval: timing the first {per_set} prompts of each set at batch 1" in err
    text = tables(record, "t")  # a line under each set's table and under both sets'
    timed = [record["sets"]["chat"]["speedup"], record["sets"]["plain"]["speedup"], overall]
    assert [line for line in text if line.startswith("  speedup ")] == [
        f"  speedup {f['speedup']:.2f}x: {f['speculative_tokens_per_s']:,.0f} tokens/s speculative vs "
        f"{f['target_alone_tokens_per_s']:,.0f} target alone, {f['prompts_timed']} prompts timed at batch 1 on "
        f"{f['device']}"
        for f in timed
    ]
    assert text[-1] == SPEEDUP_NOTE


def test_off_by_default_on_a_cpu_and_a_failed_timing_keeps_the_acceptance(run, capsys, monkeypatch):
    code, record, _ = evaluate(run, capsys, monkeypatch)
    assert code == 0 and record["speedup"] == {"off": "on CUDA only; --speedup-prompts N forces it"}
    assert "speedup" not in record["sets"]["chat"]
    said = "speedup over the target alone: not measured (on CUDA only; --speedup-prompts N forces it)"
    assert tables(record, "t")[-1] == said

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA out of memory\nmore")

    monkeypatch.setattr(speedup, "decode_slots", broken)
    code, record, err = evaluate(run, capsys, monkeypatch, "--speedup-prompts", "1")
    assert code == 0 and record["lossless"] == sum(SETS.values())
    assert record["sets"]["plain"]["speedup"] == {"error": "RuntimeError: CUDA out of memory"}
    assert record["speedup"] == {"error": "RuntimeError: CUDA out of memory"}
    assert "eval: speedup on chat not measured: RuntimeError: CUDA out of memory" in err


def test_the_demo_says_its_speedup_in_one_line_and_where_it_is_measured_on_a_cpu(tmp_path):
    """The demo's closing lines: on a CPU where the speedup is measured; on CUDA the line of `launcher
    eval --json`'s record (its child process needs a GPU: docs/benchmarks.md has the GPU run)."""
    assert commands.demo_speedup(tmp_path, "cpu") == [
        "speedup over the target alone: measured on CUDA only (`launcher eval --device cuda` on a GPU)"
    ]
    figures = {
        "prompts_timed": 16,
        "identical_outputs": 16,
        "target_alone_tokens_per_s": 350.0,
        "speculative_tokens_per_s": 1225.0,
        "speedup": 3.5,
        "device": "cuda:0 (NVIDIA H200)",
    }
    assert speedup_summary({"speedup": figures}) == [
        "speedup 3.50x: 1,225 tokens/s speculative vs 350 target alone, 16 prompts timed at batch 1 on "
        "cuda:0 (NVIDIA H200)",
        SPEEDUP_NOTE,
    ]
