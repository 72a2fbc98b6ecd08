"""What `launcher up` refuses before it makes a run folder (one line, exit 2, no folder left behind),
and the small things it says: a resume, the prompts of real acceptance, `keys`, `plan --gpus`."""

import contextlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from launcher.gpu_split import describe, plan_gpus
from launcher.preflight import PreflightError, preflight, resumed_from, resumed_line
from launcher.regen_record import record_path, write_record
from launcher.report import describe_real_acceptance
from services.run.config import load_config
from services.tools.demo import demo_overrides
from tests.launching import run_launcher

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}
SPEC = ["up", "--device", "cpu", "--gpus", "0:target,1:drafter"]


@pytest.fixture
def model(tmp_path, tok_dir):
    """A target folder as `up` reads it before any worker: config.json, the tokenizer and a weights file
    (not read before the workers)."""
    path = tmp_path / "model"
    shutil.copytree(tok_dir, path)
    (path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen3",
                "num_hidden_layers": 8,
                "hidden_size": 64,
                "vocab_size": 640,
                "num_attention_heads": 4,
                "intermediate_size": 128,
            }
        )
    )
    (path / "model.safetensors").write_bytes(b"")
    return path


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(CHAT) + "\n")
    return path


def refused(tmp_path, *args) -> str:
    """Run `up` in tmp_path (runs/ under it); it must exit 2 with one line and leave no folder; the line."""
    out = run_launcher(*SPEC, *args, cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    runs = tmp_path / "runs"
    assert not runs.exists() or not list(runs.iterdir()), list(runs.iterdir())  # no orphan, no staging folder
    return out.stderr.strip()


@pytest.mark.processes
def test_a_model_folder_without_tokenizer_files_is_one_line(tmp_path, model, data):
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (model / name).unlink()
    line = refused(tmp_path, f"target.model_path={model}", f"data.path={data}")
    assert f"target.model_path: no tokenizer in {model}" in line


@pytest.mark.processes
@pytest.mark.parametrize(
    "weights, needle",
    [
        ({}, "target.model_path: no weights in {model} (no *.safetensors, *.bin or index json"),
        (
            {
                "model.safetensors.index.json": json.dumps(
                    {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
                ),
                "model-00001-of-00002.safetensors": "",
            },
            "model.safetensors.index.json names 1 weight files that are not in {model} "
            "(model-00002-of-00002.safetensors)",
        ),
        ({"pytorch_model.bin": ""}, "{model} has weights as pytorch_model.bin but no model.safetensors"),
    ],
)
def test_a_model_folder_without_its_weights_is_one_line(tmp_path, model, data, weights, needle):
    (model / "model.safetensors").unlink()
    for name, text in weights.items():
        (model / name).write_text(text)
    assert needle.format(model=model) in refused(tmp_path, f"target.model_path={model}", f"data.path={data}")
    (model / "model-00002-of-00002.safetensors").write_text("")  # every file of an index: passes
    if "model.safetensors.index.json" in weights:
        preflight(load_config(None, [f"target.model_path={model}", f"data.path={data}"]), "cpu", True)


@pytest.mark.processes
def test_chat_data_needs_a_chat_template(tmp_path, model, data):
    (model / "chat_template.jinja").unlink()
    line = refused(tmp_path, f"target.model_path={model}", f"data.path={data}")
    assert f"the tokenizer in {model} has no chat template, needed for the chat lines of data.path {data}" in line
    pretokenized = tmp_path / "ids.jsonl"  # pre-tokenized lines need no template: not refused for it
    pretokenized.write_text(json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}) + "\n")
    line = refused(tmp_path, f"target.model_path={model}", f"data.path={pretokenized}", "kernels.attention=flex")
    assert "chat template" not in line and "kernels.attention=flex needs --device cuda" in line


