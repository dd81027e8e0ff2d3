"""docs/architecture.md "One iteration, file by file" is what one iteration does: the Python frames of a real tiny
iteration (rollout, analysis, reference, scoring with the fork scorer, advantages, PPO update, weight sync) are traced
in every thread, and every file of the package they enter must be on the documented path (at most 10 files) or among
the documented pieces below it; every file of the path must be entered."""
import fnmatch
import os
import re
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


def documented() -> tuple[list, list]:
    """(the path's files, the globs of the pieces below it) as docs/architecture.md lists them."""
    text = DOC.read_text()
    section = text[text.index("## One iteration, file by file"):]
    section = section[:section.index("\n## ", 3)]
    path = re.findall(r"^\d+\. `([^`]+)`", section, re.M)
    below = section[section.index("Below the path"):]
    pieces = []
    for name in re.findall(r"`([^`]+)`", below):
        if name.endswith("/"):
            pieces.append(name + "*")
        elif name.endswith(".py"):
            pieces.append(name)
    return path, pieces


def test_the_documented_lists_are_well_formed():
    path, pieces = documented()
    assert 1 <= len(path) <= 10, path
    for f in path + [p for p in pieces if not p.endswith("*")]:
        assert (ROOT / f).is_file(), f
    assert "kernels/*" in pieces and "opid_mega/envs/*" in pieces


@pytest.mark.slow
def test_one_iteration_enters_only_the_documented_files(tiny_cfg, tmp_path):
    from opid_mega.trainer import Trainer

    cfg = tiny_cfg("scoring.scorer=fork", "train.save_interval=0")
    tr = Trainer(cfg, str(tmp_path))
    seen: set = set()

    def profile(frame, event, arg):
        if event == "call":
            f = frame.f_code.co_filename
            if f.startswith(str(ROOT) + os.sep):
                rel = os.path.relpath(f, ROOT)
                if rel.startswith(("opid_mega" + os.sep, "kernels" + os.sep)):
                    seen.add(rel)

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        tr.iteration(1)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        tr.close()
    path, pieces = documented()
    stray = sorted(f for f in seen if f not in path and not any(fnmatch.fnmatch(f, p) for p in pieces))
    assert not stray, f"the iteration entered files docs/architecture.md does not name: {stray}"
    missed = sorted(set(path) - seen)
    assert not missed, f"files on the documented path that the iteration never entered: {missed}"
