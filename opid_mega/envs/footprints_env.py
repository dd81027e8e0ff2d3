"""Footprints: a pure-Python text game with ONE critical decision whose credit the outcome reward misassigns (the
task family of the mechanism experiment: docs/experiments.md "Building blocks of the mechanism experiment").

Every game is built from its seed alone (`make_game(seed)`, the same in every process):

    porch -> (0 or 1 corridor, 50%) -> hall with 5 coloured doors -> the right door: vault / a wrong door: closet

  * the hall shows a distractor (the rug's colour, one of the five door colours, drawn independently of the right
    door) and the cue "Fresh footprints lead to the <right> door.";
  * the right door leads to the vault, where `take coin` wins (`success_reward`, 10.0);
  * a wrong door leads to a closet that locks: its wall reveals the right door ("Scratched into the wall: The coin is
    behind the <right> door."), information that arrives after the decision, for a hindsight analyzer. A wrong door
    is always fatal;
  * 25% of games are "robbed": the right door, but the chest is empty and `take coin` cannot win. Exactly one seed
    of each block of 4 (0-3, 4-7, ...) is robbed, which one drawn per block, so every default pool is exactly 25%
    robbed (a per-game coin would have left the 48 training games at 12 +- 3). The vault reads the same either way;
    only `take coin` tells;
  * step budget: the expert's length + 1 (4 or 5 steps: `go <dir>` once or twice, `open <colour> door`,
    `take coin`). The game ends on a win, at its budget, or on the step after the game was lost (the closet entered,
    the chest found empty), so the observation that shows the loss is the one the next step acts on and is part of
    the trajectory the analyzer reads. `env.max_steps` (config) is an outer cap on top of the budget.

Routine steps: the exits' directions (north, east or west) are drawn per game; `go <back>` returns to the previous
room (a wasted pair of steps), `look` re-describes the room and `examine rug` describes the rug (a wasted step).
Admissible actions are listed sorted. Anything not admissible (garbage, the no-op "", a door in the porch) is
answered "Nothing happens." (ALFWorld's answer), changes nothing, is flagged invalid and counts toward the budget.

`info["first_door_correct"]`: None until a door was opened, then True (the right door) or False (a wrong one).

Task pools (option `pool_size`, like TextWorld's: an int for every split or a dict {train, valid, test}): train 48
games (seeds 0..), valid 64 (seeds 100000..), test 256 (seeds 200000..: the held-out pool); splits never share a
seed. Prompts: the ALFWorld-style action template of opid_mega.envs.prompts (family "footprints": its own intro
line; under env.template=reference the first observation ends with the task line, as ALFWorld's does).
"""
from __future__ import annotations

import dataclasses
import random
import re
from typing import Optional

from opid_mega.envs.base import Env, EnvError, Task, sample_pool

VERSION = "footprints-v1"  # part of every task's data and of the seed -> game map; bump when games change
COLOURS = ("red", "blue", "green", "yellow", "white", "black", "purple", "orange")
N_DOORS = 5
DIRECTIONS = ("north", "east", "west")
_OPPOSITE = {"north": "south", "east": "west", "west": "east"}
SPLIT_SEED_OFFSET = {"train": 0, "valid": 100_000, "test": 200_000}
DEFAULT_POOL_SIZE = {"train": 48, "valid": 64, "test": 256}
MAX_POOL_SIZE = 100_000  # the seed distance between splits: larger pools would share seeds
TASK_DESCRIPTION = "find the gold coin and take it."
NOTHING_HAPPENS = "Nothing happens."

# Text the hindsight analyzer reads (opid_mega.skills.hindsight): each pattern's group 1 is a colour.
CUE_RE = re.compile(r"Fresh footprints lead to the (\w+) door\.")
CLOSET_ENTRY_RE = re.compile(r"-= Closet =-\nThe (\w+) door slams shut behind you and locks\.")
REVEAL_RE = re.compile(r"Scratched into the wall: The coin is behind the (\w+) door\.")
VAULT_ENTRY_RE = re.compile(r"-= Vault =-\nYou step through the (\w+) door into a small vault\.")
EMPTY_CHEST = "You open the chest: it is empty. Someone took the coin before you."
WON_TEXT = "You open the chest and take the gold coin. You won!"


@dataclasses.dataclass(frozen=True)
class Game:
    """One game, a function of its seed (`make_game`)."""

    seed: int
    doors: tuple  # the five door colours, in the order the hall lists them
    right: str  # the door to the vault
    rug: str  # the distractor: one of `doors`, independent of `right`
    robbed: bool
    moves: tuple  # the directions from the porch to the hall (1 or 2: with a corridor, 2)

    @property
    def walkthrough(self) -> list:
        return [f"go {d}" for d in self.moves] + [f"open {self.right} door", "take coin"]

    @property
    def budget(self) -> int:
        """The step budget: the expert's length + 1."""
        return len(self.walkthrough) + 1

    @property
    def door_step(self) -> int:
        """The 0-based index of the expert's door step."""
        return len(self.moves)


