"""The rollout stage: every iteration's record drawn by the agent loop, its hindsight analysis submitted at once, up
to train.max_staleness records in flight, and the held-out evaluation. The trainer calls it; nothing here calls the
trainer back.

    stage = RolloutStage(cfg, loop, env, analysis, audit, colocation, rank0)
    took = stage.take(it)            # iteration it's record (drawn now, or in flight since an earlier iteration)
    ...                              #   the trainer scores and trains on it; the next rollouts may play meanwhile
    stage.land()                     # (disaggregated) the rollouts played beside the update, in flight before the sync
    stage.evaluate(it)               # held-out tasks without skills

**Records in flight** (train.max_staleness; docs/algorithm.md "Bounded staleness", :class:`RolloutPipeline`). With
max_staleness N, iteration it first draws every rollout up to it + N that does not exist yet (with the weights the
engines hold then, version it - 1) and submits each one's analysis at once; then it takes the oldest, its own, whose
analysis has been running in the background since it was drawn. The analyzer's latency is spent while the next
rollouts are generated (and, from the second iteration on, while the previous iteration trained) instead of after the
reference log-probs. N = 0 is the on-policy loop: draw it, take it.

Two deployments (deploy.mode). Colocated (the engines share the trainer's devices): the next rollouts are drawn in
:meth:`RolloutPipeline.fill`, before the iteration's scoring and update, so only the analysis runs beside them.
Disaggregated (the engines have devices of their own): `fill` draws only what is missing of the iteration's own record
(the first iteration, a resume), and :meth:`RolloutPipeline.start` plays the next N in a background thread while the
iteration is scored and trained; :meth:`RolloutPipeline.join` lands them before the weight sync, so an engine never
generates while its weights change. Both draw the same rollouts with the same weights: the same records, only the
waiting differs.

A sample of iteration k is drawn with version >= k - 1 - N and trained at version k - 1: at most N versions stale.
The records in flight at a checkpoint are saved inside it (:meth:`RolloutStage.state`), so a resumed run trains on
the very samples the uninterrupted run would have (their weights are gone: they cannot be redrawn), and their
analyses are submitted again.

**The analysis** (:class:`AnalysisStage`): hindsight analyses of finished trajectories through the analyzer's
interface (opid_mega.skills.Analyzer: `submit` with a deadline, then the job's result), treated as untrusted output.
Past analyzer.deadline_s what is not done is a failure (audited, counted in analysis/deadline_failures); an analyzer
crash costs the skill signal, never the run; analyzer.max_failed_iterations iterations in a row with every analysis
failed stop the run (AnalyzerFailed). Every skill is cut to analyzer.max_skill_tokens tokens of the policy tokenizer
(`count_tokens`), so a skill section never exceeds its cap (opid_mega.experience.add_skills fits it).

Multi-rank: rollouts, analyses and evaluation run on global rank 0; each record's rollout batch is broadcast over the
control group and every rank builds the same record from it.
"""
from __future__ import annotations

import base64
import pickle
import sys
import threading
import time
import zlib
from collections import deque
from concurrent.futures import Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from opid_mega import algo, experience
from opid_mega.config import Config
from opid_mega.experience import Experience, mean, outcome_info_means
from opid_mega.rollout.launch import RolloutEngineDied
from opid_mega.skills.sanitize import cut_analysis, sanitize_analysis

CLOSE_GRACE_S = 5.0  # how long close() gives a background rollout it asked to stop


# ---- the analysis --------------------------------------------------------------------------------------------------
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


# ---- records in flight ---------------------------------------------------------------------------------------------
@dataclass
class InFlight:
    exp: Experience
    views: list  # the TrajectoryViews submitted to the analysis
    pending: object  # the analysis job (PendingAnalysis) or None


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


# ---- the rollout stage ---------------------------------------------------------------------------------------------
def broadcast(produce):
    """`produce()` on global rank 0, its result (or error) on every rank over the control group (megatron-core is
    imported when called: importing this module does not import it)."""
    from opid_mega.megatron.parallel import broadcast as control_broadcast

    return control_broadcast(produce)


def skill_key(task) -> str:
    """The skill bank's key of a task: the same string as `Trajectory.task_id` of its rollouts (the AgentLoop sets
    task_id = str(task.id)), so a task's rollouts find the skill of that task's own latest analysis."""
    return str(getattr(task, "id", task))


