"""Plug-ins by import path (docs/custom_env.md): env.name / analyzer.backend = "package.module:Class", checked when the
config is loaded (one line naming the key), env.options against the constructor, and opid-train one iteration on the
docs' example env and analyzer, defined outside the package and put on PYTHONPATH."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from opid_mega import config as C

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_CFG = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
DOC = os.path.join(ROOT, "docs", "custom_env.md")


def doc_module(name: str) -> str:
    """The ```python block of docs/custom_env.md whose first line is `# <name>.py...`."""
    blocks = re.findall(r"```python\n(.*?)```", open(DOC, encoding="utf-8").read(), re.DOTALL)
    found = [b for b in blocks if b.startswith(f"# {name}.py")]
    assert len(found) == 1, f"docs/custom_env.md has no (single) {name}.py block"
    return found[0]


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """A directory outside the package with the docs' guess_env.py / guess_analyzer.py and a few broken modules,
    on sys.path of this process."""
    d = tmp_path / "plugins"
    d.mkdir()
    (d / "guess_env.py").write_text(doc_module("guess_env"))
    (d / "guess_analyzer.py").write_text(doc_module("guess_analyzer"))
    (d / "plug_misc.py").write_text(textwrap.dedent("""
        from opid_mega.envs import Env
        from opid_mega.skills import Analyzer

        def helper():
            pass

        class NotAnEnv:
            pass

        class Bare(Env):  # no prompt template of its own, no built-in family name
            name = "bare"

        class Needs(Env):
            name = "textworld"

            def __init__(self, level, max_steps=None):
                super().__init__(max_steps=max_steps)

        class Anything(Env):
            name = "textworld"

            def __init__(self, **kwargs):
                super().__init__()

        class Half(Analyzer):  # analyze not implemented
            pass
    """))
    (d / "plug_broken.py").write_text("def oops(:\n")
    (d / "plug_raises.py").write_text("raise RuntimeError('no licence file')\n")
    monkeypatch.syspath_prepend(str(d))
    for m in ("guess_env", "guess_analyzer", "plug_misc", "plug_broken", "plug_raises"):
        sys.modules.pop(m, None)
    return d


def _error(*overrides) -> str:
    with pytest.raises(C.ConfigError) as e:
        C.load_config(TINY_CFG, list(overrides))
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 400, msg
    return msg


def test_bad_import_paths_are_one_line_naming_the_key(plugin_dir):
    assert _error("env.name=mypkg.envs:Foo") == "env.name: cannot import 'mypkg.envs:Foo': No module named 'mypkg'"
    assert _error("env.name=guess_env:Foo") == \
        "env.name: cannot import 'guess_env:Foo': module 'guess_env' has no attribute 'Foo'"
    assert _error("env.name=plug_misc:NotAnEnv") == "env.name: 'plug_misc:NotAnEnv' is not a subclass of " \
                                                    "opid_mega.envs.Env"
    assert _error("env.name=plug_misc:helper").startswith("env.name: 'plug_misc:helper' is a function, not a class")
    assert _error("env.name=plug_broken:X").startswith("env.name: cannot import 'plug_broken:X': SyntaxError: ")
    assert _error("env.name=plug_raises:X") == \
        "env.name: cannot import 'plug_raises:X': RuntimeError: no licence file"
    assert _error("env.name=plug_misc:Bare").startswith("env.name: plug_misc:Bare: its name 'bare' is no prompt "
                                                        "family")
    assert _error("env.name=a b:C").startswith("env.name: 'a b:C' is not an import path")
    assert _error("env.name=nonsense").startswith("env.name: got 'nonsense', allowed: one of 'textworld', ")
    # the analyzer key, the same way
    assert _error("analyzer.backend=mypkg.an:A") == \
        "analyzer.backend: cannot import 'mypkg.an:A': No module named 'mypkg'"
    assert _error("analyzer.backend=guess_env:GuessEnv") == \
        "analyzer.backend: 'guess_env:GuessEnv' is not a subclass of opid_mega.skills.Analyzer"
    assert _error("analyzer.backend=plug_misc:Half") == "analyzer.backend: 'plug_misc:Half' is abstract (implement " \
                                                        "analyze)"
    assert _error("analyzer.backend=gpt").startswith("analyzer.backend: got 'gpt', allowed: 'rules', 'llm' or ")
    assert _error("analyzer.options.x=1").startswith("analyzer.options: got {'x': 1} with analyzer.backend=rules")


