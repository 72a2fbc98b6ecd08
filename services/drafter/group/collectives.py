"""The drafter group: joining it, leaving it, and every collective the drafter ranks call.

Each function here is called by every rank at the same point (the worker's loop, bookkeeping.py,
evaluate.py); a rank that skipped one would hang the others. DDP's own gradient all-reduce is in
train.py (the model wrapper).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import psutil
import torch
import torch.distributed as dist

from services.run.config import is_loopback


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
    return dist.TCPStore(
        address, listener.getsockname()[1], world_size, True, timedelta(minutes=30), master_listen_fd=listener.detach()
    )  # the store owns the socket from here


def join(dist_port: int, rank: int, world_size: int, device: torch.device, backend: str, run_dir=None) -> None:
    """Join the drafter group without opening a port beyond what the run needs (docs/guide/security.md,
    "Threat model and guarantees"):
    - DFLASH_DIST_STORE (the launcher sets it when every drafter is on this host): a FileStore in
      the private run dir, and gloo's and NCCL's own sockets on loopback: no port off loopback;
    - DFLASH_AGENT_STORE (the elastic agent sets it, drafters across hosts): the group's store behind
      the run's CURVE keys (keystore.py), served by rank 0's host agent; no TCPStore;
    - else, every rank on this host (MASTER_ADDR a loopback address or unset: systemd units, ranks
      started by hand): rank 0 serves the store on an ipc socket in the run's private socket folder
      (only this user can reach it; local_store); no TCPStore;
    - else MASTER_ADDR:MASTER_PORT (across hosts by hand: the drafter host from the spec), a
      TCPStore bound to that address only, and gloo/NCCL on the interface that holds it."""
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)  # always cuda:0: the launcher sets CUDA_VISIBLE_DEVICES
    store_path = os.environ.get("DFLASH_DIST_STORE")
    address = "127.0.0.1" if store_path else os.environ.get("MASTER_ADDR", "127.0.0.1")
    interface = "lo" if is_loopback(address) else _interface_of(address)
    if interface:
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(name, interface)
    if store_path:
        store = dist.FileStore(store_path, world_size)
    elif agent_store := os.environ.get("DFLASH_AGENT_STORE"):
        from services.drafter.group.keystore import KeyStore

        client = KeyStore(agent_store, os.environ.get("DFLASH_AGENT_STORE_KEYS", ""), timeout_s=1800)
        store = dist.PrefixStore(os.environ["DFLASH_AGENT_STORE_PREFIX"], client)
    elif is_loopback(address) and run_dir is not None:
        store = local_store(run_dir, rank)
    else:
        port = int(os.environ.get("MASTER_PORT", dist_port if world_size > 1 else 0))
        store = _tcp_store(address, port, rank, world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)


_SERVED = []  # rank 0's StoreServer of local_store, for the life of the group


def local_store(run_dir, rank: int):
    """The group's store when every rank is on this host: served by rank 0 on
    ipc://<run dir's socket folder>/drafter-store (a 0700 folder: the uid check), a client in every
    rank. A client sent before rank 0 binds is queued by ZeroMQ, hence the long first answer."""
    from services.drafter.group.keystore import KeyStore, StoreServer
    from services.net.endpoints import socket_dir

    folder = socket_dir(run_dir)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    endpoint = f"ipc://{folder}/drafter-store"
    if rank == 0:
        _SERVED.append(StoreServer(endpoint))
    return KeyStore(endpoint, timeout_s=1800, answer_s=600)  # rank 0 may still be importing torch


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    while _SERVED:
        _SERVED.pop().close()


def stop_everywhere(local: bool, device: torch.device) -> bool:
    """Ranks stop together (a lone rank leaving would hang the others in all-reduce)."""
    flag = torch.tensor([1.0 if local else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def same_everywhere(value: int, device: torch.device) -> bool:
    """True when every rank passed the same value."""
    t = torch.tensor([value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t[0]) == -int(t[1]) == value


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum a few numbers over the drafter ranks (float64; every rank must call it)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def gather_rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """Every rank's torch RNG states (collective: every rank calls it). Tensors through
    dist.all_gather, no pickle. The train step draws its randomness from per-batch generators
    (anchors), so these only matter to code that uses the global generators."""
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {f"{kind}.0": t for kind, t in states.items()}
    comm_device = device if dist.get_backend() == "nccl" else torch.device("cpu")
    out = {}
    for kind, local in states.items():
        parts = [torch.empty_like(local, device=comm_device) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local.to(comm_device))
        out.update({f"{kind}.{r}": p.cpu() for r, p in enumerate(parts)})
    return out