def play(loop, cfg: Config, tasks, group_size: int, temperature: float, seed: int, skills=None):
    """len(tasks) x group_size trajectories (a RolloutBatch). `skills`: one optional episode skill per trajectory,
    put into the rollout prompt itself (skill_grpo). Engine failures surface as RolloutEngineDied. The rollout ends
    within rollout.deadline_s (the trajectories still running then are deadline failures: AgentLoop)."""
    from opid_mega.rollout.engine import SamplingParams

    sampling = SamplingParams(temperature=temperature, top_p=cfg.rollout.top_p,
                              max_new_tokens=cfg.rollout.max_response_tokens,
                              stop_token_ids=tuple(loop.stop_token_ids), seed=seed)
    try:
        return loop.run(tasks, group_size, sampling, rollout_skills=skills, skill_kind=algo.EPISODE,
                        placement=cfg.algo.placement, deadline_s=cfg.rollout.deadline_s)
    except Exception as exc:  # noqa: BLE001 - env failures are handled inside the loop: this is the engine
        raise RolloutEngineDied(f"rollout engine failed: {type(exc).__name__}: {exc}") from exc


def audit_rollout_skills(audit, batch, it: int, placement: str) -> None:
    """Every rollout prompt that carried a skill (skill_grpo, evaluation with skills), in the audit log."""
    for t in batch.trajectories:
        for s in t.steps:
            if s.rollout_skill:
                audit.log_augmented_prompt(iteration=it, sample_id=f"{it}/rollout/{t.traj_id}/s{s.step}",
                                           kind=algo.EPISODE, placement=placement, skill=s.rollout_skill,
                                           prompt=s.prompt_text, stage="rollout")


