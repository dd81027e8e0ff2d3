"""Reference behaviours (docs/algorithm.md, "Deviations from the reference code" and "Where each fact is tested").
Every expected value is written out by hand from the reference code (jinyangwu/OPID @ 37a15a5; file:line quoted in
each test), never read from our own code."""
import glob
import os

import numpy as np
import pytest

from opid_mega.config import load_config
from opid_mega.skills import Analysis, TrajectoryView, build_analysis_prompt
from opid_mega.skills.sanitize import cut_analysis

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
PAPER = sorted(glob.glob(os.path.join(ROOT, "configs", "qwen*.yaml")))
WIN = TrajectoryView(task="take the coin", won=True, steps=[("room", "<action>go east</action>", 0.0),
                                                           ("coin", "<action>take coin</action>", 10.0)])
LOSS = TrajectoryView(task="open the chest", won=False, steps=[("room", "<action>look</action>", 0.0),
                                                              ("room", "<action>look</action>", 0.0)])


def test_episode_skill_instruction_has_no_generality_clause():
    """opid/analysis.py:446-457: the success instruction asks for the workflow (core decision rule, action
    ordering), the failure one for the core mistake and warning signs to avoid; the clauses asking to phrase the
    skill as a general pattern rather than for this exact task are commented out (:450, :456)."""
    for traj in (WIN, LOSS):
        p = build_analysis_prompt(traj, max_step_skills=5).lower()
        for clause in ("general", "similar tasks", "carry over", "this exact task", "one-off"):
            assert clause not in p, clause
    win = build_analysis_prompt(WIN, 5)
    assert "core decision rule" in win and "order of actions" in win
    loss = build_analysis_prompt(LOSS, 5)
    assert "core mistake" in loss and "warning signs" in loss and "avoid" in loss


def test_step_skill_instructions_and_the_example_reply():
    """opid/analysis.py:474-494: the task description is used to judge progress and mistakes (:478), the full
    episode to work out what each critical step should have done better (:479), each step skill is one short
    imperative sentence (:480), and the prompt shows the reply's shape with string-keyed step skills "0" and "2"
    (:485-493)."""
    p = build_analysis_prompt(WIN, 5)
    assert "Judge the agent's progress and its mistakes against the task" in p
    assert "what that step should have done better" in p
    assert "one short imperative sentence" in p
    shape = p[p.index("shaped like this example"):]
    for line in ('  "episode_summary": "...",', '  "episode_skill": "...",',
                 '  "step_skills": {"0": "skill for step 0", "2": "skill for step 2"}'):
        assert line in shape.splitlines(), line


def test_paper_configs_reply_cap_skill_cap_and_validation_cadence():
    """Reply cap: utils/openai_api.py:20-41 passes a timeout to the client only when one is given, and
    opid/analysis.py:254-259 gives none: no cap on one reply. Skill length: opid/analysis.py:494-507
    (`_parse_analysis_response`) keeps the skills as the reply gives them; our 256-token cap is a stated safety
    choice. Validation: examples/opid_trainer/run_webshop_opid_guide*.sh test_freq=5 val_before_train=False;
    run_search_opid_guide.sh test_freq=150 val_before_train=False; run_search_opid_guide_qwen3.sh test_freq=150
    val_before_train=True."""
    from opid_mega.trainer import should_evaluate

    assert len(PAPER) == 9
    for path in PAPER:
        name = os.path.basename(path)[:-5]
        cfg = load_config(path)
        assert cfg.analyzer.timeout_s is None, name
        assert cfg.analyzer.max_skill_tokens == 256, name
        evaluated = [it for it in range(cfg.train.iterations + 1) if should_evaluate(cfg, it)]
        if cfg.env.name == "webshop":
            assert evaluated == list(range(5, 161, 5)), name
        if cfg.env.name == "search_qa":
            assert evaluated == ([0, 150] if name.startswith("qwen3") else [150]), name


