"""A drafter group across hosts, restarted as one by torch's elastic agent (docs/elastic.md).

    python -m services.drafter.group.agent --run-dir DIR --host H --hosts H0,H1 --ranks 2,3 --world-size 4
        --port P --keys-dir KEYS --max-restarts N --rendezvous-timeout S --stop-timeout S -- WORKER ARGV...

When the drafters of a run live on more than one host, each host's launcher starts this one process
instead of its drafter workers. It runs torch's LocalElasticAgent over a rendezvous of our own
(rendezvous.py) in a store served by drafter rank 0's host agent (keystore.py): when any rank
anywhere fails, every host's agent stops its workers, meets the others again and starts them all
anew; the workers resume from the last checkpoint (rank 0 sends it to the ranks of hosts that do
not share the checkpoints folder: checkpoint_share.py).

- Ranks come from the --gpus spec, not from the rendezvous order (torch orders hosts by their
  address as text): each agent gives its workers the spec's ranks, and checks through the store
  that the agents' ranks together are 0..D-1 once each, else fails naming the hosts.
- One store, no TCPStore: rank 0's host agent serves it on rank 0's address and `port`, a CURVE
  server admitting only the run's client key (--keys-dir), msgpack, nothing unpickled. The agents
  meet in it, and the workers' process group too, under a fresh prefix each start.
- torch counts any nonzero exit as a failure to restart from, so a drafter under the agent exits 0
  after a stop and leaves a `stopped-<rank>` mark here; this process exits 0 (finished), 3
  (stopped) or 1 (failed, with one line on stderr and in agent-<host>.json).

worker_side() is the drafter's side: its log file, GPU and whether to resume, from what the agent set.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from services.process.exits import CONFIG, FINAL, STOPPED

# the exit codes that a restart would meet again: no restart, as the launcher does on one host
FINAL_CODES = {
    CONFIG: "a config or checkpoint error (one line in its log)",
    FINAL: "an error a restart would meet again",
}
ENV_DIR = "DFLASH_AGENT_DIR"  # <run_dir>/elastic: marks and the agent's status
ENV_START = "DFLASH_GROUP_START"  # 1 for the first start of the group, 2 after one restart...
ENV_GPUS = "DFLASH_AGENT_GPUS"  # this host's drafter GPUs, by local rank
ENV_STORE = "DFLASH_AGENT_STORE"  # the group's store (keystore.py): the workers' process group meets there
ENV_STORE_KEYS = "DFLASH_AGENT_STORE_KEYS"  # ... with these CURVE keys ("" on one host: ipc)
ENV_STORE_PREFIX = "DFLASH_AGENT_STORE_PREFIX"  # ... under this round's prefix


INSECURE = (
    "without transport.curve_keys_dir anyone who reaches drafter rank 0's host on transport.dist_port can read and "
    "write the drafter group's store: join or stall the group, and steer its gloo connections; set "
    "transport.curve_keys_dir (`launcher keys DIR`), or transport.insecure_rendezvous=true on a network you trust"
)


SERVER = None  # the group's store, on drafter rank 0's host (make_agent)


def folder(run_dir: str | Path) -> Path:
    return Path(run_dir) / "elastic"


def status_path(run_dir: str | Path, host: str) -> Path:
    return folder(run_dir) / f"agent-{host}.json"


def check_ranks(claims: dict[str, list[int]], world_size: int) -> str:
    """'' when the hosts' ranks are 0..world_size-1 once each, else what is wrong, naming the hosts."""
    owner: dict[int, str] = {}
    for host, ranks in claims.items():
        for r in ranks:
            if r in owner:
                return (
                    f"drafter rank {r} is claimed by {owner[r]} and {host}: "
                    "were the hosts started with one --gpus spec?"
                )
            owner[r] = host
    missing = sorted(set(range(world_size)) - set(owner))
    extra = sorted(set(owner) - set(range(world_size)))
    if missing or extra:
        said = f"no host runs drafter rank(s) {missing}" if missing else f"rank(s) {extra} are past {world_size}"
        return f"{said} (hosts: {', '.join(f'{h}: {v}' for h, v in claims.items())})"
    return ""


