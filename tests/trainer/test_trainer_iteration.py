"""One real trainer iteration (Megatron policy, local engine, TextWorld, analyzers): step-0 invariants, analyzer
failures, a dying rollout engine."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer

import pytest

from opid_mega.megatron.checkpoint import latest_step
from opid_mega.skills.audit import read_audit
from opid_mega.skills.llm_analyzer import LLMAnalyzer
from opid_mega.rollout.launch import RolloutEngineDied
from opid_mega.trainer import Trainer

from .conftest import closed_port


class _Garbage(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - an OpenAI-compatible server that answers nonsense
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.dumps({"choices": [{"message": {"content": "I think the agent did fine {not json"}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.mark.slow
def test_step0_invariants_and_analyzer_failures(tiny_cfg, tmp_path):
    port = closed_port()
    cfg = tiny_cfg("analyzer.max_retries=0", "analyzer.timeout_s=5", "algo.skill_share_cap=null")  # ties: skill term kept
    tr = Trainer(cfg, str(tmp_path))  # (an analyzer.base_url that is down would be refused by the start-up probe)
    try:
        # the endpoint goes down after the start: every analysis of the iteration fails
        tr.analyzer = LLMAnalyzer(f"http://127.0.0.1:{port}/v1", model="m", max_retries=0, timeout_s=5,
                                  audit=tr.audit)
        # iteration 1, analyzer down (closed port): step-0 invariants hold, the run goes on without a skill term
        m = tr.iteration(1)
        # trainer old log-probs = local engine log-probs (fp32; the engine's HF model loads after cpu_compat.apply()
        # with correct RoPE buffers: no repair needed)
        assert m["rollout/logprob_mismatch"] < 1e-4
        assert abs(m["ppo/approx_kl_first"]) < 1e-6  # PPO approx-KL = 0 on the first mini-batch
        assert m["analysis/failure_rate"] == 1.0
        assert m["adv/skill_abs_mean"] == 0.0
        assert m["train/step_samples"] >= 2
        # iteration 2, analyzer answers garbage: same outcome, failures counted
        server = HTTPServer(("127.0.0.1", 0), _Garbage)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        tr.analyzer.close()
        tr.analyzer = LLMAnalyzer(f"http://127.0.0.1:{server.server_address[1]}/v1", model="m", max_retries=0,
                                  audit=tr.audit)
        m2 = tr.iteration(2)
        server.shutdown()
        assert m2["analysis/failure_rate"] == 1.0 and m2["adv/skill_abs_mean"] == 0.0
        assert m2["analysis/failures_total"] == 2 * cfg.rollout.tasks_per_iter * cfg.rollout.group_size
        # iteration 3, the rule analyzer works: every trajectory analysed, the skill term is non-zero
        from opid_mega.skills import RuleAnalyzer

        tr.analyzer.close()
        tr.analyzer = RuleAnalyzer(max_step_skills=2)
        m3 = tr.iteration(3)
        assert m3["analysis/failure_rate"] == 0.0 and m3["adv/skill_abs_mean"] > 0.0
        assert m3["analysis/deadline_failures"] == 0
        # iteration 4, the analyzer never answers (its timeout 60 s x 6 attempts): analyzer.deadline_s=3 ends the
        # wait; the analyses are deadline failures (counted, audited) and the iteration completes without them
        release = threading.Event()

        class _Silent(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                release.wait(120)

            def log_message(self, *a):
                pass

        silent = ThreadingHTTPServer(("127.0.0.1", 0), _Silent)
        silent.daemon_threads = True
        threading.Thread(target=silent.serve_forever, daemon=True).start()
        tr.analyzer.close()
        tr.analyzer = LLMAnalyzer(f"http://127.0.0.1:{silent.server_address[1]}/v1", model="m", timeout_s=60,
                                  max_retries=5, audit=tr.audit)
        tr.cfg.analyzer.deadline_s = 3.0
        t0 = time.monotonic()
        m4 = tr.iteration(4)
        elapsed = time.monotonic() - t0
        release.set()
        silent.shutdown()
        n = cfg.rollout.tasks_per_iter * cfg.rollout.group_size
        print(f"iteration with a silent analyzer: {elapsed:.1f} s, analysis wait {m4['time/analysis_wait']:.1f} s")
        assert m4["analysis/deadline_failures"] == n and m4["analysis/failure_rate"] == 1.0
        assert m4["adv/skill_abs_mean"] == 0.0 and m4["train/step_samples"] >= 2
        assert m4["analysis/failures_total"] == 3 * n
        assert m4["time/analysis_wait"] < 3.0 + 30.0  # the deadline, not 6 x 60 s (slack: a loaded 2-core machine)
    finally:
        tr.close()
    records = list(read_audit(tmp_path / "audit.jsonl"))
    failures = [r for r in records if r["type"] == "analysis" and r["failure"]]
    assert len(failures) == 3 * cfg.rollout.group_size
    late = [r for r in failures if r.get("iteration") == 4]
    assert len(late) == cfg.rollout.group_size and all("analyzer.deadline_s=3 s" in r["failure"] for r in late)
    assert any(r["type"] == "augmented_prompt" and "**" in r["prompt"] for r in records)


class _CrashingEnv:
    """A real env whose step raises (a broken simulator); everything else is delegated."""

    def __init__(self, env):
        self._env = env

    def __getattr__(self, name):
        return getattr(self._env, name)

    def step(self, action):
        raise RuntimeError("simulator crashed")


def test_crashing_env_then_dying_engine(tiny_cfg, tmp_path, monkeypatch, capsys):
    """Iteration 1: one env raises -> only its trajectory ends (marked failed), the run goes on and checkpoints.
    Iteration 2: the engine dies -> a clear error naming the last checkpoint. The progress lines name the mode."""
    from opid_mega.metrics import read_metrics

    monkeypatch.setenv("OPID_PROGRESS", "lines")
    cfg = tiny_cfg("train.iterations=2", "algo.mode=grpo", "logging.progress=true")
    tr = Trainer(cfg, str(tmp_path))
    make_env, made = tr.loop.env_factory, []

    def env_factory():  # the second trajectory slot gets an env that crashes on its first step
        made.append(make_env())
        return _CrashingEnv(made[-1]) if len(made) == 2 else made[-1]

    tr.loop.env_factory = env_factory
    run_iteration = tr.iteration

    def iteration(it):
        if it == 2:
            tr.engine.shutdown()  # the engine dies before the second rollout
        return run_iteration(it)

    tr.iteration = iteration
    with pytest.raises(RolloutEngineDied) as err:
        tr.fit()
    msg = str(err.value)
    assert "iteration 2" in msg and "step_1" in msg and "--resume" in msg
    assert latest_step(str(tmp_path / "checkpoints")) == 1
    assert (tmp_path / "checkpoints" / "step_1").is_dir()
    (m1,) = read_metrics(tmp_path)
    assert m1["step"] == 1 and m1["rollout/env_errors"] == 1
    progress = [ln for ln in capsys.readouterr().out.splitlines() if "1/2 [" in ln]
    assert progress and all(ln.startswith("grpo 1/2 [") for ln in progress), progress  # not "opid" in a GRPO run
    assert m1["train/step_samples"] >= 1 and m1["ppo/loss"] is not None
