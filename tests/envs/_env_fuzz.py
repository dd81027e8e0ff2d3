"""Garbage actions for the env fuzz tests: the specific nasty strings (MACHINE_NOTES.md: jericho hangs on control
characters and raises on a multi-byte character cut at 198 bytes) and a hypothesis strategy for any string."""
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from opid_mega.envs.base import step_with_timeout

STEP_LIMIT_S = 20.0  # a fuzz step that takes longer than this is a hang: the test fails instead of stalling

NASTY = [
    "",
    " ",
    "\n\n\n",
    "\x00\x01\x02",
    "look\x00",
    "go east\x1b[2J",
    "\t\r\x0b\x0c",
    "x" * 10_000,
    "é" * 5_000,  # 10 kB of 2-byte characters
    "a" + "é" * 150,  # UTF-8 byte 198 falls inside a character (jericho: UnicodeDecodeError)
    "中文动作" * 60,
    "🙂" * 60,
    "\ud800",  # a lone surrogate: not even encodable as UTF-8
    "\u202e\u200b\ufeff",
    "restore",
    "quit",
    "restart",
    "save",
    "undo",
    "script",
    "<action></action>",
    "search[]",
    "click[]",
    "search[\x00]",
    "click[\n]",
    "<search></search>",
]


def wrapped(text: str) -> list[str]:
    """`text` as a bare action and inside every tag a policy might put it in."""
    return [text, f"<think>t</think><action>{text}</action>", f"<think>t</think><search>{text}</search>",
            f"<answer>{text}</answer>", f"search[{text}]", f"click[{text}]", f"<action>{text}"]


NASTY_ALL = [w for s in NASTY for w in wrapped(s)]

ANY_TEXT = st.text(alphabet=st.characters(exclude_categories=()), max_size=400)  # controls and surrogates too
RESPONSES = st.one_of(ANY_TEXT, ANY_TEXT.flatmap(lambda s: st.sampled_from(wrapped(s))), st.sampled_from(NASTY_ALL))

FUZZ = settings(max_examples=60, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])


def play_garbage(env, task, text: str, last: dict):
    """What the agent loop does with a response `text` (project, then step the action or the no-op), and the raw
    string as an action too; each step under STEP_LIMIT_S. Resets when an episode ends. `last["obs"]` carries the
    current observation between calls. Returns (observation before, admissible actions before, action, obs, reward,
    done, info) per step."""
    out = []
    action, valid = env.project_action(text)
    assert isinstance(valid, bool) and (action is None or isinstance(action, str))
    for a in (env.noop_action if action is None else action, text):
        if env.done or "obs" not in last:
            last["obs"] = env.reset(task)
        before, admissible = last["obs"], env.admissible_actions
        obs, reward, done, info = step_with_timeout(env, a, STEP_LIMIT_S)
        assert isinstance(obs, str) and isinstance(reward, float) and isinstance(done, bool)
        assert isinstance(info["invalid"], bool) and isinstance(info["admissible_actions"], list)
        last["obs"] = obs
        out.append((before, admissible, a, obs, reward, done, info))
    return out
