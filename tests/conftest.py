"""Fixtures shared by several test files, the folder rules, and the markers that say what a test starts."""

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from services.tools.demo import build_tokenizer, conversations
from tests.tiny_targets import HYBRID_DEVICES, dense_target, hybrid_target

# Under pytest-xdist (README: `-n 2`) two test processes share the machine's cores with the workers
# the tests start: one torch thread each, for them and the processes they start (a launcher still
# gives its workers their share), rather than every process spinning as many threads as there are cores
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

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
def no_tf32():
    """CUDA fp32 matmuls without TF32 for this test (the exact kernels a comparison needs), restored
    after; only cuBLAS reads the flag, so on CPU it changes nothing. Not monkeypatch.setattr: torch's
    cuBLASModule keeps allow_tf32 behind __getattr__/__setattr__, not in the instance dict, and
    pytest 9.2's undo then delattr()s it (AttributeError at teardown)."""
    import torch

    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    matmul.allow_tf32 = False
    yield
    matmul.allow_tf32 = before


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


# What a test starts, as markers (pyproject.toml): inprocess (the default), processes, training,
# quality, gpu. tests/unit holds the tests that start no training run, tests/e2e the ones that do or
# that start workers and launchers; every test in tests/e2e names its kind. Under pytest-xdist
# (`-n 2 --dist loadgroup`, README) the training and quality tests are one xdist_group, run one
# after the other on one worker: two training runs never share the 2 cores, so what they time
# (restarts, stops, deadlines) is not slowed by another run. A training test marked `untimed` asserts
# nothing of the kind (its data, its weights, its output): it runs in its file's group instead,
# beside the other worker's tests, which keeps the two workers busy to the end. "slow" is everything
# that starts processes:
#   python3 -m pytest -q -m "not slow" tests        the fast set, in process
TESTS = Path(__file__).resolve().parent
E2E = TESTS / "e2e"
KINDS = ("inprocess", "processes", "training", "quality")
TRAINING_GROUP = "training"


class Misplaced(pytest.File):
    """A test file directly in tests/, in neither set: it fails collection, so it cannot go unnoticed."""

    def collect(self):
        raise self.CollectError(
            f"tests/{self.path.name}: put it in tests/unit (starts no training run) or tests/e2e "
            f"(starts real workers or launchers), not directly in tests/"
        )


def pytest_pycollect_makemodule(module_path, parent):
    if module_path.parent == TESTS:
        return Misplaced.from_parent(parent, path=module_path)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group markers
def pytest_collection_modifyitems(items):
    for item in items:
        # its kind: the closest marker (the test's own over its module's)
        kind = next((m.name for m in item.iter_markers() if m.name in KINDS), None)
        if kind is None:
            if item.path.is_relative_to(E2E):
                raise pytest.UsageError(f"{item.nodeid}: a test in tests/e2e must be marked one of {', '.join(KINDS)}")
            kind = "inprocess"
            item.add_marker(pytest.mark.inprocess)
        if kind in ("training", "quality") and not item.get_closest_marker("untimed"):
            item.add_marker(pytest.mark.xdist_group(TRAINING_GROUP))
        elif item.path.is_relative_to(E2E) or kind != "inprocess":  # one worker per file: its module
            item.add_marker(pytest.mark.xdist_group(item.path.stem))  # fixtures (a trained drafter, a target) made once
        if kind != "inprocess":
            item.add_marker(pytest.mark.slow)
        if any("CUDA" in m.kwargs.get("reason", "") for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.gpu)  # a test that runs only where CUDA is (its skip says so)
    # the hybrid demo's run last: the background builder (pytest_collection_finish) makes its demo second
    items.sort(key=lambda item: item.path.stem == "test_demo_hybrid")


def pytest_collection_finish(session):
    """The trained demos (`launcher up --demo`, dense and hybrid: one and two and a half minutes of one
    core) built in the background from the start, on the core the training tests leave idle while
    they wait on their workers; the tests that run them wait on make_demo's lock if it is not done.
    One builder per test run: the first xdist worker's, or the only process's."""
    if session.config.option.collectonly or os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
        return
    kinds = {m.name for item in session.items for m in item.iter_markers() if m.name in ("training", "quality")}
    if not kinds:
        return
    variants = ["dense"] + (["hybrid"] if any(i.path.stem == "test_demo_hybrid" for i in session.items) else [])
    code = "from services.tools.demo import cache_dir, make_demo\n" + "".join(
        f"make_demo(cache_dir({v!r}), variant={v!r})\n" for v in variants
    )
    log = open(Path(os.environ["DFLASH_CACHE_DIR"]) / "demo-builder.log", "w")
    builder = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=TESTS.parent,
        env={**os.environ, "PYTHONPATH": str(TESTS.parent)},
    )
    atexit.register(builder.kill)  # before the cache's removal (atexit runs last-registered first)


@pytest.fixture(scope="module")
def dense():
    """A tiny dense Qwen3 target with random weights (tests/tiny_targets.py)."""
    return dense_target()


@pytest.fixture(scope="module", params=HYBRID_DEVICES)
def hybrid(request):
    """A tiny Qwen3.5 Gated DeltaNet hybrid target, on every device that can run it."""
    return hybrid_target(device=request.param)
