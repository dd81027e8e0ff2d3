"""`.ci/run` runs exactly the README's install and test commands."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme_commands():
    text = open(os.path.join(ROOT, "README.md")).read()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    install = next(b.strip() for b in blocks if b.strip().startswith("pip install torch=="))
    test = next(b.strip() for b in blocks if b.strip().startswith("python -m pytest"))
    return install, test


def test_ci_runs_the_readme_commands():
    install, test = _readme_commands()
    ci = [line.strip() for line in open(os.path.join(ROOT, ".ci", "run")).read().splitlines()]
    assert install in ci, "the README install command is not in .ci/run"
    assert test in ci, "the README test command is not in .ci/run"
    assert "torch==2.13.0" in install and "-m pytest" in test and "-m" not in test.replace("-m pytest", "")


def test_ci_fails_on_pytest_exit_5():
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert re.search(r"-eq 5 \].*exit 1", ci)


def test_install_uses_the_constraints_file():
    install, _ = _readme_commands()
    assert "-c tools/constraints.txt" in install
    pins = {}
    for line in open(os.path.join(ROOT, "tools", "constraints.txt")).read().splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and version and " " not in line, f"not an exact pin: {line!r}"
            pins[name] = version
    for name in ("torch", "pytest", "pytest-xdist", "hypothesis", "transformers", "megatron-core", "triton", "sglang", "textworld",
                 "jericho", "bm25s", "numpy"):
        assert name in pins, f"{name} is not pinned in tools/constraints.txt"
    assert pins["torch"].startswith("2.13.0") and "opid-mega" not in pins
    # the SGLang CPU installer applies the same file unless told otherwise
    script = open(os.path.join(ROOT, "tools", "install_sglang_cpu.sh")).read()
    assert "tools/constraints.txt" in script and '"${pin_args[@]}"' in script
