"""Transport throughput: services.net.transport (wire format + chunked streaming) against raw pyzmq.

Two processes on loopback. This process is the drafter: it asks for batches with 2 in flight
(the credits) and reassembles them. A child process is the target: it serves hidden-state-sized
batches (tokens x 5 layers x 4096 bf16 + ids and masks) through services.net.transport.BatchServer,
and, for the raw baseline, the same number of bytes as separate messages of the same chunk size
from a pre-made buffer, received with recv_into into a pre-made buffer.

    python bench/transport.py --quick                 # ~40 s on 2 cores
    python bench/transport.py --out transport.json    # full sweep, ~3 min on 2 cores

Prints GB/s for both, the ratio wire/raw, and the best chunk size per scheme. Each point is the
best of --repeats runs, raw and wire interleaved, so that load from other processes hits both.
With CUDA present the drafter side reassembles into pinned memory, as a drafter worker does.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import zmq  # noqa: E402

from services.data.batch import Batch  # noqa: E402
from services.net.batch_client import BatchArrived, BatchClient  # noqa: E402
from services.net.transport import BatchServer  # noqa: E402
from services.run.config import TransportConfig  # noqa: E402

LAYERS, WIDTH = 5, 4096
MB = 1 << 20


def make_batch(tokens: int, g: int = 0) -> Batch:
    return Batch(
        g=g,
        hidden=torch.ones(tokens, LAYERS * WIDTH, dtype=torch.bfloat16),
        input_ids=torch.arange(tokens, dtype=torch.int64),
        loss_mask=torch.ones(tokens, dtype=torch.bool),
        position_ids=torch.arange(tokens, dtype=torch.int64),
        document_ids=torch.zeros(tokens, dtype=torch.int64),
    )


def batch_bytes(tokens: int) -> int:
    return sum(t.numel() * t.element_size() for t in make_batch(1).tensors().values()) * tokens


def transport_cfg(chunk: int) -> TransportConfig:
    return TransportConfig(chunk_bytes=chunk, max_message_bytes=max(64 * MB, chunk), credits=2)


# --- the sender (child process): one command per stdin line, JSON ------------


def sender() -> None:
    batches: dict[int, Batch] = {}
    raw_buffers: dict[int, bytearray] = {}
    ctx = zmq.Context()
    for line in sys.stdin:
        cmd = json.loads(line)
        tokens, chunk = cmd["tokens"], cmd["chunk"]
        if cmd["mode"] == "wire":
            batch = batches.setdefault(tokens, make_batch(tokens))
            server = BatchServer(cmd["endpoint"], transport_cfg(chunk))
            print(server.endpoint, flush=True)
            done = False
            while not done:  # until the drafter says it has everything (closing earlier drops queued chunks)
                for request in server.poll(100):
                    done = request.kind == "info"
                    if not done:
                        batch.g = request.g
                        server.send_batch(request.client, batch, request.split)
            server.close()
        else:
            size = batch_bytes(tokens)
            buf = memoryview(raw_buffers.setdefault(size, bytearray(b"\1" * size)))
            sock = ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 4 * (size // chunk + 2))
            sock.bind(cmd["endpoint"])
            print(sock.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
            while True:
                client, ask = sock.recv_multipart()
                if ask == b"done":
                    break
                for start in range(0, size, chunk):
                    sock.send_multipart([client, buf[start : start + chunk]], copy=False)
            sock.close(linger=0)
        sys.stdout.flush()


# --- the receiver (this process) ---------------------------------------------


def run_wire(endpoint: str, tokens: int, chunk: int, count: int) -> float:
    client = BatchClient([endpoint], transport_cfg(chunk), pin_memory=torch.cuda.is_available())
    try:
        return _timed(
            count,
            tokens,
            lambda g: client.request(0, g),
            lambda: sum(isinstance(e, BatchArrived) for e in client.poll(1000)),
        )
    finally:
        client.request_info(0)  # tells the sender we are done
        time.sleep(0.05)
        client.close()


def run_raw(endpoint: str, tokens: int, chunk: int, count: int) -> float:
    size = batch_bytes(tokens)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 4 * (size // chunk + 2))
    sock.connect(endpoint)
    target = memoryview(bytearray(size))
    filled = [0]

    def receive() -> int:
        if not sock.poll(1000):
            return 0
        filled[0] += sock.recv_into(target[filled[0] % size :])
        return filled[0] % size == 0

    try:
        return _timed(count, tokens, lambda g: sock.send(b"go"), receive)
    finally:
        sock.send(b"done")
        time.sleep(0.05)
        sock.close(linger=0)
        ctx.term()


def _timed(count: int, tokens: int, ask, wait_some, credits: int = 2) -> float:
    """`credits` warm-up batches (they allocate the receive buffers), then `count` timed ones,
    always `credits` in flight. Returns GB/s of the timed ones."""
    for g in range(credits):
        ask(g)
    done = 0
    while done < credits:
        done += wait_some()
    start, asked, done = time.perf_counter(), 0, 0
    while asked < min(credits, count):
        asked += 1
        ask(credits + asked)
    while done < count:
        finished = wait_some()
        done += finished
        for _ in range(finished):
            if asked < count:
                asked += 1
                ask(credits + asked)
    seconds = time.perf_counter() - start
    return count * batch_bytes(tokens) / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches per point")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--schemes", default="ipc,tcp")
    parser.add_argument("--tokens", default="8192,2048")
    parser.add_argument("--chunks-mb", default="1,2,4,8,16,64")
    parser.add_argument("--batches", type=int, default=0, help="timed batches per point (default 3 quick, 10 full)")
    parser.add_argument(
        "--repeats", type=int, default=0, help="best of this many runs per point (default 1 quick, 3 full)"
    )
    parser.add_argument("--sender", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sender:
        return sender()

    count = args.batches or (3 if args.quick else 10)
    repeats = args.repeats or (1 if args.quick else 3)
    child = subprocess.Popen(
        [sys.executable, __file__, "--sender"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sock_dir = Path(tmp) / "sock"
        sock_dir.mkdir(mode=0o700)
        print(
            f"{'scheme':6} {'tokens':>6} {'MB/batch':>8} {'chunk MB':>8} {'raw GB/s':>8} {'wire GB/s':>9} "
            f"{'wire/raw':>8}"
        )
        for scheme in args.schemes.split(","):
            for tokens in map(int, args.tokens.split(",")):
                for chunk_mb in map(float, args.chunks_mb.split(",")):
                    chunk = int(chunk_mb * MB)
                    row = {"scheme": scheme, "tokens": tokens, "batch_bytes": batch_bytes(tokens), "chunk_bytes": chunk}
                    for mode, run in [("raw", run_raw), ("wire", run_wire)] * repeats:  # interleaved
                        endpoint = f"ipc://{sock_dir}/{mode}" if scheme == "ipc" else "tcp://127.0.0.1:*"
                        child.stdin.write(
                            json.dumps({"mode": mode, "endpoint": endpoint, "tokens": tokens, "chunk": chunk}) + "\n"
                        )
                        child.stdin.flush()
                        endpoint = child.stdout.readline().strip()
                        if not endpoint:
                            sys.exit(f"the sender process died (exit code {child.wait()})")
                        speed = run(endpoint, tokens, chunk, count)
                        row[mode] = round(max(speed, row.get(mode, 0.0)), 3)  # best of the repeats
                    row["ratio"] = round(row["wire"] / row["raw"], 3)
                    rows.append(row)
                    print(
                        f"{scheme:6} {tokens:6d} {row['batch_bytes'] / MB:8.1f} {chunk_mb:8g} "
                        f"{row['raw']:8.2f} {row['wire']:9.2f} {row['ratio']:8.2f}",
                        flush=True,
                    )
    child.stdin.close()
    child.wait(timeout=30)

    best = {}
    for scheme in args.schemes.split(","):
        largest = max(int(t) for t in args.tokens.split(","))
        candidates = [r for r in rows if r["scheme"] == scheme and r["tokens"] == largest]
        best[scheme] = max(candidates, key=lambda r: r["wire"])
        print(
            f"best chunk for {scheme}, {largest} tokens: {best[scheme]['chunk_bytes'] / MB:g} MB "
            f"({best[scheme]['wire']:.2f} GB/s wire, {best[scheme]['ratio']:.2f} of raw)"
        )
    if args.out:
        meta = {
            "date": time.strftime("%Y-%m-%d"),
            "cpus": os.cpu_count(),
            "machine": platform.node(),
            "torch": torch.__version__,
            "pyzmq": zmq.__version__,
            "libzmq": zmq.zmq_version(),
            "batches_per_point": count,
            "repeats": repeats,
            "pinned": torch.cuda.is_available(),
        }
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows, "best": best}, indent=2))


if __name__ == "__main__":
    main()
