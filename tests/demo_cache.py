"""A small demo cache for tests that run `launcher up --demo` but need no trained target."""

import json
from pathlib import Path


def untrained_demo_cache(cache: Path) -> Path:
    """A demo cache the launcher reuses as it is: a real demo (tokenizer, model, data) made small and
    with an untrained target, marked as the default build (the tests here only need a loadable one)."""
    from services.tools.demo import DEMO_VERSION, TARGET_STEPS, make_demo

    out = cache / f"demo-v{DEMO_VERSION}"
    make_demo(out, num_conversations=300, target_steps=0)
    marker = {"version": DEMO_VERSION, "seed": 0, "num_conversations": 4000, "target_steps": TARGET_STEPS}
    (out / "demo.json").write_text(json.dumps({**marker, "variant": "dense"}))
    return cache
