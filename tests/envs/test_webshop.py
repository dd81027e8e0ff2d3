"""WebShop client: a clear error for an unreachable server, and a full episode against a small local server that
speaks the AgentGym agentenv-webshop HTTP protocol (a one-product shop) (quick)."""
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from opid_mega.envs import make_env
from opid_mega.envs.base import EnvError

INSTRUCTION = "i need a red cotton t-shirt in size large, and price lower than 30.00 dollars"


class _Shop:
    """Pages: search -> results -> item (size options) -> done. Reward 1.0 for the red shirt in size large."""

    def __init__(self):
        self.page, self.size, self.done = "search", None, False

    def observation(self):
        head = f"WebShop [SEP] Instruction: [SEP] {INSTRUCTION} [SEP] "
        if self.page == "search":
            return head + "Search"
        if self.page == "results":
            return head + ("Back to Search [SEP] Page 1 (Total results: 2) [SEP] Next > [SEP] B0RED [SEP] Red "
                           "Cotton T-Shirt [SEP] $19.99 [SEP] B0BLUE [SEP] Blue Polo [SEP] $25.00")
        return head + "Back to Search [SEP] < Prev [SEP] size [SEP] small [SEP] large [SEP] Red Cotton T-Shirt " \
                      "[SEP] Price: $19.99 [SEP] Buy Now"

    def actions(self):
        if self.page == "search":
            return {"has_search_bar": True, "clickables": ["search"]}
        if self.page == "results":
            return {"has_search_bar": False, "clickables": ["back to search", "next >", "b0red", "b0blue"]}
        return {"has_search_bar": False, "clickables": ["back to search", "< prev", "small", "large", "buy now"]}

    def step(self, action):
        reward = 0.0
        if action.startswith("search[") and self.page == "search":
            self.page = "results"
        elif action == "click[back to search]":
            self.page = "search"
        elif action == "click[b0red]" and self.page == "results":
            self.page = "item"
        elif action in ("click[small]", "click[large]") and self.page == "item":
            self.size = action[6:-1]
        elif action == "click[buy now]" and self.page == "item":
            self.done = True
            reward = 1.0 if self.size == "large" else 0.5
            return "Thank you for shopping with us! [SEP] Your score (min 0.0, max 1.0) [SEP] %.1f" % reward, \
                reward, True
        return self.observation(), reward, False


