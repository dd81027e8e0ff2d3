"""Plain records produced by the agent loop and consumed by the analyzer and the trainer.

    batch: RolloutBatch
    for traj in batch.trajectories:          # B tasks x G trajectories, grouped by group_id (= task index)
        for s in traj.steps:                 # one StepSample per env step = one training sample
            s.prompt_ids, s.response_ids, s.response_logprobs, s.valid, ...
    batch.step_samples()                     # all step-samples, trajectory-major
    batch.metrics()                          # success rate, mean length, invalid rate, tokens/s ...

Skill insertion for the fork scorer: a step-sample's prompt ids are tokenized in three pieces (see
opid_mega.rollout.agent_loop.PromptTokenizer), so `prompt_ids[:episode_insert_at] + ids(episode section) +
prompt_ids[episode_insert_at:]` is exactly the token sequence of the prompt with the episode skill inserted
(faithful placement); `step_insert_at` is the same for the step skill / `late` placement (before the
"Now it's your turn" paragraph, or the end of the user message when that anchor is missing).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass
class StepSample:
    """One environment step of one trajectory: the prompt the policy saw and the response it sampled."""

    task_id: str
    group_id: int  # index of the task in the batch: the GRPO group
    traj_id: int  # index of the trajectory in the batch (unique within the batch)
    step: int  # 0-based step index within the trajectory
    prompt_text: str  # the user message (env prompt, with the rollout skill when one was injected)
    prompt_ids: list  # chat-templated prompt token ids (ends with the assistant generation prompt)
    episode_insert_at: int  # token index where an episode-skill section goes (after the task line)
    step_insert_at: int  # token index where a step-skill section goes (before "Now it's your turn")
    response_ids: list  # sampled token ids (a final stop token included)
    response_logprobs: list  # engine log-probs of response_ids (opid_mega.rollout.engine convention)
    response_text: str  # decoded response (special tokens skipped)
    finish_reason: str  # "stop" | "length" | "abort"
    action: Optional[str]  # the parsed action; None when the response could not be parsed
    valid: bool  # False: unparsable response, the env got its no-op action (the step is penalised)
    raw_obs: str  # raw env observation the policy acted on (for the hindsight analyzer)
    reward: float  # env reward paid for this step
    done: bool  # the episode ended with this step
    env_invalid: bool = False  # the env rejected a parsed action (not admissible); informational
    rollout_skill: Optional[str] = None  # skill text injected into the rollout prompt (skill_grpo), else None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Trajectory:
    """One episode: its step-samples and its outcome."""

    task_id: str
    group_id: int
    traj_id: int
    task_description: str = ""
    steps: list = field(default_factory=list)  # list[StepSample]
    won: bool = False
    score: float = 0.0  # sum of env rewards: R(trajectory), in {0, success_reward} for the shipped envs
    error: Optional[str] = None  # set when the env raised / the prompt was too long: the episode was ended
    env_error: bool = False  # the env raised (not the policy's doing): the trainer leaves this trajectory out
    rollout_skill: Optional[str] = None
    # the rollout's deadline (rollout.deadline_s) passed before the episode ended: left out like an env error,
    # counted in rollout/deadline_trajectories
    deadline_failure: bool = False
    # the last value of each info key the env declares in `info_metrics` (footprints: first_door_correct); the
    # trainer reports their means (train/<key>, eval/<key>)
    outcome_info: dict = field(default_factory=dict)

    @property
    def length(self) -> int:
        return len(self.steps)

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def num_invalid(self) -> int:
        return sum(1 for s in self.steps if not s.valid)

    def to_view(self, traj_id: Optional[str] = None):
        """The analyzer's view of this trajectory (opid_mega.skills.TrajectoryView); `traj_id` defaults to
        "<group_id>/<traj_id>"."""
        from opid_mega.skills.types import StepView, TrajectoryView

        return TrajectoryView(
            task=self.task_description, won=self.won,
            traj_id=traj_id if traj_id is not None else f"{self.group_id}/{self.traj_id}",
            steps=[StepView(s.raw_obs, s.response_text, s.reward, s.action, s.valid) for s in self.steps])

    def to_dict(self) -> dict:
        d = asdict(self)
        d["length"] = self.length
        return d


@dataclass
class RolloutBatch:
    """All trajectories of one rollout (B tasks x G trajectories) plus timing."""

    trajectories: list = field(default_factory=list)  # list[Trajectory], group-major (group 0's G first)
    wall_time_s: float = 0.0
    generate_time_s: float = 0.0  # time spent inside engine.generate
    num_generate_calls: int = 0

    def step_samples(self) -> list:
        return [s for t in self.trajectories for s in t.steps]

    def groups(self) -> dict:
        """group_id -> list of trajectories."""
        out: dict = {}
        for t in self.trajectories:
            out.setdefault(t.group_id, []).append(t)
        return out

    def metrics(self) -> dict:
        trajs = self.trajectories
        steps = self.step_samples()
        n = max(len(trajs), 1)
        gen_tokens = sum(len(s.response_ids) for s in steps)
        prompt_tokens = sum(len(s.prompt_ids) for s in steps)
        return {
            "num_trajectories": len(trajs),
            "num_tasks": len({t.group_id for t in trajs}),
            "num_step_samples": len(steps),
            "success_rate": sum(1 for t in trajs if t.won) / n,
            "mean_score": sum(t.score for t in trajs) / n,
            "mean_length": sum(t.length for t in trajs) / n,
            "invalid_rate": (sum(1 for s in steps if not s.valid) / len(steps)) if steps else 0.0,
            "num_failed": sum(1 for t in trajs if t.failed),
            "response_tokens": gen_tokens,
            "prompt_tokens": prompt_tokens,
            "mean_response_tokens": gen_tokens / max(len(steps), 1),
            "generate_tokens_per_s": gen_tokens / self.generate_time_s if self.generate_time_s > 0 else 0.0,
            "wall_time_s": self.wall_time_s,
            "generate_time_s": self.generate_time_s,
        }
