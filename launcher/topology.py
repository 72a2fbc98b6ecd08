"""GPU spec parsing: '0-4:target,5-7:drafter' -> one Worker per GPU.

Grammar: comma-separated groups `GPUS:ROLE[@HOST]`; GPUS is a number, a range `a-b`, or several
joined by '+' ('0-1+4:target'). Ranks count up per role in the order the GPUs are written.
A run across hosts names the host of every group ('0-7:target@10.0.0.1,0-7:drafter@10.0.0.2');
every host runs the same command with `--host` saying which one it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.net.endpoints import ROLES  # one list of roles: endpoints, units, the spec


class GpuSpecError(ValueError):
    """A bad --gpus spec; the message is one line meant for the user."""


@dataclass(frozen=True)
class Worker:
    role: str
    rank: int
    gpu: int
    host: str = ""  # "" = this host (a single-host run)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.rank}"


def _parse_gpus(text: str, group: str, where: str = "") -> list[int]:
    """GPU numbers and ranges joined by '+'; errors name `where` (default: the --gpus group)."""
    where = where or f"--gpus group {group!r}"
    gpus: list[int] = []
    for part in text.split("+"):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first = int(lo)
            last = int(hi) if sep else first
        except ValueError:
            raise GpuSpecError(f"{where}: {part!r} is not a GPU number or range like 0-4") from None
        if first < 0 or last < first:
            raise GpuSpecError(f"{where}: range {part!r} is empty or negative")
        gpus.extend(range(first, last + 1))
    return gpus


def parse_gpu_list(text: str, available: int | None = None) -> list[int]:
    """A plain GPU list without roles ('0-3', '0,2,5', '0-1+4'), for the commands that run one kind
    of child per GPU (regenerate). `available`: GPUs on this host (None: don't check)."""
    where = f"--gpus {text!r}"
    if not text or not text.strip():
        raise GpuSpecError("--gpus is empty; expected GPU numbers like 0-3 or 0,2,5")
    if ":" in text or "@" in text:
        raise GpuSpecError(f"{where}: expected GPU numbers like 0-3 or 0,2,5, without roles or hosts")
    gpus = _parse_gpus(text.replace(",", "+"), text, where)
    twice = sorted({g for g in gpus if gpus.count(g) > 1})
    if twice:
        raise GpuSpecError(f"{where}: GPU {twice[0]} is given twice")
    for gpu in gpus:
        if available is not None and gpu >= available:
            raise GpuSpecError(
                f"--gpus: GPU {gpu} does not exist (this machine has {available}: 0-{available - 1})"
                if available
                else f"--gpus: GPU {gpu} does not exist (no GPU found; use --device cpu)"
            )
    return gpus


def parse_gpu_spec(
    spec: str, available: int | None = None, share_gpus: bool = False, local_host: str = ""
) -> list[Worker]:
    """Parse spec into workers. `available` = number of GPUs on this host (None: don't check);
    only workers on `local_host` are checked against it."""
    if not spec or not spec.strip():
        raise GpuSpecError("--gpus is empty; expected something like 0-4:target,5-7:drafter")
    workers: list[Worker] = []
    owner: dict[tuple[str, int], str] = {}
    groups = [g.strip() for g in spec.split(",")]
    hosted = [g for g in groups if "@" in g]
    if hosted and len(hosted) != len(groups):
        raise GpuSpecError(f"--gpus {spec!r}: name the host of every group (GPUS:ROLE@HOST) or of none")
    for i, group in enumerate(groups):
        group, _, host = group.partition("@")
        host = host.strip()
        if hosted and not host:
            raise GpuSpecError(f"--gpus group {group!r}: empty host after '@'")
        gpus_text, sep, role = group.rpartition(":")
        if not sep or not gpus_text:
            raise GpuSpecError(f"--gpus group {group!r}: expected GPUS:ROLE, e.g. 0-4:target{_join_hint(groups, i)}")
        role = role.strip()
        if role not in ROLES:
            raise GpuSpecError(f"--gpus group {group!r}: unknown role {role!r} (roles: {', '.join(ROLES)})")
        for gpu in _parse_gpus(gpus_text, group):
            if available is not None and host == local_host and gpu >= available:
                raise GpuSpecError(
                    f"--gpus: GPU {gpu} does not exist (this machine has {available}: 0-{available - 1})"
                    if available
                    else f"--gpus: GPU {gpu} does not exist (no GPU found; use --device cpu)"
                )
            where = f"GPU {gpu}" + (f" of {host}" if host else "")
            if (host, gpu) in owner and not share_gpus:
                raise GpuSpecError(
                    f"--gpus: {where} is given twice ({owner[host, gpu]} and {role}); pass --share-gpus to allow it"
                )
            owner.setdefault((host, gpu), role)
            rank = sum(w.role == role for w in workers)
            workers.append(Worker(role, rank, gpu, host))
    for role in ROLES:
        if not any(w.role == role for w in workers):
            raise GpuSpecError(f"--gpus {spec!r}: no {role} GPU; at least one target and one drafter are needed")
    return workers


def _join_hint(groups: list[str], i: int) -> str:
    """'0,1:target' reads as two groups; the user almost surely meant 0+1:target."""
    bare = []
    for group in groups[i:]:
        if ":" in group:
            gpus, _, role = group.partition(":")
            return (
                f"; did you mean {'+'.join(bare + [gpus])}:{role}? (',' separates groups, '+' joins GPUs of one role)"
            )
        if not all(part.strip().replace("-", "").isdigit() for part in group.split("+")):
            return ""
        bare.append(group.strip())
    return ""


def count(workers: list[Worker], role: str) -> int:
    return sum(w.role == role for w in workers)


def hosts(workers: list[Worker]) -> list[str]:
    """The hosts a spec names, in order of first appearance ([] for a single-host run)."""
    return list(dict.fromkeys(w.host for w in workers if w.host))


def host_overrides(workers: list[Worker]) -> list[str]:
    """Config overrides that place every worker's endpoints on its host (tcp across hosts)."""
    if not hosts(workers):
        return []
    by_role = {role: [w.host for w in workers if w.role == role] for role in ROLES}
    return [
        'transport.scheme="tcp"',
        f"transport.target_hosts={by_role['target']!r}".replace("'", '"'),
        f"transport.drafter_hosts={by_role['drafter']!r}".replace("'", '"'),
    ]
