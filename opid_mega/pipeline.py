"""Rollouts in flight (train.max_staleness; docs/algorithm.md "Bounded staleness").

With max_staleness N, iteration it first draws every rollout up to it + N that does not exist yet (with the weights
the engines hold then, version it - 1) and submits each one's analysis at once; then it takes the oldest, its own,
whose analysis has been running in the background since it was drawn. The analyzer's latency is spent while the
next rollouts are generated (and, from the second iteration on, while the previous iteration trained) instead of
after the reference log-probs. N = 0 is the on-policy loop: draw it, take it.

A sample of iteration k is drawn with version >= k - 1 - N and trained at version k - 1: at most N versions stale.
The records in flight at a checkpoint are saved inside it (:meth:`RolloutPipeline.state`), so a resumed run trains
on the very samples the uninterrupted run would have (their weights are gone: they cannot be redrawn), and their
analyses are submitted again.
"""
from __future__ import annotations

import base64
import pickle
import zlib
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

from opid_mega.experience import Experience


@dataclass
class InFlight:
    exp: Experience
    views: list  # the TrajectoryViews submitted to the analysis
    pending: object  # the analysis job (opid_mega.analysis.PendingAnalysis) or None


class RolloutPipeline:
    def __init__(self, max_staleness: int, last_iteration: int):
        if int(max_staleness) != max_staleness or max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness!r} must be an integer >= 0")
        self.max_staleness = int(max_staleness)
        self.last_iteration = int(last_iteration)
        self.queue: deque = deque()

    def fill(self, it: int, rollout: Callable[[int, int], Experience], submit: Callable[[Experience], tuple]) -> int:
        """Draws the rollouts it .. it + max_staleness not drawn yet (none past the last iteration, but always it):
        `rollout(k, version)` makes iteration k's record with the engines' weights (version it - 1); `submit(exp)`
        starts its analysis and returns (views, pending). Returns how many were drawn."""
        nxt = self.queue[-1].exp.iteration + 1 if self.queue else it
        if nxt < it:
            raise RuntimeError(f"iteration {it}: the rollout of iteration {nxt} was never trained on")
        drawn = 0
        for k in range(nxt, max(it, min(it + self.max_staleness, self.last_iteration)) + 1):
            exp = rollout(k, it - 1)
            self.queue.append(InFlight(exp, *submit(exp)))
            drawn += 1
        return drawn

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