@pytest.mark.processes
def test_a_tokenizer_that_does_not_load_is_one_line_and_leaves_no_folder(tmp_path, model, data):
    (model / "tokenizer.json").write_text("{not a tokenizer")
    line = refused(tmp_path, f"target.model_path={model}", f"data.path={data}")
    assert line.startswith(f"launcher: error: target.model_path: cannot load the config and tokenizer of {model}: ")


@pytest.mark.processes
def test_a_bad_data_line_leaves_no_run_folder(tmp_path, model):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(CHAT) + "\n" + '{"messages": [\n')
    line = refused(tmp_path, f"target.model_path={model}", f"data.path={bad}")
    assert f"{bad}:2: invalid JSON: Expecting value at the end of the line" in line


@pytest.mark.processes
@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["data.pack_len=8"], "drafter.num_anchors=512 is larger than data.pack_len=8"),
        (
            ["data.pack_len=64", "drafter.num_anchors=8", "drafter.block_size=128"],
            "drafter.block_size=128 is larger than data.pack_len=64",
        ),
        (["kernels.attention=flex"], "kernels.attention=flex needs --device cuda"),
        (['kernels.precision="fp8"'], "kernels.precision=fp8 needs --device cuda (FP8 matmuls, compute capability"),
        (
            ["transport.max_batch_bytes=1000000", "transport.chunk_bytes=1000000"],
            "transport.max_batch_bytes=1000000 is smaller than one batch's hidden states "
            "(5242880 bytes: data.pack_len=8192",
        ),
        (["data.max_doc_len=10000"], "data.max_doc_len=10000 is larger than data.pack_len=8192"),
        (["optimizer.grad_accum=0"], "optimizer.grad_accum must be >= 1"),
        (["optimizer.lr=-1"], "optimizer.lr must be > 0, got -1"),
        (["optimizer.lr=0"], "optimizer.lr must be > 0, got 0"),
        (["optimizer.warmup_ratio=1"], "optimizer.warmup_ratio must be in [0, 1), got 1"),
        (["optimizer.grad_clip=-0.5"], "optimizer.grad_clip must be >= 0"),
        (["optimizer.weight_decay=-0.1"], "optimizer.weight_decay must be >= 0"),
        (["optimizer.min_lr_ratio=2"], "optimizer.min_lr_ratio must be in [0, 1]"),
        (["run.max_steps=-3"], "run.max_steps must be >= 0"),
        (["transport.base_port=70000"], "transport.base_port must be a port"),
        (["target.dtype=float64"], "target.dtype must be one of"),
        (
            ["target.attn_implementation=flash_attention_2", "target.dtype=float32"],
            "target.attn_implementation=flash_attention_2 needs target.dtype bfloat16 or float16",
        ),
    ],
)
def test_config_sizes_and_the_device_are_checked_before_any_folder(tmp_path, model, data, overrides, needle):
    line = refused(tmp_path, f"target.model_path={model}", f"data.path={data}", *overrides)
    assert needle in line


@pytest.mark.processes
def test_empty_or_odd_data_files_are_named(tmp_path, model):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert f"data.path: {empty} is empty (no JSONL lines)" in refused(
        tmp_path, f"target.model_path={model}", f"data.path={empty}"
    )
    assert f"data.path: {tmp_path} is not a file" in refused(
        tmp_path, f"target.model_path={model}", f"data.path={tmp_path}"
    )
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(CHAT) + "\n")
    line = refused(
        tmp_path, f"target.model_path={model}", f"data.path={good}", f"data.eval_path={tmp_path / 'no.jsonl'}"
    )
    assert f"data.eval_path: {tmp_path / 'no.jsonl'} does not exist" in line


