"""CURVE authentication for tcp endpoints: only holders of the client key may talk to a worker.

Over ipc the socket folder's permissions (0700) keep others out. Over tcp anyone on the
network could connect, feed garbage or read hidden states, so when transport.curve_keys_dir
is set every tcp socket is encrypted with CURVE and every server checks the client's key:

    keys_dir/ (0700)   server.public  server.secret  client.public  client.secret   (0600, z85 text)

- `generate_keys(dir)` writes both key pairs (`launcher keys DIR`); copy the folder to every host.
- `apply_server(sock, dir)` before bind: the socket is a CURVE server, and a ZAP handler on
  the socket's context accepts only client.public. Without a ZAP handler libzmq would let in
  any client that knows the server's public key, so the handler starts before the bind.
- `apply_client(sock, dir)` before connect: the socket presents the client key pair and
  checks the server's public key.

The ZAP handler is a small thread per ZMQ context. It ends by itself when the context is
terminated (its blocking recv gets ETERM and it closes its socket), so ctx.term() never hangs.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import zmq
from zmq.utils import z85

__all__ = ["CurveError", "generate_keys", "keys_for", "apply_server", "apply_client", "KEY_FILES"]

KEY_FILES = ("server.public", "server.secret", "client.public", "client.secret")
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP spec (RFC 27)
ZAP_DOMAIN = b"dflash"


class CurveError(ValueError):
    """Keys missing, malformed or too open; the message names the file."""


def generate_keys(keys_dir: str | Path, overwrite: bool = False) -> list[Path]:
    """Write a server and a client key pair into keys_dir (created 0700; files 0600).

    Refuses to replace existing keys unless overwrite=True: running workers hold the old ones.
    """
    if not zmq.has("curve"):
        raise CurveError("this libzmq was built without CURVE support")
    keys_dir = Path(keys_dir)
    existing = [keys_dir / name for name in KEY_FILES if (keys_dir / name).exists()]
    if existing and not overwrite:
        raise CurveError(
            f"{existing[0]} already exists; pass --force to replace the keys "
            "(workers that use the old ones must be restarted)"
        )
    keys_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(keys_dir, 0o700)
    written = []
    for role in ("server", "client"):
        public, secret = zmq.curve_keypair()
        for suffix, key in (("public", public), ("secret", secret)):
            path = keys_dir / f"{role}.{suffix}"
            path.unlink(missing_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(key.decode("ascii") + "\n")
            written.append(path)
    return written


def keys_for(transport) -> str:
    """The keys folder to use for this transport config, or "" (ipc, or tcp without keys).

    ipc needs none: its sockets sit in a 0700 folder. Callers: `if keys := keys_for(cfg.transport): ...`
    """
    return transport.curve_keys_dir if transport.scheme == "tcp" and transport.curve_keys_dir else ""


def _read_key(keys_dir: str | Path, name: str) -> bytes:
    """One z85 key (40 characters) from keys_dir/name; secrets must not be readable by others."""
    path = Path(keys_dir) / name
    try:
        mode = path.stat().st_mode
        text = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        raise CurveError(f"CURVE key file missing: {path} (make keys with `launcher keys {keys_dir}`)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CurveError(f"CURVE key file {path}: cannot read: {exc}") from None
    if name.endswith(".secret") and mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CurveError(f"CURVE secret key {path} is readable by others (mode {stat.S_IMODE(mode):o}); chmod 600 it")
    try:
        if len(text) != 40 or len(z85.decode(text)) != 32:
            raise ValueError
    except ValueError:
        raise CurveError(f"CURVE key file {path}: expected one 40-character z85 key") from None
    return text.encode("ascii")


class _ZapHandler:
    """Answers libzmq's ZAP requests for one context: CURVE clients with an allowed key pass."""

    def __init__(self, ctx: zmq.Context, allowed: frozenset[bytes], keys_dir: Path):
        self.ctx = ctx
        self.allowed = allowed  # raw 32-byte public keys
        self.keys_dir = keys_dir
        self.refused = 0  # handshakes turned away

    def start(self) -> None:
        self._started = threading.Event()
        self._error: Exception | None = None
        self.thread = threading.Thread(target=self._run, name="curve-zap", daemon=True)
        self.thread.start()
        self._started.wait()
        if self._error is not None:
            raise CurveError(f"cannot start the CURVE ZAP handler: {self._error}")

    def _run(self) -> None:
        try:
            sock = self.ctx.socket(zmq.REP)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            self._error = exc
            self._started.set()
            return
        self._started.set()
        try:
            while True:
                sock.send_multipart(self._answer(sock.recv_multipart()))
        except zmq.ZMQError:  # ETERM: the context is being terminated
            pass
        finally:
            sock.close(linger=0)

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        # request: version, request id, domain, address, identity, mechanism, credentials...
        if len(frames) < 6 or frames[0] != b"1.0":
            self.refused += 1
            return [b"1.0", frames[1] if len(frames) > 1 else b"", b"500", b"malformed ZAP request", b"", b""]
        request_id, mechanism, credentials = frames[1], frames[5], frames[6:]
        if mechanism == b"CURVE" and credentials and credentials[0] in self.allowed:
            return [b"1.0", request_id, b"200", b"OK", b"client", b""]
        self.refused += 1
        return [b"1.0", request_id, b"400", b"client key not allowed", b"", b""]


_handlers: dict[int, _ZapHandler] = {}
_handlers_lock = threading.Lock()


def _zap_handler(ctx: zmq.Context, keys_dir: Path) -> _ZapHandler:
    """The context's running handler, started on first use."""
    allowed = frozenset({z85.decode(_read_key(keys_dir, "client.public"))})
    with _handlers_lock:
        handler = _handlers.get(id(ctx))
        if handler is not None and handler.ctx is ctx and handler.thread.is_alive():
            if handler.allowed != allowed:
                raise CurveError(
                    f"this ZMQ context already authenticates with the keys in {handler.keys_dir}, not {keys_dir}"
                )
            return handler
        handler = _ZapHandler(ctx, allowed, keys_dir)
        handler.start()
        _handlers[id(ctx)] = handler
        return handler


def apply_server(sock: zmq.Socket, keys_dir: str | Path) -> _ZapHandler:
    """Make `sock` a CURVE server that accepts only the client key. Call before bind().

    Returns the context's ZAP handler (its `refused` counts rejected handshakes).
    """
    keys_dir = Path(keys_dir).resolve()
    public, secret = _read_key(keys_dir, "server.public"), _read_key(keys_dir, "server.secret")
    handler = _zap_handler(sock.context, keys_dir)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    return handler


def apply_client(sock: zmq.Socket, keys_dir: str | Path) -> None:
    """Present the client key pair and pin the server's public key. Call before connect()."""
    keys_dir = Path(keys_dir).resolve()
    sock.setsockopt(zmq.CURVE_SERVERKEY, _read_key(keys_dir, "server.public"))
    sock.setsockopt(zmq.CURVE_PUBLICKEY, _read_key(keys_dir, "client.public"))
    sock.setsockopt(zmq.CURVE_SECRETKEY, _read_key(keys_dir, "client.secret"))
