"""A best-case hindsight analyzer for the footprints game, DISCLOSED AS PRIVILEGED (the mechanism experiment's
positive control: docs/experiments.md "Building blocks of the mechanism experiment").

    analyzer.backend: opid_mega.skills.hindsight:FootprintsHindsightAnalyzer

Privileged: it is written for this one game by someone who knows its rules. It reads only the trajectory (each
step's observation and action, and whether it was won), but it knows which sentences carry the truth: the closet
wall names the right door, and a vault is entered only through the right door. An LLM analyzer has no such
knowledge; results with this analyzer measure what the pipeline does with correct hindsight, not what OPID's
analyzer would find. Every analysis says so in its summary ("privileged footprints hindsight: ...", audit.jsonl).

Skills (step indices are 0-based, as RuleAnalyzer's: step t's skill goes into the prompt of step t). The door step
is the step whose action took the agent through a door: the next step's observation is the closet's or the vault's
entry text, which names the door just opened.
  * a wrong door W, the closet wall naming R: a step skill at the door step, "Open the R door instead of the W
    door: ...", and an episode skill naming the cue (the fresh footprints) and R;
  * the right door R (won, or lost because the chest was empty, or lost in the vault): "the R door was right" step
    and episode skills; lost in the vault without ever doing `take coin` adds a step skill "Take the coin now" at the
    first vault step (a lost `take coin` means the chest was empty: the coin was gone, not a mistake);
  * no door outcome in the trajectory (no door opened, or the door step was the last step): an episode skill naming
    the cue, no step skill.
A step skill never names a wrong door as the thing to do: a wrong colour appears only after "instead of".
At most `max_step_skills` step skills (the door step first).

`wrong_door_rate` p > 0 makes it an analyzer that errs the way an LLM analyzer does (the mechanism experiment's
noisy arms): for a share p of the trajectories with a door outcome (a draw from a hash of `seed` and the trajectory's
observations and actions: the same trajectory always gets the same belief), it believes a WRONG door B is the right
one (B drawn the same way from the hall's other doors, never the door opened) and writes every skill above from that
belief: "Open the B door instead of the <opened> door ..." — a wrong door named as the thing to do. Its summary says
"noisy belief".
"""
from __future__ import annotations

import hashlib
import math
import re
from typing import Optional

from opid_mega.envs.footprints_env import CLOSET_ENTRY_RE, EMPTY_CHEST, REVEAL_RE, VAULT_ENTRY_RE
from opid_mega.skills.base import PerTrajectoryAnalyzer
from opid_mega.skills.types import Analysis, TrajectoryView

CUE_RULE = "In the hall, open the door the fresh footprints lead to; the rug's colour means nothing."
HALL_DOORS_RE = re.compile(r"Five doors lead off the hall: ([a-z, ]+) and ([a-z]+)\.")


def wrong_door_step_skill(right: str, opened: str) -> str:
    return f"Open the {right} door instead of the {opened} door: the fresh footprints lead to the {right} door."


def right_door_step_skill(right: str) -> str:
    return f"Open the {right} door: the fresh footprints lead to it, and it is the right door."


def wrong_door_episode_skill(right: str, opened: str) -> str:
    return (f"{CUE_RULE} Here the footprints lead to the {right} door; the {opened} door led into a locked closet "
            "and lost the game.")


def _door_colour(action: str) -> Optional[str]:
    words = str(action).split()
    return words[1] if len(words) == 3 and words[0] == "open" and words[2] == "door" else None


def _draw(seed: int, what: str, steps: list) -> float:
    """A number in [0, 1) from a hash of the seed, a purpose and the trajectory's observations and actions."""
    text = repr((int(seed), what, [(s.raw_obs, s.action) for s in steps]))
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2.0 ** 64


