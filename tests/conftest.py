"""Suite-wide set-up.

- Triton's CPU interpreter is on from the start when there is no CUDA (see below).
- tests/tolerance.py is importable (`from tolerance import assert_close_scaled`) whatever pytest's import mode
  (--import-mode=importlib does not put test directories on sys.path).
- Strict environment under CI: with the CI variable set (any value but "", "0", "false"), a skipped test fails the
  run. CI's machine has everything the README install brings, root and network namespaces; only a test marked
  ``gpu`` (it needs a CUDA GPU) may skip there. The session ends with one line per skipped test naming the test and
  the missing condition, and exit status 1. Outside CI, skips stay skips with their reason.
- Two lanes under `-n 2` (tests/lanes.py): single-process files side by side, a core each, then every other file
  alone on one worker.
- Time per file: the session ends with the test files that took longer than FILE_BUDGET_S (set-up, call and
  tear-down of their tests summed), slowest first, and the total of the run (the suite's budget: 40 min on the CI
  machine's 2 cores).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


import pytest  # noqa: E402
import torch  # noqa: E402

from lanes import pytest_configure_node, pytest_runtest_setup, pytest_xdist_make_scheduler  # noqa: E402,F401

# Triton chooses interpreter or compiled code when it is first imported (its standard library's @jit functions) and
# when each kernel is decorated. Without CUDA the interpreter must be on before ANY test module imports triton at
# collection (megatron-core does, and opid-bench's tests import megatron-core), or the interpreted kernels of
# tests/kernels fail with "Cannot call @triton.jit'd outside of the scope of a kernel". With CUDA the variable is
# left alone (tools/gpu_check.sh runs the same tests compiled).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test ends with os.environ as it began: code run in-process may set variables (the process-group set-up
    sets MASTER_ADDR / MASTER_PORT, a command's console set-up tokenizer and hub settings), which would otherwise
    leak into later tests."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)



def ci_strict() -> bool:
    """True under CI: every skip but a ``gpu`` test's fails the run."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


_REQUIRED_SKIPS: list[tuple[str, str]] = []  # (node id, reason) of tests CI's machine can run that skipped


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (file, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _note_skip(report) -> None:
    if report.skipped and not hasattr(report, "wasxfail") and "gpu" not in getattr(report, "keywords", {}):
        _REQUIRED_SKIPS.append((report.nodeid, _skip_reason(report)))


FILE_BUDGET_S = 120.0  # a test file over this is named at the end of the run
_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    _note_skip(report)
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + float(getattr(report, "duration", 0.0) or 0.0)


def pytest_collectreport(report):  # a module-level skip (importorskip of a missing package)
    _note_skip(report)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    if ci_strict() and _REQUIRED_SKIPS and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    over = sorted(((s, f) for f, s in _FILE_SECONDS.items() if s > FILE_BUDGET_S), reverse=True)
    total = sum(_FILE_SECONDS.values())
    terminalreporter.section(f"test files over {FILE_BUDGET_S:.0f} s", sep="=")
    for seconds, path in over:
        terminalreporter.line(f"{seconds:8.1f} s  {path}")
    terminalreporter.line(f"{len(over)} of {len(_FILE_SECONDS)} files over {FILE_BUDGET_S:.0f} s; the tests took "
                          f"{total / 60:.1f} min in all")
    if ci_strict() and _REQUIRED_SKIPS:
        terminalreporter.section("required tests skipped under CI", sep="=", red=True, bold=True)
        for nodeid, reason in _REQUIRED_SKIPS:
            terminalreporter.line(f"CI: required test skipped: {nodeid}: {reason}", red=True)
        terminalreporter.line(f"CI: {len(_REQUIRED_SKIPS)} required test(s) skipped; the run fails (only tests marked "
                              "'gpu' may skip under CI)", red=True)
