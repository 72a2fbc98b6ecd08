"""The drafter's model config in tests: from a config and a target's fields, as the run spec makes it."""

from services.drafter.modeling.target_head import check_mask
from services.run import runspec, shapes


def model_config_from_hf(text_cfg, tie: bool = False) -> dict:
    """The target-derived fields of DrafterModelConfig from a transformers config object (the same
    rule as the run spec's reading of config.json: shapes.target_fields)."""
    return shapes.target_fields(text_cfg.to_dict(), tie)


def build_model_config(cfg, base: dict, mask_token_id: int = -1):
    """base (from the target or the synthetic defaults) + drafter/target sections + drafter.overrides
    (runspec.drafter_shape), with this mask token id unless drafter.overrides names one; its mask checked."""
    return check_mask(runspec.drafter_shape(cfg, base, mask_token_id))
