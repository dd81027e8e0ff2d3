"""A deterministic, offline hindsight analyzer: skills derived from the trajectory alone, no LLM.

Success -> the episode skill is the winning workflow: the trajectory's valid actions in order, with actions that
          changed nothing (the observation stayed the same) and immediate repeats left out. Critical steps are the
          steps that earned reward, then the last step, then the other steps that changed the observation, in
          trajectory order, at most K.
Failure -> the episode skill lists avoidance rules found in the trajectory: unparsable responses (answer format),
          actions repeated without any change in the observation (loops), and actions that changed nothing.
          Critical steps are the first occurrence of each mistake, in trajectory order, at most K; each step skill
          says what to do instead. A failure with no detectable mistake gets a generic exploration rule.
It is the embedded default (`analyzer.backend=rules`): it makes OPID's whole pipeline run offline and its skills are
correct by construction, if plainer than an LLM's.
"""
from __future__ import annotations

from typing import Optional

from opid_mega.skills.base import PerTrajectoryAnalyzer
from opid_mega.skills.types import Analysis, StepView, TrajectoryView


def _norm(text: str) -> str:
    return " ".join(text.split()).lower()


class RuleAnalyzer(PerTrajectoryAnalyzer):
    def __init__(self, max_step_skills: int = 5, max_workflow_actions: int = 30):
        if max_step_skills < 0:
            raise ValueError(f"RuleAnalyzer: max_step_skills={max_step_skills} must be >= 0")
        self.max_step_skills = max_step_skills
        self.max_workflow_actions = max_workflow_actions

    def analyze_one(self, traj: TrajectoryView) -> Optional[Analysis]:
        steps = traj.step_views()
        return self._success(traj, steps) if traj.won else self._failure(traj, steps)

    @staticmethod
    def _changed(steps: list[StepView], t: int) -> bool:
        """Did step t's action change the observation (the next step's observation differs from this one's)?"""
        if t + 1 >= len(steps):
            return True
        return _norm(steps[t + 1].raw_obs) != _norm(steps[t].raw_obs)

    def _success(self, traj: TrajectoryView, steps: list[StepView]) -> Analysis:
        workflow: list[str] = []
        for t, s in enumerate(steps):
            if not s.valid or not s.action:
                continue
            if not self._changed(steps, t) and s.reward <= 0:
                continue
            if workflow and _norm(workflow[-1]) == _norm(s.action):
                continue
            workflow.append(s.action.strip())
        if not workflow:
            workflow = [s.action.strip() for s in steps if s.valid and s.action] or ["act on the task directly"]
        workflow = workflow[: self.max_workflow_actions]
        episode_skill = (f"To complete a task like '{traj.task}', follow this workflow: "
                         + " -> ".join(workflow) + ". Do not waste steps on actions that change nothing.")
        order = [t for t, s in enumerate(steps) if s.reward > 0 and s.valid and s.action]
        last = len(steps) - 1
        if steps[last].valid and steps[last].action and last not in order:
            order.append(last)
        order += [t for t, s in enumerate(steps)
                  if t not in order and s.valid and s.action and self._changed(steps, t)]
        chosen = sorted(order[: self.max_step_skills])
        step_skills = {t: f"Now do '{steps[t].action.strip()}': it moves the task forward." for t in chosen}
        summary = f"Succeeded in {len(steps)} steps."
        return Analysis(episode_summary=summary, episode_skill=episode_skill, step_skills=step_skills)

    def _failure(self, traj: TrajectoryView, steps: list[StepView]) -> Analysis:
        rules: list[str] = []
        mistakes: list[tuple[int, str]] = []
        seen_pairs: set[tuple[str, str]] = set()
        flagged: set[str] = set()
        for t, s in enumerate(steps):
            if not s.valid or not s.action:
                if "format" not in flagged:
                    flagged.add("format")
                    rules.append("Always end with exactly one admissible action inside <action></action> tags.")
                mistakes.append((t, "Give exactly one admissible action inside <action></action> tags."))
                continue
            key = (_norm(s.raw_obs), _norm(s.action))
            if key in seen_pairs:
                if ("loop", key[1]) not in seen_pairs:
                    seen_pairs.add(("loop", key[1]))
                    rules.append(f"Do not repeat '{s.action.strip()}' when it did not change the situation.")
                    mistakes.append((t, f"Do not repeat '{s.action.strip()}' again; try an untried admissible "
                                        "action instead."))
                continue
            seen_pairs.add(key)
            if not self._changed(steps, t) and s.reward <= 0 and ("noop", key[1]) not in seen_pairs:
                seen_pairs.add(("noop", key[1]))
                rules.append(f"'{s.action.strip()}' changed nothing here; prefer actions that make progress.")
                mistakes.append((t, f"Instead of '{s.action.strip()}', choose an action that changes the "
                                    "situation toward the goal."))
        if not rules:
            rules.append("The task was not completed in time: explore systematically, do not revisit places or "
                         "objects without reason, and act on the goal as soon as it is reachable.")
        episode_skill = f"When doing a task like '{traj.task}', avoid these mistakes: " + " ".join(rules)
        first: dict[int, str] = {}
        for t, text in mistakes:
            if t not in first and len(first) < self.max_step_skills:
                first[t] = text
        summary = f"Failed after {len(steps)} steps with {len(mistakes)} detected mistakes."
        return Analysis(episode_summary=summary, episode_skill=episode_skill, step_skills=dict(sorted(first.items())))
