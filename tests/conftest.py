"""Fixtures shared by several test files."""
import atexit
import os
import shutil
import tempfile

import pytest
from transformers import AutoTokenizer

from services.demo import build_tokenizer, conversations


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


# Test files that start real workers (targets, drafters, the launcher over them) run as the
# "slow" set; the rest is the fast set a developer runs after each change:
#   python3 -m pytest -q -m "not slow" tests       (seconds)     python3 -m pytest -q tests   (everything)
END_TO_END = {"test_e2e", "test_demo", "test_training_lifecycle", "test_multihost", "test_drafter_zmq",
              "test_drafter_process", "test_checkpoint", "test_checkpoint_faults", "test_target_worker",
              "test_report", "test_launcher_runs", "test_launcher_plan", "test_export", "test_transport",
              "test_checkpoint_background", "test_demo_hybrid",
              "test_quickstart", "test_elastic_resume",
              "test_integrity", "test_exit_causes", "test_stop_signals",
              "test_verify"}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.module.__name__.split(".")[-1] in END_TO_END:
            item.add_marker(pytest.mark.slow)