def test_skill_cap_at_the_reply_budget_keeps_skills_as_given():
    """The reference uses skills as given (opid/analysis.py:494-507); with analyzer.max_skill_tokens at the
    analyzer's whole budget (4096) a 300-word skill is kept whole, while the default 256 cuts it."""
    skill = " ".join(f"w{i}" for i in range(300))
    a = Analysis(episode_summary="s", episode_skill=skill, step_skills={0: skill})
    count = lambda text: len(text.split())  # noqa: E731 - one token per word
    kept, n_cut = cut_analysis(a, 4096, count)
    assert (kept.episode_skill, kept.step_skills, n_cut) == (skill, {0: skill}, 0)
    cut, n_cut = cut_analysis(a, 256, count)
    assert n_cut == 2 and count(cut.episode_skill) <= 256


@pytest.mark.parametrize("cls,response,want", [
    # agent_system/environments/env_package/alfworld/projection.py:38-41: no <action>...</action> block -> the last 30
    # characters of the lower-cased response; env_manager.py:258 stores that as the history's action
    ("alfworld_env:AlfWorldEnv", "<think>x</think> GO TO Cabinet 1 please!!", "hink> go to cabinet 1 please!!"),
    ("textworld_env:TextWorldEnv", "I think I Should Open The Wooden Door Now, OK", "d open the wooden door now, ok"),
    ("footprints_env:FootprintsEnv", "<action>take the left door", "<action>take the left door"),
    # webshop/projection.py:39-41: 20 characters; env_manager.py:597
    ("webshop:WebShopEnv", "Search For A Red Shirt Under 30 Dollars", "irt under 30 dollars"),
    # search/projection.py:72-73: no block -> ""
    ("search_qa:SearchQAEnv", "I would look this up", ""),
    # a projected action is recorded as is
    ("textworld_env:TextWorldEnv", "<think>t</think><action>Open Door</action>", "open door"),
])
def test_history_records_the_tail_of_an_unparseable_response(cls, response, want):
    import importlib

    mod, name = cls.split(":")
    env_cls = getattr(importlib.import_module(f"opid_mega.envs.{mod}"), name)
    env = env_cls.__new__(env_cls)  # history_action needs only the class's family and tail length
    action, _ = env.project_action(response)
    assert env.history_action(response, action) == want
    if action is None and want:
        assert len(want) == min(len(response), {"webshop:WebShopEnv": 20}.get(cls, 30))


def test_history_action_through_a_worker_process():
    """The same rule when the env runs in a worker process (ProcessEnv): 30 characters for an <action> env
    (alfworld/projection.py:38-41), "" for Search (search/projection.py:72-73)."""
    from opid_mega.envs import make_env

    for name, want in (("footprints", "x" * 30), ("search_qa", "")):
        env = make_env(name, process=True)
        try:
            assert type(env).__name__ == "ProcessEnv"
            assert env.history_action("X" * 40, None) == want, name
            assert env.history_action("X" * 40, "go north") == "go north"
        finally:
            env.close()


def test_balanced_partitions_worked_by_hand():
    """verl/utils/seqlen_balancing.py:96-122 (largest differencing over groups of k ascending lengths, partitions
    sorted by sum descending) and :171-181 (indices ascending in each partition); ray_trainer.py:2339-2348 reorders the
    batch as the partitions' concatenation, rank r taking partition r.
    [1, 2, 3, 4], k=2: states {3:4 | 2:3} and {1:2 | 0:1} (spread 1 each; the one with the larger part pops first),
    merged largest-with-smallest: {3, 0} = 5 and {2, 1} = 5; equal sums and sizes, (3, 4) > (2, 3) first.
    [5, 1, 1, 1, 1, 3], k=3: {0:5 | 5:3 | 4:1} (spread 4) merged with {3 | 2 | 1} (spread 0): {0, 1} = 6, {5, 2} = 4,
    {4, 3} = 2."""
    from opid_mega.batching.balance import balanced_partitions, reference_minibatch_order

    assert balanced_partitions([1, 2, 3, 4], 2) == [[0, 3], [1, 2]]
    assert balanced_partitions([5, 1, 1, 1, 1, 3], 3) == [[0, 1], [2, 5], [3, 4]]
    assert balanced_partitions([7, 3, 9], 1) == [[0, 1, 2]]  # one rank: rollout order
    # mini-batch j = the j-th slice of every rank's partition (each rank splits its share into mini-batches)
    assert reference_minibatch_order([1, 2, 3, 4], 2, 2).tolist() == [0, 1, 3, 2]
    assert reference_minibatch_order([1, 2, 3, 4], 2, 4).tolist() == [0, 3, 1, 2]
    with pytest.raises(ValueError, match="equal size"):
        balanced_partitions([1, 2, 3], 2)