class FootprintsHindsightAnalyzer(PerTrajectoryAnalyzer):
    def __init__(self, max_step_skills: int = 5, wrong_door_rate: float = 0.0, seed: int = 0):
        if isinstance(max_step_skills, bool) or not isinstance(max_step_skills, int) or max_step_skills < 0:
            raise ValueError(f"FootprintsHindsightAnalyzer: max_step_skills must be an int >= 0, got "
                             f"{max_step_skills!r}")
        if isinstance(wrong_door_rate, bool) or not isinstance(wrong_door_rate, (int, float)) \
                or not math.isfinite(wrong_door_rate) or not 0.0 <= wrong_door_rate <= 1.0:
            raise ValueError(f"FootprintsHindsightAnalyzer: wrong_door_rate must be a number in [0, 1], got "
                             f"{wrong_door_rate!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"FootprintsHindsightAnalyzer: seed must be an int, got {seed!r}")
        self.max_step_skills = max_step_skills
        self.wrong_door_rate = float(wrong_door_rate)
        self.seed = seed

    def noisy_belief(self, steps: list, right: str, opened: str) -> Optional[str]:
        """The wrong door this analyzer believes right for this trajectory (None: it believes the truth)."""
        if self.wrong_door_rate <= 0.0 or _draw(self.seed, "wrong", steps) >= self.wrong_door_rate:
            return None
        hall = next((HALL_DOORS_RE.search(s.raw_obs or "") for s in steps if HALL_DOORS_RE.search(s.raw_obs or "")),
                    None)
        if hall is None:
            return None
        doors = [c.strip() for c in hall.group(1).split(",")] + [hall.group(2)]
        others = [c for c in doors if c not in (right, opened)]
        return others[int(_draw(self.seed, "door", steps) * len(others))] if others else None

    def decision_sections(self, choice: str, options: list, rng) -> list:
        """opid-sft's sft.blind_decision: the skills this analyzer writes that name `choice` (an action
        "open <colour> door" out of `options`) as the door to open, one route {kind: skill} per format: the step
        skill after a wrong door W (a random other option), the step skill after the right door, and the episode
        skill after a wrong door."""
        colour = _door_colour(choice)
        others = [_door_colour(o) for o in options if o != choice]
        if colour is None or not others or any(o is None for o in others):
            raise ValueError(f"FootprintsHindsightAnalyzer.decision_sections: {choice!r} / {options!r} are not "
                             "'open <colour> door' actions")
        wrong = rng.choice(others)
        return [{"step": wrong_door_step_skill(colour, wrong)}, {"step": right_door_step_skill(colour)},
                {"episode": wrong_door_episode_skill(colour, wrong)}]

    def analyze_one(self, traj: TrajectoryView) -> Optional[Analysis]:
        steps = traj.step_views()
        obs = [s.raw_obs or "" for s in steps]
        door = None  # (door step, opened colour, right colour, through the right door)
        for t in range(len(steps) - 1):
            closet, vault = CLOSET_ENTRY_RE.search(obs[t + 1]), VAULT_ENTRY_RE.search(obs[t + 1])
            if closet:
                reveal = REVEAL_RE.search(obs[t + 1])
                if reveal:
                    door = (t, closet.group(1), reveal.group(1), False)
                break
            if vault:
                door = (t, vault.group(1), vault.group(1), True)
                break
        if door is None:
            return Analysis(episode_summary=f"privileged footprints hindsight: no door outcome in {len(steps)} "
                                            "steps", episode_skill=CUE_RULE, step_skills={})
        t, opened, right, correct = door
        skills: dict[int, str] = {}
        believed = self.noisy_belief(steps, right, opened)
        if believed is not None:  # the noisy analyzer: a wrong door B believed right, the opened one wrong
            skills[t] = wrong_door_step_skill(believed, opened)
            chosen = dict(sorted(skills.items())[: self.max_step_skills]) if self.max_step_skills else {}
            return Analysis(episode_summary=f"privileged footprints hindsight, noisy belief: the {believed} door "
                                            f"(right: {right}) at step {t}; {'won' if traj.won else 'lost'}",
                            episode_skill=wrong_door_episode_skill(believed, opened), step_skills=chosen)
        if not correct:
            skills[t] = wrong_door_step_skill(right, opened)
            episode = wrong_door_episode_skill(right, opened)
            summary = f"wrong door {opened} at step {t} (right: {right}, from the closet wall); lost"
        else:
            skills[t] = right_door_step_skill(right)
            # the coin was gone: the chest was seen empty, or `take coin` was done in the vault and did not win
            # (the empty chest is then the final observation, which no step acts on)
            empty = any(EMPTY_CHEST in o for o in obs[t + 1:]) or any(
                " ".join((s.action or "").lower().split()) == "take coin" for s in steps[t + 1:])
            if traj.won:
                episode = f"{CUE_RULE} Here the {right} door was right; then take the coin."
                summary = f"right door {right} at step {t}; won"
            elif empty:
                episode = (f"{CUE_RULE} Here the {right} door was right: the coin was already gone this time, bad "
                           "luck rather than a wrong choice.")
                summary = f"right door {right} at step {t}; robbed (the chest was empty)"
            else:
                episode = f"{CUE_RULE} Here the {right} door was right; in the vault, take the coin at once."
                skills[t + 1] = "Take the coin now: it is in the chest."
                summary = f"right door {right} at step {t}; lost in the vault without taking the coin"
        chosen = dict(sorted(skills.items())[: self.max_step_skills]) if self.max_step_skills else {}
        return Analysis(episode_summary=f"privileged footprints hindsight: {summary}", episode_skill=episode,
                        step_skills=chosen)