# --- the worker's side ------------------------------------------------------------------------------


def worker_side(rank: int) -> bool:
    """In a drafter started by the agent: log to logs/drafter-<rank>.log (appended, as the launcher
    does), take this local rank's GPU, and say whether to resume (any start after the first)."""
    marks = os.environ.get(ENV_DIR)
    if not marks:
        return False
    log = Path(marks).parent / "logs" / f"drafter-{rank}.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(
        fd,
        f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} start (group start {os.environ.get(ENV_START)})\n".encode(),
    )
    for std in (1, 2):
        os.dup2(fd, std)
    os.close(fd)
    gpus = [g for g in os.environ.get(ENV_GPUS, "").split(",") if g]
    if gpus and os.environ.get("CUDA_VISIBLE_DEVICES"):  # on the CPU the launcher hides every GPU
        os.environ["CUDA_VISIBLE_DEVICES"] = os.environ["DFLASH_GPU"] = gpus[int(os.environ.get("LOCAL_RANK", 0))]
    (Path(marks) / f"stopped-{rank}").unlink(missing_ok=True)
    return int(os.environ.get(ENV_START, "1")) > 1


def worker_exit(rank: int, code: int) -> int:
    """A stop is 0 to torch's agent (else it restarts the group) plus a mark the agent reads."""
    marks = os.environ.get(ENV_DIR)
    if marks and code == STOPPED:
        (Path(marks) / f"stopped-{rank}").touch()
        return 0
    return code


# --- the agent --------------------------------------------------------------------------------------


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.drafter.group.agent", description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--host", required=True, help="this host's address (as in the --gpus spec)")
    p.add_argument(
        "--hosts", required=True, help="the drafter hosts in spec order, comma-separated; the first runs rank 0"
    )
    p.add_argument("--ranks", required=True, help="this host's drafter ranks, comma-separated")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--port", type=int, required=True, help="the rendezvous store's port (transport.dist_port)")
    p.add_argument("--run-id", required=True)
    p.add_argument("--keys-dir", default="", help="the run's CURVE keys (transport.curve_keys_dir)")
    p.add_argument(
        "--insecure-rendezvous", action="store_true", help="serve the store across hosts without keys (trusted network)"
    )
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--rendezvous-timeout", type=float, default=600.0)
    p.add_argument("--stop-timeout", type=float, default=330.0)
    p.add_argument("worker", nargs=argparse.REMAINDER, help="-- then the drafter worker's argv")
    args = p.parse_args(argv)
    args.worker = args.worker[1:] if args.worker[:1] == ["--"] else args.worker
    args.hosts, args.ranks = args.hosts.split(","), [int(r) for r in args.ranks.split(",")]
    if not args.worker or args.host not in args.hosts:
        p.error("give the worker's argv after --, and a --host among --hosts")
    if len(args.hosts) > 1 and not args.keys_dir and not args.insecure_rendezvous:
        p.error(f"a drafter group across hosts needs --keys-dir: {INSECURE}")
    return args


def store_endpoint(args: argparse.Namespace) -> str:
    """Where drafter rank 0's host agent serves the group's store: on one host an ipc socket in the
    run's private socket folder, across hosts rank 0's address and transport.dist_port."""
    if len(args.hosts) == 1:
        from services.net.endpoints import socket_dir

        return f"ipc://{socket_dir(args.run_dir)}/drafter-store"
    return f"tcp://{args.hosts[0]}:{args.port}"


