"""A run's config as versions from before [run] and [drafter] were split into a section per component
wrote it (services/run/config/loading.py RENAMED): for the tests that an older run's config.json still reads
and resumes."""

from __future__ import annotations

from services.run.config import RENAMED

# keys added to the new sections since the split: a version from before it never wrote them
ADDED_SINCE = ("eval.every_s",)


def before_the_split(config: dict) -> dict:
    """config (as Config.to_dict() writes it) with every renamed key back under its old name; the new
    sections, which hold only moved keys (and those added since), gone."""
    old = {section: dict(values) for section, values in config.items()}
    for added in ADDED_SINCE:
        section, key = added.split(".")
        old[section].pop(key, None)
    for old_name, new_name in RENAMED.items():
        (section, key), (new_section, new_key) = old_name.split("."), new_name.split(".")
        old.setdefault(section, {})[key] = old[new_section].pop(new_key)
    for moved in {new.split(".")[0] for new in RENAMED.values()}:
        assert old.pop(moved) == {}, f"[{moved}] holds keys that were never renamed"
    return old