@pytest.mark.processes
def test_data_regenerated_with_other_chat_template_options_is_refused(tmp_path, model, data, capsys):
    """`launcher regenerate`'s record beside the data: the run must render the chats as it did."""
    write_record(data, {"chat_template_kwargs": {"enable_thinking": False}})
    line = refused(tmp_path, f"target.model_path={model}", f"data.path={data}")
    assert line == (
        f"launcher: error: data.path {data} was regenerated with chat_template_kwargs "
        '{"enable_thinking": false}, the run renders with {}: '
        "set data.chat_template_kwargs = {enable_thinking = false}"
    )
    base = [f"target.model_path={model}", f"data.path={data}"]
    preflight(load_config(None, base + ["data.chat_template_kwargs={enable_thinking=false}"]), "cpu", True)
    with pytest.raises(PreflightError, match=re.escape('the run renders with {"enable_thinking": true}')):
        preflight(load_config(None, base + ["data.chat_template_kwargs={enable_thinking=true}"]), "cpu", True)
    heldout = tmp_path / "heldout.jsonl"  # data.eval_path is checked the same way
    heldout.write_text(json.dumps(CHAT) + "\n")
    write_record(heldout, {"chat_template_kwargs": {"enable_thinking": True}})
    with pytest.raises(PreflightError, match=re.escape(f"data.eval_path {heldout} was regenerated with")):
        preflight(
            load_config(
                None, base + ["data.chat_template_kwargs={enable_thinking=false}", f"data.eval_path={heldout}"]
            ),
            "cpu",
            True,
        )
    assert capsys.readouterr().err == ""
    # an edited file is no longer what the record describes: a warning, not a refusal
    with open(data, "a") as f:
        f.write(json.dumps(CHAT) + "\n")
    preflight(load_config(None, base), "cpu", True)
    assert capsys.readouterr().err == (
        f"launcher: warning: {data.name}.regenerate.json says data.path {data} was regenerated with "
        'chat_template_kwargs {"enable_thinking": false}, the run renders with {}; but '
        f"{data} changed since (its sha256 differs), so this is not checked: render as the data was written\n"
    )


def test_data_without_a_record_or_with_a_broken_one_is_not_checked(tmp_path, model, data):
    base = [f"target.model_path={model}", f"data.path={data}", "data.chat_template_kwargs={enable_thinking=false}"]
    preflight(load_config(None, base), "cpu", True)  # no record: nothing to compare
    record_path(data).write_text("{not json")
    preflight(load_config(None, base), "cpu", True)


@pytest.mark.processes
def test_resume_of_a_run_dir_that_does_not_exist_is_refused(tmp_path, model, data):
    line = refused(
        tmp_path,
        f"target.model_path={model}",
        f"data.path={data}",
        "--resume",
        "--run-dir",
        str(tmp_path / "runs" / "nope"),
    )
    assert f"--resume: {tmp_path / 'runs' / 'nope'} does not exist, so there is nothing to resume" in line


def test_the_launcher_says_what_a_drafter_resumed_from(tmp_path):
    import logging

    from services.process.log import EVENTS, LineFormat

    def line(logger: str, message: str) -> str:  # as a worker's log has it (services.process.log's format)
        return (
            LineFormat("drafter-0").format(logging.LogRecord(logger, logging.INFO, "", 0, message, None, None)) + "\n"
        )

    log = tmp_path / "logs" / "drafter-0.log"
    log.parent.mkdir()
    resumed = {
        "event": "resumed",
        "rank": 0,
        "checkpoint": "/r/checkpoints/step-00000040",
        "step": 40,
        "micro_step": 80,
    }
    log.write_text(
        "\n===== 2026-01-01 00:00:00 start: drafter\n"
        + line(EVENTS.name, json.dumps(resumed))
        + "\n===== 2026-01-01 00:10:00 start: drafter\n"
        + line("drafter", "loading")
    )
    checkpoints = tmp_path / "checkpoints"
    assert resumed_line(resumed_from(log), checkpoints) == f"no checkpoint in {checkpoints}: training starts at step 0"
    with open(log, "a") as f:  # only what this start of the worker logged counts
        f.write(line(EVENTS.name, json.dumps(dict(resumed, step=60))))
    assert resumed_line(resumed_from(log), checkpoints) == "resumed from step 60 (/r/checkpoints/step-00000040)"