def test_balanced_partitions_on_random_inputs_are_equal_size_permutations_at_least_as_balanced_as_rollout_order():
    from opid_mega.batching.balance import balanced_partitions

    rng = np.random.default_rng(0)
    for _ in range(50):
        k = int(rng.integers(1, 6))
        lens = rng.integers(1, 500, size=k * int(rng.integers(1, 9))).tolist()
        parts = balanced_partitions(lens, k)
        assert sorted(i for p in parts for i in p) == list(range(len(lens)))
        assert {len(p) for p in parts} == {len(lens) // k} and all(p == sorted(p) for p in parts)
        sums = [sum(lens[i] for i in p) for p in parts]
        assert sums == sorted(sums, reverse=True)
        n = len(lens) // k
        naive = [sum(lens[r * n:(r + 1) * n]) for r in range(k)]
        assert max(sums) - min(sums) <= max(lens) or max(sums) - min(sums) <= max(naive) - min(naive)


def test_padding_indices_reference_rule():
    """agent_system/multi_turn_rollout/utils.py:99-101 and :126-131: remainder = n % divisor; none added when 0,
    else divisor - remainder distinct indices drawn uniformly without replacement and appended in draw order."""
    from opid_mega.batching.balance import padding_indices

    rng = np.random.default_rng(3)
    assert padding_indices(64, 32, rng).size == 0
    got = padding_indices(70, 32, np.random.default_rng(3))
    want = np.random.default_rng(3).choice(70, 26, replace=False)
    assert got.tolist() == want.tolist() and len(set(got.tolist())) == 26
    with pytest.raises(ValueError, match="distinct duplicates"):
        padding_indices(3, 8, rng)


def _record(groups, scores, prompts, responses, traj_index, step_index):
    from types import SimpleNamespace

    from opid_mega.batching.layout import csr_offsets
    from opid_mega.experience import Experience

    seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
    S = len(seqs)
    steps = [SimpleNamespace(prompt_text=f"p{s}", step_insert_at=0, episode_insert_at=0) for s in range(S)]
    return Experience(
        iteration=1, trajectories=[], rollout_trajectories=0, env_errors=0, deadline_trajectories=0,
        traj_index=np.asarray(traj_index, np.int64), step_index=np.asarray(step_index, np.int64),
        tokens=np.asarray([x for q in seqs for x in q], np.int32), seq_offsets=csr_offsets([len(q) for q in seqs]),
        prompt_lens=np.asarray([len(p) for p in prompts], np.int64),
        resp_lens=np.asarray([len(r) for r in responses], np.int64), groups=np.asarray(groups, np.int64),
        scores=np.asarray(scores, np.float64), invalid=np.zeros(S, bool),
        engine_logprobs=np.asarray([-(s + 1) for s, r in enumerate(responses) for _ in r], np.float64),
        policy_version=np.zeros(S, np.int64), steps=steps, skill_offsets=np.zeros(S + 1, np.int64))


def test_padding_copies_enter_the_group_statistics():
    """agent_system/multi_turn_rollout/utils.py:126-131 appends the drawn copies to the batch, and
    verl/trainer/ppo/ray_trainer.py:2482 (adjust_batch) runs before compute_advantage (:2634): a copy is one more
    member of its group. Worked by hand: rows (group, score) = (0, 1), (0, 0), (1, 3), padded to a multiple of 4 with
    the generator seeded 1, which draws row 1; mean_norm: group 0 = [1, 0, 0], mean 1/3 -> A_out = [2/3, -1/3, 3,
    -1/3] (without the copy: [1/2, -1/2, 3]; a one-member group keeps its score: mean 0, as the reference's GRPO)."""
    from opid_mega.experience import advantages, pad_to_multiple

    exp = _record([0, 0, 1], [1.0, 0.0, 3.0], [[5, 6], [7], [8, 9, 10]], [[11], [12, 13], [14]], [0, 1, 2], [0, 0, 0])
    assert pad_to_multiple(exp, 4, np.random.default_rng(1)) == 1
    assert exp.num_samples == 4 and exp.groups.tolist() == [0, 0, 1, 0]
    assert exp.sequence(3).tolist() == [7, 12, 13] and exp.engine_logprobs.tolist() == [-1, -2, -2, -3, -2, -2]
    assert (exp.traj_index.tolist(), exp.steps[3].prompt_text) == ([0, 1, 2, 1], "p1")
    exp.old_logprobs = np.zeros(int(exp.resp_lens.sum()))
    a = load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), ["algo.mode=grpo",
                                                                     "algo.outcome_mode=mean_norm"]).algo
    advantages(exp, a)
    assert exp.a_out.tolist() == pytest.approx([2 / 3, -1 / 3, 3.0, -1 / 3], abs=1e-12)
    assert pad_to_multiple(_record([0], [1.0], [[1]], [[2]], [0], [0]), 1, np.random.default_rng(0)) == 0
    with pytest.raises(ValueError, match="fresh record"):
        pad_to_multiple(exp, 8, np.random.default_rng(0))


