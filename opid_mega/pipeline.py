"""Rollouts in flight (train.max_staleness; docs/algorithm.md "Bounded staleness").

With max_staleness N, iteration it first draws every rollout up to it + N that does not exist yet (with the weights
the engines hold then, version it - 1) and submits each one's analysis at once; then it takes the oldest, its own,
whose analysis has been running in the background since it was drawn. The analyzer's latency is spent while the
next rollouts are generated (and, from the second iteration on, while the previous iteration trained) instead of
after the reference log-probs. N = 0 is the on-policy loop: draw it, take it.

Two deployments (deploy.mode). Colocated (the engines share the trainer's devices): the next rollouts are drawn in
:meth:`fill`, before the iteration's scoring and update, so only the analysis runs beside them. Disaggregated (the
engines have devices of their own): :meth:`fill` draws only what is missing of the iteration's own record (the first
iteration, a resume), and :meth:`start` plays the next N in a background thread while the iteration is scored and
trained; :meth:`join` lands them before the weight sync, so an engine never generates while its weights change. Both
draw the same rollouts with the same weights: the same records, only the waiting differs.

A sample of iteration k is drawn with version >= k - 1 - N and trained at version k - 1: at most N versions stale.
The records in flight at a checkpoint are saved inside it (:meth:`RolloutPipeline.state`), so a resumed run trains
on the very samples the uninterrupted run would have (their weights are gone: they cannot be redrawn), and their
analyses are submitted again.
"""
from __future__ import annotations

import base64
import pickle
import threading
import zlib
from collections import deque
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Callable, Optional

from opid_mega.experience import Experience

CLOSE_GRACE_S = 5.0  # how long close() gives a background rollout it asked to stop


@dataclass
class InFlight:
    exp: Experience
    views: list  # the TrajectoryViews submitted to the analysis
    pending: object  # the analysis job (opid_mega.analysis.PendingAnalysis) or None


class RolloutPipeline:
    def __init__(self, max_staleness: int, last_iteration: int, overlap: bool = False):
        """`overlap`: the next rollouts are played beside the update (:meth:`start` / :meth:`join`), not before it."""
        if int(max_staleness) != max_staleness or max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness!r} must be an integer >= 0")
        self.max_staleness = int(max_staleness)
        self.last_iteration = int(last_iteration)
        self.overlap = bool(overlap)
        self.queue: deque = deque()
        self.drawing: Optional[tuple] = None  # playing in the background: (iterations, weight version, Future)

    def fill(self, it: int, rollout: Callable[[int, int], Experience], submit: Callable[[Experience], tuple]) -> int:
        """Draws the rollouts it .. it + max_staleness not drawn yet (none past the last iteration, but always it):
        `rollout(k, version)` makes iteration k's record with the engines' weights (version it - 1); `submit(exp)`
        starts its analysis and returns (views, pending). Returns how many were drawn."""
        if self.drawing is not None:
            raise RuntimeError(f"iteration {it}: the rollouts {self.drawing[0]} started in the background were never "
                               "joined")
        nxt = self.queue[-1].exp.iteration + 1 if self.queue else it
        if nxt < it:
            raise RuntimeError(f"iteration {it}: the rollout of iteration {nxt} was never trained on")
        drawn = 0
        last = it if self.overlap else max(it, min(it + self.max_staleness, self.last_iteration))
        for k in range(nxt, last + 1):
            exp = rollout(k, it - 1)
            self.queue.append(InFlight(exp, *submit(exp)))
            drawn += 1
        return drawn

    def start(self, it: int, job: Callable[[int, int], Callable[[], object]]) -> list:
        """Overlap: the rollouts after it up to it + max_staleness not drawn yet, played in one background thread,
        in order, while iteration it is scored and trained. `job(k, version)` is called now, in the caller's thread
        (it reads what the rollout needs: tasks, the skill bank), and returns what the thread runs (rank 0: the
        rollout played and its analysis submitted; other ranks: nothing). Returns the iterations started."""
        if not self.overlap or self.drawing is not None:
            raise RuntimeError(f"iteration {it}: start() needs an overlapping pipeline with nothing playing")
        nxt = self.queue[-1].exp.iteration + 1 if self.queue else it + 1
        todo = list(range(nxt, min(it + self.max_staleness, self.last_iteration) + 1))
        if todo:
            runs = [job(k, it - 1) for k in todo]
            future: Future = Future()

            def play() -> None:
                future.set_running_or_notify_cancel()
                try:
                    future.set_result([run() for run in runs])
                except BaseException as exc:  # noqa: BLE001 - raised again where it lands (join)
                    future.set_exception(exc)

            # a daemon thread: nothing (the interpreter's exit included) ever waits for a rollout nobody will train on
            threading.Thread(target=play, name="rollout", daemon=True).start()
            self.drawing = (todo, it - 1, future)
        return todo

    def join(self, land: Callable[[int, int, Callable[[], object]], tuple]) -> int:
        """Waits for the rollouts of :meth:`start` and puts them in flight: `land(k, version, produce)` (every rank,
        the caller's thread) returns (record, views, pending) from `produce()`, the thread's result for k (which
        raises what the thread raised). Returns how many landed."""
        if self.drawing is None:
            return 0
        todo, version, future = self.drawing
        self.drawing = None
        try:
            results, error = future.result(), None
        except BaseException as exc:  # noqa: BLE001 - raised again by produce(), inside land's broadcast
            results, error = None, exc

        def produce(i: int):
            if error is not None:
                raise error
            return results[i]

        for i, k in enumerate(todo):
            self.queue.append(InFlight(*land(k, version, lambda i=i: produce(i))))
        return len(todo)

    def close(self, cancel: Optional[Callable[[], None]] = None, grace_s: float = CLOSE_GRACE_S) -> None:
        """Ends the pipeline (an error or a signal ended the run): a rollout still playing in the background is asked
        to stop (`cancel()`: the agent loop's stop) and given `grace_s` seconds to end, never its deadline; its
        result is dropped (nobody trains on it)."""
        if self.drawing is None:
            return
        future = self.drawing[2]
        self.drawing = None
        if cancel is not None:
            cancel()
        wait([future], timeout=grace_s)

    def take(self, it: int) -> InFlight:
        """Iteration it's record (the oldest in flight)."""
        if not self.queue or self.queue[0].exp.iteration != it:
            have = [x.exp.iteration for x in self.queue]
            raise RuntimeError(f"iteration {it}: its rollout is not in flight (in flight: {have})")
        return self.queue.popleft()

    def state(self) -> Optional[str]:
        """The records still in flight (drawn, not trained on) as one string for a checkpoint (None: none)."""
        if not self.queue:
            return None
        return base64.b64encode(zlib.compress(pickle.dumps([x.exp for x in self.queue], protocol=4))).decode()

    def restore(self, state: Optional[str], submit: Callable[[Experience], tuple]) -> None:
        """The records of a checkpoint's :meth:`state`, their analyses submitted again."""
        self.queue.clear()
        if not state:
            return
        for exp in pickle.loads(zlib.decompress(base64.b64decode(state))):
            self.queue.append(InFlight(exp, *submit(exp)))
