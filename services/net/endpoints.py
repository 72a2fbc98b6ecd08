"""Where each worker listens. Every process computes the same names from the run dir and config,
so no one has to be told another's address.

ipc: socket files in <run_dir>/sock/, a folder only the owner may enter (0700).
tcp: the worker's host (transport.target_hosts / drafter_hosts by rank when the run spans
hosts, else transport.host, loopback unless configured) and base_port + a fixed offset per worker.
"""

from __future__ import annotations

from pathlib import Path

from services.run.config import TransportConfig, is_loopback

PURPOSES = ("health", "data")
ROLES = ("target", "drafter")
_MAX_RANKS = 256  # tcp port layout: base + purpose*2*MAX + role*MAX + rank


def socket_dir(run_dir: str | Path) -> Path:
    """The private socket folder of a run (made owner-only by bind_private, when a worker binds)."""
    return Path(run_dir).resolve() / "sock"


def endpoint(run_dir: str | Path, transport: TransportConfig, role: str, rank: int, purpose: str) -> str:
    if role not in ROLES or purpose not in PURPOSES or not 0 <= rank < _MAX_RANKS:
        raise ValueError(f"no endpoint for role={role!r} rank={rank} purpose={purpose!r}")
    if transport.scheme == "ipc":
        return f"ipc://{socket_dir(run_dir)}/{role}-{rank}.{purpose}"
    hosts = transport.target_hosts if role == "target" else transport.drafter_hosts
    host = hosts[rank] if rank < len(hosts) else transport.host
    port = transport.base_port + PURPOSES.index(purpose) * 2 * _MAX_RANKS + ROLES.index(role) * _MAX_RANKS + rank
    return f"tcp://{host}:{port}"


def plaintext_binds(transport: TransportConfig, num_targets: int, num_drafters: int) -> list[tuple[str, str]]:
    """(worker, endpoint) of every tcp socket the run's ranks will bind without CURVE keys: the
    endpoints themselves, so a rank past transport.target_hosts / drafter_hosts (on transport.host)
    is seen too."""
    if transport.scheme != "tcp" or transport.curve_keys_dir:
        return []
    return [
        (f"{role}-{rank}", endpoint(".", transport, role, rank, purpose))
        for role, count in (("target", num_targets), ("drafter", num_drafters))
        for rank in range(count)
        for purpose in PURPOSES
    ]


def plaintext_problems(transport: TransportConfig, num_targets: int, num_drafters: int) -> tuple[str, str]:
    """(refusal, warning) for the run's plaintext tcp sockets; "" where there is nothing to say.
    Off loopback without keys is refused unless transport.allow_plaintext says otherwise."""
    binds = plaintext_binds(transport, num_targets, num_drafters)
    host = lambda ep: ep[len("tcp://") :].rsplit(":", 1)[0]  # noqa: E731
    off = [(worker, ep) for worker, ep in binds if not is_loopback(host(ep))]
    refusal = ""
    if off and not transport.allow_plaintext:
        worker, ep = off[0]
        others = f" (and {len(off) - 1} more sockets off loopback)" if len(off) > 1 else ""
        refusal = (
            f"{worker} would bind {ep} in plaintext{others}: transport.scheme=tcp without "
            "transport.curve_keys_dir lets anyone who reaches that address read hidden states and feed the "
            "drafters batches. Make keys with `launcher keys DIR` and set transport.curve_keys_dir=DIR, or set "
            "transport.allow_plaintext=true on a network you trust completely"
        )
    hosts = list(dict.fromkeys(host(ep) for _, ep in binds))
    warning = (
        f"plaintext tcp on {', '.join(hosts)}: any local user (and, off loopback, anyone on the network) "
        "can connect to the workers and read hidden states; set transport.curve_keys_dir (`launcher keys DIR`)"
        if hosts
        else ""
    )
    return refusal, warning