def test_a_padded_copy_takes_its_originals_route():
    """The copy is the same step-sample (utils.py:130 select_idxs): it carries its original's skill routing."""
    from types import SimpleNamespace

    from opid_mega.experience import add_skills, pad_to_multiple
    from opid_mega.skills import Analysis

    exp = _record([0, 0, 0], [1.0, 1.0, 0.0], [[1], [2], [3]], [[4], [5], [6]], [0, 0, 1], [0, 1, 0])
    exp.trajectories = [SimpleNamespace(steps=[0, 1]), SimpleNamespace(steps=[0])]
    pad_to_multiple(exp, 4, np.random.default_rng(1))  # draws row 1: trajectory 0, step 1
    a = load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), ["algo.mode=opid"]).algo
    an = Analysis(episode_summary="", episode_skill="E", step_skills={1: "S"})
    add_skills(exp, [an, None], a, lambda skill, kind: (skill, [ord(skill)]))
    got = [exp.contexts(s) for s in range(exp.num_samples)]
    assert got[3] == got[1] and got[1] and got[2] == {}


def test_minibatch_order_of_a_record_balances_prompt_plus_response_tokens():
    """ray_trainer.py:2341-2345: the lengths balanced are the attention-mask sums (prompt + response tokens).
    Lengths [1, 2, 3, 4] over 2 ranks: partitions [0, 3] and [1, 2] (worked above); mini-batches of 2 take one
    sample of each: [0, 1], [3, 2]."""
    from opid_mega.experience import minibatch_order

    exp = _record([0, 0, 1, 1], [1.0, 0.0, 1.0, 0.0], [[1], [1], [1, 1], [1, 1]], [[2], [2, 2], [2], [2, 2]],
                  [0, 1, 2, 3], [0, 0, 0, 0])
    assert minibatch_order(exp, 2, 2).tolist() == [0, 1, 3, 2]


def test_docs_tables_name_every_behaviour_with_its_switch_and_test():
    """docs/algorithm.md: the deviations table names the switch of each behaviour that is ours by default (or in
    the paper configs), and the facts table names this file's test of each reference behaviour."""
    text = open(os.path.join(ROOT, "docs", "algorithm.md"), encoding="utf-8").read()
    deviations = text.split("## Deviations from the reference code", 1)[1].split("\n## ", 1)[0]
    for switch in ("`analyzer.timeout_s`", "`analyzer.stall_timeout_s`", "`analyzer.max_skill_tokens`",
                   "`train.pad_multiple`", "`train.balance_ranks`", "`env.template=reference\\|ours`",
                   "length of the augmented prompt"):
        assert switch in deviations, switch
    facts = text.split("### Where each fact is tested", 1)[1].split("\n## ", 1)[0]
    this = "test_docs_tables_name_every_behaviour_with_its_switch_and_test"
    for name in [n for n in globals() if n.startswith("test_") and n != this]:
        assert f"::{name}`" in facts, name
