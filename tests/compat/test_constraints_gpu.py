"""tools/constraints-gpu.txt, read offline: exact pins, each with its reason, consistent with what the code and the
compatibility tests target. Whether the set resolves is checked by the README install (tools/install_compat.sh, pip
--dry-run on Python 3.12), where the registry is reachable; the tests run without network."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATH = os.path.join(ROOT, "tools", "constraints-gpu.txt")


def _pins():
    """{name: (version, the comment lines just above it)}."""
    pins, comment = {}, []
    for line in open(PATH):
        line = line.strip()
        if line.startswith("#"):
            comment.append(line)
        elif line:
            m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9_.-]*)==([A-Za-z0-9_.+-]+)", line)
            assert m, f"not an exact pin: {line!r}"
            pins[m.group(1)] = (m.group(2), list(comment))
            comment = []
        else:
            comment = []
    return pins


def test_every_pin_is_exact_and_has_its_reason():
    pins = _pins()
    assert {"torch", "sglang", "megatron-core", "transformer-engine", "triton"} <= set(pins)
    shared = None
    for name, (version, comment) in pins.items():
        shared = comment or shared  # consecutive pins share the comment above the first
        assert shared, f"{name}=={version} has no reason above it"


def test_pins_match_what_the_compatibility_tests_and_install_use():
    pins = _pins()
    install = open(os.path.join(ROOT, "tools", "install_compat.sh")).read()
    assert f'VERSION="{pins["megatron-core"][0]}"' in install  # the megatron-core the 0.19 tests run on
    assert "constraints-gpu.txt" in install and "--dry-run" in install  # the resolvability check of the install
    te = {pins[n][0] for n in ("transformer-engine", "transformer-engine-cu13", "transformer-engine-torch")}
    assert len(te) == 1, te  # Transformer Engine's three packages at one version
    assert pins["triton"][0].split(".")[:2] == ["3", "8"] and pins["torch"][0] == "2.14.1"  # torch 2.14.1: triton~=3.8