def make_game(seed: int) -> Game:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"footprints: a game seed is an int >= 0, got {seed!r}")
    rng = random.Random(f"{VERSION}/{seed}")  # str seeds hash with SHA-512: the same in every process
    doors = tuple(rng.sample(COLOURS, N_DOORS))
    right = rng.choice(doors)
    rug = rng.choice(doors)
    # exactly one game in each block of 4 consecutive seeds is robbed (which one: drawn from the block's number), so
    # every pool of 4k seeds from a multiple of 4 (all default pools) holds exactly 25% robbed games
    robbed = seed % 4 == random.Random(f"{VERSION}/robbed/{seed // 4}").randrange(4)
    moves = (rng.choice(DIRECTIONS),)
    if rng.random() < 0.5:  # a corridor; its exit never doubles back (the corridor's two exits differ)
        moves += (rng.choice([d for d in DIRECTIONS if d != _OPPOSITE[moves[0]]]),)
    return Game(seed=seed, doors=doors, right=right, rug=rug, robbed=robbed, moves=moves)


def _pool_sizes(pool_size) -> dict:
    sizes = dict(DEFAULT_POOL_SIZE)
    if pool_size is None:
        return sizes
    if isinstance(pool_size, dict):
        items = pool_size.items()
    elif isinstance(pool_size, int) and not isinstance(pool_size, bool):
        items = [(split, pool_size) for split in sizes]
    else:
        raise ValueError(f"footprints: pool_size must be an int or a mapping {{train, valid, test}} of ints, got "
                         f"{pool_size!r}")
    for split, n in items:
        if split not in SPLIT_SEED_OFFSET:
            raise ValueError(f"footprints: pool_size.{split}: not a split; allowed: {', '.join(SPLIT_SEED_OFFSET)}")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_POOL_SIZE:
            raise ValueError(f"footprints: pool_size.{split} must be an int in 1..{MAX_POOL_SIZE}, got {n!r}")
        sizes[split] = n
    return sizes


def _join(colours) -> str:
    return ", ".join(colours[:-1]) + " and " + colours[-1]


