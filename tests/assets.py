"""The asset store: what tests read and none writes, built once per test run and shared by every
pytest-xdist worker. It lives under $DFLASH_CACHE_DIR, which tests/conftest.py sets before the
workers start (they inherit it), so `launcher up --demo` in any test finds the same demo; each
asset is built under make_demo's lock, so two workers asking at once build it once.

- trained_demo(): the demo `launcher up --demo` runs (its target trained on its data);
- random_demo(): the demo's tokenizer and chat data with an untrained target, for plumbing tests;
- shared_data(run_dir): a run folder whose packed-data cache is the store's, shared by content
  hash (services/target/packing.py keys it by the data, the tokenizer and the config), so runs of
  the same data and settings pack it once.
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


def shared_data(run_dir: Path) -> Path:
    """run_dir, made now with its data-cache/ pointing at the store's packed data (`launcher up`
    prepares an existing run folder in place)."""
    packed = store() / "packed-data"
    packed.mkdir(parents=True, exist_ok=True)
    run_dir.mkdir(parents=True)
    (run_dir / "data-cache").symlink_to(packed, target_is_directory=True)
    return run_dir
