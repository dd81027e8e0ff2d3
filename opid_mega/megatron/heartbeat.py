"""Every rank's liveness, independent of what the ranks are doing (deploy.heartbeat_timeout_s; docs/multi-node.md
"Bound on a lost node").

    hb = Heartbeat(store, rank, world, timeout_s, describe, reports)   # opid_mega.megatron.parallel.initialize
    hb.start(); ...; hb.stop()                                          # stop(): this rank ended, it is not lost

A daemon thread per rank writes a counter under its rank into the job's rendezvous store every `beat_interval`
seconds (torchrun's agent store on node 0, or global rank 0's own store), through a client connection of its own
with a short timeout, so a store that no longer answers never blocks anything else. Global rank 0 reads every rank's
counter (one request); every other rank reads rank 0's and the verdict key. A counter that has not changed for
`timeout_s`, or a store that has not answered for that long, is a lost node: the rank that says so prints one line
naming the node (rank 0 for the others; for rank 0, the lowest rank on another host), rank 0 writes the line as the
verdict (the other ranks leave quietly on reading it), and the process ends at once with exit code 5 through
opid_mega.infra.shutdown.exit_now (its servers stopped), wherever its main thread is: in a training collective, in
the weight sync, or waiting on the control group for rank 0's rollout. So a lost node ends the job within
opid_mega.config.node_lost_bound(cfg) seconds, whatever the collectives' own timeouts are. A rank that ended (normally, or
with its own error or signal: stop() marks it) is not lost. A rank whose own beats ran late (the process was
stopped as a whole, a suspended job) restarts its clocks instead of blaming the others. Store requests: one write
and one read per rank and beat; rank 0's read covers every rank.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Callable, Optional

from opid_mega.config import beat_interval

VERDICT = "verdict"
BYE = "bye"  # a rank that ended writes this instead of its counter


class Heartbeat:
    def __init__(self, store, rank: int, world: int, timeout_s: float, describe: Callable[[list, float], str],
                 reports: Callable[[int], bool], prog: str = "opid-train",
                 on_lost: Optional[Callable[[int], None]] = None):
        """`store`: a store this thread alone uses (a client connection with a timeout of about one beat);
        `describe(ranks, seconds)`: the one line naming the node of `ranks`; `reports(lost)`: whether this rank
        prints the line for rank `lost`; `on_lost(code)`: how the process ends (default: shutdown.exit_now)."""
        self.store, self.rank, self.world = store, int(rank), int(world)
        self.timeout_s = float(timeout_s)
        self.interval = beat_interval(timeout_s)
        self.describe, self.reports, self.prog = describe, reports, prog
        self.on_lost = on_lost
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.lost: Optional[str] = None  # the line, once a node was found lost

    def start(self) -> "Heartbeat":
        self._thread = threading.Thread(target=self._run, name="opid-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """This rank ended: its peers are not to count it as lost. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self.store.set(str(self.rank), BYE)
        except Exception:  # noqa: BLE001 - the store may be gone already: the job is ending anyway
            pass

    # ---- the thread ---------------------------------------------------------------------------------------------
    def _watched(self) -> list:
        return [r for r in range(self.world) if r != self.rank] if self.rank == 0 else [0]

    def _read(self, ranks: list) -> dict:
        """rank -> its last value, for the ranks whose key exists (one request when all do)."""
        keys = [str(r) for r in ranks]
        if self.store.check(keys):
            return dict(zip(ranks, self.store.multi_get(keys)))
        return {r: self.store.get(str(r)) for r in ranks if self.store.check([str(r)])}

    def _run(self) -> None:
        from opid_mega.infra import shutdown

        watched = self._watched()
        seen: dict = {r: None for r in watched}
        changed = {r: time.monotonic() for r in watched}
        answered = time.monotonic()  # the store's last answer
        counter, tick = 0, time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            if now - tick > 3 * self.interval:  # this process itself was stopped or starved: start the clocks again
                changed = {r: now for r in watched}
                answered = now
            tick = now
            try:
                counter += 1
                self.store.set(str(self.rank), str(counter))
                if self.rank != 0 and self.store.check([VERDICT]):
                    self.lost = self.store.get(VERDICT).decode(errors="replace")
                    return self._end(shutdown, report=False)
                values = self._read(watched)
                answered = time.monotonic()
            except Exception:  # noqa: BLE001 - no answer from the store: counted below
                values = {}
            now = time.monotonic()
            for r, v in values.items():
                if v == BYE.encode():
                    watched.remove(r)
                    seen.pop(r, None)
                    changed.pop(r, None)
                elif v != seen.get(r):
                    seen[r], changed[r] = v, now
            if now - answered >= self.timeout_s:  # the store's host (node 0) is lost, or cut off from this node
                self.lost = self.describe([0], self.timeout_s)
                return self._end(shutdown, report=self.reports(0))
            silent = [r for r in watched if now - changed[r] >= self.timeout_s]
            if silent:
                self.lost = self.describe(silent, self.timeout_s)
                if self.rank == 0:
                    try:
                        self.store.set(VERDICT, self.lost)
                    except Exception:  # noqa: BLE001
                        pass
                return self._end(shutdown, report=self.rank == 0 or self.reports(silent[0]))

    def _end(self, shutdown, report: bool) -> None:
        if self._stop.is_set() or shutdown.exiting():
            return  # this rank is ending already, by its own way
        if report:
            print(f"{self.prog}: {self.lost}", file=sys.stderr, flush=True)
        if self.on_lost is not None:
            self.on_lost(5)
        else:
            shutdown.exit_now(5)
