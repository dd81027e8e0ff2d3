"""TextWorld backend: games generated locally (the offline default environment).

Games come from TextWorld's built-in challenges (coin_collector, treasure_hunter, simple, cooking) at named
difficulty levels, generated from a seed with `textworld.challenges` and compiled to Z-machine files, cached on disk
as `<cache_dir>/<challenge>-<difficulty>-<game_seed>.z8` (+ `.json`, the game logic). A task set is therefore
reproducible from the options alone. Splits use disjoint game seeds (train 0.., valid 100000.., test 200000..);
the cooking challenge also uses its own train/valid/test food splits.

The task pool of a split is `pool_size[split]` games; `tasks(split, n, seed)` draws n tasks from that pool (seeded
permutation, cycled when n > pool), so a training run generates each game once. Generation: ~0.5-3 s per game
here (Inform7 compile); `prepare(tasks)` pre-generates a task list (do it before rollouts).

Threads: instances can be used from many threads, but every call into textworld (generation, load, reset, step) is
serialised by a process-wide lock (`_cache.TEXTWORLD_LOCK`, see there); a generation holds it for seconds.
`make_env("textworld")` runs the env in a worker process (`ProcessEnv`) under `step_timeout_s`; `process=False`
builds this class in the caller's process.

Commands: by default only admissible commands reach the game (`admissible_only=True`). `admissible_only=False` sends
any non-empty command to the game's parser, as TextWorld itself does (the game answers "That's not a verb I
recognise." and the like; the step is still flagged invalid when the command was not admissible), except one the
interpreter cannot take whole (over 198 UTF-8 bytes, or not encodable), which is an invalid step without a game call.
jericho hangs on some control characters (e.g. "\x00\x01\x02"): with admissible_only=False only the deadline
(`step_timeout_s`, a worker kill) bounds such a step.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import warnings
from typing import Optional

from opid_mega.envs._cache import TEXTWORLD_LOCK, cache_dir, path_lock
from opid_mega.envs.base import Env, EnvError, Task, TextWorldGameEnv, sample_pool

CHALLENGES = ("coin_collector", "treasure_hunter", "simple", "cooking")

# Named difficulty presets -> the challenge's own generation settings.
DIFFICULTIES: dict[str, dict[str, dict]] = {
    "coin_collector": {"easy": {"level": 3}, "medium": {"level": 10}, "hard": {"level": 110}},
    "treasure_hunter": {"easy": {"level": 5}, "medium": {"level": 15}, "hard": {"level": 25}},
    "simple": {
        "easy": {"rewards": "dense", "goal": "detailed"},
        "medium": {"rewards": "balanced", "goal": "detailed"},
        "hard": {"rewards": "sparse", "goal": "brief"},
    },
    "cooking": {
        "easy": {"recipe": 1, "take": 1, "go": 1},
        "medium": {"recipe": 2, "take": 1, "go": 6, "open": True, "cut": True},
        "hard": {"recipe": 3, "take": 2, "go": 9, "open": True, "cook": True, "cut": True},
    },
}

SPLIT_SEED_OFFSET = {"train": 0, "valid": 100_000, "test": 200_000}
DEFAULT_POOL_SIZE = {"train": 16, "valid": 8, "test": 8}



def _settings(challenge: str, difficulty: str, split: str) -> dict:
    try:
        settings = dict(DIFFICULTIES[challenge][difficulty])
    except KeyError:
        raise ValueError(f"textworld: unknown challenge/difficulty {challenge!r}/{difficulty!r}; "
                         f"known: { {c: sorted(d) for c, d in DIFFICULTIES.items()} }") from None
    if challenge == "simple":
        settings["test"] = split != "train"
    if challenge == "cooking":
        base = {"recipe": 1, "take": 0, "go": 1, "open": False, "cook": False, "cut": False, "drop": False,
                "recipe_seed": 0, "split": "train" if split == "train" else ("valid" if split == "valid" else "test")}
        base.update(settings)
        settings = base
    return settings


@contextlib.contextmanager
def _quiet_jericho():
    """jericho warns that generated games are "not fully supported" (its own score/move detection): harmless,
    TextWorld tracks score and moves itself. Used under TEXTWORLD_LOCK."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Game .* is not fully supported")
        yield


def game_file(challenge: str, difficulty: str, game_seed: int, out_dir: str) -> str:
    """The cached .z8 path of these parameters (it exists once generate_game has completed)."""
    return os.path.join(out_dir, f"{challenge}-{difficulty}-{game_seed}.z8")


def is_generated(path: str) -> bool:
    return os.path.isfile(path) and os.path.isfile(path[:-3] + ".json")