def test_env_options_are_checked_against_the_constructor(plugin_dir):
    g = "env.name=guess_env:GuessEnv"
    assert _error(g, "env.options.sizes=4") == ("env.options.sizes: not an option of guess_env:GuessEnv; accepted: "
                                                "process, size, success_reward, tasks_per_split")
    assert _error(g, "env.options.max_steps=4") == "env.options.max_steps: set by env.max_steps, not in env.options"
    assert _error(g, "env.options.template=ours").startswith("env.options.template: set by env.template")
    assert _error(g, "env.options.process=3") == "env.options.process: got 3, allowed: true or false"
    # a worker process has options of its own; in-process they are not options
    assert _error(g, "env.options.timeout=5").startswith("env.options.timeout: not an option of guess_env:GuessEnv")
    C.load_config(TINY_CFG, [g, "env.options.process=true", "env.options.timeout=5"])
    assert _error("env.name=plug_misc:Needs") == "env.options: plug_misc:Needs needs option level"
    cfg = C.load_config(TINY_CFG, ["env.name=plug_misc:Anything", "env.options.whatever=[1, 2]"])  # **kwargs
    assert cfg.env.options == {"whatever": [1, 2]}
    # the built-in envs too (before: a TypeError after the warm start and the model were built)
    assert _error("env.options.bogus=1").startswith("env.options.bogus: not an option of textworld; accepted: "
                                                    "admissible_only, cache_dir, challenges, ")
    assert _error("env.name=search_qa", "env.options.topk=2", "env.options.top_k=2").startswith(
        "env.options.top_k: not an option of search_qa; accepted: corpus_path, process, qa_path, success_reward, "
        "topk")


def test_options_belong_to_one_class(plugin_dir, tmp_path):
    """Changing env.name drops the earlier layer's env.options (file over base, overrides over file)."""
    cfg = C.load_config(TINY_CFG, ["env.name=guess_env:GuessEnv", "env.options.size=4"])
    assert cfg.env.options == {"size": 4}
    cfg = C.load_config(TINY_CFG, ["env.name=textworld", "env.options.pool_size.train=3"])  # same class: merged
    assert cfg.env.options["challenges"] == ["coin_collector"] and cfg.env.options["pool_size"]["train"] == 3
    f = tmp_path / "guess.yaml"
    f.write_text(f"base: {TINY_CFG}\nenv:\n  name: guess_env:GuessEnv\n  options: {{size: 5}}\n")
    cfg = C.load_config(str(f))
    assert cfg.env.options == {"size": 5} and cfg.env.history_length == 2  # the rest of the base stays


def test_plugin_env_and_analyzer_are_built(plugin_dir, tmp_path):
    from opid_mega.envs import env_factory, make_env
    from opid_mega.rollout.launch import build_analyzer

    cfg = C.load_config(TINY_CFG, ["env.name=guess_env:GuessEnv", "env.options.size=4", "env.max_steps=3",
                                   "analyzer.backend=guess_analyzer:BisectAnalyzer",
                                   "analyzer.options.advice=halve it", "analyzer.max_step_skills=1"])
    env = env_factory(cfg.env)()
    assert type(env).__name__ == "GuessEnv" and env.size == 4 and env.max_steps == 3
    task = env.tasks("train", 1, seed=0)[0]
    obs = env.reset(task)
    prompt = env.build_prompt([], obs, cfg.env.history_length)
    assert "Your task is to: find the hidden number between 1 and 4" in prompt and "Now it's your turn to" in prompt
    action, o, r, done, info = env.step_response("<think>x</think><action>guess 9</action>")
    assert info["invalid"] and not done and r == 0.0
    for a in env.walkthrough():
        o, r, done, info = env.step(a)
    assert done and info["won"] and r == 10.0
    with pytest.raises(ValueError, match="size must be >= 2"):
        make_env("guess_env:GuessEnv", size=1)

    analyzer, server = build_analyzer(cfg, audit=None, run_dir=tmp_path)
    assert server is None and type(analyzer).__name__ == "BisectAnalyzer"
    assert analyzer.advice == "halve it" and analyzer.max_step_skills == 1  # analyzer.max_step_skills passed
    from opid_mega.skills import StepView, TrajectoryView

    views = [TrajectoryView(task="find it", won=False, traj_id="t0",
                            steps=[StepView("o", "no tags", 0.0, None, False), StepView("o", "r", 0.0, "guess 2")]),
             TrajectoryView(task="find it", won=True, traj_id="t1", steps=[])]
    out = analyzer.submit(views, iteration=3).result(timeout=30)
    assert out[1] is None and out[0].episode_skill == "To find it: halve it; every answer halves the range."
    assert list(out[0].step_skills) == [0]
    analyzer.close()


def test_plugin_env_in_a_worker_process(plugin_dir):
    """env.options.process=true: the worker imports the plug-in module itself (from the parent's sys.path)."""
    from opid_mega.envs import make_env

    env = make_env("guess_env:GuessEnv", process=True, start_method="spawn", max_steps=2, size=3, timeout=120)
    try:
        assert type(env).__name__ == "ProcessEnv" and env.max_steps == 2 and env.name == "guess"
        task = env.tasks("test", 1, seed=1)[0]
        assert env.reset(task).startswith("I am thinking of a number between 1 and 3")
        obs, r, done, info = env.step("guess 7")
        assert info["invalid"] and not done
    finally:
        env.close()


