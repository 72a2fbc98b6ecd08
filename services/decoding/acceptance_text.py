"""Real acceptance in words (no torch: the launcher's report uses it too): a table of the drafter's
figures and its controls', for one evaluation and for each prompt set of it, with the wall-clock
speedup over the target alone where `launcher eval` timed it (services/eval/speedup.py)."""

from __future__ import annotations

from services.decoding.lossless import describe_lossless


def describe_prompts(count: int, held_out: bool | None, sets=()) -> str:
    """The prompts real acceptance was measured on, in words that say where they came from (held_out
    None: prompt files, named by their `sets`, or a record from before this was recorded)."""
    if held_out is None:
        return f"{count} prompts" + (f" of {', '.join(sets)}" if sets else "")
    if held_out:
        return f"{count} held-out prompts"
    return f"{count} training prompts (no held-out split: set data.eval_fraction or data.eval_path)"


CONTROLS = ("repeat_last", "random")
HEADER = f"  {'':<12}{'per prompt':>11}{'per step':>10}{'tokens/forward':>16}  lossless"
COLUMNS = (
    "per prompt: tokens a verify step commits, averaged per prompt, then over prompts (τ); per step: over all "
    "steps; tokens/forward: new tokens per target forward; lossless: outputs equal to the target's own greedy decoding"
)
SPEEDUP_NOTE = (
    "speedup: the target alone's wall-clock time over speculative decoding's on the same prompts, the "
    "drafter's own cost in it (greedy, batch 1, timed after a warm-up pass)"
)


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


def speedup_rows(figures: dict | None) -> list[str]:
    """A table's speedup line: the figure, or why it is missing (none where nothing was timed)."""
    if not figures:
        return []
    if "speedup" not in figures:
        return [f"  speedup: not measured ({figures.get('error') or figures.get('off')})"]
    differ = figures["prompts_timed"] - figures["identical_outputs"]
    line = (
        f"  speedup {figures['speedup']:.2f}x: {figures['speculative_tokens_per_s']:,.0f} tokens/s speculative vs "
        f"{figures['target_alone_tokens_per_s']:,.0f} target alone, {figures['prompts_timed']} prompts timed at "
        f"batch 1 on {figures['device']}"
    )
    return [line + (f"; {differ} decoded differently (near ties: see lossless)" if differ else "")]


def speedup_footer(overall: dict | None) -> list[str]:
    """What the speedup lines mean, or why there are none (off on a CPU, a failed timing)."""
    if not overall:
        return []
    if "speedup" in overall:
        return [SPEEDUP_NOTE]
    return [f"speedup over the target alone: not measured ({overall.get('error') or overall.get('off')})"]


def speedup_summary(record: dict) -> list[str]:
    """An evaluation's speedup over all its sets without its tables (the end of `launcher up --demo`)."""
    overall = record.get("speedup") or {"error": "not in the record"}
    return [line.strip() for line in speedup_rows(overall)] + speedup_footer(overall)


def tables(result: dict, title: str) -> list[str]:
    """One table per prompt set, then all sets together (when there are several): the lines a user reads.
    title: what the figures are of, e.g. "greedy speculative decoding, up to 128 new tokens"."""
    sets = by_set(result)
    parts = [(f"{name} ({figures['prompts']} prompts)", figures) for name, figures in sets.items()]
    if len(sets) != 1:
        parts.append((f"all sets ({result['prompts']} prompts)" if sets else f"{result['prompts']} prompts", result))
    lines = [f"real acceptance ({title}):"]
    overall = result.get("speedup")  # `launcher eval`'s records only
    for head, figures in parts:
        lines += [f"{head}:", HEADER, *rows(figures)]
        lines += speedup_rows(figures.get("speedup")) if overall and "speedup" in overall else []
    return lines + [COLUMNS] + speedup_footer(overall)
