"""Lossless, in words a user can read (torch-free: the launcher's report uses it too).

Greedy speculative decoding must return the target's own greedy output: the check is exact
equality with plain greedy decoding (one token per target forward), prompt by prompt. Where a
prompt differs, the first differing position says why. The target's top-1 minus top-2 logit margin
there, from the reference's forward or the verify forward (the smaller one), is compared with the
rounding of the target's dtype at that logit's magnitude (services/decoding/decode_step.py,
rounding_tolerance: 4 ulps, 4 * eps(dtype) * max(1, |top-1 logit|); eps is 2^-7 for bf16, 2^-10
for fp16, 2^-23 for fp32, and sqrt(eps * 2^-3) for a target whose decoder linears run in FP8):
  - margin <= tolerance: a near-tie. A block forward and a one-token forward round differently,
    and a tie within rounding may go either way: not a bug of the decoding;
  - margin > tolerance: the two forwards disagree by more than rounding: a bug.
"""

from __future__ import annotations


def first_difference(
    tokens: list[int],
    ref_tokens: list[int],
    margins: list[float],
    tolerances: list[float],
    ref_margins: list[float],
    ref_tolerances: list[float],
) -> dict | None:
    """None when equal; else {position, margin, tolerance, near_tie} at the first differing token.
    margins[i] / tolerances[i] belong to the forward that produced token i."""
    if tokens == ref_tokens:
        return None
    pos = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), min(len(tokens), len(ref_tokens)))
    seen = [(m[pos], t[pos]) for m, t in ((ref_margins, ref_tolerances), (margins, tolerances)) if pos < len(m)]
    margin, tolerance = min(seen, key=lambda mt: mt[0] - mt[1]) if seen else (float("inf"), 0.0)
    return {"position": pos, "margin": margin, "tolerance": tolerance, "near_tie": margin <= tolerance}


def lossless_figures(differences: list[dict | None]) -> dict:
    """differences[i]: first_difference of prompt i -> the record's `lossless`, `near_ties`, `differences`."""
    found = [{"index": i, **d} for i, d in enumerate(differences) if d is not None]
    return {
        "lossless": len(differences) - len(found),
        "near_ties": sum(d["near_tie"] for d in found),
        "differences": found,
    }


def describe_lossless(record: dict) -> str:
    """e.g. `lossless 31/32 (1 near-tie)`; a difference that is no near-tie is called a bug; a record
    without the check (a pass by the clock during training) says so."""
    if "lossless" not in record:
        return "lossless not checked"
    text = f"lossless {record.get('lossless', '?')}/{record.get('prompts', '?')}"
    found = record.get("differences") or []
    ties = sum(d.get("near_tie", False) for d in found)
    bugs = len(found) - ties
    notes = ([f"{ties} near-tie"] if ties else []) + ([f"{bugs} NOT near-ties: a bug"] if bugs else [])
    return text + (f" ({', '.join(notes)})" if notes else "")
