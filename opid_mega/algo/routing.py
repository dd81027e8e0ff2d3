"""Critical-first skill routing, gated by λ (docs/algorithm.md §4 and "Routing is gated by λ")."""
from __future__ import annotations

import math
import random
from typing import Mapping, Optional

EPISODE = "episode"
STEP = "step"
SKILL_KINDS = (EPISODE, STEP)
ROUTING_MODES = ("step_priority", "additive")


def _text(skill: Optional[str]) -> str:
    """The skill text, or "" for a missing / empty / whitespace-only skill (which is never routed)."""
    if skill is None:
        return ""
    if not isinstance(skill, str):
        raise TypeError(f"route_skills: a skill must be a string or None, got {type(skill).__name__}")
    return skill if skill.strip() else ""


def route_skills(
    num_steps: int,
    step_skills: Optional[Mapping[int, str]],
    episode_skill: Optional[str],
    mode: str = "step_priority",
    use_episode: bool = True,
    use_step: bool = True,
    lambda_episode: float = 1.0,
    lambda_step: float = 1.0,
) -> list[dict[str, str]]:
    """Which skill text(s) to score each step of one trajectory with.

    Returns one dict per step, mapping skill kind (`"episode"` / `"step"`) to the skill text; an empty dict means
    the step gets no skill term (its outcome advantage stays).

    A skill kind takes part only when it is switched on (`use_*`), its weight is positive (`lambda_* > 0`, as in the
    reference) and its text is not empty/whitespace. Then:
    - `step_priority` (default, critical-first): a step with a step skill gets that skill only; otherwise the
      episode skill; otherwise nothing. So `lambda_step=0` (or `use_step=False`) sends critical steps back to the
      episode skill, and `lambda_episode=0` (or `use_episode=False`) leaves non-critical steps without a signal.
    - `additive` (the "w/o routing" ablation): critical steps get both skills (each gated as above), each scored
      as its own prompt; the other steps get the episode skill.
    A trajectory whose analysis failed passes `episode_skill=None, step_skills=None` and gets no skill anywhere.
    The λ defaults (1.0) route every non-empty skill, for callers that do not weigh the terms.
    """
    if mode not in ROUTING_MODES:
        raise ValueError(f"route_skills: mode={mode!r}, allowed: {', '.join(ROUTING_MODES)}")
    if num_steps < 0:
        raise ValueError(f"route_skills: num_steps={num_steps} must be >= 0")
    for name, lam in (("lambda_episode", lambda_episode), ("lambda_step", lambda_step)):
        if not (isinstance(lam, (int, float)) and not isinstance(lam, bool) and math.isfinite(lam) and lam >= 0):
            raise ValueError(f"route_skills: {name}={lam!r} must be a finite number >= 0")
    step_skills = dict(step_skills or {})
    for t in step_skills:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < num_steps:
            raise ValueError(f"route_skills: step skill index {t!r} outside 0..{num_steps - 1}")
    episode = _text(episode_skill) if (use_episode and lambda_episode > 0) else ""
    steps = {t: _text(s) for t, s in step_skills.items()} if (use_step and lambda_step > 0) else {}
    routes: list[dict[str, str]] = []
    for t in range(num_steps):
        step = steps.get(t, "")
        route: dict[str, str] = {}
        if mode == "step_priority":
            if step:
                route[STEP] = step
            elif episode:
                route[EPISODE] = episode
        else:  # additive
            if episode:
                route[EPISODE] = episode
            if step:
                route[STEP] = step
        routes.append(route)
    return routes


def shuffle_analyses(groups: list, analyses: list, seed: int) -> list:
    """The negative control's analyses (algo.skill_source=shuffled), one per trajectory: trajectory j of group g
    gets the analysis of trajectory j (modulo that group's size) of the group after g in a seeded random cycle of
    the batch's groups, so no trajectory keeps an analysis of its own task and every analysis stays one an analyzer
    wrote for a trajectory of this batch. A batch of a single group has no other task: no analyses (all None)."""
    order = list(dict.fromkeys(groups))
    if len(order) < 2:
        return [None] * len(analyses)
    random.Random(seed).shuffle(order)
    donor_of = {g: order[(k + 1) % len(order)] for k, g in enumerate(order)}
    by_group: dict = {}
    for g, a in zip(groups, analyses):
        by_group.setdefault(g, []).append(a)
    taken: dict = {}
    out = []
    for g in groups:
        donors = by_group[donor_of[g]]
        out.append(donors[taken.get(g, 0) % len(donors)])
        taken[g] = taken.get(g, 0) + 1
    return out
