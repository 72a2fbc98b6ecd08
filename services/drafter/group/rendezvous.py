"""The drafter agents' rendezvous over the run's authenticated store (keystore.py), for torch's
elastic agent: no TCPStore, no pickle (torch's DynamicRendezvous keeps its state as a pickle).

The hosts are fixed by the --gpus spec (min = max nodes), so a round is simple: host i writes
`round/<r>/in/<i>` and waits for every other host's; the round's number is one past the last this
agent met, or the highest any host has joined when that round is still open. Every value read is
a number parsed as such; anything else is counted (`bad`) and ignored. An agent that comes back
(its host restarted) finds its old round met and waits in the next: the others restart to join it.

- A host counts as waiting for a new round (torch's agent then restarts its workers: a membership
  change) only while its heartbeat counter moves: a forged wait-list entry without a live agent
  behind it expires.
- Membership restarts count against `max_membership_restarts`, apart from failure restarts; past it
  the agent fails with one line rather than restart the group forever.
"""

from __future__ import annotations

import threading
import time

from torch.distributed import PrefixStore
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from services.drafter.group.keystore import KeyStore, StoreGone

BEAT_S = 1.0  # each agent bumps its heartbeat counter this often
EXPIRE_S = 10.0  # a waiting host whose counter has not moved for this long is not waiting


class MembershipLoop(RendezvousError):
    """Too many restarts for membership changes (no worker failed)."""


class KeyedRendezvous(RendezvousHandler):
    def __init__(
        self,
        store: KeyStore,
        run_id: str,
        hosts: list[str],
        index: int,
        port: int,
        join_timeout_s: float,
        max_membership_restarts: int,
    ):
        self.store, self.run_id, self.hosts, self.index, self.port = store, run_id, hosts, index, port
        self.join_timeout_s, self.max_membership_restarts = join_timeout_s, max_membership_restarts
        self.prefix = f"rdzv/{run_id}/"
        self.round = -1  # the last round this agent met
        self.membership_restarts = 0
        self.bad = 0  # values in the store that are not what this protocol writes
        self._beats: dict[int, tuple[int, float]] = {}  # host -> (its counter, when it last moved)
        self._stop = threading.Event()
        self._beat_thread = threading.Thread(target=self._beat, name="rdzv-beat", daemon=True)
        self._beat_thread.start()

    # --- the store's keys -------------------------------------------------------------------------

    def _k(self, *parts) -> str:
        return self.prefix + "/".join(str(p) for p in parts)

    def _number(self, key: str) -> int | None:
        """The number at key, None when absent; a value that is not one is counted and ignored."""
        if not self.store.check([key]):
            return None
        raw = self.store.get(key)
        if len(raw) <= 20 and raw.isdigit():
            return int(raw)
        self.bad += 1
        return None

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self.store.add(self._k("host", self.index, "beat"), 1)
            except (StoreGone, RuntimeError, ValueError):
                pass  # the main loop says what is wrong with the store

    def _round_full(self, r: int) -> bool:
        return self.store.check([self._k("round", r, "in", j) for j in range(len(self.hosts))])

    # --- torch's RendezvousHandler ----------------------------------------------------------------

    def get_backend(self) -> str:
        return "dflash-keystore"

    @property
    def use_agent_store(self) -> bool:
        return False  # the workers open their own client of the same store (collectives.join)

    def get_run_id(self) -> str:
        return self.run_id

    def next_rendezvous(self) -> RendezvousInfo:
        if self.is_closed():
            raise RendezvousClosedError()
        joined = [self._number(self._k("host", j, "round")) for j in range(len(self.hosts))]
        target = max([self.round + 1] + [r for r in joined if r is not None])
        if self._round_full(target):  # met already: by this host's agent before a restart of it
            target += 1
        self.store.set(self._k("host", self.index, "round"), str(target))
        self.store.set(self._k("round", target, "in", self.index), "1")
        deadline = time.monotonic() + self.join_timeout_s
        while not self._round_full(target):
            if self.is_closed():
                raise RendezvousClosedError()
            if time.monotonic() > deadline:
                missing = [
                    h for j, h in enumerate(self.hosts) if not self.store.check([self._k("round", target, "in", j)])
                ]
                raise RendezvousTimeoutError(f"round {target}: no agent of {', '.join(missing)} joined")
            time.sleep(0.2)
        self.round = target
        self._beats.clear()
        store = PrefixStore(self._k("round", target, "agents") + "/", self.store)
        return RendezvousInfo(store, self.index, len(self.hosts), RendezvousStoreInfo(self.hosts[0], self.port))

    def workers_prefix(self) -> str:
        """The workers' process group keys for the round just met (a fresh prefix each start)."""
        return self._k("round", self.round, "workers") + "/"

    def num_nodes_waiting(self) -> int:
        now, waiting = time.monotonic(), 0
        for j in range(len(self.hosts)):
            if j == self.index or (self._number(self._k("host", j, "round")) or -1) <= self.round:
                continue
            beat = self._number(self._k("host", j, "beat")) or 0
            seen = self._beats.get(j)
            if seen is None:  # first sight: waiting once its counter moves
                self._beats[j] = (beat, float("-inf"))
            elif beat != seen[0]:
                self._beats[j] = (beat, now)
            if now - self._beats[j][1] < EXPIRE_S:
                waiting += 1
        if waiting:
            self.membership_restarts += 1
            if self.membership_restarts > self.max_membership_restarts:
                raise MembershipLoop(
                    f"{self.membership_restarts} group restarts for drafter hosts rejoining, none for a failure "
                    f"(limit supervise.max_restarts={self.max_membership_restarts})"
                )
        return waiting

    def is_closed(self) -> bool:
        return self.store.check([self._k("closed")])

    def set_closed(self) -> None:
        self.store.set(self._k("closed"), "1")

    def shutdown(self) -> bool:
        self._stop.set()
        try:
            self.set_closed()
        except (StoreGone, RuntimeError):
            return False
        return True