class _Handler(BaseHTTPRequestHandler):
    shops: dict = {}
    received: list = []  # every action POSTed to /step

    def log_message(self, *args):
        pass

    def _send(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        url = urlparse(self.path)
        q = parse_qs(url.query)
        if url.path == "/":
            return self._send("ok")
        shop = self.shops[int(q["env_idx"][0])]
        if url.path == "/available_actions":
            return self._send(shop.actions())
        if url.path == "/instruction_text":
            return self._send(f"Instruction: {INSTRUCTION}")
        if url.path == "/observation":
            return self._send(shop.observation())
        self.send_error(404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
        if self.path == "/create":
            idx = len(self.shops)
            self.shops[idx] = _Shop()
            return self._send(idx)
        if self.path == "/reset":
            if body.get("session_id", 0) >= 10_000:
                self.send_error(500, "goal index out of range")
                return
            self.shops[body["env_idx"]] = _Shop()
            return self._send([self.shops[body["env_idx"]].observation(), None])
        if self.path == "/step":
            self.received.append(body["action"])
            state, reward, done = self.shops[body["env_idx"]].step(body["action"])
            return self._send({"state": state, "reward": reward, "done": done, "info": None})
        if self.path == "/close":
            return self._send({"closed": self.shops.pop(body["env_idx"], None) is not None})
        self.send_error(404)


@pytest.fixture(scope="module")
def server_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _closed_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_unreachable_server_error_names_url():
    url = f"http://127.0.0.1:{_closed_port()}"
    env = make_env("webshop", url=url, timeout=5)
    with pytest.raises(EnvError, match=f"cannot reach the WebShop server at {url}"):
        env.reset(env.tasks("test", 1, seed=0)[0])
    with pytest.raises(EnvError, match=url):
        env.ping()


def test_episode_against_local_server(server_url):
    env = make_env("webshop", url=server_url)
    assert env.ping()
    task = env.tasks("train", 1, seed=0)[0]
    assert 500 <= task.data["session"] < 1500
    obs = env.reset(task)
    assert env.task_description == INSTRUCTION
    assert obs == "WebShop [SEP] Search"  # the instruction is stripped from the page (it is in the task line)
    assert env.admissible_actions == ["search[<your query>]"]
    prompt = env.build_prompt([], obs, history_length=2)
    assert INSTRUCTION in prompt.split("\n")[0]

    obs, reward, done, info = env.step("search[red cotton t-shirt]")
    assert "B0RED" in obs and not info["invalid"] and "click[b0red]" in info["admissible_actions"]
    obs, reward, done, info = env.step("click[b0green]")  # not on the page
    assert info["invalid"] and not done
    obs, reward, done, info = env.step(env.noop_action)  # the no-op keeps the page
    assert info["invalid"] and "B0RED" in obs
    for action in ["click[B0RED]", "Click[ large ]"]:  # normalised to WebShop's lower-case clickables
        obs, reward, done, info = env.step(action)
        assert not info["invalid"] and reward == 0.0
    obs, reward, done, info = env.step("click[buy now]")
    assert done and info["won"] and reward == 10.0 and info["task_score"] == 1.0
    env.close()


def test_partial_score_is_not_a_win(server_url):
    env = make_env("webshop", url=server_url)
    env.reset(env.tasks("test", 1, seed=0)[0])
    for action in ["search[shirt]", "click[b0red]", "click[small]"]:
        env.step(action)
    obs, reward, done, info = env.step("click[buy now]")
    assert done and not info["won"] and reward == 0.0 and info["task_score"] == 0.5
    env.close()


def test_server_error_is_clear(server_url):
    env = make_env("webshop", url=server_url, session_ranges={"train": (20_000, 20_001)})
    with pytest.raises(EnvError, match="HTTP 500"):
        env.reset(env.tasks("train", 1, seed=0)[0])


def test_invalid_rules_and_noop(server_url):
    """verl-agent's webshop_projection: the lower-cased <action> content; invalid without think tags or with
    Chinese characters (executed all the same); no action tag: the no-op, which keeps the page and sends nothing."""
    env = make_env("webshop", url=server_url)
    first = env.reset(env.tasks("train", 1, seed=0)[0])
    _Handler.received.clear()
    action, obs, reward, done, info = env.step_response("<think>browse</think> search for a shirt")
    assert action is None and info["format_invalid"] and info["invalid"] and obs == first
    assert _Handler.received == [] and info["step"] == 1
    action, obs, reward, done, info = env.step_response("<action>search[Red Shirt]</action>")  # no think tags
    assert action == "search[red shirt]" and info["format_invalid"] and not info["invalid"] and "B0RED" in obs
    action, obs, reward, done, info = env.step_response("<think>红色</think><action>click[B0RED]</action>")
    assert action == "click[b0red]" and info["format_invalid"] and "Buy Now" in obs
    action, obs, reward, done, info = env.step_response("<think>ok</think><action>click[large]</action>")
    assert action == "click[large]" and not info["format_invalid"] and not info["invalid"]
    assert _Handler.received == ["search[red shirt]", "click[b0red]", "click[large]"]
    env.close()


def test_fuzz_any_string_is_an_action(server_url):
    """Hypothesis-generated and known-nasty strings never raise or hang, and only well-formed actions (a printable
    search query of bounded length, a click on the page) reach the server."""
    from _env_fuzz import FUZZ, NASTY_ALL, RESPONSES, play_garbage
    from hypothesis import given

    from opid_mega.envs.webshop import MAX_QUERY_CHARS

    env = make_env("webshop", url=server_url, max_steps=100_000)
    task = env.tasks("train", 1, seed=0)[0]
    last: dict = {}
    _Handler.received.clear()

    @FUZZ
    @given(RESPONSES)
    def check(text):
        for before, admissible, action, obs, reward, done, info in play_garbage(env, task, text, last):
            a = action.strip()
            if not (a.lower().startswith(("search[", "click[")) and a.endswith("]")):
                assert info["invalid"] and obs == before and not done

    check()
    for text in NASTY_ALL:
        play_garbage(env, task, text, last)
    assert _Handler.received  # hypothesis found well-formed searches too
    for sent in _Handler.received:
        kind, arg = sent[:-1].split("[", 1)
        assert kind in ("search", "click") and arg and arg.isprintable() and len(arg) <= MAX_QUERY_CHARS
    env.close()