def _tiny_overrides() -> list:
    import importlib.util

    spec = importlib.util.spec_from_file_location("_trainer_conftest",
                                                  os.path.join(ROOT, "tests", "trainer", "conftest.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return list(mod.TINY)


@pytest.mark.slow
def test_opid_train_one_iteration_on_an_out_of_tree_env(tmp_path):
    """The acceptance run: `opid-train` on the docs' guess_env / guess_analyzer, written outside the package and put
    on PYTHONPATH; one iteration; its metrics and the plug-in analyzer's skills in the prompts the scorer saw."""
    d = tmp_path / "mine"
    d.mkdir()
    (d / "guess_env.py").write_text(doc_module("guess_env"))
    (d / "guess_analyzer.py").write_text(doc_module("guess_analyzer"))
    run = tmp_path / "run"
    exe = shutil.which("opid-train")
    cmd = ([exe] if exe else [sys.executable, "-m", "opid_mega.cli"]) + [
        "--config", TINY_CFG, "--run-dir", str(run)] + _tiny_overrides() + [
        "env.name=guess_env:GuessEnv", "env.options.size=4", "analyzer.backend=guess_analyzer:BisectAnalyzer",
        "analyzer.options.advice=halve the range"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(d)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
           "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "2"}
    r = subprocess.run(cmd, env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert 1 in [m.get("step") for m in recs], recs
    saved = (run / "config.yaml").read_text()
    assert "name: guess_env:GuessEnv" in saved and "advice: halve the range" in saved
    audit = [json.loads(line) for line in (run / "audit.jsonl").read_text().splitlines() if line.strip()]
    analyses = [a for a in audit if a["type"] == "analysis"]
    assert analyses and all(a.get("analyzer") == "BisectAnalyzer" for a in analyses)
    assert any("halve the range" in json.dumps(a.get("analysis")) for a in analyses)
    # the scorer's skill contexts carry this analyzer's skills (critical-first routing: a step skill where there is
    # one, else the episode skill) inside the plug-in's own prompts
    skills = {s for a in analyses for s in [a["analysis"]["episode_skill"], *a["analysis"]["step_skills"].values()]}
    augmented = [a for a in audit if a["type"] == "augmented_prompt"]
    assert augmented and all(a["skill"] in skills and a["skill"] in a["prompt"] for a in augmented)
    assert all("Your task is to: find the hidden number between 1 and 4" in a["prompt"] for a in augmented)


def test_opid_train_exits_2_on_a_bad_option(plugin_dir, capsys, monkeypatch):
    """One line, exit 2, before the run directory or anything else is made."""
    from opid_mega import cli

    monkeypatch.setattr(cli, "quiet", lambda: None)
    run = plugin_dir / "never-created"
    for overrides, line in (
            (["env.name=guess_env:GuessEnv", "env.options.sizes=4"],
             "config error: env.options.sizes: not an option of guess_env:GuessEnv; accepted: process, size, "
             "success_reward, tasks_per_split"),
            (["env.name=mypkg.envs:Foo"], "config error: env.name: cannot import 'mypkg.envs:Foo': No module named "
                                          "'mypkg'")):
        assert cli.train_main(["--config", TINY_CFG, "--run-dir", str(run)] + overrides) == 2
        out, err = capsys.readouterr()
        assert err.strip().splitlines() == [line] and not run.exists()


def test_a_run_of_a_plugin_read_back_without_the_plugin(plugin_dir, tmp_path):
    """Resuming needs the plug-in (one line when it is gone); opid-export reads the config without importing it."""
    from opid_mega import rundir
    from opid_mega.export import ExportError, plan_export

    cfg = C.load_config(TINY_CFG, ["env.name=guess_env:GuessEnv", "env.options.size=4"])
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(C.dump_config(cfg).replace("guess_env:GuessEnv", "gone_env:GuessEnv"))
    with pytest.raises(rundir.RunDirError) as e:
        rundir.read_saved_config(run)
    assert str(e.value).endswith("env.name: cannot import 'gone_env:GuessEnv': No module named 'gone_env'")
    assert rundir.read_saved_config(run, plugins=False).env.options == {"size": 4}
    with pytest.raises(ExportError, match="checkpoint"):  # got past the config: no checkpoint in this run
        plan_export(run)


def test_the_warm_start_key_follows_the_plugin_source(plugin_dir, tmp_path):
    """model.init_from=sft with a plug-in env: the opid-sft cache key hashes the module's source (no built-in
    template to fingerprint), so editing the env's prompts builds a new warm start."""
    from opid_mega.sft import sft_key

    cfg = C.load_config(TINY_CFG, ["env.name=guess_env:GuessEnv", "env.options.size=4"])
    key = sft_key(cfg, str(tmp_path), {})
    assert key == sft_key(cfg, str(tmp_path), {})
    (plugin_dir / "guess_env.py").write_text(doc_module("guess_env").replace("number-guessing game", "guessing game"))
    assert sft_key(cfg, str(tmp_path), {}) != key
