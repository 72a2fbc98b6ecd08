"""A .gguf target trains end to end on CPU: `launcher up` converts the file once to a cached Hugging
Face folder (launcher/gguf.py), writes that folder into the run's config, and the workers train on it."""

import json
import tempfile
import time
from pathlib import Path

import pytest

from services.drafter.books.ledger import read_all
from services.run.files import sha256_file
from services.tools.demo import conversations
from tests.gguf_files import write_llama_gguf
from tests.launching import child_env, run_launcher

pytestmark = [pytest.mark.training, pytest.mark.untimed]  # a conversion, a run to its end, its files


def test_a_gguf_target_trains_end_to_end(tmp_path):
    model = write_llama_gguf(tmp_path / "tiny-llama.gguf")
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations(120, seed=5)))
    cache = tmp_path / "cache"
    run_dir = Path(tempfile.mkdtemp(prefix="gguf-", dir="/tmp")) / "run"  # ipc socket paths: at most 107 bytes
    env = child_env(DFLASH_CACHE_DIR=str(cache))
    start = time.monotonic()
    out = run_launcher(
        "up",
        "--device",
        "cpu",
        "--gpus",
        "0:target,1:drafter",
        "--run-dir",
        str(run_dir),
        f"target.model_path={model}",
        f"data.path={data}",
        "target.dtype=float32",
        "data.pack_len=256",
        "data.eval_fraction=0.05",
        "drafter.num_layers=1",
        "drafter.block_size=4",
        "drafter.num_anchors=16",
        "kernels.compile=false",
        "run.max_steps=6",
        "log.every=2",
        "eval.every=6",
        "checkpoint.every=6",
        "eval.num_prompts=2",
        "eval.max_new_tokens=8",
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    took = time.monotonic() - start
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    config = json.loads((run_dir / "config.json").read_text())
    folder = Path(config["target"]["model_path"])
    sha = sha256_file(model)
    assert folder == cache / "gguf" / sha, folder  # the converted folder, not the .gguf
    source = json.loads((folder / "gguf_source.json").read_text())
    assert source["sha256"] == sha and source["gguf"] == str(model.resolve()) and source["size"] == model.stat().st_size
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    steps = [
        m["step"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if not m.get("eval")
    ]
    assert steps and max(steps) == 6, steps
    assert len(list(read_all(run_dir))) == 6
    print(f"gguf e2e: {took:.0f} s")