def generate_game(challenge: str, difficulty: str, game_seed: int, split: str, out_dir: str) -> str:
    """Generate (or reuse) the game file for these parameters; returns the .z8 path. Safe across threads and
    processes sharing `out_dir` (lock + write to a temp dir + atomic rename)."""
    path = game_file(challenge, difficulty, game_seed, out_dir)
    json_path = path[:-3] + ".json"
    if is_generated(path):
        return path
    with path_lock(path):
        if os.path.isfile(path) and os.path.isfile(json_path):
            return path
        import textworld
        from textworld import GameOptions
        from textworld.challenges import CHALLENGES as TW_CHALLENGES

        settings = _settings(challenge, difficulty, split)
        tmp = tempfile.mkdtemp(prefix=".gen-", dir=out_dir)
        try:
            with TEXTWORLD_LOCK, _quiet_jericho():
                opts = GameOptions()
                opts.seeds = int(game_seed)
                opts.path = os.path.join(tmp, "game.z8")
                opts.force_recompile = True
                try:
                    game = TW_CHALLENGES["tw-" + challenge][1](settings, opts)
                    produced = textworld.generator.compile_game(game, opts)
                except Exception as exc:  # noqa: BLE001 - re-raised with the parameters that failed
                    raise EnvError(f"textworld: generating {challenge}/{difficulty} seed {game_seed} "
                                   f"(settings {settings}) failed: {exc}") from exc
            os.replace(produced[:-3] + ".json", json_path)
            os.replace(produced, path)  # the .z8 appears last: its presence means the game is complete
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


NOTHING_HAPPENS = "Nothing happens."
# jericho's input buffer (jericho.INPUT_BUFFER_SIZE): it cuts a longer command, and raises UnicodeDecodeError when
# the cut falls inside a multi-byte character
MAX_COMMAND_BYTES = 198
_BANNER_LINE = re.compile(r"^[\s_$\\|/<>]*$")
_END_RE = re.compile(r"\*\*\* The End \*\*\*.*$", re.DOTALL)


