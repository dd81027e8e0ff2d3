"""The analyzer interface: one analysis (or None = no skill signal) per completed trajectory."""
from __future__ import annotations

import abc
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

from opid_mega.skills.types import Analysis, TrajectoryView


class Analyzer(abc.ABC):
    """`analyze` blocks; `submit` runs it in the background so the trainer can score meanwhile
    (docs/algorithm.md §3)."""

    _pool: Optional[ThreadPoolExecutor] = None
    #: True: the analyzer writes its own audit records (the LLM analyzer: prompts and raw replies); otherwise the
    #: trainer writes one record per trajectory
    audits_itself: bool = False
    #: seconds past `deadline_s` a caller still waits for a job: an analyzer that ends its own job at the deadline
    #: returns the partial results a little after it
    deadline_slack_s: float = 0.0

    @abc.abstractmethod
    def analyze(self, trajs: list[TrajectoryView], iteration: Optional[int] = None) -> list[Optional[Analysis]]:
        """One entry per trajectory, in order; None when the trajectory gets no skill signal."""

    def submit(self, trajs: list[TrajectoryView], iteration: Optional[int] = None,
               deadline_s: Optional[float] = None) -> "Future[list[Optional[Analysis]]]":
        """`analyze` in a background thread. `deadline_s`: the caller waits that long (+ deadline_slack_s) from
        now and counts what is not done as failed; this default leaves the waiting to the caller."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=type(self).__name__)
        return self._pool.submit(self.analyze, list(trajs), iteration)

    def late(self, job) -> int:
        """How many analyses of a finished `submit` job the analyzer itself ended at the deadline (none here)."""
        return 0

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class PerTrajectoryAnalyzer(Analyzer):
    """An analyzer that reads each trajectory on its own (the rule analyzers): `analyze_one` per trajectory, None for
    one without steps."""

    def analyze(self, trajs: list[TrajectoryView], iteration: Optional[int] = None) -> list[Optional[Analysis]]:
        return [self.analyze_one(t) if t.step_views() else None for t in trajs]

    @abc.abstractmethod
    def analyze_one(self, traj: TrajectoryView) -> Optional[Analysis]:
        """The analysis of one trajectory with at least one step (None: no skill signal)."""
