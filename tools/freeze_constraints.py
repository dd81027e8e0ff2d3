"""Print the installed distributions as a pip constraints file (`name==version`, sorted), without this project.

    python tools/freeze_constraints.py > tools/constraints.txt

Unlike `pip freeze`, every line is `name==version` (no `@ file://` URLs, no editable lines), so the file works with
`pip install -c`. Used by tools/update_constraints.sh after the whole suite has passed in that environment.
"""
import importlib.metadata as md
import platform
import re
import sys

SKIP = {"opid-mega", "pip", "setuptools", "wheel"}  # this project, and the installer's own tools


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main() -> int:
    pins = {}
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if not name or canonical(name) in SKIP:
            continue
        pins[canonical(name)] = dist.version
    print(f"# Exact versions the whole test suite last passed with (Python {platform.python_version()}, "
          f"{platform.machine()}, CPU torch). Used by the README install command and tools/install_sglang_cpu.sh.")
    print("# Refresh: bash tools/update_constraints.sh (new venv, newest versions, whole suite, then this file).")
    for name in sorted(pins):
        print(f"{name}=={pins[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
