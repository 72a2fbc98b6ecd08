"""GGUF targets before any worker: the conversion to a cached folder (same weights, reused by a second
resolve without hashing), and each user error as one line and exit 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import gguf
from services.run import runspec
from services.run.files import sha256_file
from tests.gguf_files import write_llama_gguf
from tests.launching import child_env, run_launcher

ENV = child_env()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def child(*args, pre: str = "pass") -> subprocess.CompletedProcess:
    """python -m services.tools.gguf_model ARGS; pre: Python run first (to hide a package)."""
    code = (
        f"import sys, runpy; {pre}; sys.argv = ['gguf_model', *{list(args)!r}]; "
        "sys.exit(runpy.run_module('services.tools.gguf_model', run_name='__main__'))"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=300)


def up(*overrides: str, cwd) -> subprocess.CompletedProcess:
    return run_launcher(
        "up",
        "--device",
        "cpu",
        "--gpus",
        "0:target,1:drafter",
        "--run-dir",
        str(Path(cwd) / "run"),
        *overrides,
        cwd=cwd,
        timeout=300,
    )


def one_line(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    return lines[0]


@pytest.mark.slow  # converts in a child process: torch and transformers load
def test_the_converted_folder_holds_the_gguf_weights_and_is_reused(tiny, tmp_path, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DFLASH_GGUF_DTYPE", "float32")  # exact: compare with the GGUF loaded directly
    folder = Path(gguf.resolve(tiny))
    sha = sha256_file(tiny)
    assert folder == tmp_path / "gguf" / f"{sha}-float32"
    source = json.loads((folder / "gguf_source.json").read_text())
    assert source["sha256"] == sha and source["size"] == tiny.stat().st_size and source["transformers"]
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    direct = AutoModelForCausalLM.from_pretrained(tiny.parent, gguf_file=tiny.name, dtype=torch.float32)
    plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.tensor([[5, 17, 99, 3, 250]])
    assert torch.equal(direct(ids).logits, plain(ids).logits)
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.chat_template and tok.eos_token == "<|im_end|>"

    from services.drafter.modeling.target_head import from_target
    from services.run.config import ConfigError, load_config

    bad_mask = load_config(None, [f"target.model_path={folder}", "drafter.num_layers=1", "drafter.mask_token_id=448"])
    with pytest.raises(
        ConfigError,
        match=r"outside the embedding \(448 rows\); set drafter.mask_token_id to a special "
        r"token the data never uses, e.g. drafter.mask_token_id=3 \(<\|MASK\|>\)",
    ):
        from_target(runspec.resolve(bad_mask))  # a GGUF tokenizer has no mask token: its spare special token is named

    monkeypatch.setattr(gguf, "sha256_file", lambda *_: pytest.fail("hashed again"))
    monkeypatch.setattr(gguf, "convert", lambda *_: pytest.fail("converted again"))
    assert gguf.resolve(tiny) == str(folder)  # path + size + mtime: a stat, no hashing
    assert gguf.gguf_file(str(tiny.parent)) == tiny  # a folder with one .gguf and no config.json


def test_a_folder_with_several_gguf_files_names_them(tmp_path):
    (tmp_path / "a.Q4_0.gguf").write_bytes(b"GGUF")
    (tmp_path / "b.Q8_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(gguf.GgufError, match=r"several \.gguf files \(a\.Q4_0\.gguf, b\.Q8_0\.gguf\)"):
        gguf.gguf_file(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")  # an HF folder that also holds GGUFs: the folder
    assert gguf.gguf_file(str(tmp_path)) is None


@pytest.mark.processes
def test_missing_packages_name_the_extra(tiny, tmp_path):
    line = one_line(child("--gguf", str(tiny), "--out", str(tmp_path / "out"), pre="sys.modules['gguf'] = None"))
    assert "needs the gguf package(s): pip install -e '.[gguf]'" in line, line


def test_missing_packages_stop_up_before_hashing(tiny, tmp_path, monkeypatch):
    from launcher.errors import UsageError
    from launcher.inputs import with_local_model
    from services.run.config import load_config

    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gguf, "missing_packages", lambda: ["gguf", "accelerate"])
    with pytest.raises(UsageError, match=r"needs the gguf and accelerate package\(s\): pip install -e '\.\[gguf\]'"):
        with_local_model(load_config(None, [f"target.model_path={tiny}"]))


@pytest.mark.processes
def test_a_corrupt_file_is_one_line_before_any_worker(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    data = tmp_path / "chat.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    line = one_line(up(f"target.model_path={bad}", f"data.path={data}", cwd=tmp_path))
    assert line.startswith(f"launcher: error: target.model_path {bad}: not a readable GGUF file"), line
    assert not (tmp_path / "run").exists()


@pytest.mark.processes
def test_an_architecture_transformers_does_not_convert_is_named(tmp_path):
    odd = write_llama_gguf(tmp_path / "odd.gguf", arch="tinyfoo")
    line = one_line(child("--gguf", str(odd), "--out", str(tmp_path / "out")))
    assert "GGUF architecture 'tinyfoo' is not one transformers' GGUF support converts" in line, line
    assert "convert the model to a Hugging Face folder another way" in line
    assert not (tmp_path / "out").exists()
