"""opid-sft with skill sections (sft.skill_share): a share of the expert step-samples appears a second time with the
section the rule analyzer writes from that expert trajectory (the reference's section text and placement); 0 keeps
the warm start and its cache key exactly as before."""
import dataclasses

import pytest

from opid_mega.config import ConfigError
from opid_mega.models import load_tokenizer, resolve_model_path
from opid_mega.sft import expert_episodes, expert_skill_routes, sft_key, walkthrough_samples

# The reference's section text (OPID.md "Reference rules in detail"): title line, instruction line, [skill], blank line.
EPISODE_HEAD = ("**Episode-Level Skill**\nRefer to this episode-level skill when deciding what action to take in the "
                "current episode:\n[")
STEP_HEAD = "**Critical-Step Skill**\nUse this current-step skill for this decision only:\n["
CLOSING = "Now it's your turn"


@pytest.fixture
def tok():
    return load_tokenizer(resolve_model_path("", "tiny-qwen3"))


def _cfg(tiny_cfg, *extra):
    return tiny_cfg("env.options.pool_size.train=3", "analyzer.max_step_skills=2", "env.max_steps=5", *extra)


def test_expert_routes_follow_the_rule_analyzer_and_critical_first_routing(tiny_cfg):
    cfg = _cfg(tiny_cfg)
    eps = expert_episodes(cfg)
    assert len(eps) == 3
    for ep in eps:
        acts = ep["actions"]
        assert ep["view"].won and len(acts) == 3 and acts[-1] == "take coin"
        routes = expert_skill_routes(cfg, ep)
        # success, K = 2: critical steps = the rewarded last step, then the first step that changed the observation
        # (rules.py); critical steps get their step skill only, the other step the episode skill (critical-first)
        assert routes[0] == {"step": f"Now do '{acts[0]}': it moves the task forward."}
        assert routes[2] == {"step": "Now do 'take coin': it moves the task forward."}
        assert routes[1] == {"episode": f"To complete a task like '{ep['view'].task}', follow this workflow: "
                                        f"{acts[0]} -> {acts[1]} -> take coin. Do not waste steps on actions that "
                                        "change nothing."}


def test_skill_share_one_pairs_every_sample_with_its_routed_section(tiny_cfg, tok):
    cfg = _cfg(tiny_cfg)
    plain = walkthrough_samples(cfg, tok)
    paired = walkthrough_samples(cfg, tok, skill_share=1.0)
    assert len(plain) == 9 and len(paired) == 18
    assert paired[0::2] == plain  # every no-skill sample stays, in order
    assert [r for _, r in paired[1::2]] == [r for _, r in plain]  # the copy's target is the expert's response
    eps = expert_episodes(cfg)
    placements = set()
    for k, ((p_ids, _), (s_ids, _)) in enumerate(zip(plain, paired[1::2])):
        ep, t = eps[k // 3], k % 3
        text, base = tok.decode(s_ids), tok.decode(p_ids)
        assert text.count("**Episode-Level Skill**") + text.count("**Critical-Step Skill**") == 1
        # K = 2 on a 3-step win: steps 0 and 2 are critical and get their step skill, right before the closing
        # paragraph in both placements; step 1 gets the episode skill
        if t in (0, 2):
            section = STEP_HEAD + f"Now do '{ep['actions'][t]}': it moves the task forward.]\n\n"
            assert section + CLOSING in text
        else:
            at = text.index(EPISODE_HEAD)
            task_line_end = base.index("\n", base.index("Your task is to:"))
            if text[at + len(EPISODE_HEAD):].split("]\n\n", 1)[1].startswith(CLOSING):
                placements.add("late")  # late: right before the closing paragraph
            else:  # faithful: on its own line right after the task line
                assert text[:at] == base[:task_line_end + 1]
                placements.add("faithful")
        assert text.replace(text[text.index("**"):text.index("]\n\n") + 3], "") == base  # nothing else changed
    assert placements and placements <= {"faithful", "late"}


def test_skill_share_zero_changes_neither_data_nor_cache_key(tiny_cfg, tok):
    cfg = _cfg(tiny_cfg)
    assert cfg.sft.skill_share == 0.0  # the default
    plain = walkthrough_samples(cfg, tok)
    assert walkthrough_samples(cfg, tok, skill_share=0.0) == plain
    assert not any("Skill**" in tok.decode(p) for p, _ in plain)
    base = resolve_model_path(cfg.model.path, cfg.model.builtin, cfg.model.cache_dir)
    opts = dataclasses.asdict(cfg.sft)
    before = {k: v for k, v in opts.items() if k != "skill_share"}  # the options a warm start was keyed by before
    assert sft_key(cfg, base, opts) == sft_key(cfg, base, before)
    half = dict(opts, skill_share=0.5)
    assert sft_key(cfg, base, half) != sft_key(cfg, base, opts)
    # with sections, the analyzer's K decides them: part of the key
    assert sft_key(_cfg(tiny_cfg, "analyzer.max_step_skills=1"), base, half) != sft_key(cfg, base, half)


def test_skill_share_half_is_a_seeded_share(tiny_cfg, tok):
    cfg = _cfg(tiny_cfg, "env.options.pool_size.train=8")
    a = walkthrough_samples(cfg, tok, skill_share=0.5)
    assert a == walkthrough_samples(cfg, tok, skill_share=0.5)  # deterministic
    n = sum("Skill**" in tok.decode(p) for p, _ in a)
    assert len(a) == 24 + n and 0 < n < 24  # 24 expert step-samples, n of them also with a section


def test_bad_skill_share_is_a_clear_error(tiny_cfg, tok):
    with pytest.raises(ConfigError, match=r"sft.skill_share: got 1.5, allowed: a number in \[0, 1\]"):
        tiny_cfg("sft.skill_share=1.5")
    with pytest.raises(ValueError, match="skill_share=-0.1"):
        walkthrough_samples(_cfg(tiny_cfg), tok, skill_share=-0.1)
