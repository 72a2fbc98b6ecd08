"""Whether a checkpoint can resume this run: the model's shape and the keys that decide batch g must match.

No torch here: `launcher up --resume` checks the keys before it writes anything in the run folder.
"""

from __future__ import annotations

import dataclasses

from services.run import runspec, shapes
from services.run.config import upgrade
from services.run.shapes import DrafterModelConfig

# The drafter model fields a checkpoint does not depend on: initializer_range only draws the first
# weights (a resume loads them); max_position_embeddings is written into the export's config.json,
# the drafter's rotary embedding does not read it; tie_word_embeddings says where the frozen lm_head
# is read from in the target checkpoint, and the drafter's own weights hold no lm_head.
NOT_FOR_RESUME = frozenset({"initializer_range", "max_position_embeddings", "tie_word_embeddings"})
# Fields whose change makes a checkpoint meaningless for this run: the model's shapes and inputs ...
MODEL_FIELDS = tuple(f for f in shapes.MODEL_FIELDS if f not in NOT_FOR_RESUME)
# ... and what batch g contains and which rank trains it (exactly-once across the resume).
RUN_FIELDS = tuple(runspec.keys_deciding(runspec.RESUME_KINDS))
# what a field not in an older checkpoint's state.json was then (fields added since, e.g. the Domino head's)
MODEL_DEFAULTS = {
    f.name: f.default for f in dataclasses.fields(DrafterModelConfig) if f.default is not dataclasses.MISSING
}


def _config_value(cfg: dict, dotted: str):
    section, key = dotted.split(".")
    return cfg.get(section, {}).get(key)


def compatibility_errors(meta: dict, config: dict, model_cfg: DrafterModelConfig, now: dict) -> list[str]:
    """'field: checkpoint X, now Y' for every field that makes the checkpoint unusable for this run
    (config: the checkpoint's config.json; now: this run's, as Config.to_dict() writes it)."""
    return model_errors(meta, model_cfg.to_dict()) + run_errors(config, now)


def model_errors(meta: dict, now_model: dict, skip: tuple[str, ...] = ()) -> list[str]:
    """'model field: checkpoint X, now Y' for the MODEL_FIELDS (but `skip`) of state.json's model that differ."""
    errors = []
    then_model = meta.get("model", {})
    for key in MODEL_FIELDS:
        if key in skip:
            continue
        then = then_model.get(key, MODEL_DEFAULTS.get(key))
        if then != now_model[key]:
            errors.append(f"model {key}: checkpoint {then!r}, now {now_model[key]!r}")
    return errors


def run_errors(config: dict, now_config: dict) -> list[str]:
    """'key: checkpoint X, now Y' for every key deciding batch g (RUN_FIELDS) whose value differs
    (both configs as Config.to_dict() writes them; an older run's, with keys since renamed, upgraded)."""
    errors, config = [], upgrade(config)
    for dotted in RUN_FIELDS:
        then, now = _config_value(config, dotted), _config_value(now_config, dotted)
        if then != now:
            errors.append(f"{dotted}: checkpoint {then!r}, now {now!r}")
    # the number of drafter ranks may change: the schedule continues from the batches done (schedule.py)
    return errors