def clean_observation(text: str) -> str:
    """Drop TextWorld's ASCII-art banner and the end-of-game RESTART/QUIT menu; collapse blank lines."""
    lines = [ln.rstrip() for ln in text.splitlines()]
    lines = [ln for ln in lines if not (ln.strip() and _BANNER_LINE.match(ln)) and not ln.startswith(">")]
    text = "\n".join(lines)
    text = _END_RE.sub("", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def normalize_command(text: str) -> str:
    return " ".join(text.strip().lower().split())


def interpreter_takes(cmd: str) -> bool:
    """Whether the Z-machine interpreter takes `cmd` whole: non-empty, UTF-8 encodable, at most 198 bytes."""
    try:
        return 0 < len(cmd.encode("utf-8")) <= MAX_COMMAND_BYTES
    except UnicodeEncodeError:  # a lone surrogate
        return False


class TextWorldEnv(TextWorldGameEnv):
    name = "textworld"
    family = "action"
    default_max_steps = 30
    default_success_reward = 10.0
    noop_action = ""  # answered "Nothing happens." without a game call

    def __init__(self, challenges=("coin_collector", "treasure_hunter", "simple", "cooking"),
                 difficulties=("easy",), pool_size: Optional[dict] = None, cache_dir: Optional[str] = None,
                 max_steps: Optional[int] = None, success_reward: Optional[float] = None,
                 admissible_only: bool = True, template: str = "reference"):
        super().__init__(max_steps=max_steps, success_reward=success_reward)
        from opid_mega.envs.prompts import TEMPLATES

        if template not in TEMPLATES:
            raise ValueError(f"textworld: template must be one of {', '.join(TEMPLATES)}, got {template!r}")
        self.prompt_template = template
        if not isinstance(admissible_only, bool):
            raise ValueError(f"textworld: admissible_only must be true or false, got {admissible_only!r}")
        self.admissible_only = admissible_only
        if isinstance(challenges, str):
            challenges = [challenges]
        if isinstance(difficulties, str):
            difficulties = [difficulties]
        self.challenges = [c[3:] if c.startswith("tw-") else c for c in challenges]
        self.difficulties = list(difficulties)
        for c in self.challenges:
            for d in self.difficulties:
                _settings(c, d, "train")  # validates the names
        if not self.challenges or not self.difficulties:
            raise ValueError("textworld: need at least one challenge and one difficulty")
        self.pool_size = dict(DEFAULT_POOL_SIZE)
        if isinstance(pool_size, int):
            self.pool_size = {k: int(pool_size) for k in self.pool_size}
        elif pool_size:
            self.pool_size.update({k: int(v) for k, v in pool_size.items()})
        self._cache_override = cache_dir
        self.cache_dir = _cache_dir_for(cache_dir)
        self._tw_env = None
        self._tw_path = None
        self._walkthrough: Optional[list[str]] = None

    # ---- tasks --------------------------------------------------------------------------------------------------
    def task_pool(self, split: str) -> list[Task]:
        if split not in SPLIT_SEED_OFFSET:
            raise ValueError(f"textworld: unknown split {split!r}; expected one of {sorted(SPLIT_SEED_OFFSET)}")
        pool = []
        nc, nd = len(self.challenges), len(self.difficulties)
        for k in range(self.pool_size.get(split, 0)):
            challenge = self.challenges[k % nc]
            difficulty = self.difficulties[(k // nc) % nd]
            game_seed = SPLIT_SEED_OFFSET[split] + k
            pool.append(Task(id=f"textworld/{challenge}-{difficulty}-{game_seed}", split=split, env=self.name,
                             data={"challenge": challenge, "difficulty": difficulty, "game_seed": game_seed}))
        return pool

    def tasks(self, split: str, n: int, seed: int = 0) -> list[Task]:
        return sample_pool(self.task_pool(split), n, seed)

    def game_path(self, task: Task) -> str:
        d = task.data
        return generate_game(d["challenge"], d["difficulty"], int(d["game_seed"]), task.split, self.cache_dir)

    def prepare(self, tasks: list[Task]) -> list[str]:
        """Generate (or find in the cache) the game file of every task; returns their paths."""
        return [self.game_path(t) for t in tasks]

    def unprepared(self, tasks: list[Task]) -> int:
        """How many of `tasks` have no generated game in the cache yet (each takes seconds to generate)."""
        return sum(not is_generated(game_file(t.data["challenge"], t.data["difficulty"], int(t.data["game_seed"]),
                                              self.cache_dir)) for t in tasks)

    # ---- episode ------------------------------------------------------------------------------------------------
    def _start(self, path: str):
        import textworld

        if self._tw_env is not None and self._tw_path == path:
            return self._tw_env
        self._close_game()
        infos = textworld.EnvInfos(admissible_commands=True, won=True, lost=True, score=True, max_score=True,
                                   objective=True, policy_commands=True, moves=True)
        try:
            with TEXTWORLD_LOCK, _quiet_jericho():
                self._tw_env = textworld.start(path, request_infos=infos)
        except Exception as exc:  # noqa: BLE001
            raise EnvError(f"textworld: cannot start game {path}: {exc}") from exc
        self._tw_path = path
        return self._tw_env

    def _reset(self, task: Task):
        env = self._start(self.game_path(task))
        with TEXTWORLD_LOCK:
            state = env.reset()
        self._walkthrough = list(state.policy_commands or [])
        self._score = state.score or 0
        self._max_score = state.max_score
        raw = state.feedback or ""
        objective = " ".join((state.objective or "").split())
        obs = clean_observation(raw)
        if self.prompt_template == "reference" and objective:
            # as ALFWorld's first observation: it ends with the task line (the reference's step-0 template has none)
            from opid_mega.envs.prompts import first_observation_task_line

            obs = f"{obs}\n\n{first_observation_task_line(objective)}"
        return obs, raw, list(state.admissible_commands or []), objective

    def _step(self, action: str):
        """Only an admissible command reaches the game (jericho hangs on control characters and raises on a
        multi-byte character cut at 198 bytes), unless admissible_only=False (module docstring). Anything else, the
        no-op (an empty command) included, is answered "Nothing happens." without a game call (what ALFWorld's
        engine answers, and what the reference's agent sees for an invalid step): nothing new is revealed, the game
        state and the admissible actions stay as they were, info["invalid"] is set. A game that cannot decode or
        answer a command raises EnvError (the trajectory ends as an env error), never UnicodeError."""
        cmd = normalize_command(action)
        admissible = cmd in {normalize_command(a) for a in self._admissible}  # "" is never admissible
        if not (admissible if self.admissible_only else interpreter_takes(cmd)):
            extra = {"score": self._score, "max_score": self._max_score}
            return NOTHING_HAPPENS, NOTHING_HAPPENS, list(self._admissible), False, True, extra
        try:
            with TEXTWORLD_LOCK:
                state, score, done = self._tw_env.step(cmd)
        except UnicodeError as exc:
            raise EnvError(f"textworld: the game could not take {cmd[:60]!r}: {type(exc).__name__}: {exc}") from exc
        self._score = score
        raw = state.feedback or ""
        obs = clean_observation(raw) or NOTHING_HAPPENS
        extra = {"score": score, "max_score": self._max_score, "done": bool(done or state.lost)}
        return obs, raw, list(state.admissible_commands or []), bool(state.won), not admissible, extra


def _cache_dir_for(override: Optional[str]) -> str:
    return cache_dir("textworld", override)
