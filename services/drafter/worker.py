"""The drafter process: one GPU (or CPU slot), one torch.distributed rank among the drafters.

    starting -> loading -> compiling -> ready -> training -> stopped      (or failed)
                                                     \\-> draining (SIGTERM: finish the step, checkpoint, exit 0)

--resume continues from the newest good checkpoint in <run_dir>/checkpoints (or starts fresh when
there is none); bookkeeping.py does the ledger, metrics, evaluation, checkpoints and the final export.
"""
from __future__ import annotations

import functools
import ipaddress
import json
import os
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import psutil

import torch
import torch.distributed as dist

from services import lifecycle
from services.config import Config, ConfigError
from services.endpoints import endpoint
from services.files import cpu_share
from services import curve
from services.handshake import batch_config_digest
from services.health import HealthServer
from services.drafter import checkpoint as ckpt
from services.drafter.compile import RecompileWatch, warmup
from services.drafter.evaluate import evaluate
from services.drafter.plan import make_plan
from services.drafter.bookkeeping import Bookkeeping, warn
from services.drafter.synthetic import SYNTHETIC_MODEL, SyntheticSource
from services.drafter.target_head import TargetHead, build_model_config, from_target
from services.drafter.train import (build_train_state, check_batch, make_scheduler, parameter_fingerprint,
                                    train_step)


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def _interface_of(address: str) -> str | None:
    """The network interface that holds `address` (gloo and NCCL bind their own sockets to it)."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            return name
    return None


def _tcp_store(address: str, port: int, rank: int, world_size: int):
    """A TCPStore whose server (rank 0) listens on `address` alone. TCPStore binds every interface
    by itself; handing it a socket bound here keeps the rendezvous off the others."""
    if rank != 0:
        return dist.TCPStore(address, port, world_size, False, timedelta(minutes=30))
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((address, port))
    listener.listen(128)
    return dist.TCPStore(address, listener.getsockname()[1], world_size, True, timedelta(minutes=30),
                         master_listen_fd=listener.detach())      # the store owns the socket from here


def init_distributed(cfg: Config, rank: int, world_size: int, device: torch.device, backend: str) -> None:
    """Join the drafter group without opening a port beyond what the run needs (docs/operations.md,
    "Threat model and guarantees"):
    - DFLASH_DIST_STORE (the launcher sets it when every drafter is on this host): a FileStore in
      the private run dir, and gloo's and NCCL's own sockets on loopback: no port off loopback;
    - else MASTER_ADDR:MASTER_PORT (across hosts: the drafter host from the spec), the store bound
      to that address only, and gloo/NCCL on the interface that holds it;
    - else (a rank started by hand) 127.0.0.1:transport.dist_port, or any free port when alone."""
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)               # always cuda:0: the launcher sets CUDA_VISIBLE_DEVICES
    store_path = os.environ.get("DFLASH_DIST_STORE")
    address = "127.0.0.1" if store_path else os.environ.get("MASTER_ADDR", "127.0.0.1")
    interface = "lo" if _loopback(address) else _interface_of(address)
    if interface:
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(name, interface)
    if store_path:
        store = dist.FileStore(store_path, world_size)
    else:
        port = int(os.environ.get("MASTER_PORT", cfg.transport.dist_port if world_size > 1 else 0))
        store = _tcp_store(address, port, rank, world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)


def load_model(cfg: Config, synthetic: bool):
    """(model config, target head) on the CPU: every config error surfaces here, before GPU work."""
    if cfg.target.model_path or not synthetic:
        return from_target(cfg)
    vocab = cfg.drafter.overrides.get("vocab_size", SYNTHETIC_MODEL["vocab_size"])
    mask_id = cfg.drafter.mask_token_id if cfg.drafter.mask_token_id >= 0 else vocab - 1
    model_cfg = build_model_config(cfg, SYNTHETIC_MODEL, mask_id)
    return model_cfg, TargetHead.random(model_cfg.vocab_size, model_cfg.hidden_size, seed=cfg.run.seed)


SYNTHETIC_EVAL_BATCHES = 8
SYNTHETIC_EVAL_FIRST_G = 1 << 40       # held-out synthetic batches: same data distribution, g never trained


class SyntheticEval:
    """Rank d's share (i*D + d) of the synthetic held-out batches, made lazily on each pass."""

    def __init__(self, source: SyntheticSource, rank: int, world_size: int):
        self.source, self.rank, self.world_size = source, rank, world_size

    def __iter__(self):
        for i in range(-(-SYNTHETIC_EVAL_BATCHES // self.world_size)):
            g = i * self.world_size + self.rank
            batch = self.source.batch(SYNTHETIC_EVAL_FIRST_G + g)
            if g >= SYNTHETIC_EVAL_BATCHES:                # the split's end: an empty batch keeps ranks in step
                batch.loss_mask[:] = False
            yield batch


def make_batches(args, cfg, model_cfg, health, device, max_steps, start_step, check=None):
    """(this rank's training batches, the run's plan). check: validates a batch on the CPU."""
    if args.synthetic:
        plan = make_plan(None, 1, args.world_size, cfg.drafter.grad_accum, max_steps)
        source = SyntheticSource(model_cfg, cfg.data.pack_len, rank=args.rank, world_size=args.world_size,
                                 seed=cfg.run.seed, total_steps=plan.micro_batches, start_step=start_step,
                                 device=device, with_target_labels=cfg.target.labels_from_target)
        return source, plan
    from services.drafter.source import ZmqSource       # the real (ZMQ) source; imported only when used
    source = ZmqSource(cfg, args.run_dir, args.rank, args.world_size, args.num_targets, health, max_steps=max_steps,
                       start_step=start_step, device=device, check=check)
    return source, source.plan


def make_eval_batches(args, cfg, model_cfg, health, device, check=None):
    """The held-out split (rank d evaluates batches i*D + d), or None when evaluation is off or empty."""
    if cfg.run.eval_every <= 0:
        return None
    if args.synthetic:
        return SyntheticEval(SyntheticSource(model_cfg, cfg.data.pack_len, seed=cfg.run.seed, device=device,
                                             with_target_labels=cfg.target.labels_from_target),
                             args.rank, args.world_size)
    from services.drafter.source import ZmqSource
    source = ZmqSource(cfg, args.run_dir, args.rank, args.world_size, args.num_targets, health, split="eval",
                       device=device, check=check)
    if source.total_batches == 0:
        warn("run.eval_every is set but the data has no held-out batches (data.eval_fraction / data.eval_path); "
             "evaluation is off")
        source.close()
        return None
    return source


def timed(batches):
    """Yield (batch, seconds spent waiting for it). A stop requested while waiting for data
    yields (None, seconds) and ends: the rank still joins the others' stop vote."""
    it = iter(batches)
    while True:
        start = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            return
        except lifecycle.Stopped:
            yield None, time.perf_counter() - start
            return
        yield batch, time.perf_counter() - start


def gpu_memory(device: torch.device) -> int:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0


def stop_everywhere(local: bool, device: torch.device) -> bool:
    """Ranks stop together (a lone rank leaving would hang the others in all-reduce)."""
    flag = torch.tensor([1.0 if local else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def find_checkpoint(args, cfg: Config, run_dir: Path, model_cfg, health: HealthServer):
    """--resume: the newest good checkpoint (None: start fresh). Without --resume, refuse a run dir
    that has checkpoints (a fresh run there would mix two runs' checkpoints, ledger and metrics)."""
    if not getattr(args, "resume", False):
        if ckpt.list_checkpoints(ckpt.checkpoints_dir(run_dir)):
            raise ConfigError(f"{ckpt.checkpoints_dir(run_dir)} has checkpoints: pass --resume to continue "
                              "from them, or use another --run-dir")
        return None
    return ckpt.find_resume_point(run_dir, model_cfg, cfg, args.world_size, warn, tick=health.progress)


def same_everywhere(value: int, device: torch.device) -> bool:
    t = torch.tensor([value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t[0]) == -int(t[1]) == value


def setup(args, cfg: Config, run_dir: Path, device: torch.device, health: HealthServer, max_steps: int):
    """loading -> compiling -> ready. Config and checkpoint errors surface before any GPU work."""
    health.set(state="loading")
    # a fair share of the cores: several workers oversubscribing them slows every one of them down
    torch.set_num_threads(cpu_share(args.workers_on_node))
    model_cfg, head = load_model(cfg, args.synthetic)
    found = find_checkpoint(args, cfg, run_dir, model_cfg, health)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda but CUDA is not available")
    rank, world_size = args.rank, args.world_size
    init_distributed(cfg, rank, world_size, device, args.dist_backend)
    if not same_everywhere(found.micro_step if found else -1, device):
        raise RuntimeError("drafter ranks picked different checkpoints to resume from (is checkpoints/ shared?)")
    state = build_train_state(cfg, model_cfg, head, device, world_size=world_size, total_steps=max(1, max_steps))
    # compile before asking for batches: the targets load their models meanwhile
    health.set(state="compiling")
    health.progress()                            # compiling is progress too (until the warmup returns)
    dummy = SyntheticSource(model_cfg, cfg.data.pack_len, seed=cfg.run.seed + 1, device=device,
                            with_target_labels=cfg.target.labels_from_target).batch(0)
    compile_s = warmup(state, dummy)
    if cfg.run.eval_every > 0:                   # the forward-only graph, compiled now rather than mid-run
        start = time.perf_counter()
        evaluate(state, [dummy])
        compile_s += time.perf_counter() - start
    compile_s = round(compile_s, 3)
    start_step = found.micro_step if found else 0
    check = functools.partial(check_batch, state=state)    # values too, before a batch goes to the GPU early
    batches, plan = make_batches(args, cfg, model_cfg, health, device, max_steps, start_step, check)
    if hasattr(batches, "info"):                 # the targets' handshake, against this drafter's model
        batches.info.check(hidden_size=model_cfg.hidden_size, vocab_size=model_cfg.vocab_size,
                           layer_ids=model_cfg.target_layer_ids, seq_len=cfg.data.pack_len,
                           labels_from_target=cfg.target.labels_from_target, config_digest=batch_config_digest(cfg))
    eval_batches = make_eval_batches(args, cfg, model_cfg, health, device, check)
    state.scheduler = make_scheduler(state.optimizer, cfg, plan.optimizer_steps)   # the real horizon, now known
    if found:
        for note in ckpt.restore(state, found, rank):
            warn(note)
        print(json.dumps({"event": "resumed", "rank": rank, "checkpoint": str(found.path), **state.counters()}),
              flush=True)
    books = Bookkeeping(cfg, run_dir, rank, world_size, state, health, found, eval_batches)
    health.set(state="ready", compile_s=compile_s, total_steps=plan.optimizer_steps,
               step=state.step, samples_done=state.samples_done)  # set(): under systemd this also sends READY=1
    health.progress()
    print(json.dumps({"event": "ready", "rank": rank, "compile_s": compile_s, "params": state.drafter.num_parameters(),
                      "plan": plan.describe()}), flush=True)
    return state, batches, books, compile_s


def run(args, cfg: Config) -> int:
    run_dir, rank = Path(args.run_dir), args.rank
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    max_steps = args.max_steps if args.max_steps is not None else cfg.run.max_steps
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0") if device.type == "cuda" else f"cpu-{rank}"
    health = HealthServer(endpoint(run_dir, cfg.transport, "drafter", rank, "health"), "drafter", rank, gpu,
                          stall_after_s=cfg.run.stall_after_s,
                          startup_stall_after_s=cfg.run.startup_stall_after_s,
                          keys_dir=curve.keys_for(cfg.transport))
    stop, batches, books = lifecycle.install(grace_s=cfg.run.stop_timeout_s), None, None
    try:
        state, batches, books, compile_s = setup(args, cfg, run_dir, device, health, max_steps)
        watch = RecompileWatch()                 # any graph compiled from here on is a recompile
        health.set(state="training")
        last, interrupted = time.perf_counter(), False
        for batch, waited in timed(batches):
            if stop_everywhere(stop.is_set() or batch is None, device):
                interrupted = True               # the checkpoint is the last optimizer step's state
                break
            start = time.perf_counter()
            m = train_step(state, batch)
            now = time.perf_counter()
            elapsed, last = now - last, now
            # loss, τ and tokens/s reach health with each metrics line (books), not per step: one
            # definition of each figure for metrics.jsonl, the launcher's line and `launcher status`
            stamp = dict(step=state.step, samples_done=state.samples_done, recompiles=watch.count,
                         compile_s=compile_s, gpu_mem_bytes=gpu_memory(device))
            health.progress(**stamp)
            provenance = batches.provenance_of(batch.g) if hasattr(batches, "provenance_of") else None
            books.after_batch(batch.g, m, waited, now - start, provenance)   # ledger, metrics, eval, checkpoint
            if state.micro_step % max(1, cfg.run.log_every) == 0:  # this rank's own step, in its log
                print(json.dumps({"rank": rank, **m, **stamp, "step_tokens_per_s": round(m["tokens"] / elapsed, 1),
                                  "step_s": round(elapsed, 4)}), flush=True)
        if interrupted:
            health.set(state="draining")
        books.finish(completed=not interrupted)                   # final checkpoint; export when completed
        print(json.dumps({"event": "stopped", "rank": rank, "signal": interrupted, **state.counters(),
                          "recompiles": watch.count, "params_digest": parameter_fingerprint(state.drafter)}), flush=True)
        health.set(state="stopped")
        return 0
    except lifecycle.Stopped:                    # stopped while starting (waiting for a target): nothing to save
        health.set(state="stopped")
        return 0
    except ConfigError as exc:                   # bad config or checkpoint: one clear line
        health.set(state="failed")
        health.error(f"config error: {exc}")
        print(f"drafter rank {rank}: config error: {exc}", file=sys.stderr, flush=True)
        return 2
    except Exception as exc:
        health.set(state="failed")
        health.error(f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
        print(f"drafter rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        if books is not None:
            books.close()
        if hasattr(batches, "close"):
            batches.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        health.close()
