"""The launcher's side of a drafter group across hosts (docs/elastic.md): this host's drafters run
under one torch elastic agent (services/drafter/group/agent.py), which starts them, gives them their
ranks and restarts the whole group, on every host, when any rank fails. The Supervisor mixes this
in; it keeps probing the drafters' health and ends the run when the agent ends.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal

import psutil

from launcher import process
from launcher.errors import RunFailed, cannot_write
from launcher.topology import Worker, count
from services.process import jobs


def rendezvous_problems(transport, drafter_hosts: list[str]) -> tuple[str, str]:
    """(refusal, warning) for a drafter group across hosts without the run's keys: its store would
    admit anyone who reaches rank 0's host (docs/guide/security.md, threat model)."""
    if len(set(drafter_hosts)) < 2 or transport.curve_keys_dir:
        return "", ""
    said = (
        f"the drafter group's store at {drafter_hosts[0]}:{transport.dist_port} (transport.dist_port) without "
        "transport.curve_keys_dir: anyone who reaches that port can read and write it, join or stall the drafter "
        "group and steer its gloo connections"
    )
    if not transport.insecure_rendezvous:
        return (
            f"{said}. Make keys with `launcher keys DIR` and set transport.curve_keys_dir=DIR on every host, or set "
            "transport.insecure_rendezvous=true on a network you trust completely",
            "",
        )
    return "", f"{said} (transport.insecure_rendezvous=true)"


class ElasticDrafters:
    """Supervisor methods for the agent of this host's drafters (uses the Supervisor's state)."""

    def agent_argv(self, drafters: list[Worker]) -> list[str]:
        """services/drafter/group/agent.py for this host's drafters, then the drafter worker's argv: the
        Supervisor's (launcher/worker_argv.py), without rank and world size, which the agent gives."""
        run = self.cfg.run
        spec = ",".join(f"{w.name}@{w.host}" for w in self.workers)
        return [
            *jobs.argv("drafter-agent"),
            "--run-dir",
            str(self.run_dir),
            "--host",
            self.host,
            "--hosts",
            ",".join(self.drafter_hosts),
            "--ranks",
            ",".join(str(w.rank) for w in drafters),
            "--world-size",
            str(count(self.workers, "drafter")),
            "--port",
            str(self.dist_port),
            "--run-id",
            f"dflash-{run.name}-{hashlib.sha256(spec.encode()).hexdigest()[:12]}",
            *(["--keys-dir", keys] if (keys := self.cfg.transport.curve_keys_dir) else []),
            *(["--insecure-rendezvous"] if self.cfg.transport.insecure_rendezvous else []),
            "--max-restarts",
            str(self.cfg.supervise.max_restarts),
            "--rendezvous-timeout",
            str(self.cfg.supervise.rendezvous_timeout_s),
            "--stop-timeout",
            str(self.stop_timeout_s),
            "--",
            *self.argv(drafters[0]),
        ]

    def start_agent(self, drafters: list[Worker]) -> None:
        """One elastic agent for this host's drafters: each drafter's process is the agent's (its
        exit is theirs), recorded once (a stop signals it once: it forwards the stop to them)."""
        env = self.env(drafters[0])
        if self.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(w.gpu) for w in drafters)
        env["DFLASH_AGENT_GPUS"] = ",".join(str(w.gpu) for w in drafters)
        env["LOCAL_WORLD_SIZE"] = str(len(drafters))
        log = self.run_dir / "logs" / "drafter-agent.log"
        try:
            proc = process.spawn(self.agent_argv(drafters), env, log)
        except OSError as exc:
            raise RunFailed(cannot_write(log, exc)) from None
        ident = process.identity(proc.pid)
        for i, w in enumerate(drafters):
            self.procs[w.name] = proc
            self.idents[w.name] = ident if i == 0 else None
            self.pids_seen[w.name].append(proc.pid)
            self.answered.discard(w.name)
        self.write_run_json()

    def agent_status(self) -> dict | None:
        """What this host's agent last wrote (services/drafter/group/agent.py): state, restarts, reason."""
        try:
            return json.loads((self.run_dir / "elastic" / f"agent-{self.host}.json").read_text())
        except (OSError, ValueError):
            return None

    def agent_failed(self, rc: int) -> str:
        """One line for an agent that ended in failure, naming the drafter hosts that are gone."""
        reason = (self.agent_status() or {}).get("reason") or f"the drafter agent exited with code {rc}"
        remote = [w for w in self.workers if w.role == "drafter" and w.host != self.host]
        silent = [w for w, (_, status, _) in zip(remote, self.probe_all(remote, timeout_s=1.0)) if status is None]
        gone = [h for h in self.drafter_hosts if h != self.host and any(w.host == h for w in silent)]
        if gone:
            names = ", ".join(w.name for w in silent)
            return f"drafter host {', '.join(gone)} is gone ({names} unreachable): {reason}"
        return f"drafter group failed: {reason}"

    def kill_drafter(self, w: Worker) -> bool:
        """A stalled or unresponsive drafter under the agent: kill it (True), and the agents restart
        the group. Only a live child of this host's agent is killed."""
        pid = self.last_pid.get(w.name)
        agent = process.verified(self.idents.get(next(d.name for d in self.local if d.role == "drafter")))
        try:
            if pid and agent is not None and pid in {c.pid for c in agent.children(recursive=True)}:
                os.kill(pid, signal.SIGKILL)
                self.last_pid.pop(w.name, None)
                return True
        except (ProcessLookupError, psutil.Error):
            pass
        return False