class FootprintsEnv(Env):
    name = "footprints"
    family = "action"
    default_max_steps = 5  # the largest step budget (a game with a corridor: 4 expert steps + 1)
    default_success_reward = 10.0
    noop_action = ""  # never admissible: "Nothing happens."
    info_metrics = ("first_door_correct",)  # reported as train/ and eval/first_door_correct (None counts as False)

    def __init__(self, pool_size=None, max_steps: Optional[int] = None, success_reward: Optional[float] = None,
                 template: str = "reference"):
        super().__init__(max_steps=max_steps, success_reward=success_reward)
        from opid_mega.envs.prompts import TEMPLATES

        if template not in TEMPLATES:
            raise ValueError(f"footprints: template must be one of {', '.join(TEMPLATES)}, got {template!r}")
        self.prompt_template = template
        self.pool_size = _pool_sizes(pool_size)
        self._game: Optional[Game] = None
        self._room = ""
        self._lost = False  # a wrong door was opened or the chest was found empty: the next step ends the game
        self._first_door_correct: Optional[bool] = None
        self._opened = ""  # the wrong door that led into the closet

    # ---- tasks --------------------------------------------------------------------------------------------------
    def task_pool(self, split: str) -> list:
        if split not in SPLIT_SEED_OFFSET:
            raise ValueError(f"footprints: unknown split {split!r}; expected one of {sorted(SPLIT_SEED_OFFSET)}")
        offset = SPLIT_SEED_OFFSET[split]
        return [Task(id=f"footprints/{split}-{offset + k}", split=split, env=self.name,
                     data={"seed": offset + k, "version": VERSION}) for k in range(self.pool_size[split])]

    def tasks(self, split: str, n: int, seed: int = 0) -> list:
        return sample_pool(self.task_pool(split), n, seed)

    @property
    def game(self) -> Optional[Game]:
        return self._game

    def walkthrough(self) -> Optional[list]:
        return None if self._game is None else self._game.walkthrough

    def decision_options(self) -> list:
        """The actions of the game's one critical decision while the agent faces it (the five doors, in the hall),
        else [] (opid-sft's sft.blind_decision)."""
        if self._game is None or self._room != "hall":
            return []
        return [f"open {c} door" for c in self._game.doors]

    # ---- text ---------------------------------------------------------------------------------------------------
    def _describe(self, room: str) -> str:
        g = self._game
        if room == "porch":
            return (f"-= Porch =-\nYou are on the porch of an old house. An open doorway leads {g.moves[0]}.")
        if room == "corridor":
            return (f"-= Corridor =-\nYou are in a narrow corridor lined with portraits. It goes on {g.moves[1]}; "
                    f"the porch is back {_OPPOSITE[g.moves[0]]}.")
        if room == "hall":
            back = "corridor" if len(g.moves) == 2 else "porch"
            return (f"-= Hall =-\nYou are in a dim hall. A {g.rug} rug lies on the floor. Five doors lead off the "
                    f"hall: {_join(g.doors)}. Fresh footprints lead to the {g.right} door. The {back} is back "
                    f"{_OPPOSITE[g.moves[-1]]}.")
        if room == "vault":
            return (f"-= Vault =-\nYou step through the {g.right} door into a small vault. An iron chest stands in "
                    "the corner.")
        raise AssertionError(room)

    def _admissible_in(self, room: str) -> list:
        g = self._game
        if room == "porch":
            acts = [f"go {g.moves[0]}"]
        elif room == "corridor":
            acts = [f"go {g.moves[1]}", f"go {_OPPOSITE[g.moves[0]]}"]
        elif room == "hall":
            acts = [f"go {_OPPOSITE[g.moves[-1]]}", "examine rug"] + [f"open {c} door" for c in g.doors]
        elif room == "vault":
            acts = ["take coin"]
        else:  # the closet
            acts = []
        return sorted(acts + ["look"])

    # ---- episode ------------------------------------------------------------------------------------------------
    def _reset(self, task: Task):
        data = task.data or {}
        if data.get("version") != VERSION or "seed" not in data:
            raise EnvError(f"footprints: task {task.id} is not a {VERSION} task (data {data!r}); build tasks with "
                           "this env's tasks()")
        try:
            self._game = make_game(data["seed"])
        except ValueError as exc:
            raise EnvError(f"footprints: task {task.id}: {exc}") from None
        self._room, self._lost, self._first_door_correct, self._opened = "porch", False, None, ""
        obs = self._describe("porch")
        if self.prompt_template == "reference":  # as ALFWorld's first observation: it ends with the task line
            from opid_mega.envs.prompts import first_observation_task_line

            obs = f"{obs}\n\n{first_observation_task_line(TASK_DESCRIPTION)}"
        return obs, obs, self._admissible_in("porch"), TASK_DESCRIPTION

    def _step(self, action: str):
        g = self._game
        cmd = " ".join(action.strip().lower().split())
        admissible = self._admissible_in(self._room)
        ends = self._lost  # the step after the loss showed ends the game, whatever it does
        if cmd not in admissible:  # "" and garbage included
            obs, invalid, won = NOTHING_HAPPENS, True, False
        else:
            obs, invalid, won = self._act(cmd), False, cmd == "take coin" and not g.robbed
        # truncated: the step count reached the game's budget (or env.max_steps) without a win, whatever else ended it
        out_of_steps = not won and self.steps + 1 >= min(g.budget, self.max_steps)
        extra = {"first_door_correct": self._first_door_correct, "truncated": out_of_steps}
        if not won and (ends or out_of_steps):
            extra["done"] = True
        return obs, obs, self._admissible_in(self._room), won, invalid, extra

    def _act(self, cmd: str) -> str:
        """Carry out an admissible command; returns the observation."""
        g = self._game
        if cmd == "look":
            if self._room == "closet":
                return self._closet_text()
            return self._describe(self._room)
        if cmd == "examine rug":
            return f"It is a {g.rug} rug, worn thin by many feet."
        if cmd.startswith("go "):
            forward = {"porch": (g.moves[0], "corridor" if len(g.moves) == 2 else "hall"),
                       "corridor": (g.moves[-1], "hall")}
            back = {"corridor": "porch", "hall": "corridor" if len(g.moves) == 2 else "porch"}
            if self._room in forward and cmd == f"go {forward[self._room][0]}":
                self._room = forward[self._room][1]
            else:
                self._room = back[self._room]
            return self._describe(self._room)
        if cmd.startswith("open "):
            colour = cmd.split()[1]
            self._first_door_correct = colour == g.right
            if colour == g.right:
                self._room = "vault"
                return self._describe("vault")
            self._room, self._lost, self._opened = "closet", True, colour
            return self._closet_text()
        if cmd == "take coin":
            if g.robbed:
                self._lost = True
                return EMPTY_CHEST
            return WON_TEXT
        raise AssertionError(cmd)

    def _closet_text(self) -> str:
        return (f"-= Closet =-\nThe {self._opened} door slams shut behind you and locks. You are in a cramped, "
                f"empty closet: the game is lost. Scratched into the wall: The coin is behind the "
                f"{self._game.right} door.")
