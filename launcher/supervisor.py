"""The supervisor: start one process per GPU, wait until all are ready, watch them until training ends.

Policy (docs/guide/failures.md#restart-policy):
- a worker is in trouble when it exits, stalls (its health says no progress for supervise.stall_after_s)
  or is unresponsive: its pid lives but its health, which answered before, has not answered for
  supervise.unresponsive_after_s (SIGSTOP, a hung interpreter: the health thread is frozen too);
- a target in trouble is restarted with backoff (1, 2, 4 ... 60 s): SIGTERM, and SIGKILL when that
  does nothing within KILL_AFTER_S; drafters notice the new process and re-request the batches it
  owed, so nothing is lost;
- a drafter in trouble takes the whole DDP group down; the group restarts from the latest
  checkpoint (a rank cannot rejoin a running NCCL/gloo group). A drafter that only *stalls* while
  a target is in trouble (or was, within supervise.stall_after_s) is waiting for it, not at fault: it is
  left alone, so a hung target never uses up the drafters' restarts;
- each role may restart supervise.max_restarts times over the run; one more failure ends the run (exit 1);
  a failure no restart can mend (out of memory, a config error, a final error: exit 4, the same
  error line twice in a row: launcher/causes.py) ends it at once, saying what to change;
- the messages a worker dropped (its health's counts, polled with the probes): one warning when
  they start to rise, the totals at the end and in run.json's outcome (launcher/drops.py);
- SIGINT/SIGTERM: graceful stop (drafters checkpoint and exit, then targets), exit 3; a second
  signal during the stop kills every worker at once (a stuck stop would otherwise wait out
  --stop-timeout), but only from a person: 2 s or more after the first, and not from a sender
  that sent that signal already (services/process/lifecycle.py, StopRequests);
- all drafters exit 0 (the last step reached, stop or not): finished, targets stopped, exit 0;
  drafters that exit services.process.exits.STOPPED (3: a stop sent to a drafter itself stops its group)
  stopped before the end: targets stopped, exit 3, as for a stop of the launcher.

Across hosts every launcher supervises the workers of its own host. A host with targets only
ends when every (remote) drafter has reported "stopped" or stayed unreachable for REMOTE_GONE_S:
finished (0) when each drafter's last status had reached its last step, else stopped (3).
A drafter group spread over several hosts runs under torch's elastic agent, one per drafter host
(services/drafter/group/agent.py, docs/elastic.md): the agents restart the whole group, on every host,
when any rank fails; this launcher starts its host's agent, probes its drafters, kills a stalled or
unresponsive one (the agents then restart the group) and ends the run when its agent ends.

One piece on purpose (about 580 lines, the policy above as code): every rule reads and changes the
same state (the processes, their restart counts and backoffs, who is in trouble since when, the
stop in progress), and each decision weighs the others (a drafter stalled by a target in trouble is
left alone); what stands apart is its own module: the drafter group across hosts (elastic.py), the
causes of an exit (causes.py), the dropped messages (drops.py), a worker's command line
(worker_argv.py), signals and pids (process.py).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from launcher import process
from launcher.causes import exit_cause, read_log
from launcher.drops import DropWatch
from launcher.elastic import ElasticDrafters
from launcher.errors import RunFailed, cannot_write
from launcher.progress import ProgressLine, describe_acceptance, duration
from launcher.topology import Worker, count
from launcher.worker_argv import worker_argv
from services.net import curve
from services.net.endpoints import endpoint, socket_dir
from services.net.health_probe import probe
from services.process.exits import STOPPED as DRAFTER_STOPPED
from services.process.lifecycle import StopRequests, describe, watch_with_sender
from services.run.config import Config
from services.run.files import cpu_share, write_json_atomic

EXIT_DONE, EXIT_FAILED, EXIT_USAGE, EXIT_STOPPED = 0, 1, 2, 3
PROBE_EVERY_S = 5.0
REMOTE_GONE_S = 30.0
KILL_AFTER_S = 5.0  # a worker in trouble gets SIGTERM, then SIGKILL (a frozen one ignores SIGTERM)


def probe_all(endpoints: list[str], timeout_s: float, keys_dir: str = "") -> list[tuple[int, dict | None, str]]:
    """Probe several health endpoints at once: N dead workers cost one timeout, not N."""
    if not endpoints:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(endpoints))) as pool:
        return list(pool.map(lambda e: probe(e, timeout_s=timeout_s, keys_dir=keys_dir), endpoints))


class Supervisor(ElasticDrafters):
    def __init__(
        self,
        run_dir: Path,
        cfg: Config,
        workers: list[Worker],
        device: str,
        resume: bool = False,
        ready_timeout_s: float = 3600.0,
        stop_timeout_s: float = 300.0,
        host: str = "",
    ):
        self.run_dir, self.cfg, self.workers, self.device = run_dir, cfg, workers, device
        self.local = [w for w in workers if w.host == host]  # this host's workers (all of them on one host)
        self.resume = resume
        self.ready_timeout_s, self.stop_timeout_s = ready_timeout_s, stop_timeout_s
        self.procs: dict[str, object] = {}
        self.idents: dict[str, dict | None] = {}  # start time + command line of each spawned worker
        self.pids_seen: dict[str, list[int]] = {w.name: [] for w in workers}
        self.launcher = process.identity(os.getpid())
        self.started = time.time()
        self.outcome: dict | None = None
        self.restarts = {"target": 0, "drafter": 0}
        # Every drafter on this host (always so on one host): the group meets in a file in the
        # private socket folder, and opens no TCP port. Across hosts: at the drafter host of the
        # spec, port transport.dist_port, which every launcher knows.
        self.local_group = all(w.host == host for w in workers if w.role == "drafter")
        # drafters on several hosts: one elastic agent per host starts and restarts them (docs/elastic.md)
        self.drafter_hosts = list(dict.fromkeys(w.host for w in workers if w.role == "drafter"))
        self.elastic = len(self.drafter_hosts) > 1
        self.host = host
        self.master_addr = cfg.transport.drafter_hosts[0] if host else "127.0.0.1"
        self.dist_port = cfg.transport.dist_port
        self.groups_started = 0
        # a group across hosts is unreachable while its agents meet again: wait that long too
        self.remote_gone_s = REMOTE_GONE_S + (cfg.supervise.rendezvous_timeout_s if self.elastic else 0)
        self.remote_seen: dict[str, float] = {}  # remote drafter -> last time it answered
        self.remote_last: dict[str, dict] = {}  # ... and what it said then
        self.answered: set[str] = set()  # workers whose health answered since they started
        self.silent_since: dict[str, float] = {}  # ... and has not answered since this time
        self.target_trouble_at = -float("inf")  # the last time a target was in trouble or not ready
        self.last_state: dict[str, str] = {}  # each worker's state at the last probe
        self.last_pid: dict[str, int] = {}  # each worker's pid, as its health says (the agent's drafters)
        self.trained: set[str] = set()  # drafters seen in state "training" (they have steps to save)
        self.stopping = self.forced = False
        self.stop_reason = ""  # why the drafters stopped early (run.json's reason)
        self.resumed: dict | None = None  # `up --resume`: what drafter 0 resumed from (run.json's `resumed`)
        self.stop_requests = StopRequests()
        self.last_exit: dict[str, dict] = {}  # each worker's last exit: code, cause, time
        self.progress = ProgressLine()
        self.drops = DropWatch()  # messages each worker dropped (another process answering...)
        self.said: set = set()  # real-acceptance lines and notes printed (one line each)

    # --- starting ----------------------------------------------------------
    def endpoints(self, w: Worker) -> dict[str, str]:
        return {p: endpoint(self.run_dir, self.cfg.transport, w.role, w.rank, p) for p in ("health", "data")}

    def probe(self, w: Worker, timeout_s: float) -> tuple[int, dict | None, str]:
        return probe(self.endpoints(w)["health"], timeout_s=timeout_s, keys_dir=curve.keys_for(self.cfg.transport))

    def probe_all(self, workers: list[Worker], timeout_s: float) -> list[tuple[int, dict | None, str]]:
        return probe_all([self.endpoints(w)["health"] for w in workers], timeout_s, curve.keys_for(self.cfg.transport))

    def argv(self, w: Worker) -> list[str]:
        """The worker's command line; a drafter under the elastic agent gets no rank nor world size
        (the agent gives each worker RANK and WORLD_SIZE)."""
        drafter = w.role == "drafter"
        under_agent = drafter and self.elastic
        return worker_argv(
            w.role,
            config=str(self.run_dir / "config.json"),
            run_dir=str(self.run_dir),
            rank=None if under_agent else w.rank,
            world_size=None if under_agent else count(self.workers, w.role),
            device=self.device,
            num_targets=count(self.workers, "target") if drafter else None,
            resume=drafter and bool(self.resume or self.restarts["drafter"]),
        )

    def env(self, w: Worker) -> dict[str, str]:
        env = dict(os.environ)
        share = cpu_share(len(self.local))
        env.update(
            {
                "PYTHONUNBUFFERED": "1",
                "TORCHINDUCTOR_CACHE_DIR": str(self.run_dir / "compile-cache"),
                "TORCHINDUCTOR_COMPILE_THREADS": str(share),
                "DFLASH_GPU": str(w.gpu),
            }
        )
        if self.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = str(w.gpu)  # inside, the GPU is always cuda:0
            if self.cfg.run.alloc_conf:
                env["PYTORCH_CUDA_ALLOC_CONF"] = self.cfg.run.alloc_conf
        else:
            env["CUDA_VISIBLE_DEVICES"] = ""  # logical slots; hide any GPU
            env["OMP_NUM_THREADS"] = str(share)
        if w.role == "drafter" and self.local_group:  # the rendezvous; rank and world size are arguments
            env["DFLASH_DIST_STORE"] = str(self.dist_store())
        elif w.role == "drafter" and not self.elastic:
            env.update({"MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.dist_port)})
        return env

    def dist_store(self) -> Path:
        """The drafter group's FileStore: a fresh file for each start of the group (a group that
        died leaves its file behind, and a new group must not read the old one's keys)."""
        folder = socket_dir(self.run_dir)  # private: made here too, since a tcp run binds no ipc socket in it
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        return folder / f"dist-{self.groups_started}.store"

    def start(self, w: Worker) -> None:
        try:
            proc = process.spawn(self.argv(w), self.env(w), self.log(w))
        except OSError as exc:  # a full disk: the worker could not log anything, so is not started
            raise RunFailed(cannot_write(self.log(w), exc)) from None
        self.procs[w.name] = proc
        self.idents[w.name] = process.identity(proc.pid)
        self.answered.discard(w.name)
        self.silent_since.pop(w.name, None)
        self.last_state.pop(w.name, None)
        self.pids_seen[w.name].append(proc.pid)
        self.drops.restarted(w.name)
        self.write_run_json()

    def start_all(self) -> None:
        self._new_dist_store()
        for w in self.local:
            if not (self.elastic and w.role == "drafter"):
                self.start(w)
        if drafters := [w for w in self.local if w.role == "drafter" and self.elastic]:
            self.start_agent(drafters)

    def _new_dist_store(self) -> None:
        if self.local_group:
            self.dist_store().unlink(missing_ok=True)  # the last group's file, done with
            self.groups_started += 1
            # the path the new group will use: an earlier launch of this run dir may have left it
            # behind (its count started at 0 too), and stale keys send gloo to dead ports
            self.dist_store().unlink(missing_ok=True)

    def write_run_json(self) -> None:
        try:
            self._write_run_json()
        except OSError as exc:
            raise RunFailed(cannot_write(self.run_dir / "run.json", exc)) from None

    def _write_run_json(self) -> None:
        info = {
            "launcher_pid": os.getpid(),
            "launcher": self.launcher,
            "device": self.device,
            "started": self.started,
            "run_dir": str(self.run_dir),
            "dist_port": None if self.local_group else self.dist_port,
            "elastic": self.agent_status() if self.elastic else None,
            "restarts": self.restarts,
            "resumed": self.resumed,
            "outcome": self.outcome or {"state": "running"},
            "workers": [
                dict(
                    asdict(w),
                    name=w.name,
                    pid=self.procs[w.name].pid if w.name in self.procs else None,
                    identity=self.idents.get(w.name),
                    pids_seen=self.pids_seen[w.name],
                    endpoints=self.endpoints(w),
                    last_exit=self.last_exit.get(w.name),
                )
                for w in self.workers
            ],
        }
        write_json_atomic(self.run_dir / "run.json", info)

    def record_outcome(self, code: int, reason: str = "") -> None:
        """How the run ended, for `launcher status` after the processes are gone."""
        state = {EXIT_DONE: "finished", EXIT_STOPPED: "stopped"}.get(code, "failed")
        self.outcome = {"state": state, "exit": code, "reason": reason, "ended": time.time()}
        if dropped := self.drops.dropped():  # kept with the outcome: a run that ended well can have had them
            self.outcome.update(dropped=dropped, dropped_from=self.drops.dropped_from())
        try:
            self._write_run_json()
        except OSError as exc:  # the run has ended anyway; say why its outcome is not on disk
            self.progress.done(f"outcome not recorded: {cannot_write(self.run_dir / 'run.json', exc)}")

    # --- readiness -----------------------------------------------------------
    def wait_ready(self) -> None:
        """Block until every worker's health says ready/training; raise RunFailed on an exit or timeout.

        A drafter that exits 0 before it was seen ready has finished (e.g. --resume of a finished
        run: it loads the last step, exports and exits), one that exits 3 (exits.STOPPED) before it
        was seen has stopped; neither is waited for, and once every local drafter has ended there is
        nothing left to wait for: supervise() ends the run, finished or stopped."""
        began = time.monotonic()
        deadline = began + self.ready_timeout_s
        pending = {w.name: w for w in self.local}
        drafters = [w for w in self.local if w.role == "drafter"]
        while pending:
            if self.stopping:
                return
            for w in pending.values():
                self._check_exited_during_start(w)
            if drafters and all(self.procs[w.name].poll() in (0, DRAFTER_STOPPED) for w in drafters):
                self.progress.done("every drafter has already ended")  # finished or stopped: supervise() says
                return
            waiting = list(pending.values())
            states = {}
            for w, (_, status, _) in zip(waiting, self.probe_all(waiting, timeout_s=1.0)):
                state = status.get("state") if status else None
                if state == "training" and w.role == "drafter":
                    self.trained.add(w.name)
                ended = w.role == "drafter" and self.procs[w.name].poll() in (0, DRAFTER_STOPPED)
                if state in ("ready", "training") or ended:
                    del pending[w.name]
                elif state == "failed" and not (self.elastic and w.role == "drafter"):  # the agent restarts those
                    with contextlib.suppress(subprocess.TimeoutExpired):  # a failed worker is on its way out:
                        self.procs[w.name].wait(timeout=5.0)  # its exit code says whether a restart could mend it
                    self._check_exited_during_start(w)
                    raise RunFailed(f"{w.name} failed while starting: {status.get('errors')} (log: {self.log(w)})")
                states[w.name] = state or "?"
            if not pending:
                break
            if time.monotonic() > deadline:
                raise RunFailed(f"not ready after {self.ready_timeout_s:.0f}s: {', '.join(pending)}")
            waiting_for = " ".join(f"{n}:{states[n]}" for n in sorted(pending))
            waited = duration(time.monotonic() - began)  # it changes, so a log gets a line every 10 s too
            self.progress.show(f"starting… waiting for {waiting_for} ({waited})")
            time.sleep(0.5)
        self.progress.done("all workers ready")

    def _check_exited_during_start(self, w: Worker) -> None:
        rc = self.procs[w.name].poll()
        if self.elastic and w.role == "drafter" and rc not in (None, 0, DRAFTER_STOPPED):  # its agent gave up
            agent_log = self.run_dir / "logs" / "drafter-agent.log"
            tail = "\n".join(read_log(agent_log).splitlines()[-15:]) if agent_log.exists() else "(no log)"
            raise RunFailed(f"{self.agent_failed(rc)}\nlast lines of {agent_log}:\n{tail}")
        if rc is not None and not (w.role == "drafter" and rc in (0, DRAFTER_STOPPED)):  # ended, not failed
            cause = self.exit_cause(w, rc)
            advice = f"; {cause.fatal}" if cause.fatal and rc != 2 else ""
            # the first line is the outcome's reason in run.json: it carries the cause, the log follows
            raise RunFailed(
                f"{w.name} exited with code {rc} while starting: {cause.text}{advice}\n"
                f"last lines of {self.log(w)}:\n{self.tail(w)}"
            )

    def exit_cause(self, w: Worker, rc: int):
        """Why w exited (kept for run.json and `launcher status`)."""
        previous = self.last_exit.get(w.name, {}).get("cause", "")
        cause = exit_cause(w.role, rc, read_log(self.log(w)), previous)
        self.last_exit[w.name] = {"code": rc, "cause": cause.text, "fatal": cause.fatal, "at": time.time()}
        return cause

    def exited(self, w: Worker, rc: int) -> str:
        """The launcher's line for a worker that exited after it was ready; RunFailed when no
        restart can help."""
        cause = self.exit_cause(w, rc)
        line = f"{w.name} exited with code {rc} on gpu {w.gpu}: {cause.text}"
        if cause.fatal:
            raise RunFailed(f"{line}; {cause.fatal}")
        return line

    def log(self, w: Worker) -> Path:
        return self.run_dir / "logs" / f"{w.name}.log"

    def tail(self, w: Worker, lines: int = 15) -> str:
        try:
            return "\n".join(self.log(w).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    # --- supervising ---------------------------------------------------------
    def supervise(self) -> int:
        """Watch the run until it ends. Returns the launcher's exit code."""
        targets = [w for w in self.local if w.role == "target"]
        drafters = [w for w in self.local if w.role == "drafter"]
        everyone = [w for w in self.workers if w.role == "drafter"]
        restart_due: dict[str, float] = {}
        down_since: dict[str, float] = {}  # targets restarting or loading again: since when
        last_probe = 0.0
        while not self.stopping:
            now = time.monotonic()
            trouble: dict[str, tuple[str, str]] = {}
            if now - last_probe > PROBE_EVERY_S:
                trouble, last_probe = self._troubled_workers(), now
            for w in targets:
                rc = self.procs[w.name].poll()
                if w.name in restart_due or self.last_state.get(w.name) not in ("ready", "training"):
                    self.target_trouble_at = now  # down, or loading again: drafters wait for it
                if w.name in restart_due:
                    if now >= restart_due[w.name]:
                        del restart_due[w.name]
                        self.start(w)
                elif rc is not None or w.name in trouble:
                    self.target_trouble_at = now
                    why = self.exited(w, rc) if rc is not None else f"{w.name} {trouble[w.name][1]}"
                    delay = self._count_restart("target", why)
                    process.stop_all([self.idents[w.name]], deadline_s=KILL_AFTER_S)  # itself, not its peers
                    restart_due[w.name] = now + delay
            if now - self.target_trouble_at < self.cfg.supervise.stall_after_s:  # drafters wait for it: not their fault
                trouble = {n: t for n, t in trouble.items() if t[0] != "stalled" or not n.startswith("drafter")}
            codes = [self.procs[w.name].poll() for w in drafters]
            if drafters and DRAFTER_STOPPED in codes and all(rc in (0, DRAFTER_STOPPED) for rc in codes):
                return self._drafters_stopped(
                    [w.name for w, rc in zip(drafters, codes) if rc == DRAFTER_STOPPED], "a stop request sent to it"
                )
            if all(rc == 0 for rc in codes) and (drafters or self._remote_drafters_done(everyone)):
                early = [n for n in map(self._short_of_end, everyone) if n]
                # ranks step together: one seen at the last step means all reached it (the others
                # may have exited between two probes)
                if not drafters and early and len(early) == len(everyone):
                    return self._drafters_stopped(early, "seen from this host")
                self.progress.done(self._progress_text(everyone, final=True))
                self.stop_targets()
                return EXIT_DONE
            bad = [w for w, rc in zip(drafters, codes) if (rc not in (None, 0, DRAFTER_STOPPED)) or w.name in trouble]
            if bad and self.elastic:
                if (rc := codes[0]) not in (None, 0, DRAFTER_STOPPED):
                    raise RunFailed(self.agent_failed(rc))
                for w in bad:  # (not while the agents meet again: then its last pid is gone)
                    if self.kill_drafter(w):
                        self.progress.done(f"{w.name} {trouble[w.name][1]}; killed it: the drafter group restarts")
            elif bad:
                self._restart_drafter_group(drafters, bad, codes, trouble)
            waits = target_waits(targets, restart_due, self.last_state, down_since, now)
            self.progress.show(" | ".join(p for p in (waits, self._progress_text(everyone)) if p))
            time.sleep(0.5)
        return self.shutdown()

    def _drafters_stopped(self, names: list[str], why: str) -> int:
        """The drafters stopped before the end, not by our stop: the run is stopped, not finished."""
        self.stop_reason = f"{', '.join(names)} stopped before the end of training ({why})"
        self.progress.done(self.stop_reason)
        self.stop_targets()
        return EXIT_STOPPED

    def _short_of_end(self, w: Worker) -> str:
        """'drafter-0 at step 37/150' for a remote drafter whose last status was short of its last step, else ''."""
        last = self.remote_last.get(w.name) or {}
        step, total = last.get("step", 0), last.get("total_steps")
        return "" if total and step >= total else f"{w.name} at step {step}/{total or '?'}"

    def _remote_drafters_done(self, drafters: list[Worker]) -> bool:
        """For a host without drafters: has every drafter finished (stopped, or gone for good)?"""
        now, done = time.monotonic(), True
        answers = list(zip(drafters, self.probe_all(drafters, timeout_s=0.5)))
        for w, (_, status, _) in answers:
            if status:
                self.remote_seen[w.name], self.remote_last[w.name] = now, status
        # ranks step together: one seen at the last step means every rank reached it
        ended = any(w.name in self.remote_last and not self._short_of_end(w) for w in drafters)
        for w, (_, status, _) in answers:
            silent = now - self.remote_seen.get(w.name, now)
            # gone: silent for long (a group across hosts is silent while its agents meet again),
            # or at once once the group has reached its last step
            gone = w.name in self.remote_seen and (silent > self.remote_gone_s or (not status and ended))
            done &= bool(status and status.get("state") == "stopped") or gone
        return done

    def _count_restart(self, role: str, why: str) -> float:
        self.restarts[role] += 1
        if self.restarts[role] > self.cfg.supervise.max_restarts:
            raise RunFailed(
                f"{why}; {role} restarts exhausted (supervise.max_restarts={self.cfg.supervise.max_restarts})"
            )
        delay = min(60.0, 2.0 ** (self.restarts[role] - 1))
        self.progress.done(
            f"{why}; restarting in {delay:.0f}s ({self.restarts[role]}/{self.cfg.supervise.max_restarts})"
        )
        return delay

    def _restart_drafter_group(
        self, drafters: list[Worker], bad: list[Worker], codes: list, trouble: dict[str, tuple[str, str]]
    ) -> None:
        whys, fatal = [], None
        for w, c in zip(drafters, codes):
            if w in bad:
                try:
                    whys.append(f"{w.name} {trouble[w.name][1]}" if c is None else self.exited(w, c))
                except RunFailed as exc:
                    whys.append(str(exc))
                    fatal = fatal or exc
        why = ", ".join(whys)
        if fatal:
            raise RunFailed(why)
        delay = self._count_restart("drafter", why)
        for w in drafters:
            process.kill_tree(self.idents[w.name])
        for w in drafters:
            self.procs[w.name].wait()
        time.sleep(delay)
        self._new_dist_store()  # a fresh rendezvous for the new group
        for w in drafters:
            self.start(w)

    def _troubled_workers(self) -> dict[str, tuple[str, str]]:
        """Running workers that are stalled or unresponsive: name -> (kind, why)."""
        if self.elastic and (agent := self.agent_status()) and agent.get("restarts") != self.restarts["drafter"]:
            self.restarts["drafter"] = agent.get("restarts", 0)  # the agents' restarts, in run.json
            self.write_run_json()
        running = [w for w in self.local if self.procs[w.name].poll() is None]
        now, trouble = time.monotonic(), {}
        for w, (_, status, _) in zip(running, self.probe_all(running, timeout_s=2.0)):
            if status is not None:
                self.answered.add(w.name)
                self.last_state[w.name] = status.get("state")
                self.last_pid[w.name] = status.get("pid")
                if w.role == "drafter" and status.get("state") == "training":
                    self.trained.add(w.name)
                self.silent_since.pop(w.name, None)
                if self.drops.seen(w.name, status.get("bad_message_kinds") or {}, status.get("bad_message_from") or {}):
                    self.progress.done(f"warning: {self.drops.describe(w.name)}")
                if status.get("stalled"):
                    trouble[w.name] = ("stalled", f"stalled (no progress for {status['last_progress_age_s']:.0f}s)")
            elif w.name in self.answered:  # before its first answer it may still be importing torch
                silent = now - self.silent_since.setdefault(w.name, now)
                if silent >= self.cfg.supervise.unresponsive_after_s:
                    trouble[w.name] = (
                        "unresponsive",
                        f"unresponsive (its pid lives, its health has not answered for {silent:.0f}s)",
                    )
        return trouble

    def _progress_text(self, drafters: list[Worker], final: bool = False) -> str:
        statuses = [status for _, status, _ in self.probe_all(drafters, timeout_s=0.5) if status]
        if not statuses:
            return "training finished" if final else "waiting for drafters…"
        lead = statuses[0]
        self._say_acceptance(lead)
        # loss, τ and tok/s: the last metrics.jsonl line (all ranks, its window), as drafter 0 reports it
        return self.progress.format(
            step=lead.get("step", 0),
            total=lead.get("total_steps", 0),
            window=lead.get("window"),
            train_s=lead.get("train_s"),
        )

    def _say_acceptance(self, lead: dict) -> None:
        """A line that stays for each real-acceptance pass drafter 0 reports, and once why it is off."""
        figures, off = lead.get("acceptance"), lead.get("real_acceptance_off")
        if figures and ("pass", figures.get("time")) not in self.said:
            self.said.add(("pass", figures.get("time")))
            self.progress.done(describe_acceptance(figures))
        if off and off not in self.said:
            self.said.add(off)
            self.progress.done(f"warning: {off}")

    # --- stopping ------------------------------------------------------------
    def request_stop(self, signum: int, sender: int = 0) -> None:
        verdict = self.stop_requests.classify(signum, sender)
        if verdict == "stop":
            self.stopping = True
            return
        if verdict == "repeat":  # GNU timeout signals the launcher, then its process group
            # os.write: print() from a signal handler can collide with the main thread's own print
            os.write(
                sys.stderr.fileno(),
                f"\n{describe(signum, sender)} again: the same stop request, still stopping gracefully\n".encode(),
            )
            return
        # A second Ctrl-C: the user will not wait for the graceful stop. Kill every worker now;
        # the stop in progress (waiting in stop_all) then sees them gone and returns.
        if not self.forced:
            self.forced = True
            os.write(sys.stderr.fileno(), b"\nsecond signal: killing every worker now (no final checkpoint)\n")
        for name in self.procs:
            process.kill_tree(self.idents.get(name))

    def stop_targets(self) -> None:
        process.stop_all([self.idents.get(w.name) for w in self.local if w.role == "target"], deadline_s=30)

    def shutdown(self) -> int:
        """Graceful stop: drafters first (they checkpoint), then targets, then anything left."""
        if not any(w.role == "drafter" for w in self.local):  # the drafters are another host's to stop
            last = max((s.get("step", 0) for s in self.remote_last.values()), default=0)
            what = f"stopping this host's targets (the drafters run on other hosts; last seen at step {last})"
        elif self.trained:
            what = "stopping: drafters checkpoint and exit, then targets"
        else:  # nothing trained yet (a failed start): there is nothing to checkpoint
            what = "stopping the workers (no drafter reached training: nothing to checkpoint)"
        self.progress.done(f"{what} (Ctrl-C again, 2 s or more later, to kill them now)")
        names = [w.name for w in self.local if w.role == "drafter" and w.name in self.procs]
        ended = {self.procs[n].pid: self.procs[n].poll() for n in names}  # before stop_all reaps them
        hard = process.stop_all([self.idents.get(n) for n in names], deadline_s=self.stop_timeout_s, codes=ended)
        self.stop_targets()
        if hard and not self.forced:
            self.progress.done(f"killed after {self.stop_timeout_s:.0f}s deadline: pids {hard}")
        if names and all(ended.get(self.procs[n].pid) == 0 for n in names):  # the stop came after the last step
            self.progress.done("every drafter had finished training")
            return EXIT_DONE
        return EXIT_STOPPED

    def install_signal_handlers(self) -> None:
        """Before any thread starts: SIGINT/SIGTERM are read with their sender (lifecycle.watch_with_sender)."""
        watch_with_sender(self.request_stop)


def target_waits(targets, restart_due: dict, states: dict, down_since: dict, now: float) -> str:
    """The live line's note while a target restarts: 'waiting for target-0 (loading, 12s)'. A model
    load takes 30-40 s on a busy CPU (minutes for a large model), and the drafters' data and
    evaluations wait for it: the line says so instead of a step that does not move."""
    notes = []
    for w in targets:
        if w.name in restart_due:
            what = f"restarts in {max(0.0, restart_due[w.name] - now):.0f}s"
        elif states.get(w.name) not in ("ready", "training"):
            what = states.get(w.name) or "starting"
        else:
            down_since.pop(w.name, None)
            continue
        notes.append(f"{w.name} ({what}, {now - down_since.setdefault(w.name, now):.0f}s)")
    return f"waiting for {', '.join(notes)}" if notes else ""
