"""Cold-cache compile of flex_attention by N workers: threads of one process vs OS processes.

Each worker builds the DFlash block mask (services.drafter.modeling.attention), compiles flex_attention in
its own way (threads share one process's dynamo state; processes each have their own) and runs
forward+backward a few times. Every trial runs in a fresh subprocess with a fresh, empty
TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR, under a timeout: a trial that does not finish in
time is a hang. Modes:

  single     one worker alone (the yardstick)
  threads    N threads of one process (the design this project replaces)
  processes  N spawned OS processes, one per worker, sharing the cache dir (this project)
  drafters   N real `python -m services.drafter --synthetic` workers (the whole drafter process)
  warm       N processes again on the cache the last `processes` trial left: time to ready

    python bench/compile_isolation.py --workers 3 --trials 3 --timeout 180 --out $OUT/compile.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worker(idx: int, heads: int, head_dim: int, context: int, anchors: int, block: int, iters: int) -> float:
    """Compile flex_attention with the DFlash mask and run fwd+bwd `iters` times; returns seconds."""
    import torch

    from services.drafter.modeling.attention import FlexAttention, anchor_context_starts

    start = time.perf_counter()
    device = "cuda"
    gen = torch.Generator(device="cpu").manual_seed(idx)
    pos = torch.randperm(context - block, generator=gen)[:anchors].sort().values + 1
    pos = pos.to(device)
    attn = FlexAttention()
    mask = attn.build_mask(pos, anchor_context_starts(pos, None), block, context)
    q_len, kv_len = anchors * block, context + anchors * block
    for _ in range(iters):
        q = torch.randn(1, heads, q_len, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, heads, kv_len, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, heads, kv_len, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
        attn(q, k, v, mask).sum().backward()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def run_threads(n: int, shape: dict) -> None:
    """Inside one process: n threads, each compiling and running. Prints one line per worker."""
    import threading

    def body(i):
        try:
            print(f"READY {i} {worker(i, **shape):.2f}", flush=True)
        except Exception as exc:  # a crash is a result here: report it
            print(f"ERROR {i} {type(exc).__name__}: {str(exc)[:300]}", flush=True)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def child_env(cache: Path) -> dict:
    env = dict(
        os.environ,
        TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
        TRITON_CACHE_DIR=str(cache / "triton"),
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        PYTHONUNBUFFERED="1",
    )
    env["TORCHINDUCTOR_COMPILE_THREADS"] = str(max(1, (os.cpu_count() or 1) // 3))
    return env


def trial(mode: str, n: int, shape: dict, cache: Path, timeout: float) -> dict:
    """One trial in fresh subprocesses. Returns outcome, seconds to all ready, errors."""
    args = [f"--{k.replace('_', '-')}={v}" for k, v in shape.items()]
    me = [sys.executable, str(Path(__file__).resolve())]
    if mode in ("single", "threads"):
        cmds = [me + ["--as-threads", str(1 if mode == "single" else n)] + args]
    elif mode in ("processes", "warm"):
        cmds = [me + ["--as-worker", str(i)] + args for i in range(n)]
    else:  # drafters: the real drafter worker, one process each, world size 1 (NCCL needs one GPU per rank)
        cmds = [
            [
                sys.executable,
                "-m",
                "services.drafter",
                "--synthetic",
                "--device",
                "cuda",
                "--max-steps",
                "3",
                "--run-dir",
                str(cache / f"d{i}"),
                "drafter.num_layers=1",
                "data.pack_len=1024",
                "drafter.num_anchors=64",
                "drafter.block_size=16",
                "drafter.overrides={hidden_size=1024, intermediate_size=2048, num_attention_heads=8, "
                "num_key_value_heads=8, head_dim=128}",
            ]
            for i in range(n)
        ]
    start = time.monotonic()
    procs = [
        subprocess.Popen(
            c, env=child_env(cache), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        for c in cmds
    ]
    outputs, hung = [], False
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=max(1.0, timeout - (time.monotonic() - start)))[0])
        except subprocess.TimeoutExpired:
            hung = True
            os.killpg(p.pid, 9)
            outputs.append(p.communicate()[0])
    elapsed = time.monotonic() - start
    text = "\n".join(outputs)
    ready = text.count("READY ") if mode != "drafters" else sum(p.returncode == 0 for p in procs)
    errors = [line for line in text.splitlines() if line.startswith("ERROR") or "Error" in line][:5]
    want = 1 if mode == "single" else n
    outcome = "hang" if hung else ("ok" if ready == want and all(p.returncode == 0 for p in procs) else "crash")
    return {"mode": mode, "outcome": outcome, "seconds": round(elapsed, 2), "ready": ready, "errors": errors}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--modes", default="single,threads,processes,warm,drafters")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--as-threads", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--as-worker", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--out")
    a = ap.parse_args()
    shape = dict(heads=a.heads, head_dim=a.head_dim, context=a.context, anchors=a.anchors, block=a.block, iters=a.iters)
    if a.as_threads:
        return run_threads(a.as_threads, shape)
    if a.as_worker >= 0:
        try:
            print(f"READY {a.as_worker} {worker(a.as_worker, **shape):.2f}", flush=True)
        except Exception as exc:
            print(f"ERROR {a.as_worker} {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            sys.exit(1)
        return

    import torch

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, workers {a.workers}, shape {shape}", flush=True)
    results = []
    modes = a.modes.split(",")
    for t in range(a.trials):
        warm_cache = None
        for mode in modes:
            if mode == "single" and t > 0:
                continue
            if mode == "warm":
                if warm_cache is None:
                    continue
                cache = warm_cache
            else:
                cache = Path(tempfile.mkdtemp(prefix=f"cold-{mode}-"))
            r = trial(mode, a.workers, shape, cache, a.timeout)
            r["trial"] = t
            results.append(r)
            print(json.dumps(r), flush=True)
            if mode == "processes" and r["outcome"] == "ok":
                warm_cache = cache
            elif cache is not warm_cache:
                shutil.rmtree(cache, ignore_errors=True)
    print("\nmode        trials  ok  crash  hang  seconds to all ready (each trial)")
    for mode in modes:
        rs = [r for r in results if r["mode"] == mode]
        if rs:
            count = {o: sum(r["outcome"] == o for r in rs) for o in ("ok", "crash", "hang")}
            secs = ", ".join(f"{r['seconds']:.1f}" + ("" if r["outcome"] == "ok" else f" ({r['outcome']})") for r in rs)
            print(f"{mode:<11} {len(rs):>6} {count['ok']:>3} {count['crash']:>6} {count['hang']:>5}  {secs}")
    if a.out:
        Path(a.out).write_text(
            json.dumps({"torch": torch.__version__, "shape": shape, "workers": a.workers, "results": results}, indent=2)
        )


if __name__ == "__main__":
    main()
