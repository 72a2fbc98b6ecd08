"""Messages the workers dropped (services/process/health.py, Drops), in the launcher's words: the warning
of `launcher up` when a worker's counts rise, a line of `launcher status`, and the `dropped` map
of run.json's outcome, so a run that ended well after another process answered for a target
does not look like any other.

    drafter-0 dropped 91 answers (data-content 88, data-incarnation 3): another process answered
    for target-0 (see logs/drafter-0.log)
"""

from __future__ import annotations

# answers that no real target of this run sends: a batch whose tokens are not batch g's, an
# error for a batch that exists (a late answer of a restarted target is data-incarnation only)
NOT_A_TARGET = ("data-content", "data-error-claim")


def describe_drops(name: str, kinds: dict[str, int], sources=()) -> str:
    """One line: who dropped how many of what, and from whom (sources: 'target-0' ...)."""
    total = sum(kinds.values())
    word = "answers" if name.startswith("drafter") and all(k.startswith("data-") for k in kinds) else "messages"
    parts = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items(), key=lambda kn: (-kn[1], kn[0])))
    line = f"{name} dropped {total} {word} ({parts})"
    if sources and any(k in kinds for k in NOT_A_TARGET):
        line += f": another process answered for {', '.join(sorted(sources))}"
    return f"{line} (see logs/{name}.log)"


class DropWatch:
    """Each worker's dropped-message counts over the run (a restarted worker counts from 0 again),
    and whether a poll starts a burst of increases: one warning per burst, not one per poll."""

    def __init__(self):
        self.before: dict[str, dict[str, int]] = {}  # counts of a worker's earlier processes
        self.now: dict[str, dict[str, int]] = {}  # ... and of its running one, as last seen
        self.sources: dict[str, set[str]] = {}
        self.rising: set[str] = set()

    def restarted(self, name: str) -> None:
        self.before[name] = self.totals(name)
        self.now[name] = {}
        self.rising.discard(name)  # a new process: its first drops are a new burst

    def seen(self, name: str, kinds: dict[str, int], sources=()) -> bool:
        """Record a worker's health counts; True when they rose after a poll in which they did not."""
        rose = sum(kinds.values()) > sum(self.now.get(name, {}).values())
        self.now[name] = dict(kinds)
        self.sources.setdefault(name, set()).update(sources)
        first = rose and name not in self.rising
        (self.rising.add if rose else self.rising.discard)(name)
        return first

    def totals(self, name: str) -> dict[str, int]:
        out = dict(self.before.get(name, {}))
        for kind, n in self.now.get(name, {}).items():
            out[kind] = out.get(kind, 0) + n
        return out

    def describe(self, name: str) -> str:
        return describe_drops(name, self.totals(name), self.sources.get(name, ()))

    def dropped(self) -> dict[str, dict[str, int]]:
        """run.json's `dropped`: worker -> kind -> count, workers that dropped nothing left out."""
        return {name: totals for name in sorted(set(self.before) | set(self.now)) if (totals := self.totals(name))}

    def dropped_from(self) -> dict[str, list[str]]:
        return {name: sorted(self.sources[name]) for name in self.dropped() if self.sources.get(name)}
