"""Analyzer prompts (docs/algorithm.md §3 and "More reference facts: Analyzer prompt content"), in this project's
words.

One prompt per finished trajectory: the task, the outcome label, the candidate step indices (every step), then one
block of lines per step (its 0-based index, the raw observation, the full policy response, the discounted return
with 6 decimals), the outcome's instruction (success: a reusable workflow; failure: the core mistake and the warning
signs to avoid, never "what to do instead"; no clause asking for general phrasing), and the reply format: exactly
three JSON fields (episode_summary, episode_skill, step_skills) with the constraints the reference lists (0-based
indices, progress judged against the task, what each critical step should have done better, each step skill one
short imperative sentence, actionable guidance rather than a story, step_skills keyed by the chosen critical steps,
at most K = min(K, T) of them) and an example of the reply's shape.
"""
from __future__ import annotations

from opid_mega.skills.types import TrajectoryView

# The re-ask quotes this many characters from the end of the unusable reply (the reference's value).
REASK_TAIL_CHARS = 2000


def discounted_returns(rewards: list[float], gamma: float = 0.95) -> list[float]:
    """Return-to-go G_t = Σ_{k>=t} γ^(k-t) r_k for each step."""
    out = [0.0] * len(rewards)
    acc = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        acc = float(rewards[t]) + gamma * acc
        out[t] = acc
    return out


_INTRO = ("You are reviewing one finished episode of a language agent in hindsight. Your goal is guidance that "
          "helps the same agent act better.")
# The episode-skill instructions carry no "state it generally" clause: the reference has that clause commented out.
_SUCCESS = ("The agent succeeded. Extract a reusable workflow from this episode: the core decision rule and the order "
            "of actions that made it work.")
_FAILURE = ("The agent failed. Identify the core mistake that made this episode fail and the warning signs the agent "
            "should avoid.")
_SUCCESS_FIELD = "the reusable workflow, as guidance for the whole episode"
_FAILURE_FIELD = "the core mistake and its warning signs, as guidance on what to avoid in the whole episode"


def build_analysis_prompt(traj: TrajectoryView, max_step_skills: int = 5, gamma: float = 0.95) -> str:
    """The analyzer prompt of one finished trajectory (see the module docstring)."""
    steps = traj.step_views()
    returns = discounted_returns([s.reward for s in steps], gamma)
    k = min(max_step_skills, len(steps))
    candidates = ", ".join(str(i) for i in range(len(steps)))
    lines = [
        _INTRO,
        "",
        f"Task: {traj.task}",
        f"Outcome: {'success' if traj.won else 'failure'}",
        f"Candidate step indices: [{candidates}]",
        "",
        f"Trajectory ({len(steps)} steps; the discounted return of a step sums the rewards from that step on, "
        f"discounted by gamma = {gamma:g}):",
    ]
    for i, (s, g) in enumerate(zip(steps, returns)):
        lines += [
            "",
            f"Step {i}",
            f"Observation: {s.raw_obs.strip()}",
            f"Response: {s.response.strip()}",
            f"Discounted return: {g:.6f}",
        ]
    lines += [
        "",
        _SUCCESS if traj.won else _FAILURE,
        "",
        "Reply with one JSON object that has exactly these three fields:",
        '- "episode_summary": a brief account of what happened in the episode;',
        f'- "episode_skill": {_SUCCESS_FIELD if traj.won else _FAILURE_FIELD};',
        '- "step_skills": an object whose keys are the indices of the critical steps you choose and whose values '
        "are the guidance for each of those steps.",
        "Constraints:",
        "- Step indices are 0-based, as numbered above, and come from the candidate list.",
        f'- Choose at most {k} critical steps; the keys of "step_skills" are exactly the steps you chose.',
        "- Judge the agent's progress and its mistakes against the task together with the episode.",
        "- For each critical step, use the whole episode to work out what that step should have done better.",
        "- Make every step skill one short imperative sentence addressed to the agent at that step.",
        "- Write every skill as guidance the agent can act on when it faces that decision, not as a story of what "
        "happened.",
        "- Output the JSON object only, shaped like this example (the step keys are illustrative):",
        "{",
        '  "episode_summary": "...",',
        '  "episode_skill": "...",',
        '  "step_skills": {"0": "skill for step 0", "2": "skill for step 2"}',
        "}",
    ]
    return "\n".join(lines)


def build_reask_prompt(original_prompt: str, bad_answer: str, error: str,
                       tail_chars: int = REASK_TAIL_CHARS) -> str:
    """The single re-ask after an unusable reply: the problem and the last `tail_chars` characters of the reply."""
    tail = bad_answer[-tail_chars:] if tail_chars > 0 else ""
    return (
        f"{original_prompt}\n\n"
        "Your previous reply could not be used.\n"
        f"Problem: {error}\n"
        f"End of your previous reply:\n{tail}\n\n"
        "Reply again with ONE valid JSON object with the fields episode_summary, episode_skill (non-empty) and "
        "step_skills (keys are candidate step indices), and nothing else."
    )
