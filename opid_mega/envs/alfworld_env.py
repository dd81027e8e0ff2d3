"""ALFWorld backend (text version, TextWorld PDDL engine with ALFWorld's wrappers).

Two task sources:
  * `source="data"` (default): the real ALFWorld games (`game.tw-pddl` + `traj_data.json` per task) under
    `data_path` / $ALFWORLD_DATA (`json_2.1.1/{train,valid_seen,valid_unseen}`), as downloaded by
    `alfworld-download`. Splits: train -> train, valid -> valid_seen, test -> valid_unseen (the names
    valid_seen / valid_unseen are accepted as well).
  * `source="generated"`: small ALFWorld-style kitchen problems generated from a seed (alfworld_gen), cached as
    `<cache_dir>/<task_type>-<seed>/game.tw-pddl`; splits use disjoint seeds. Runs offline, in CI.

Both play through `textworld.start(game, wrappers=[AlfredDemangler, AlfredInfos])`, exactly as ALFWorld's
AlfredTWEnv does, with the planner (`policy_commands`) as walkthrough.

Threads: instances can be used from many threads, but every call into textworld (load, reset, step) is serialised
by a process-wide lock (`_cache.TEXTWORLD_LOCK`: textworld's tatsu parsers are module globals used during steps,
and fast_downward swaps sys.stdout while translating PDDL). Steps take ~15-50 ms here.
"""
from __future__ import annotations

import glob
import json
import os
import re
from typing import Optional

from opid_mega.envs._cache import TEXTWORLD_LOCK
from opid_mega.envs._cache import cache_dir as _cache_dir
from opid_mega.envs.base import Env, EnvError, Task, TextWorldGameEnv, sample_pool

DATA_SPLITS = {"train": "train", "valid": "valid_seen", "valid_seen": "valid_seen", "test": "valid_unseen",
               "valid_unseen": "valid_unseen"}
GEN_SPLIT_SEED_OFFSET = {"train": 0, "valid": 100_000, "valid_seen": 100_000, "test": 200_000,
                         "valid_unseen": 200_000}
GEN_DEFAULT_POOL_SIZE = 64
REAL_TASK_TYPES = ("pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
                   "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep", "pick_two_obj_and_place")

NOTHING_HAPPENS = "Nothing happens."
_WELCOME_RE = re.compile(r"^\s*-= Welcome to TextWorld, ALFRED! =-\s*")
_TASK_RE = re.compile(r"Your task is to:\s*(.*?)\s*$", re.DOTALL)


def _missing_data_error(path: str, split_dir: str) -> EnvError:
    return EnvError(
        f"alfworld: no ALFWorld games found under {split_dir!r} (data_path={path!r}). Download the data with "
        "`alfworld-download` (stores it in $ALFWORLD_DATA, default ~/.cache/alfworld; needs internet), or pass "
        "data_path=<dir containing json_2.1.1>, or use the offline generated games: make_env('alfworld', "
        "source='generated').")


def _has_game(split_dir: str) -> bool:
    """Whether some directory under `split_dir` holds a game.tw-pddl (the walk stops at the first one)."""
    for _root, _dirs, files in os.walk(split_dir):
        if "game.tw-pddl" in files:
            return True
    return False


