"""The marks on the config keys (services/config.py `setting`) and the checks derived from them."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from services import runspec
from services.config import BATCH_KINDS, SECTIONS, _section_class, load_config
from services.demo import conversations
from services.drafter.checkpoint_compat import RUN_FIELDS
from services.handshake import batch_config_digest
from services.target.packing import build_index, cache_key

VOCAB = 4096
ALL_KEYS = [(s, f) for s in SECTIONS for f in dataclasses.fields(_section_class(s))]


def test_every_config_key_says_what_it_decides_about_a_batch():
    """A key added without a mark fails here: mark it with setting(..., batch=KIND)."""
    unmarked = [f"{s}.{f.name}" for s, f in ALL_KEYS if f.metadata.get("batch") not in BATCH_KINDS]
    assert unmarked == []


def test_the_three_checks_come_from_the_marks():
    assert set(RUN_FIELDS) == set(runspec.keys_deciding(runspec.RESUME_KINDS))
    assert {"data.path", "data.pack_len", "run.seed", "drafter.grad_accum", "target.labels_from_target"} <= set(RUN_FIELDS)
    assert "run.epochs" not in RUN_FIELDS                  # more epochs later: batch g < N stays the same
    base = batch_config_digest(load_config(None, ['data.on_bad_sample="skip"']))
    for dotted in runspec.keys_deciding(runspec.HANDSHAKE_KINDS):
        changed = load_config(None, ['data.on_bad_sample="skip"', _changed(dotted)])
        assert batch_config_digest(changed) != base, dotted


def _changed(dotted: str) -> str:
    """An override that gives `dotted` another valid value."""
    section, key = dotted.split(".")
    default = getattr(getattr(load_config(None, []), section), key)
    special = {"data.on_bad_sample": '"fail"', "data.eval_fraction": "0.25", "target.layer_ids": "[1, 2]",
               "data.pack_len": "96", "data.max_doc_len": "40", "data.max_line_bytes": "200",
               "data.max_doc_tokens": "30"}
    if dotted in special:
        return f"{dotted}={special[dotted]}"
    if isinstance(default, bool):
        return f"{dotted}={'false' if default else 'true'}"
    if isinstance(default, (int, float)):
        return f"{dotted}={default + 1}"
    if isinstance(default, str):
        return f'{dotted}="{default}x"'
    if isinstance(default, list):
        return f"{dotted}=[]" if default else f'{dotted}=[1]'
    return f"{dotted}={{}}"


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "chat.jsonl"
    lines = [json.dumps(c) for c in conversations(120, seed=3)]
    lines.insert(5, json.dumps({"messages": [{"role": "user", "content": "x " * 400},
                                             {"role": "assistant", "content": "y " * 400}]}))   # long: max_* bite
    path.write_text("\n".join(lines) + "\n")
    return path


def _packed(cfg, tokenizer):
    tensors, _ = build_index(cfg, tokenizer, VOCAB)
    return {k: np.asarray(v) for k, v in tensors.items()}


def test_keys_not_marked_as_deciding_tokens_leave_the_packed_data_alone(data_file, tokenizer):
    """The marks are checked against what packing really does: every [run] / [data] / [target] key
    without a "content" or "path" mark is changed alone, and the packed rows must stay the same
    (and the cache key too); every key with one changes the cache key."""
    base_args = [f"data.path={data_file}", "data.pack_len=128", 'data.on_bad_sample="skip"']
    base_cfg = load_config(None, base_args)
    base, key = _packed(base_cfg, tokenizer), cache_key(base_cfg, tokenizer, VOCAB)
    for section, f in ALL_KEYS:
        dotted = f"{section}.{f.name}"
        if section not in ("run", "data", "target") or f.metadata["batch"] == "path" or dotted == "target.model_path":
            continue                                     # files: by content (tests/unit/test_data_packing.py)
        try:
            cfg = load_config(None, base_args + [_changed(dotted)])
        except Exception:
            continue                                     # a value this key refuses: nothing to compare
        if f.metadata["batch"] in runspec.CACHE_KINDS:
            assert cache_key(cfg, tokenizer, VOCAB) != key, dotted
            continue
        assert cache_key(cfg, tokenizer, VOCAB) == key, dotted
        other = _packed(cfg, tokenizer)
        assert other.keys() == base.keys() and all(np.array_equal(other[k], base[k]) for k in base), \
            f"{dotted} changes the packed data: mark it batch=\"content\" in services/config.py"