class RolloutStage:
    """Records of B tasks x G trajectories (task draws and sampling seeds depend only on train.seed and the
    iteration), their analyses, the records in flight and the evaluation. `loop` and `env`: the agent loop and an env
    for task draws (rank 0; None elsewhere); `analysis`: the AnalysisStage; `colocation`: the trainer's
    Colocation (the engines' memory around each rollout); `skill_bank`: task id -> latest episode skill (skill_grpo
    rollouts; kept in checkpoints by the trainer)."""

    def __init__(self, cfg: Config, loop, env, analysis: "AnalysisStage", audit, colocation, rank0: bool):
        self.cfg, self.loop, self.env, self.analysis, self.audit = cfg, loop, env, analysis, audit
        self.colocation, self.rank0 = colocation, rank0
        self.skill_bank: dict = {}
        self.eval_tasks = env.tasks(cfg.env.eval_split, cfg.eval.num_tasks, seed=cfg.train.seed) \
            if cfg.eval.num_tasks else []
        self.queue = RolloutPipeline(cfg.train.max_staleness, cfg.train.iterations,
                                     overlap=cfg.deploy.mode == "disaggregated")

    # ---- what the trainer calls ---------------------------------------------------------------------------------
    def take(self, it: int) -> InFlight:
        """Iteration it's record, views and pending analysis: drawn now (and with train.max_staleness N the next N),
        or in flight since an earlier iteration; disaggregated, the next rollouts then start playing beside the
        update."""
        self.queue.fill(it, self.rollout, self.submit_analysis)
        took = self.queue.take(it)
        if self.queue.overlap:
            self.queue.start(it, self.background_rollout)
        return took

    def land(self) -> int:
        """(disaggregated) The rollouts played beside the update, in flight: before the weight sync, so no engine
        generates while its weights change."""
        return self.queue.join(self.landed)

    def state(self) -> Optional[str]:
        return self.queue.state()

    def restore(self, state: Optional[str]) -> None:
        self.queue.restore(state, self.submit_analysis)

    def close(self) -> None:
        """A rollout still playing in the background is asked to stop and given seconds (RolloutPipeline.close)."""
        self.queue.close(cancel=getattr(self.loop, "stop", None))

    # ---- drawing a record -----------------------------------------------------------------------------------------
    def rollout(self, it: int, version: int) -> Experience:
        """Iteration it's rollout on rank 0, broadcast; its record, drawn with the weights the engines hold
        (`version`)."""
        self.colocation.before_rollout()
        batch = broadcast(self.rollout_job(it))
        self.colocation.after_rollout()
        return self.record(it, version, batch)

    def rollout_job(self, it: int) -> Callable:
        """Rank 0's part of iteration it's rollout: its tasks drawn and (skill_grpo) the skill bank read now, the
        episodes played when the job is called."""
        cfg = self.cfg
        tasks = self.env.tasks(cfg.env.train_split, cfg.rollout.tasks_per_iter, seed=cfg.train.seed * 7919 + it)
        G = cfg.rollout.group_size
        # skill_grpo: every rollout of task t carries the episode skill of t's OWN latest analysis (none yet: none)
        skills = [self.skill_bank.get(skill_key(t)) for t in tasks for _ in range(G)] \
            if cfg.algo.mode == "skill_grpo" else None
        return lambda: play(self.loop, cfg, tasks, G, cfg.rollout.temperature, seed=cfg.train.seed * 100_003 + it,
                            skills=skills)

    def record(self, it: int, version: int, batch, exp: Optional[Experience] = None) -> Experience:
        """Iteration it's rollout batch as a record (`exp`: already made from it), audited and checked."""
        cfg = self.cfg
        audit_rollout_skills(self.audit, batch, it, cfg.algo.placement)
        exp = exp or Experience.from_rollout(batch, it, policy_version=version)
        if not exp.trajectories and exp.deadline_trajectories:
            raise RolloutEngineDied(f"the rollout passed rollout.deadline_s={cfg.rollout.deadline_s:g} s with none of "
                                    f"its {exp.rollout_trajectories} trajectories finished "
                                    f"({exp.deadline_trajectories} cut by the deadline)")
        if not exp.num_samples:
            raise RuntimeError(f"iteration {it}: the rollout produced no step-samples (every env raised: see "
                               "rollout/env_errors and the trajectories' errors)")
        if cfg.train.pad_multiple:  # the reference's padding, before any stage (copies enter A_out and the loss)
            experience.pad_to_multiple(exp, cfg.train.pad_multiple, np.random.default_rng((cfg.train.seed, it)))
        return exp

    def background_rollout(self, it: int, version: int) -> Callable:
        """(disaggregated) What plays iteration it's rollout beside the update: on rank 0 the episodes, their record
        and its analysis submitted; nothing on the other ranks (they get the batch in :meth:`landed`)."""
        if not self.rank0:
            return lambda: None
        job = self.rollout_job(it)

        def run():
            batch = job()
            exp = Experience.from_rollout(batch, it, policy_version=version)
            return batch, exp, self.submit_analysis(exp)
        return run

    def landed(self, it: int, version: int, produce: Callable) -> tuple:
        """(record, views, pending) of a rollout played in the background (`produce()`: rank 0's result)."""
        batch = broadcast(lambda: produce()[0])
        if self.rank0:
            _, exp, (views, pending) = produce()
            return self.record(it, version, batch, exp), views, pending
        exp = self.record(it, version, batch)
        return (exp, *self.submit_analysis(exp))

    def submit_analysis(self, exp: Experience) -> tuple:
        """(views, pending): the analysis of a fresh rollout's trajectories, started in the background."""
        views = [t.to_view(f"{exp.iteration}/{t.task_id}/{ti}") for ti, t in enumerate(exp.trajectories)]
        return views, self.analysis.submit(views, exp.iteration)

    # ---- evaluation -------------------------------------------------------------------------------------------------
    def evaluate(self, it: int) -> dict:
        """Held-out tasks, one episode each, WITHOUT skills (docs/algorithm.md §9). With eval.with_skills (always for
        skill_grpo) each eval task is then played once more WITH an episode skill of its own: eval tasks are never
        analysed during training, so the analyzer analyses the task's no-skill eval trajectory just played and
        that analysis' episode skill is put into the second episode's prompts (a task whose analysis failed, or
        with no analyzer, is replayed without a skill). No task ever gets another task's skill."""
        cfg, seed = self.cfg, self.cfg.train.seed * 100_003 + 77_777 + it
        trajs = play(self.loop, cfg, self.eval_tasks, 1, cfg.eval.temperature, seed).trajectories
        out = {"eval/success_rate": mean(t.won for t in trajs), "eval/episode_length": mean(t.length for t in trajs),
               **outcome_info_means(trajs, "eval")}
        if (cfg.eval.with_skills or cfg.algo.mode == "skill_grpo") and self.analysis.analyzer is not None:
            skills = self.eval_skills(trajs, it)
            batch = play(self.loop, cfg, self.eval_tasks, 1, cfg.eval.temperature, seed, skills=skills)
            audit_rollout_skills(self.audit, batch, it, cfg.algo.placement)
            out["eval/success_rate_with_skills"] = mean(t.won for t in batch.trajectories)
        return out

    def eval_skills(self, trajs: list, it: int) -> list:
        """One optional episode skill per eval trajectory: the analyzer's analysis of that very trajectory (eval
        analyses are audited, not counted in analysis/failures_total)."""
        keep = [i for i, t in enumerate(trajs) if t.steps and not t.env_error]
        views = [trajs[i].to_view(f"eval{it}/{trajs[i].task_id}/{i}") for i in keep]
        analyses = self.analysis.collect(self.analysis.submit(views, it), views, it, count_failures=False) \
            if views else []
        skills: list = [None] * len(trajs)
        for i, an in zip(keep, analyses):
            if an is not None and an.episode_skill.strip():
                skills[i] = an.episode_skill
        return skills