def test_a_resume_past_a_corrupt_checkpoint_says_which_and_why_on_the_console(tmp_path):
    """The newest checkpoint fails verification: the drafter resumes from the one before, and the
    launcher's line names the one skipped and why (not only logs/drafter-0.log)."""
    import logging

    from services.drafter.checkpoints.checkpoint import find_resume_point, make_meta, write_checkpoint
    from services.drafter.modeling.model import DFlashDrafter, DrafterModelConfig
    from services.process.log import EVENTS, LineFormat
    from tests.unit.test_export_serving import TINY

    cfg, run_config = DrafterModelConfig(**TINY), load_config(None, []).to_dict()
    weights = DFlashDrafter(cfg).state_dict()
    for step in (5, 6):
        meta = make_meta({"step": step, "micro_step": step}, cfg, world_size=1)
        newest = write_checkpoint(
            tmp_path / "checkpoints", step, weights=weights, optimizer={}, rng={}, config=run_config, keep=3, meta=meta
        )
    (newest / "model.safetensors").write_bytes(b"garbage")
    found = find_resume_point(tmp_path, cfg, run_config, 1, warn=lambda _: None)
    assert found.path.name == "step-00000005"
    (why,) = found.skipped
    assert why.startswith("step-00000006: model.safetensors has 7 bytes, manifest says ") and "truncated" in why
    resumed = {"event": "resumed", "checkpoint": str(found.path), "skipped": found.skipped, "step": 5}
    record = logging.LogRecord(EVENTS.name, logging.INFO, "", 0, json.dumps(resumed), None, None)
    log = tmp_path / "logs" / "drafter-0.log"
    log.parent.mkdir()
    log.write_text("\n===== 2026-01-01 00:00:00 start: drafter\n" + LineFormat("drafter-0").format(record) + "\n")
    assert resumed_from(log) == {"step": 5, "checkpoint": str(found.path), "skipped": [why]}  # run.json's `resumed`
    line = resumed_line(resumed_from(log), tmp_path / "checkpoints")
    assert line == f"resumed from step 5 ({found.path}); skipped 1 newer corrupt checkpoint(s): {why}"


def test_real_acceptance_on_training_prompts_says_so():
    record = {
        "prompts": 16,
        "acceptance_per_prompt": 3.0,
        "acceptance_per_step": 2.5,
        "tokens_per_forward": 2.0,
        "lossless": 16,
    }
    assert (
        "16 training prompts (no held-out split: set data.eval_fraction or data.eval_path)"
        in describe_real_acceptance(dict(record, held_out=False), "step 9")[0]
    )
    assert "16 held-out prompts" in describe_real_acceptance(dict(record, held_out=True), "step 9")[0]
    assert "held-out" not in describe_real_acceptance(record, "step 9")[0]  # older records: not claimed either way


def test_the_demo_target_is_bfloat16_on_cuda():
    assert "target.dtype=bfloat16" in demo_overrides("/m", "/d.jsonl", "cuda")
    assert "target.dtype=float32" in demo_overrides("/m", "/d.jsonl", "cpu")


@pytest.mark.processes
def test_keys_says_force(tmp_path):
    assert run_launcher("keys", str(tmp_path / "k"), cwd=tmp_path).returncode == 0
    again = run_launcher("keys", str(tmp_path / "k"), cwd=tmp_path)
    assert again.returncode == 2 and "pass --force to replace the keys" in again.stderr
    assert "overwrite=True" not in again.stderr
    assert run_launcher("keys", str(tmp_path / "k"), "--force", cwd=tmp_path).returncode == 0


