"""Which target layers a drafter reads: the default spread and its check. No torch here, so
`launcher up` can check a model's config.json before any worker starts (the target worker
applies the same rule after loading)."""

from __future__ import annotations


def default_layer_ids(num_layers: int, num_draft_layers: int) -> list[int]:
    """docs/dflash.md: spread from layer 1 to L-3; one draft layer reads L // 2. Python's round
    (half to even), as the released z-lab helper does, so ids match its drafters."""
    if num_draft_layers == 1:
        return [num_layers // 2]
    start, end = 1, num_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def resolve_layer_ids(requested: list[int], num_layers: int, num_draft_layers: int) -> list[int]:
    """The sorted ids to capture; ValueError naming the real cause when they cannot be."""
    if not requested:
        ids = default_layer_ids(num_layers, num_draft_layers)
        if len(set(ids)) != len(ids):  # the user set neither key: blame the depth, not layer_ids
            raise ValueError(
                f"the target has {num_layers} decoder layers, too few for drafter.num_layers="
                f"{num_draft_layers} (the default spread over layers 1..{max(1, num_layers - 3)} "
                f"needs at least {num_draft_layers + 3}); lower drafter.num_layers or set "
                f"target.layer_ids to {num_draft_layers} distinct layers in 0..{num_layers - 1}"
            )
        return ids
    ids = list(requested)
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"target.layer_ids {bad} out of range: the target has {num_layers} decoder layers (0..{num_layers - 1})"
        )
    if len(set(ids)) != len(ids):
        raise ValueError(f"target.layer_ids {ids} has duplicates; give each captured layer once")
    return sorted(ids)
