"""Where each worker listens. Every process computes the same names from the run dir and config,
so no one has to be told another's address.

ipc: socket files in <run_dir>/sock/, a folder only the owner may enter (0700).
tcp: the worker's host (transport.target_hosts / drafter_hosts by rank when the run spans
hosts, else transport.host, loopback unless configured) and base_port + a fixed offset per worker.
"""
from __future__ import annotations

import socket
from pathlib import Path

from services.config import TransportConfig

PURPOSES = ("health", "data")
ROLES = ("target", "drafter")
_MAX_RANKS = 256   # tcp port layout: base + purpose*2*MAX + role*MAX + rank


def free_port(host: str = "127.0.0.1") -> int:
    """A tcp port nobody listens on right now (the rendezvous of a lone drafter rank, tests)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
