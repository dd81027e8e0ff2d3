"""Plain data types of the skill layer."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional


class AnalysisParseError(ValueError):
    """An analyzer reply that holds no usable analysis (the message says why)."""


@dataclass
class Analysis:
    """One trajectory's hindsight analysis (docs/algorithm.md §3)."""

    episode_summary: str
    episode_skill: str
    step_skills: dict[int, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"episode_summary": self.episode_summary, "episode_skill": self.episode_skill,
                "step_skills": {str(k): v for k, v in self.step_skills.items()}}


class StepView(NamedTuple):
    """What the analyzer sees of one step: the raw env observation, the full policy response, the step reward."""

    raw_obs: str
    response: str
    reward: float
    action: Optional[str] = None  # the parsed action (None: the response could not be parsed)
    valid: bool = True


@dataclass
class TrajectoryView:
    """What the analyzer sees of one trajectory."""

    task: str
    won: bool
    steps: list  # list[StepView] (plain (raw_obs, response, reward) tuples are accepted)
    traj_id: str = ""

    def step_views(self) -> list[StepView]:
        return [s if isinstance(s, StepView) else StepView(*s) for s in self.steps]
