"""target.model_path as a Hugging Face repo id: resolved through a real local HF cache (no network)."""

import json
import os
import subprocess
import sys

import pytest

from launcher.models import resolve_model_path
from tests.launching import child_env, run_launcher


def _cache_with(root, repo_id: str, files: dict) -> str:
    """A Hugging Face hub cache holding one snapshot of repo_id (the hub's documented layout)."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    return str(snapshot)


def _resolve_in(cache, value: str) -> subprocess.CompletedProcess:
    """resolve_model_path in a fresh process: huggingface_hub reads HF_HUB_CACHE when imported."""
    code = "import sys; from launcher.models import resolve_model_path; print(resolve_model_path(sys.argv[1]))"
    return subprocess.run(
        [sys.executable, "-c", code, value],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1"),
    )


@pytest.mark.processes
def test_a_cached_repo_id_resolves_to_its_snapshot(tmp_path):
    snapshot = _cache_with(tmp_path, "acme/tiny-model", {"config.json": "{}"})
    assert _resolve_in(tmp_path, "acme/tiny-model").stdout.strip() == snapshot
    missing = _resolve_in(tmp_path, "acme/missing")
    assert missing.returncode != 0 and "ModelNotFound" in missing.stderr
    assert "'acme/missing': not a local folder, not in the Hugging Face cache" in missing.stderr


def test_paths_stay_paths(tmp_path):
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)  # a folder stays what it is
    assert resolve_model_path("no/such-folder/here") == "no/such-folder/here"  # a path, not a repo id: the caller
    assert resolve_model_path("") == ""  # names the missing key


@pytest.mark.processes
def test_launcher_up_writes_the_local_folder_into_the_run_config(tmp_path):
    env = child_env(HF_HUB_CACHE=tmp_path / "hub", HF_HUB_OFFLINE=1)
    snapshot = _cache_with(tmp_path / "hub", "acme/not-a-model", {"config.json": json.dumps({"num_hidden_layers": 2})})
    (tmp_path / "data.jsonl").write_text("")
    out = run_launcher(
        "up",
        "--device",
        "cpu",
        "--gpus",
        "0:target,1:drafter",
        "--run-dir",
        str(tmp_path / "run"),
        'target.model_path="acme/not-a-model"',
        f'data.path="{tmp_path / "data.jsonl"}"',
        timeout=120,
        env=env,
    )
    # the folder is found in the cache; the run then stops on what that folder lacks, naming the folder
    assert out.returncode == 2 and snapshot in out.stderr, out.stderr
    assert "does not exist" not in out.stderr
