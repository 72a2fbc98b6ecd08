"""Fixtures shared by several test files, and the folder rules: tests/unit is fast, tests/e2e slow."""

import atexit
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from services.tools.demo import build_tokenizer, conversations
from tests.tiny_targets import HYBRID_DEVICES, dense_target, hybrid_target


# `launcher up --demo` builds the demo once per cache and reuses it: one cache for this test
# session (the first demo test builds it), none of it in the user's ~/.cache
if "DFLASH_CACHE_DIR" not in os.environ:
    os.environ["DFLASH_CACHE_DIR"] = tempfile.mkdtemp(prefix="dflash-test-cache-")
    atexit.register(shutil.rmtree, os.environ["DFLASH_CACHE_DIR"], True)


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    """A real tokenizer trained on the fly on demo chat text (no download)."""
    texts = [m["content"] for c in conversations(300, seed=1) for m in c["messages"]]
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(texts, vocab_size=600).save_pretrained(path)
    return path


@pytest.fixture
def tokenizer(tok_dir):
    return AutoTokenizer.from_pretrained(tok_dir)


@pytest.fixture
def hf_torch_hybrid(monkeypatch):
    """transformers' own Qwen3.5 Gated DeltaNet on its pure-torch code, as the reference on CPU.

    Where flash-linear-attention imports (a GPU box), transformers sends even CPU tensors to its
    Triton kernels; the reference must be the readable torch code, so unwrap those functions.
    """
    import inspect
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    for name in ("causal_conv1d_fn", "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        monkeypatch.setattr(m, name, inspect.unwrap(getattr(m, name)))


@pytest.fixture
def small_disk(tmp_path):
    """small_disk(size) -> a fresh tmpfs of that size: a real file system that really fills up."""
    mounted = []

    def mount(size: str) -> Path:
        path = tmp_path / f"disk{len(mounted)}"
        path.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], capture_output=True, text=True
        )
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


# The folder decides what is slow. tests/e2e: files that start real workers or launchers (targets,
# drafters, the launcher over them), the "slow" set; tests/unit: the fast set a developer runs after
# each change (a test there that is itself slow carries @pytest.mark.slow):
#   python3 -m pytest -q -m "not slow" tests       (about a minute)     python3 -m pytest -q tests   (everything)
TESTS = Path(__file__).resolve().parent
E2E = TESTS / "e2e"


class Misplaced(pytest.File):
    """A test file directly in tests/, in neither set: it fails collection, so it cannot go unnoticed."""

    def collect(self):
        raise self.CollectError(
            f"tests/{self.path.name}: put it in tests/unit (fast) or tests/e2e (it starts "
            f"real workers or launchers: the slow set), not directly in tests/"
        )


def pytest_pycollect_makemodule(module_path, parent):
    if module_path.parent == TESTS:
        return Misplaced.from_parent(parent, path=module_path)


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.is_relative_to(E2E):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def dense():
    """A tiny dense Qwen3 target with random weights (tests/tiny_targets.py)."""
    return dense_target()


@pytest.fixture(scope="module", params=HYBRID_DEVICES)
def hybrid(request):
    """A tiny Qwen3.5 Gated DeltaNet hybrid target, on every device that can run it."""
    return hybrid_target(device=request.param)