def test_plan_gpus_takes_a_count_a_list_or_an_up_spec():
    assert plan_gpus("4") == plan_gpus("0-3") == plan_gpus("0-2:target,3:drafter") == [0, 1, 2, 3]
    assert plan_gpus("2+4-5") == [2, 4, 5]
    for bad, needle in (("1", "at least 2 GPUs"), ("0-1:painter", "unknown role"), ("0:target@h,1:drafter@h", "@HOST")):
        with pytest.raises(ValueError, match=needle):
            plan_gpus(bad)
    measured = {
        "device": "cuda",
        "target": {"tok_s": 100.0, "path": "packed", "mean_real_tokens": 10},
        "drafter": {"tok_s": 100.0, "step_s": 0.1},
    }
    assert describe(measured, [2, 4, 5, 6]).endswith("use: --gpus 2+4:target,5-6:drafter")


def test_eval_takes_device_like_every_other_command(tmp_path):
    from launcher.parser import build_parser

    for flag in ("--device", "--eval-device"):
        args = build_parser().parse_args(["eval", flag, "cuda:1"])
        assert args.eval_device == "cuda:1"


@contextlib.contextmanager
def supervisor_with_health():
    """A Supervisor of 0:target,1:drafter on CPU whose workers are `sleep` processes, each with a real
    health server the test sets the state of: (sup, [target's server, drafter's server])."""
    import tempfile

    from launcher.supervisor import Supervisor
    from launcher.topology import parse_gpu_spec
    from services.process.health import HealthServer
    from services.run.config import load_config

    run_dir = Path(tempfile.mkdtemp(prefix="dfl"))  # short: ipc socket paths stay < 108 bytes
    workers = parse_gpu_spec("0:target,1:drafter")
    sup = Supervisor(run_dir, load_config(None, []), workers, "cpu")
    servers = [HealthServer(sup.endpoints(w)["health"], w.role, w.rank, "cpu") for w in workers]
    sup.procs = {w.name: subprocess.Popen(["sleep", "60"]) for w in workers}
    try:
        yield sup, servers
    finally:
        for server in servers:
            server.close()
        for proc in sup.procs.values():
            proc.kill()
            proc.wait()
        shutil.rmtree(run_dir)


@pytest.mark.processes
def test_wait_ready_never_shows_an_empty_waiting_list(capsys):
    with supervisor_with_health() as (sup, servers):
        for server in servers:
            server.set(state="ready")
        sup.wait_ready()
    out = capsys.readouterr().out
    assert "all workers ready" in out
    assert all(line.strip() != "starting… waiting for" for line in out.splitlines()), out


@pytest.mark.processes
def test_a_long_start_prints_a_line_with_the_time_waited_while_it_lasts(capsys):
    """In a log (systemd, a file) the start line comes again while one state lasts, with the time waited:
    a 5-minute compile or model load is never 5 minutes of silence."""
    import threading

    with supervisor_with_health() as (sup, servers):
        sup.progress.every_s = 1.0
        servers[0].set(state="ready")
        servers[1].set(state="compiling")
        timer = threading.Timer(3.5, lambda: servers[1].set(state="ready"))
        timer.start()
        sup.wait_ready()
        timer.join()
    lines = [line for line in capsys.readouterr().out.splitlines() if "drafter-0:compiling" in line]
    assert len(lines) >= 2 and lines[0].startswith("starting… waiting for drafter-0:compiling (0m0"), lines
    assert lines[-1] != lines[0] and lines[-1].endswith("s)"), lines


# --- paths: written absolute, so the run's config reads the same from any folder ----------------------


def up_in_process(monkeypatch, cwd, *args) -> int:
    """`launcher up` in this process, run from cwd, up to the workers (none is started: the run
    'finishes' at once); returns its exit code."""
    from launcher import cli, up

    monkeypatch.chdir(cwd)
    monkeypatch.setattr(up, "run_supervised", lambda sup, on_ready=None: (0, ""))
    monkeypatch.setattr(up.Supervisor, "install_signal_handlers", lambda self: None)
    return cli.main([*SPEC, *args])