def make_agent(args: argparse.Namespace):
    from torch.distributed.elastic.agent.server.api import Worker, WorkerSpec, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import LogsDest, LogsSpecs

    from services.drafter.group.keystore import KeyStore, StoreServer
    from services.drafter.group.rendezvous import KeyedRendezvous

    marks = folder(args.run_dir)

    class InheritLogs(LogsSpecs):
        """Workers keep the agent's stdout/stderr until worker_side() moves them to their own log
        (torch's own logs are opened with "w": a restart would erase the one before)."""

        def reify(self, envs):
            ranks = list(envs)
            return LogsDest({r: "" for r in ranks}, {r: "" for r in ranks}, {}, {}, {r: "" for r in ranks})

        @property
        def root_log_dir(self) -> str:
            return str(marks)

    class DrafterAgent(LocalElasticAgent):
        starts, final = 0, ""

        def _assign_worker_ranks(self, store, group_rank, group_world_size, spec):
            """The spec's ranks, checked across hosts through this round's store."""
            if group_world_size != len(args.hosts):
                raise RuntimeError(f"{group_world_size} drafter hosts met, the spec has {len(args.hosts)}")
            store.set(f"dflash/ranks/{group_rank}", json.dumps([args.host, args.ranks]))
            claims = dict(json.loads(store.get(f"dflash/ranks/{i}")) for i in range(group_world_size))
            if problem := check_ranks(claims, args.world_size):
                raise RuntimeError(problem)
            return [
                Worker(
                    local_rank=i,
                    global_rank=r,
                    role_rank=r,
                    world_size=args.world_size,
                    role_world_size=args.world_size,
                )
                for i, r in enumerate(args.ranks)
            ]

        def _start_workers(self, worker_group):
            self.starts += 1
            os.environ[ENV_START] = str(self.starts)  # the workers' environment is a copy of ours
            os.environ[ENV_STORE_PREFIX] = handler.workers_prefix()  # a fresh group's keys
            write_status(args, state="running", starts=self.starts)
            return super()._start_workers(worker_group)

        def _restart_workers(self, worker_group):
            """torch's, but the workers are killed, not sent SIGTERM: that is a stop to a drafter, which
            checkpoints and reports "stopped", and the target hosts would end the run. As after a failure,
            the group resumes from its last checkpoint (the ledger cuts the steps after it)."""
            self._shutdown(signal.SIGKILL)
            worker_group.state = WorkerState.STOPPED
            self._initialize_workers(worker_group)

        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if result.state == WorkerState.FAILED:
                if final := [f for f in result.failures.values() if f.exitcode in FINAL_CODES]:
                    self._remaining_restarts = 0  # a restart would meet it again: end now, as on one host
                    self.final = (
                        f"; {FINAL_CODES[final[0].exitcode]}, see logs/drafter-{args.ranks[final[0].local_rank]}.log"
                    )
                write_status(
                    args, state="restarting", starts=self.starts, failures=describe(result.failures, args.ranks)
                )
            return result

    endpoint = store_endpoint(args)
    global SERVER
    SERVER = StoreServer(endpoint, args.keys_dir) if args.host == args.hosts[0] else None
    store = KeyStore(endpoint, args.keys_dir, timeout_s=args.rendezvous_timeout)
    os.environ.update({ENV_STORE: endpoint, ENV_STORE_KEYS: args.keys_dir})
    handler = KeyedRendezvous(
        store,
        args.run_id,
        args.hosts,
        args.hosts.index(args.host),
        args.port,
        join_timeout_s=args.rendezvous_timeout,
        max_membership_restarts=args.max_restarts,
    )
    spec = WorkerSpec(
        role="drafter",
        local_world_size=len(args.ranks),
        rdzv_handler=handler,
        entrypoint=args.worker[0],
        args=tuple(args.worker[1:]),
        max_restarts=args.max_restarts,
        monitor_interval=0.5,
        master_addr=args.hosts[0],  # unused: the workers' process group meets in the store above
        master_port=args.port,
        local_addr=args.host,
    )
    return DrafterAgent(
        spec, InheritLogs(), start_method="spawn", shutdown_timeout=int(args.stop_timeout), exit_barrier_timeout=60
    )


