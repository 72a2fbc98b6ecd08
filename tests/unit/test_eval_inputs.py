"""`launcher eval`'s inputs checked before any model loads: a corrupt export names the file and what
is wrong with it (one line, exit 2, no traceback), and a --prompts file that is missing, a folder or
empty is refused by the launcher and by the eval itself before the target loads."""

import pytest
import torch

from launcher import commands
from launcher.cli import main as launcher_main
from services.drafter.checkpoints.export import export_weights
from services.drafter.modeling.model import DFlashDrafter, DrafterModelConfig
from services.eval import launcher_eval, local_spec_eval
from services.process import torchao_gate
from services.run.config import dump_json, load_config
from tests.unit.test_export_serving import TINY


def _no_target(*args, **kwargs):
    raise AssertionError("the target was loaded")


@pytest.fixture
def eval_main(monkeypatch, capsys):
    """launcher eval's main in this process, the target never loaded: (exit code, stderr)."""
    monkeypatch.setattr(torchao_gate, "hide", lambda: None)  # the child's; this process keeps torchao
    monkeypatch.setattr(local_spec_eval, "LocalSpecEval", _no_target)
    threads = torch.get_num_threads()

    def run(*argv) -> tuple[int, str]:
        try:
            code = launcher_eval.main(["--device", "cpu", *map(str, argv)])
        finally:
            torch.set_num_threads(threads)  # main sets its own
        return code, capsys.readouterr().err

    return run


@pytest.fixture
def export(tmp_path):
    """(run dir with a config.json, a fresh export of a tiny drafter) for each corruption."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dump_json(load_config(None, []), run_dir / "config.json")
    cfg = DrafterModelConfig(**{**TINY, "num_hidden_layers": 1, "mask_token_id": 63})
    return run_dir, export_weights(DFlashDrafter(cfg).state_dict(), cfg, tmp_path / "export", "float32")


def truncate(file):
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def garbage(file):
    file.write_bytes(b"\xf0\xff\xfe\x00 not what was written" * 4)  # not UTF-8, not safetensors


def empty(file):
    file.write_bytes(b"")


@pytest.mark.parametrize(
    "name, damage, what",
    [
        ("config.json", truncate, "not valid JSON ("),  # where it ends depends on the cut
        ("config.json", garbage, "not valid JSON (not UTF-8 text: byte 0 is 0xf0)"),
        ("config.json", empty, "not valid JSON (Expecting value: line 1 column 1)"),
        ("model.safetensors", truncate, "not a readable safetensors file (Error while deserializing"),
        ("model.safetensors", garbage, "not a readable safetensors file (Error while deserializing"),
        ("model.safetensors", empty, "not a readable safetensors file (Error while deserializing"),
        ("model.safetensors", lambda f: f.unlink(), "unreadable (No such file or directory)"),
    ],
    ids=lambda v: getattr(v, "__name__", None) if callable(v) else None,
)
def test_a_corrupt_export_names_the_file_and_what_is_wrong(export, eval_main, name, damage, what):
    run_dir, out = export
    damage(out / name)
    code, err = eval_main("--run-dir", run_dir, "--checkpoint", out)
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"eval: error: {out / name}: {what}"), err
    assert "Traceback" not in err


def test_an_intact_export_gets_past_loading(export, eval_main):
    run_dir, out = export
    code, err = eval_main("--run-dir", run_dir, "--checkpoint", out)
    assert code == 2 and err.strip().endswith("eval: error: the target was loaded"), err


@pytest.fixture
def bad_prompt_files(tmp_path):
    """--prompts values that name no usable file, and what the error says of each."""
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "folder").mkdir()
    return [
        (tmp_path / "missing.jsonl", "no such file"),
        (tmp_path / "empty.jsonl", "empty file"),
        (tmp_path / "folder", "a folder, not a prompt file"),
    ]


def test_the_launcher_refuses_a_bad_prompt_file_before_starting_eval(bad_prompt_files, capsys, monkeypatch):
    monkeypatch.setattr(commands.subprocess, "run", _no_target)  # the eval child (it loads the target)
    for file, what in bad_prompt_files:
        for argv in (["eval"], ["report", "--eval"]):
            code = launcher_main([*argv, "--prompts", str(file)])
            err = capsys.readouterr().err
            assert code == 2, argv
            assert len(err.strip().splitlines()) == 1, err
            assert err.startswith(f"launcher: error: --prompts {file}: {what}"), err


def test_eval_refuses_a_bad_prompt_file_before_the_target_loads(bad_prompt_files, eval_main, tmp_path):
    for file, what in bad_prompt_files:
        code, err = eval_main("--run-dir", tmp_path / "no-run", "--prompts", file)
        assert code == 2
        assert len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"eval: error: --prompts {file}: {what}"), err