def test_relative_paths_are_written_absolute_and_read_back_from_another_folder(tmp_path, model, data, monkeypatch):
    from launcher.inputs import check_inputs
    from services.run import runspec

    a, b, run = tmp_path / "A", tmp_path / "B", tmp_path / "run"
    (a / "models").mkdir(parents=True)
    (a / "data").mkdir()
    b.mkdir()
    shutil.move(model, a / "models" / "my-model")
    shutil.move(data, a / "data" / "chat.jsonl")
    (a / "prompts.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    (a / "keys").mkdir()
    code = up_in_process(
        monkeypatch,
        a,
        "--run-dir",
        str(run),
        "target.model_path=./models/my-model",
        "data.path=data/chat.jsonl",
        "data.eval_path=data/../data/chat.jsonl",
        'eval.prompts=["prompts.jsonl"]',
        "transport.curve_keys_dir=keys",
    )
    assert code == 0
    written = json.loads((run / "config.json").read_text())
    assert written["target"]["model_path"] == str(a / "models" / "my-model")
    assert written["data"]["path"] == written["data"]["eval_path"] == str(a / "data" / "chat.jsonl")
    assert written["eval"]["prompts"] == [str(a / "prompts.jsonl")]
    assert written["transport"]["curve_keys_dir"] == str(a / "keys")
    assert runspec.load(run / "runspec.json").model_path == str(a / "models" / "my-model")
    monkeypatch.chdir(b)  # `launcher eval --checkpoint RUN/export` from elsewhere
    cfg = load_config(run / "config.json")
    check_inputs(cfg, runs_targets=True)
    preflight(cfg, "cpu", runs_targets=True)


def test_a_repo_id_stays_a_repo_id_and_every_path_key_is_made_absolute(tmp_path, monkeypatch):
    import dataclasses

    from launcher.inputs import PATH_KEYS, absolute_paths
    from services.run.config import Config

    monkeypatch.chdir(tmp_path)
    cfg = absolute_paths(load_config(None, ["target.model_path=Qwen/Qwen3-8B", "data.path=~/d.jsonl"]))
    assert cfg.target.model_path == "Qwen/Qwen3-8B" and cfg.data.path == str(Path.home() / "d.jsonl")
    assert cfg.data.eval_path == "" and cfg.eval.prompts == []  # unset stays unset
    (tmp_path / "Qwen" / "Qwen3-8B").mkdir(parents=True)  # a local folder of that name: a path
    assert absolute_paths(load_config(None, ["target.model_path=Qwen/Qwen3-8B"])).target.model_path == str(
        tmp_path / "Qwen" / "Qwen3-8B"
    )
    named_like_paths = {
        f"{s.name}.{k.name}"
        for s in dataclasses.fields(Config)
        for k in dataclasses.fields(s.type if not isinstance(s.type, str) else type(getattr(Config(), s.name)))
        if k.name.endswith(("path", "_dir")) or k.name == "prompts"
    }
    assert named_like_paths == set(PATH_KEYS)


def test_units_write_absolute_paths(tmp_path, monkeypatch):
    from launcher.units import render_units

    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.toml").write_text('[target]\nmodel_path = "./models/m"\n[data]\npath = "data/chat.jsonl"\n')
    render_units(
        "0:target,1:drafter",
        "cfg.toml",
        "out",
        str(tmp_path / "run"),
        device="cpu",
        overrides=['eval.prompts=["p.jsonl"]'],
        env_dir=str(tmp_path / "env"),
    )
    written = json.loads((tmp_path / "out" / "dflash-env" / "config.json").read_text())
    assert written["target"]["model_path"] == str(tmp_path / "models" / "m")
    assert written["data"]["path"] == str(tmp_path / "data" / "chat.jsonl")
    assert written["eval"]["prompts"] == [str(tmp_path / "p.jsonl")]


# --- resume: refused before the run folder is touched; the run's own config by default ----------------


@pytest.fixture
def finished_run(tmp_path, model, data, monkeypatch):
    """A run as `up` leaves it once trained: config.json, runspec.json, data.json, run.json (finished)
    and a checkpoint (its config.json and state.json, as services/drafter/checkpoints/checkpoint.py writes them)."""
    from launcher import runlock
    from services.run import runspec

    run, held = tmp_path / "run", len(runlock._held)
    assert (
        up_in_process(
            monkeypatch,
            tmp_path,
            "--run-dir",
            str(run),
            f"target.model_path={model}",
            f"data.path={data}",
            "data.pack_len=1024",
            "drafter.num_anchors=64",
        )
        == 0
    )
    for fd in runlock._held[held:]:  # this launcher has ended: its lock goes
        os.close(fd)
    del runlock._held[held:]
    record = json.loads((run / "run.json").read_text())
    assert record["outcome"]["state"] == "finished"
    (run / "run.json").write_text(json.dumps(dict(record, launcher=None)))  # its launcher is gone
    step = run / "checkpoints" / "step-00000020"
    step.mkdir(parents=True)
    shutil.copy(run / "config.json", step / "config.json")
    (step / "state.json").write_text(json.dumps({"step": 20, "model": runspec.load(run / "runspec.json").drafter}))
    os.symlink(step.name, run / "checkpoints" / "latest")
    return run


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.processes
def test_a_refused_resume_leaves_every_file_of_the_run_as_it_was(tmp_path, model, data, finished_run):
    before = snapshot(finished_run)
    out = run_launcher(
        *SPEC,
        "--run-dir",
        str(finished_run),
        "--resume",
        f"target.model_path={model}",
        f"data.path={data}",
        "data.pack_len=512",
        "drafter.num_anchors=64",
        "drafter.num_layers=2",
        cwd=tmp_path,
        timeout=60,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "data.pack_len: checkpoint 1024, now 512" in out.stderr
    assert "model num_hidden_layers: checkpoint 5, now 2" in out.stderr
    assert out.stdout.startswith("--resume without --config") and len(out.stdout.splitlines()) == 1, out.stdout
    assert snapshot(finished_run) == before


@pytest.mark.processes
def test_resume_without_config_uses_the_runs_own_config(tmp_path, finished_run):
    before = snapshot(finished_run)
    out = run_launcher(*SPEC, "--run-dir", str(finished_run), "--resume", "data.pack_len=512", cwd=tmp_path, timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout.strip() == (
        f"--resume without --config: using the run's config, {finished_run / 'config.json'} "
        "(the overrides given here apply on top)"
    )
    assert "data.pack_len: checkpoint 1024, now 512" in out.stderr and "is not set" not in out.stderr
    assert snapshot(finished_run) == before


def test_max_steps_past_the_epochs_is_said_before_any_worker(tmp_path, model, data, monkeypatch, capsys):
    """Not cut silently to the epochs' end: the user hears, before any worker starts, where the run
    ends and what to set for the steps asked."""
    args = [f"target.model_path={model}", f"data.path={data}", "data.pack_len=1024", "drafter.num_anchors=64"]
    assert up_in_process(monkeypatch, tmp_path, "--run-dir", str(tmp_path / "run"), *args, "run.max_steps=3") == 0
    assert (
        "launcher: warning: run.max_steps=3 is past the end of run.epochs=1 (1 optimizer steps: 1 rows per "
        "epoch on 1 drafter): the run ends at step 1; set run.epochs=3 to train 3 steps\n"
    ) in capsys.readouterr().err
    assert (
        up_in_process(
            monkeypatch, tmp_path, "--run-dir", str(tmp_path / "run2"), *args, "run.max_steps=3", "run.epochs=3"
        )
        == 0
    )
    assert "past the end" not in capsys.readouterr().err
