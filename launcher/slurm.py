"""`launcher up --slurm`: this node and the spec's hosts from the Slurm environment (docs/elastic.md).

Under `srun` (one task per node) every node runs the same `launcher up --slurm --gpus SPEC`. In SPEC a
group's host is a node index into the job's node list, or a range of them: `0-7:target@0,0-7:drafter@1-2`
is the targets on the first node and drafter ranks 0-7 on the second, 8-15 on the third. Each node
name is resolved to its address (the workers bind tcp there; ZeroMQ binds addresses, not names).

The node list (SLURM_JOB_NODELIST, e.g. `node[01-03,07],gpu5`) is expanded here, by a small parser
of Slurm's hostlist syntax, rather than with `scontrol show hostnames`: the same answer on a login
node, in a container without the Slurm tools and in the tests. This node is SLURMD_NODENAME, else
the list's entry at SLURM_NODEID.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from typing import Callable, Mapping

from launcher.errors import UsageError


def expand_hostlist(text: str) -> list[str]:
    """Slurm's hostlist: 'node[01-03,07],gpu5' -> node01 node02 node03 node07 gpu5 (zero padding kept;
    several bracket groups in one name, 'r[1-2]n[1-2]', expand as a product)."""
    names: list[str] = []
    for item in _split_top(text.strip()):
        names.extend(_expand_one(item, text))
    if not names:
        raise UsageError(f"SLURM_JOB_NODELIST={text!r} names no node")
    return names


def _split_top(text: str) -> list[str]:
    """Split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise UsageError(f"SLURM_JOB_NODELIST={text!r}: unbalanced brackets")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise UsageError(f"SLURM_JOB_NODELIST={text!r}: unbalanced brackets")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_one(item: str, whole: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if not match:
        return [item]
    head, tail = item[: match.start()], item[match.end() :]
    out = []
    for part in match.group(1).split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise UsageError(f"SLURM_JOB_NODELIST={whole!r}: {part!r} is not a number or a range like 01-03")
        width = len(lo)
        last = int(hi) if sep else int(lo)
        if last < int(lo):
            raise UsageError(f"SLURM_JOB_NODELIST={whole!r}: range {part!r} is empty")
        for n in range(int(lo), last + 1):
            out.extend(_expand_one(f"{head}{n:0{width}d}{tail}", whole))
    return out


def this_node(env: Mapping[str, str], nodes: list[str]) -> str:
    """This node's name: SLURMD_NODENAME, else the node list's entry at SLURM_NODEID."""
    name = env.get("SLURMD_NODENAME", "")
    if name:
        if name not in nodes:
            raise UsageError(f"SLURMD_NODENAME={name} is not in the job's nodes ({', '.join(nodes)})")
        return name
    try:
        return nodes[int(env["SLURM_NODEID"])]
    except (KeyError, ValueError, IndexError):
        raise UsageError(
            "--slurm: neither SLURMD_NODENAME nor a valid SLURM_NODEID is set (run it under srun)"
        ) from None


def spec_on_nodes(spec: str, nodes: list[str]) -> str:
    """'0-7:target@0,0-7:drafter@1-2' -> '0-7:target@N0,0-7:drafter@N1,0-7:drafter@N2' (node names)."""
    groups = []
    for group in spec.split(","):
        gpus_role, at, where = group.strip().rpartition("@")
        if not at:
            raise UsageError(f"--slurm: --gpus group {group!r} needs @NODE, an index into the job's nodes (@0, @1-2)")
        lo, sep, hi = where.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise UsageError(f"--slurm: --gpus group {group!r}: @{where} is not a node index or range like @1-2")
        for i in range(int(lo), int(hi if sep else lo) + 1):
            if i >= len(nodes):
                raise UsageError(f"--slurm: --gpus group {group!r}: node {i} of {len(nodes)} ({', '.join(nodes)})")
            groups.append(f"{gpus_role}@{nodes[i]}")
    return ",".join(groups)


def resolve(name: str) -> str:
    """A node name's IPv4 address, as every node resolves it."""
    try:
        return socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except OSError as exc:
        raise UsageError(f"--slurm: cannot resolve node {name}: {exc}") from None


def from_slurm(spec: str, env: Mapping[str, str], resolve: Callable[[str], str] = resolve) -> tuple[str, str]:
    """(--gpus with each node's address, --host: this node's address) from the Slurm environment."""
    if "SLURM_JOB_NODELIST" not in env:
        raise UsageError("--slurm: SLURM_JOB_NODELIST is not set (start it with srun inside an allocation)")
    nodes = expand_hostlist(env["SLURM_JOB_NODELIST"])
    here = this_node(env, nodes)
    named = spec_on_nodes(spec, nodes)
    used = list(dict.fromkeys(g.rpartition("@")[2] for g in named.split(",")))
    addresses = {name: resolve(name) for name in dict.fromkeys([*used, here])}
    if len(used) > 1:  # a node whose own name resolves to loopback (/etc/hosts) would bind off the network
        if bad := [n for n, a in addresses.items() if ipaddress.ip_address(a).is_loopback]:
            raise UsageError(
                f"--slurm: node {bad[0]} resolves to {addresses[bad[0]]} (loopback): fix /etc/hosts, or give "
                "--gpus with addresses and --host instead of --slurm"
            )
    on_addresses = ",".join(f"{g.rpartition('@')[0]}@{addresses[g.rpartition('@')[2]]}" for g in named.split(","))
    return on_addresses, addresses[here]
