"""CURVE over real tcp on loopback: a real server process, real client processes with and without the key."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import threading

import pytest
import zmq

from services.net.curve import KEY_FILES, CurveError, apply_client, apply_server, generate_keys, keys_for
from services.run.config import TransportConfig
from tests.launching import child_env

ENV = child_env()

# Answers every message with b"pong:" + message until an authenticated "quit";
# then prints what it received and how many handshakes its ZAP handler refused.
SERVER = textwrap.dedent("""
    import json, sys, zmq
    from services.net.curve import apply_server
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    zap = apply_server(sock, sys.argv[1])
    sock.bind("tcp://127.0.0.1:*")
    print(sock.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
    received = []
    while sock.poll(20000):
        ident, payload = sock.recv_multipart()
        received.append(payload.decode())
        sock.send_multipart([ident, b"pong:" + payload])
        if payload == b"quit":
            break
    sock.close()
    ctx.term()                      # must not hang on the ZAP handler
    print(json.dumps({"received": received, "refused": zap.refused}), flush=True)
""")

# Sends one message; prints the reply, or exits 3 when nothing came back within the timeout.
CLIENT = textwrap.dedent("""
    import sys, zmq
    from services.net.curve import apply_client
    endpoint, keys, message, timeout_ms = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if keys != "-":
        apply_client(sock, keys)
    sock.connect(endpoint)
    sock.send(message.encode())
    if not sock.poll(timeout_ms):
        print("no reply")
        sys.exit(3)
    print(sock.recv().decode())
""")


def _client(endpoint: str, keys: str, message: str, timeout_ms: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", CLIENT, endpoint, keys, message, str(timeout_ms)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.processes
def test_only_the_keyed_client_gets_through(tmp_path):
    keys, stranger = tmp_path / "keys", tmp_path / "stranger"
    generate_keys(keys)
    generate_keys(stranger)
    # The stranger knows the server's public key (it is public) but holds another client key.
    (stranger / "server.public").write_text((keys / "server.public").read_text())

    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(keys)], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        endpoint = server.stdout.readline().strip()
        assert endpoint.startswith("tcp://127.0.0.1:"), server.stderr.read()

        good = _client(endpoint, str(keys), "hello", 10000)
        assert good.returncode == 0, good.stderr
        assert good.stdout.strip() == "pong:hello"

        wrong_key = _client(endpoint, str(stranger), "let me in", 1500)
        assert wrong_key.returncode == 3, wrong_key.stderr
        no_curve = _client(endpoint, "-", "plain text", 1500)
        assert no_curve.returncode == 3, no_curve.stderr

        assert _client(endpoint, str(keys), "quit", 10000).stdout.strip() == "pong:quit"
        out, err = server.communicate(timeout=30)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert server.returncode == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    # The server never saw the outsiders' messages, and its ZAP handler refused the wrong key.
    assert report["received"] == ["hello", "quit"]
    assert report["refused"] >= 1


def test_generated_files_are_private_z85(tmp_path):
    keys = tmp_path / "deep" / "keys"
    paths = generate_keys(keys)
    assert sorted(p.name for p in paths) == sorted(KEY_FILES)
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    for path in paths:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        assert len(path.read_text().strip()) == 40
    assert (keys / "server.public").read_text() != (keys / "client.public").read_text()
    with pytest.raises(CurveError, match="already exists"):
        generate_keys(keys)
    old = (keys / "client.secret").read_text()
    generate_keys(keys, overwrite=True)
    assert (keys / "client.secret").read_text() != old


def test_bad_key_files_are_named(tmp_path):
    keys = tmp_path / "keys"
    generate_keys(keys)
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        os.chmod(keys / "client.secret", 0o644)
        with pytest.raises(CurveError, match=r"client\.secret is readable by others"):
            apply_client(sock, keys)
        os.chmod(keys / "client.secret", 0o600)
        (keys / "server.public").write_text("not a key\n")
        with pytest.raises(CurveError, match=r"server\.public: expected one 40-character z85 key"):
            apply_client(sock, keys)
        (keys / "server.public").unlink()
        with pytest.raises(CurveError, match=r"missing: .*server\.public"):
            apply_server(ctx.socket(zmq.ROUTER), keys)
    finally:
        ctx.destroy(linger=0)


def test_context_term_stops_the_zap_handler(tmp_path):
    keys = tmp_path / "keys"
    generate_keys(keys)
    ctx = zmq.Context()
    first, second = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    handler = apply_server(first, keys)
    assert apply_server(second, keys) is handler  # one handler per context
    first.close()
    second.close()
    done = threading.Event()
    threading.Thread(target=lambda: (ctx.term(), done.set()), daemon=True).start()
    assert done.wait(10), "ctx.term() hung on the ZAP handler"
    handler.thread.join(5)
    assert not handler.thread.is_alive()


def test_keys_only_for_tcp_with_a_keys_dir():
    assert keys_for(TransportConfig(scheme="tcp", curve_keys_dir="/k")) == "/k"
    assert keys_for(TransportConfig(scheme="tcp")) == ""
    assert keys_for(TransportConfig(scheme="ipc", curve_keys_dir="/k")) == ""  # 0700 socket folder instead