def describe(failures: dict, ranks: list[int]) -> str:
    """'drafter-3 exited with code 1' for each failed worker (torch's ProcessFailure, by local rank)."""
    said = []
    for f in failures.values():
        code = f"signal {signal.Signals(-f.exitcode).name}" if f.exitcode < 0 else f"code {f.exitcode}"
        said.append(f"drafter-{ranks[f.local_rank]} exited with {code}")
    return ", ".join(said)


def write_status(args: argparse.Namespace, **status) -> None:
    from services.run.files import write_json_atomic

    restarts = max(0, status.get("starts", 1) - 1)
    if SERVER is not None:  # rank 0's host: what its store answered, refused (handshakes) and dropped
        status["store"] = {"served": SERVER.served, "refused": SERVER.refused, "dropped": SERVER.dropped}
    write_json_atomic(
        status_path(args.run_dir, args.host),
        {
            "host": args.host,
            "ranks": args.ranks,
            "port": args.port,
            "restarts": restarts,
            "pid": os.getpid(),
            "at": time.time(),
            **status,
        },
    )


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    marks = folder(args.run_dir)
    marks.mkdir(parents=True, exist_ok=True)
    for r in args.ranks:
        (marks / f"stopped-{r}").unlink(missing_ok=True)
    os.environ[ENV_DIR] = str(marks)
    # the launcher's death signal (launcher/process.py) is a stop, as SIGTERM (torch's agent handles that one)
    from services.process.lifecycle import PARENT_DIED

    signal.signal(PARENT_DIED, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousError

    from services.drafter.group.keystore import StoreGone
    from services.drafter.group.rendezvous import MembershipLoop

    agent = None
    try:
        agent = make_agent(args)
        result = agent.run()
        if result.is_failed():
            why = f"{describe(result.failures, args.ranks)}"
            why += agent.final or f"; drafter restarts exhausted (supervise.max_restarts={args.max_restarts})"
            return fail(args, why, agent)
    except SignalException:  # a stop: the workers were sent it and have ended
        try:  # the other hosts' agents wait there for this one before they exit
            agent._exit_barrier()
        except Exception:  # noqa: BLE001 - the store may be gone already
            pass
    except RendezvousClosedError:
        return fail(args, "another drafter host's agent failed and closed the group (its launcher says why)", agent)
    except StoreGone as exc:
        said = f"drafter rank 0's host {args.hosts[0]} stopped answering ({exc}): it or its agent is gone"
        return fail(args, said, agent)
    except MembershipLoop as exc:
        return fail(args, str(exc), agent)
    except RendezvousError as exc:
        return fail(
            args,
            f"the drafter hosts ({', '.join(args.hosts)}) did not all meet within supervise.rendezvous_timeout_s="
            f"{args.rendezvous_timeout:.0f}s at {args.hosts[0]}:{args.port}" + (f" ({exc})" if str(exc) else ""),
            agent,
        )
    except Exception as exc:  # the store gone (rank 0's host died), ranks that do not add up...
        return fail(args, f"{type(exc).__name__}: {exc}", agent)
    stopped = [r for r in args.ranks if (marks / f"stopped-{r}").exists()]
    write_status(args, state="stopped" if stopped else "finished", starts=agent.starts)
    linger()
    return STOPPED if stopped else 0


def linger() -> None:
    """On rank 0's host: keep the store up a moment, so that the other agents read its last keys
    (the exit barrier, the group closed) rather than wait for an answer that will not come."""
    if SERVER is not None:
        time.sleep(3)
        SERVER.close()


def fail(args: argparse.Namespace, reason: str, agent) -> int:
    """One line, the status file, and the rendezvous closed: the other hosts' agents end now rather
    than wait supervise.rendezvous_timeout_s for this one."""
    print(f"agent: failed: {reason}", file=sys.stderr, flush=True)
    write_status(args, state="failed", reason=reason, starts=agent.starts if agent else 0)
    if agent is not None:
        try:
            agent.get_worker_group().spec.rdzv_handler.shutdown()
        except Exception:  # noqa: BLE001 - the store may be gone with rank 0's host
            pass
        linger()
    return 1


if __name__ == "__main__":
    sys.exit(main())