class AlfWorldEnv(TextWorldGameEnv):
    name = "alfworld"
    family = "action"
    default_max_steps = 30
    default_success_reward = 10.0
    noop_action = ""  # answered "Nothing happens." without a game call

    def __init__(self, source: str = "data", data_path: Optional[str] = None, task_types=None,
                 pool_size: Optional[int] = None, cache_dir: Optional[str] = None, max_steps: Optional[int] = None,
                 success_reward: Optional[float] = None, generated: Optional[bool] = None):
        super().__init__(max_steps=max_steps, success_reward=success_reward)
        if generated is not None:
            source = "generated" if generated else "data"
        if source not in ("data", "generated"):
            raise ValueError(f"alfworld: source must be 'data' or 'generated', got {source!r}")
        self.source = source
        if source == "generated":
            from opid_mega.envs.alfworld_gen import TASK_TYPES

            self.task_types = list(task_types or TASK_TYPES)
            bad = [t for t in self.task_types if t not in TASK_TYPES]
            if bad:
                raise ValueError(f"alfworld: generated games support task types {TASK_TYPES}, got {bad}")
            self.cache_dir = _cache_dir("alfworld_gen", cache_dir)
            self.pool_size = int(pool_size if pool_size is not None else GEN_DEFAULT_POOL_SIZE)
        else:
            self.task_types = list(task_types or REAL_TASK_TYPES)
            self.data_path = os.path.expanduser(
                data_path or os.environ.get("ALFWORLD_DATA") or os.path.join("~", ".cache", "alfworld"))
            self.pool_size = pool_size
        self._tw_env = None
        self._walkthrough: Optional[list[str]] = None
        self._files_cache: dict[str, list[str]] = {}

    # ---- tasks --------------------------------------------------------------------------------------------------
    def _real_game_files(self, split: str) -> list[str]:
        if split not in DATA_SPLITS:
            raise ValueError(f"alfworld: unknown split {split!r}; expected one of {sorted(DATA_SPLITS)}")
        if split in self._files_cache:
            return self._files_cache[split]
        split_dir = os.path.join(self.data_path, "json_2.1.1", DATA_SPLITS[split])
        if not os.path.isdir(split_dir):
            raise _missing_data_error(self.data_path, split_dir)
        files = []
        for traj in sorted(glob.glob(os.path.join(split_dir, "**", "traj_data.json"), recursive=True)):
            root = os.path.dirname(traj)
            game = os.path.join(root, "game.tw-pddl")
            if "movable" in root or "Sliced" in root or not os.path.isfile(game):
                continue
            with open(traj) as fh:
                if json.load(fh).get("task_type") not in self.task_types:
                    continue
            with open(game) as fh:
                if not json.load(fh).get("solvable", False):
                    continue
            files.append(game)
        if not files:
            raise _missing_data_error(self.data_path, split_dir)
        if self.pool_size:
            files = files[: int(self.pool_size)]
        self._files_cache[split] = files
        return files

    def data_problem(self, splits) -> Optional[str]:
        """The start-up check (opid_mega.checks, before any model is built): None when every split in `splits` has
        ALFWorld games under data_path (real data) or when the games are generated; else one line naming the
        directory and the fix. Cheap: it stops at the first game file of each split (the full scan, with the task
        type and solvability filters, is task_pool's)."""
        if self.source != "data":
            return None
        for split in splits:
            if split not in DATA_SPLITS:
                return (f"alfworld: unknown split {split!r} (env.train_split / env.eval_split); expected one of "
                        f"{sorted(DATA_SPLITS)}")
            split_dir = os.path.join(self.data_path, "json_2.1.1", DATA_SPLITS[split])
            if not _has_game(split_dir):
                return (f"alfworld: no ALFWorld games under {split_dir} (split {split}; the data directory is "
                        "env.options.data_path, else $ALFWORLD_DATA, else ~/.cache/alfworld): download them with "
                        "`alfworld-download`, point env.options.data_path at the directory holding json_2.1.1, or "
                        "set env.options.source=generated for the offline generated games")
        return None

    def task_pool(self, split: str) -> list[Task]:
        if self.source == "data":
            base = os.path.join(self.data_path, "json_2.1.1")
            return [Task(id="alfworld/" + os.path.relpath(os.path.dirname(f), base), split=split, env=self.name,
                         data={"gamefile": f}) for f in self._real_game_files(split)]
        if split not in GEN_SPLIT_SEED_OFFSET:
            raise ValueError(f"alfworld: unknown split {split!r}; expected one of {sorted(GEN_SPLIT_SEED_OFFSET)}")
        pool = []
        for k in range(self.pool_size):
            task_type = self.task_types[k % len(self.task_types)]
            seed = GEN_SPLIT_SEED_OFFSET[split] + k
            pool.append(Task(id=f"alfworld_gen/{task_type}-{seed}", split=split, env=self.name,
                             data={"generated": True, "task_type": task_type, "seed": seed}))
        return pool

    def tasks(self, split: str, n: int, seed: int = 0) -> list[Task]:
        return sample_pool(self.task_pool(split), n, seed)

    def game_path(self, task: Task) -> str:
        if task.data.get("generated"):
            from opid_mega.envs.alfworld_gen import write_game

            out = getattr(self, "cache_dir", None) or _cache_dir("alfworld_gen")
            return write_game(int(task.data["seed"]), task.data["task_type"], out)
        path = task.data.get("gamefile")
        if not path or not os.path.isfile(path):
            raise EnvError(f"alfworld: game file {path!r} of task {task.id} does not exist")
        return path

    # ---- episode ------------------------------------------------------------------------------------------------
    def _reset(self, task: Task):
        import textworld
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

        path = self.game_path(task)
        infos = textworld.EnvInfos(won=True, admissible_commands=True, policy_commands=True, extras=["gamefile"])
        with TEXTWORLD_LOCK:
            self._close_game()
            try:
                self._tw_env = textworld.start(path, request_infos=infos,
                                               wrappers=[AlfredDemangler(shuffle=False), AlfredInfos])
                state = self._tw_env.reset()
            except Exception as exc:  # noqa: BLE001
                raise EnvError(f"alfworld: cannot load game {path}: {exc}") from exc
        self._walkthrough = list(state.get("policy_commands") or [])
        raw = state.feedback or ""
        m = _TASK_RE.search(raw)
        description = m.group(1).rstrip(".") if m else ""
        return _WELCOME_RE.sub("", raw).strip(), raw, _admissible(state), description

    def _step(self, action: str):
        """As verl-agent: the lower-cased action goes to the game. Only admissible commands reach it: ALFWorld's
        engine answers anything else "Nothing happens.", which is what this returns without a game call (no
        string can upset the engine). The no-op (an empty command) gets the same answer — what the reference's
        agent sees for an invalid step, whose response tail is sent to the game: nothing new is revealed (it used
        to run `look`). info["invalid"] is set; state and admissible actions stay as they were."""
        cmd = " ".join(action.strip().lower().split())
        if cmd not in self._admissible:  # "" is never admissible
            return NOTHING_HAPPENS, NOTHING_HAPPENS, list(self._admissible), False, True, {}
        with TEXTWORLD_LOCK:
            state, _score, done = self._tw_env.step(cmd)
        raw = state.feedback or ""
        return raw.strip() or NOTHING_HAPPENS, raw, _admissible(state), bool(state.get("won")), False, {
            "done": bool(done)}


def _admissible(state) -> list[str]:
    # like verl-agent: "help" is admissible in ALFWorld but never useful
    return [a for a in (state.get("admissible_commands") or []) if a != "help"]
