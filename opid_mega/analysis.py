"""The analysis stage: hindsight analyses of finished trajectories through the analyzer's interface
(opid_mega.skills.Analyzer: `submit` with a deadline, then the job's result), treated as untrusted output.

    pending = stage.submit(views, iteration)      starts the analyzer in the background; the deadline runs from now
    analyses = stage.collect(pending)             one Analysis or None per view, sanitised and cut, audited

Past analyzer.deadline_s what is not done is a failure (audited, counted in analysis/deadline_failures); an analyzer
crash costs the skill signal, never the run; analyzer.max_failed_iterations iterations in a row with every analysis
failed stop the run (AnalyzerFailed). Every skill is cut to analyzer.max_skill_tokens tokens of the policy tokenizer
(`count_tokens`), so a skill section never exceeds its cap (opid_mega.experience.add_skills fits it).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from opid_mega.skills.sanitize import cut_analysis, sanitize_analysis


class AnalyzerFailed(RuntimeError):
    pass


@dataclass
class PendingAnalysis:
    job: object  # the analyzer's Future
    views: list  # the TrajectoryViews submitted
    iteration: int
    deadline: float  # time.monotonic() past which the job is not waited for


class AnalysisStage:
    def __init__(self, analyzer, audit, analyzer_cfg, count_tokens: Callable[[str], int], run_dir: Path):
        self.analyzer, self.audit, self.cfg = analyzer, audit, analyzer_cfg
        self.count_tokens = count_tokens
        self.run_dir = run_dir
        self.failures = 0  # analyses failed over the run (analysis/failures_total; kept in checkpoints)
        self.failed_iterations = 0  # iterations in a row in which every analysis failed
        self.deadline_failures = 0  # analyses of the last collected iteration that missed the deadline
        self.skills_truncated = 0  # skills of the last collected iteration cut to max_skill_tokens

    def submit(self, views: list, iteration: int) -> Optional[PendingAnalysis]:
        """Start the analysis of `views` in the background (None without an analyzer)."""
        if self.analyzer is None:
            return None
        deadline_s = self.cfg.deadline_s
        job = self.analyzer.submit(views, iteration=iteration, deadline_s=deadline_s)
        return PendingAnalysis(job, list(views), iteration,
                               time.monotonic() + deadline_s + self.analyzer.deadline_slack_s)

    def collect(self, pending: Optional[PendingAnalysis], views: list, iteration: int,
                count_failures: bool = True) -> list:
        """The analyses of a submitted job, one per view (None: no skill signal). `count_failures` False: an
        evaluation's analyses (audited, not counted)."""
        if count_failures:
            self.deadline_failures = 0
        if pending is None:
            return [None] * len(views)
        late = 0
        try:
            analyses = list(pending.job.result(timeout=max(0.0, pending.deadline - time.monotonic())))
            late = self.analyzer.late(pending.job)
        except TimeoutError:  # an analyzer that does not keep the deadline itself: the whole batch is late
            pending.job.cancel()
            analyses, late = [None] * len(views), len(views)
            self._audit_failures(views, iteration, f"deadline: analyzer.deadline_s={self.cfg.deadline_s:g} s passed")
        except Exception as exc:  # noqa: BLE001 - an analyzer crash costs the skill term, never the run
            analyses = [None] * len(views)
            self._audit_failures(views, iteration, f"{type(exc).__name__}: {exc}")
        analyses, cut = self.cut(analyses, len(views))
        if not self.analyzer.audits_itself:
            for v, a in zip(views, analyses):
                self.audit.log_analysis(iteration=iteration, traj_id=v.traj_id, task=v.task, won=v.won, prompt=None,
                                        raw_reply=None, analysis=a, failure=None if a else "no analysis",
                                        analyzer=type(self.analyzer).__name__)
        if count_failures:
            self.skills_truncated = cut
            self.failures += sum(a is None for a in analyses)
            self.deadline_failures = late
            if analyses:  # (an iteration with nothing to analyse leaves the count as it is)
                self.failed_iterations = self.failed_iterations + 1 if all(a is None for a in analyses) else 0
            limit = self.cfg.max_failed_iterations
            if limit and self.failed_iterations >= limit:
                raise AnalyzerFailed(f"iteration {iteration}: every analysis failed in {self.failed_iterations} "
                                     f"iterations in a row (analyzer.max_failed_iterations={limit}; the reasons are "
                                     f"in {self.run_dir / 'audit.jsonl'})")
        return analyses

    def _audit_failures(self, views: list, iteration: int, failure: str) -> None:
        for v in views:
            self.audit.log_analysis(iteration=iteration, traj_id=v.traj_id, task=v.task, won=v.won, prompt=None,
                                    raw_reply=None, failure=failure)

    def cut(self, analyses: list, n: int) -> tuple[list, int]:
        """(analyses, skills cut): analyzer output is untrusted, so each of the `n` analyses is sanitised
        (opid_mega.skills.sanitize; an unusable one, or one whose handling fails, becomes None: it costs only itself)
        and every skill is cut to analyzer.max_skill_tokens tokens of the policy tokenizer at a word boundary."""
        analyses = (list(analyses) + [None] * n)[:n]  # an analyzer that returned too few or too many entries
        out, cut = [], 0
        for a in analyses:
            try:
                a = sanitize_analysis(a)
                if a is not None:
                    a, k = cut_analysis(a, self.cfg.max_skill_tokens, self.count_tokens)
                    cut += k
                    if not a.episode_skill.strip():
                        a = None
            except Exception as exc:  # noqa: BLE001
                print(f"opid-train: an analysis could not be prepared ({type(exc).__name__}: {exc}); no skill "
                      "signal for its trajectory", file=sys.stderr)
                a = None
            out.append(a)
        return out, cut

