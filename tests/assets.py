"""The asset store: what tests read and none writes, built once per test run and shared by every
pytest-xdist worker. It lives under $DFLASH_CACHE_DIR, which tests/conftest.py sets before the
workers start (they inherit it), so `launcher up --demo` in any test finds the same demo; each
asset is built under make_demo's lock, so two workers asking at once build it once.

- trained_demo(): the demo `launcher up --demo` runs (its target trained on its data);
- random_demo(): the demo's tokenizer and chat data with an untrained target, for plumbing tests.

Runs of the same data and packing keys pack it once: the product's own store of packed data
(services/target/batches/packing.py, under $DFLASH_CACHE_DIR) serves every test's run folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from services.tools.demo import cache_dir, make_demo


def store() -> Path:
    return Path(os.environ["DFLASH_CACHE_DIR"]) / "test-assets"


def trained_demo() -> dict:
    """The demo of `launcher up --demo` (the same cache folder): trained once per test run."""
    return make_demo(cache_dir())


def random_demo(conversations: int = 300) -> dict:
    """The demo's tokenizer and data, its target untrained (random weights): a loadable model."""
    return make_demo(store() / f"random-{conversations}", num_conversations=conversations, target_steps=0)
