"""GPU spec parsing: '0-4:target,5-7:drafter' -> one Worker per GPU.

Grammar: comma-separated groups `GPUS:ROLE`; GPUS is a number, a range `a-b`, or several joined
by '+' ('0-1+4:target'). Ranks count up per role in the order the GPUs are written.
"""
from __future__ import annotations

from dataclasses import dataclass

ROLES = ("target", "drafter")


class SpecError(ValueError):
    """A bad --gpus spec; the message is one line meant for the user."""


@dataclass(frozen=True)
class Worker:
    role: str
    rank: int
    gpu: int

    @property
    def name(self) -> str:
        return f"{self.role}-{self.rank}"


def _parse_gpus(text: str, group: str) -> list[int]:
    gpus: list[int] = []
    for part in text.split("+"):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first = int(lo)
            last = int(hi) if sep else first
        except ValueError:
            raise SpecError(f"--gpus group {group!r}: {part!r} is not a GPU number or range like 0-4") from None
        if first < 0 or last < first:
            raise SpecError(f"--gpus group {group!r}: range {part!r} is empty or negative")
        gpus.extend(range(first, last + 1))
    return gpus


def parse_gpu_spec(spec: str, available: int | None = None, share_gpus: bool = False) -> list[Worker]:
    """Parse spec into workers. `available` = number of GPUs present (None: don't check)."""
    if not spec or not spec.strip():
        raise SpecError("--gpus is empty; expected something like 0-4:target,5-7:drafter")
    workers: list[Worker] = []
    owner: dict[int, str] = {}
    for group in spec.split(","):
        group = group.strip()
        gpus_text, sep, role = group.rpartition(":")
        if not sep or not gpus_text:
            raise SpecError(f"--gpus group {group!r}: expected GPUS:ROLE, e.g. 0-4:target")
        role = role.strip()
        if role not in ROLES:
            raise SpecError(f"--gpus group {group!r}: unknown role {role!r} (roles: {', '.join(ROLES)})")
        for gpu in _parse_gpus(gpus_text, group):
            if available is not None and gpu >= available:
                raise SpecError(f"--gpus: GPU {gpu} does not exist (this machine has {available}: 0-{available - 1})"
                                if available else f"--gpus: GPU {gpu} does not exist (no GPU found; use --device cpu)")
            if gpu in owner and not share_gpus:
                raise SpecError(f"--gpus: GPU {gpu} is given twice ({owner[gpu]} and {role}); pass --share-gpus to allow it")
            owner.setdefault(gpu, role)
            rank = sum(w.role == role for w in workers)
            workers.append(Worker(role, rank, gpu))
    for role in ROLES:
        if not any(w.role == role for w in workers):
            raise SpecError(f"--gpus {spec!r}: no {role} GPU; at least one target and one drafter are needed")
    return workers


def count(workers: list[Worker], role: str) -> int:
    return sum(w.role == role for w in workers)
