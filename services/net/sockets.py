"""The settings every ZMQ socket of this project gets, and private binding for ipc endpoints.

No torch here: the launcher's probe uses it too.
"""

from __future__ import annotations

import os

import zmq


def secure_socket(sock: zmq.Socket, max_bytes: int) -> None:
    """Settings every socket in this project gets: no lingering, capped message size."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)


def bind_private(sock: zmq.Socket, endpoint: str) -> None:
    """Bind; for ipc in an owner-only folder (made here if needed), as an owner-only socket file."""
    if endpoint.startswith("ipc://"):
        folder = os.path.dirname(endpoint[len("ipc://") :])
        os.makedirs(folder, mode=0o700, exist_ok=True)
        os.chmod(folder, 0o700)
    sock.bind(endpoint)
    if endpoint.startswith("ipc://"):
        os.chmod(endpoint[len("ipc://") :], 0o600)
