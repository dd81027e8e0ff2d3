"""Analyzer output is untrusted (issue 22, items 5 and 7) — end to end on the tiny config:
  * one real trainer iteration whose LLM analyzer answers 2000-token skills (one reply with a lone-surrogate escape
    and a 5000-digit step key): skills are cut to analyzer.max_skill_tokens at a word boundary, counted in
    analysis/skills_truncated, and the fork scorer scores every group (its budget is derived from the caps);
  * `opid-train` with `analyzer.api_key=<secret>` on the command line and another secret in $OPENAI_API_KEY (the
    variable the key is read from when analyzer.api_key is empty), then a resume with the key on its command line
    again: neither secret appears in any file of the run directory (binary-safe) nor in the output."""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from .conftest import CONFIG, TINY

LONG = " ".join(f"step{i}: look around, open the drawer, take the coin, then go east." for i in range(300))


class _LongSkills(BaseHTTPRequestHandler):
    n = 0

    def do_POST(self):  # noqa: N802 - an analyzer that writes far too much, once with poisoned escapes
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        _LongSkills.n += 1
        first = _LongSkills.n == 1
        reply = {"episode_summary": "long", "episode_skill": ("\ud800 " if first else "") + LONG,
                 "step_skills": {"0": LONG, "1": "go east \udfff now", **({"9" * 5000: "x"} if first else {})}}
        body = json.dumps({"choices": [{"message": {"content": json.dumps(reply)}}]}).encode()  # \\ud800 escapes
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.mark.slow
def test_long_and_poisoned_skills_are_cut_and_every_fork_group_is_scored(tiny_cfg, tmp_path):
    from opid_mega.skills.audit import read_audit
    from opid_mega.skills.injection import render_skill_section
    from opid_mega.trainer import Trainer

    srv = ThreadingHTTPServer(("127.0.0.1", 0), _LongSkills)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    cfg = tiny_cfg("analyzer.backend=llm", f"analyzer.base_url=http://127.0.0.1:{srv.server_address[1]}/v1",
                   "analyzer.model=m", "analyzer.max_retries=0", "analyzer.timeout_s=60", "scoring.scorer=fork",
                   "algo.skill_share_cap=null")  # a tied group keeps its skill term: the one checked here
    tr = Trainer(cfg, str(tmp_path))
    try:
        count = lambda s: len(tr.encode_text(s))  # noqa: E731 - the policy tokenizer
        assert count(LONG) >= 2000
        # the old fixed budget, max(micro_batch_tokens, 4 x (prompt + response)), is smaller than the two uncut
        # sections of one step-sample alone: scoring them raised ValueError in the fork scorer
        uncut = sum(count(render_skill_section(LONG, k)) for k in ("episode", "step"))
        assert uncut > max(cfg.train.micro_batch_tokens,
                           4 * (cfg.rollout.max_prompt_tokens + cfg.rollout.max_response_tokens))
        assert tr.scorer.max_tokens >= 3 * (cfg.rollout.max_prompt_tokens + cfg.rollout.max_response_tokens) \
            + sum(tr.fit_section.caps.values())
        m = tr.iteration(1)
    finally:
        tr.close()
        srv.shutdown()
        srv.server_close()
    n_traj = cfg.rollout.tasks_per_iter * cfg.rollout.group_size
    assert m["analysis/failure_rate"] == 0.0  # the poisoned reply was sanitised, not lost
    assert m["analysis/skills_truncated"] >= 2 * n_traj  # every episode skill and every step-0 skill
    assert m["adv/skill_abs_mean"] > 0 and m["scoring/tokens"] > 0
    prompts = list(read_audit(tmp_path / "audit.jsonl", "augmented_prompt"))
    assert prompts
    for r in prompts:
        skill = r["skill"]
        assert count(skill) <= cfg.analyzer.max_skill_tokens, len(skill)
        body = skill.replace("\ufffd ", "", 1) if skill.startswith("\ufffd") else skill
        assert LONG.startswith(body) and LONG[len(body)] == " " or body == "go east \ufffd now", skill[-40:]
    analyses = list(read_audit(tmp_path / "audit.jsonl", "analysis"))
    assert len(analyses) == n_traj and all(a["analysis"] for a in analyses)


def _files_holding(run: Path, needles: list) -> list:
    """Every file under `run` (binary-safe, symlinks not followed) that holds one of the byte strings."""
    hits = []
    for root, dirs, files in os.walk(run):
        for name in files:
            p = Path(root) / name
            if p.is_symlink() or not p.is_file():
                continue
            data = p.read_bytes()
            hits += [f"{p}: {n!r}" for n in needles if n in data]
    return hits


@pytest.mark.slow
def test_the_analyzer_key_appears_in_no_file_of_the_run_directory(tmp_path):
    cli_key = f"sk-SECRET-{secrets.token_hex(12)}"
    env_key = f"sk-SECRET-{secrets.token_hex(12)}"
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "2", "OPENAI_API_KEY": env_key}
    cmd = [sys.executable, "-m", "opid_mega.cli", "--config", CONFIG, "--run-dir", str(run)] + TINY + [
        f"analyzer.api_key={cli_key}", "logging.tensorboard=true", "logging.progress=true"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (run / "config.yaml").exists() and (run / "checkpoints").exists()
    needles = [k.encode() for k in (cli_key, env_key)] + [k.encode("utf-16-le") for k in (cli_key, env_key)]
    assert _files_holding(run, needles) == []
    assert cli_key not in r.stdout + r.stderr and env_key not in r.stdout + r.stderr
    # a resume with the key on its command line again (resume overrides are recorded in the run directory)
    r = subprocess.run([sys.executable, "-m", "opid_mega.cli", "--resume", str(run), "train.iterations=2",
                        f"analyzer.api_key={cli_key}"], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (run / "checkpoints" / "latest_step").read_text().strip() == "2"
    assert _files_holding(run, needles) == []
    assert cli_key not in r.stdout + r.stderr and env_key not in r.stdout + r.stderr
