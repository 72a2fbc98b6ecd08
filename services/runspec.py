"""What decides batch g, read once from the marks on the config keys (services/config.py `setting`).

Three checks need the same facts and derive them here, so a key added to the config is covered by
all of them as soon as it is marked (and tests/unit/test_runspec.py fails for a key with no mark):
  - the packed data's cache key (services/target/packing.py): "content" keys and "path" files;
  - the target/drafter handshake digest (services/handshake.py): "content", "capture", "range";
  - the resume check of a checkpoint (services/drafter/checkpoint.py): "content", "path", "capture",
    "schedule".
No torch here: the launcher uses it.
"""
from __future__ import annotations

import dataclasses

from services.config import Config, _section_class, SECTIONS

CACHE_KINDS = ("content", "path")
HANDSHAKE_KINDS = ("content", "capture", "range")
RESUME_KINDS = ("content", "path", "capture", "schedule")


def keys_deciding(kinds: tuple[str, ...]) -> list[str]:
    """The dotted config keys ("data.pack_len") whose mark is one of `kinds`, in declaration order."""
    return [f"{section}.{f.name}" for section in SECTIONS for f in dataclasses.fields(_section_class(section))
            if f.metadata.get("batch") in kinds]


def value(cfg: Config, dotted: str):
    section, key = dotted.split(".", 1)
    return getattr(getattr(cfg, section), key)


def values(cfg: Config, kinds: tuple[str, ...]) -> dict:
    """{dotted key: value} of the keys marked with one of `kinds`."""
    return {dotted: value(cfg, dotted) for dotted in keys_deciding(kinds)}
