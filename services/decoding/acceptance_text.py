"""Real acceptance in words (no torch: the launcher's report uses it too): a table of the drafter's
figures and its controls', for one evaluation and for each prompt set of it."""

from __future__ import annotations

from services.decoding.lossless import describe_lossless

CONTROLS = ("repeat_last", "random")
HEADER = f"  {'':<12}{'per prompt':>11}{'per step':>10}{'tokens/forward':>16}  lossless"


def rows(result: dict) -> list[str]:
    """The drafter's row and its controls' under HEADER."""
    named = [("drafter", result)] + [(c.replace("_", "-"), result[c]) for c in CONTROLS if c in result]
    return [
        f"  {name:<12}{r['acceptance_per_prompt']:>11.2f}{r['acceptance_per_step']:>10.2f}"
        f"{r['tokens_per_forward']:>16.2f}  {describe_lossless(r).removeprefix('lossless ')}"
        for name, r in named
    ]


def by_set(result: dict) -> dict[str, dict]:
    """{prompt set: its figures, with its controls' figures beside them} of an evaluation."""
    return {
        name: {**figures, **{c: result[c]["sets"][name] for c in CONTROLS if name in result.get(c, {}).get("sets", {})}}
        for name, figures in (result.get("sets") or {}).items()
    }


def tables(result: dict, title: str) -> list[str]:
    """One table per prompt set, then all sets together (when there are several): the lines a user reads.
    title: what the figures are of, e.g. "greedy speculative decoding, up to 128 new tokens"."""
    sets = by_set(result)
    parts = [(f"{name} ({figures['prompts']} prompts)", figures) for name, figures in sets.items()]
    if len(sets) != 1:
        parts.append((f"all sets ({result['prompts']} prompts)" if sets else f"{result['prompts']} prompts", result))
    lines = [f"real acceptance ({title}):"]
    for head, figures in parts:
        lines += [f"{head}:", HEADER, *rows(figures)]
    return lines
