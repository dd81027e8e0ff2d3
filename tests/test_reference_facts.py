"""OPID.md "More reference facts" (issue 26, acceptance item 1): the facts whose DEFAULTS no other test pinned.

Each expected value is written by hand from the fact named in the comment, never read from our own code; a default
that is ours instead of the reference's must be a row of docs/algorithm.md's deviations table with its switch. The
other facts are tested where their code is (the table in docs/algorithm.md, "Where each fact is tested"). Pure
Python; the ALFWorld test plays one offline generated game (a few seconds)."""
import glob
import importlib.util
import os
import re
import sys

import pytest

from opid_mega.config import analyzer_response_format, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPER_CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "qwen*.yaml")))
DOCS = os.path.join(ROOT, "docs", "algorithm.md")


def _reference_defaults(cfg, where):
    a = cfg.analyzer
    # Analyzer sampling: "the temperature is left to the server's default" (not sent: null); "no JSON response
    # format is requested"
    assert a.temperature is None, where
    assert analyzer_response_format(a) == "none", where
    # Retries: "5 attempts in all" = the first one + 4 retries
    assert 1 + a.max_retries == 5, where
    # Parser edge cases: the reference's rules ("null" -> "None", last duplicate wins, int() keys, str() skill,
    # python-literal fallback only without any JSON object)
    assert a.parser == "reference", where
    # Environment templates: the reference's (ALFWorld step 0 without history and task line, "\n " joins, WebShop /
    # Search closings of their own)
    assert cfg.env.template == "reference", where
    # Loss aggregation: "Mini-batches are not shuffled"
    assert cfg.train.shuffle_minibatches is False, where


def test_code_defaults_are_the_references():
    _reference_defaults(load_config(None), "code default")


@pytest.mark.parametrize("path", PAPER_CONFIGS, ids=[os.path.basename(p)[:-5] for p in PAPER_CONFIGS])
def test_paper_configs_keep_the_references_analyzer_templates_and_order(path):
    cfg = load_config(path)
    _reference_defaults(cfg, path)
    # Loss aggregation: token mean per micro-batch (the reference's aggregation); validation before training only in
    # the Qwen3 Search-QA script
    before = os.path.basename(path).startswith("qwen3") and "search_qa" in path  # Qwen3 Search validates first
    assert (cfg.algo.loss_agg, cfg.eval.before_training) == ("token-mean-micro", before), path


def _deviation_rows() -> list[str]:
    text = open(DOCS, encoding="utf-8").read()
    section = text.split("## Deviations from the reference code", 1)[1].split("\n## ", 1)[0]
    return [ln for ln in section.splitlines() if ln.startswith("| ") and not ln.startswith("| what")]


def test_code_defaults_that_are_ours_are_deviation_rows():
    """Two code defaults (used by the CPU configs) are ours, not the reference's: one token mean over the whole
    mini-batch (reference: per micro-batch, then averaged) and an evaluation before training (reference: none).
    Each must be a row of the deviations table that names its switch."""
    cfg = load_config(None)
    assert cfg.algo.loss_agg == "token-mean" and cfg.eval.before_training is True
    rows = _deviation_rows()
    assert any("`algo.loss_agg=token-mean-micro`" in r for r in rows)
    assert any("`eval.before_training" in r for r in rows)


def _experiment_arms() -> dict:
    spec = importlib.util.spec_from_file_location("_experiment_tool", os.path.join(ROOT, "tools", "experiment.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.modules.pop(spec.name, None)
    return mod.ARMS


def test_baselines_grpo_scripts_normalisation():
    """Baselines: the reference's GRPO scripts for ALFWorld and WebShop use mean_norm (our `grpo_paper` arm); its
    Search GRPO and its ALFWorld-3B OPID script use mean_std_norm."""
    arms = _experiment_arms()
    for name in ("qwen2.5-3b_alfworld", "qwen2.5-3b_webshop", "qwen2.5-7b_alfworld", "qwen2.5-7b_webshop"):
        cfg = load_config(os.path.join(ROOT, "configs", f"{name}.yaml"), list(arms["grpo_paper"]))
        assert (cfg.algo.mode, cfg.algo.outcome_mode) == ("grpo", "mean_norm"), name
    search = load_config(os.path.join(ROOT, "configs", "qwen2.5-3b_search_qa.yaml"), ["algo.mode=grpo"])
    assert (search.algo.mode, search.algo.outcome_mode) == ("grpo", "mean_std_norm")
    alf3b = load_config(os.path.join(ROOT, "configs", "qwen2.5-3b_alfworld.yaml"))
    assert (alf3b.algo.mode, alf3b.algo.outcome_mode) == ("opid", "mean_std_norm")
    # the plain `grpo` arm keeps the base config's normalisation (ALFWorld-3B: mean_std_norm, i.e. NOT the
    # reference's GRPO script); that is why `grpo_paper` exists
    cfg = load_config(os.path.join(ROOT, "configs", "qwen2.5-3b_alfworld.yaml"), list(arms["grpo"]))
    assert cfg.algo.outcome_mode == "mean_std_norm"


def test_skill_grpo_is_documented_as_ours():
    """Baselines: "Any Skill-GRPO here is this project's own construction and must be documented as such"."""
    text = open(DOCS, encoding="utf-8").read()
    text = re.sub(r"[ \t]*\n[ \t]+(?!- )", " ", text)  # markdown line wraps inside a bullet
    bullets = [b for b in re.split(r"\n(?=- )", text) if b.startswith("- **Skill-GRPO**")]
    assert bullets and all("this project's construction" in b for b in bullets)
    facts = text.split("## More reference facts", 1)[1].split("\n## ", 1)[0]
    assert "static skill bank" in facts and "never enabled" in facts and "own construction" in facts


def test_alfworld_step0_of_a_real_game_puts_the_episode_skill_mid_prompt(tmp_path):
    """Environment templates + task-line choice on the prompt our ALFWorld env really builds at step 0 (an offline
    generated game): ALFWorld's first observation ends with the task line; the step-0 prompt has no history and no
    task line of its own, so the only "Your task is to:" line is the observation's last one, and the episode skill
    goes right after it — mid-prompt, before the admissible-actions line, whose actions are quoted and joined by a
    newline and a space. The step skill goes before the first "Now it's your turn to"."""
    pytest.importorskip("textworld")
    from opid_mega.envs import make_env
    from opid_mega.skills import insertion_point

    env = make_env("alfworld", process=False, source="generated", cache_dir=str(tmp_path), pool_size=2)
    try:
        obs = env.reset(env.task_pool("train")[0])
        task_line = obs.split("\n")[-1]
        assert task_line.startswith("Your task is to: ")  # the game's first observation ends with the task
        actions = env.admissible_actions
        prompt = env.build_prompt([], obs, 5)
    finally:
        env.close()
    assert len(actions) >= 2 and prompt.count("Your task is to:") == 1 and "Prior to this step" not in prompt
    actions_line = "Your admissible actions of the current situation are: [" + "\n ".join(
        f"'{a}'" for a in actions) + "]."
    head = prompt[:prompt.index(actions_line)]
    assert head.endswith(task_line + "\n")  # the task line is the line right before the actions
    assert insertion_point(prompt, "episode") == len(head)  # mid-prompt: text of the prompt follows the section
    assert len(prompt) - len(head) > len(actions_line)
    assert insertion_point(prompt, "step") == prompt.index("\n\nNow it's your turn to") + 2
    assert prompt.index("Now it's your turn to") == insertion_point(prompt, "step")
