"""Two lanes for the suite on a 2-core machine (`python -m pytest -n 2`, pytest-xdist).

Most of the suite's time goes to tests that already use both cores: multi-rank launches, SGLang servers, torch with
two OpenMP threads. The rest are single-process tests whose time is mostly one core's Python (Triton's interpreter,
config and parsing checks, small torch ops). Run side by side on one core each, those finish in about half the
wall time; run side by side with a two-core test, either one is slowed and timing-sensitive tests suffer.

So the scheduler here (xdist's `pytest_xdist_make_scheduler` hook) runs the suite in two phases:

1. **Paired**: the files of PAIRED, a whole file at a time, on both workers at once; each worker runs them with one
   torch thread and OMP_NUM_THREADS=1 (one core each).
2. **Alone**: every other file, on one worker, with the machine's usual threads, once the other worker has ended:
   nothing runs beside them, as in a serial run.

A file is in PAIRED when a serial run of it keeps the machine at about one busy core (/proc/stat's busy time over
the file's time, <= ~1.3: its own Python, or one child process at a time with one thread), it starts no SGLang
server, torchrun launch, multi-rank run or simulated node, gives no child two threads, and shares no session fixture
with a file of the other lane (the SGLang server pool, the shared runs of tests/trainer). Pairing the pool's files or
the server-signal tests as well (their processes mostly wait) saved ~1.5 min more but starved the deadline tests
beside them. A file that is not listed simply runs alone: forgetting one costs time, never correctness. `-n 2` with
an explicit `--dist` other than `load` keeps xdist's own scheduling; without `-n` the suite runs serially as before.
"""
from __future__ import annotations

import os
from collections import deque

import pytest

# About one core each (listed alphabetically; they are sent in the order pytest collects them).
PAIRED = frozenset(
    """
    tests/batching/test_batch_builder.py
    tests/batching/test_fuzz.py
    tests/batching/test_layout.py
    tests/batching/test_optional_extension.py
    tests/bench/test_scoring_ops.py
    tests/bench/test_systems_ops.py
    tests/compat/test_constraints_gpu.py
    tests/envs/test_alfworld.py
    tests/envs/test_env_process.py
    tests/envs/test_footprints.py
    tests/envs/test_search_qa.py
    tests/envs/test_webshop.py
    tests/infra/test_shutdown.py
    tests/infra/test_tether.py
    tests/kernels/test_kernel_logprob_main_grad.py
    tests/kernels/test_kernel_triton_compile.py
    tests/megatron/test_checkpoint_rng_fallback.py
    tests/megatron/test_checkpoint_writer.py
    tests/megatron/test_divergence_paths.py
    tests/megatron/test_fuser_guard.py
    tests/megatron/test_kernel_backend_arg.py
    tests/megatron/test_megatron_lm_args.py
    tests/megatron/test_megatron_lm_builder_019.py
    tests/megatron/test_megatron_quick.py
    tests/megatron/test_model_dtype.py
    tests/megatron/test_packed_attention.py
    tests/megatron/test_te_extra_state.py
    tests/megatron/test_te_guard.py
    tests/megatron/test_train_batches.py
    tests/megatron/test_varlen_attention.py
    tests/rollout/test_agent_loop.py
    tests/rollout/test_colocation.py
    tests/rollout/test_cuda_ipc_payloads.py
    tests/rollout/test_failover.py
    tests/rollout/test_free_port.py
    tests/rollout/test_local_engine.py
    tests/rollout/test_models.py
    tests/rollout/test_server_dtype.py
    tests/rollout/test_sglang_fake_session.py
    tests/skills/test_hindsight_analyzer.py
    tests/skills/test_injection.py
    tests/skills/test_llm_analyzer.py
    tests/skills/test_llm_analyzer_audit.py
    tests/skills/test_parser.py
    tests/skills/test_sanitize.py
    tests/skills/test_standin.py
    tests/test_advantage_maths.py
    tests/test_algo.py
    tests/test_bench.py
    tests/test_ci_strict.py
    tests/test_config.py
    tests/test_config_numbers.py
    tests/test_config_yaml.py
    tests/test_gpu_check.py
    tests/test_gpu_wheels.py
    tests/test_layers.py
    tests/test_logging.py
    tests/test_mechanism.py
    tests/test_mechanism_v3.py
    tests/test_mechanism_v4.py
    tests/test_metrics.py
    tests/test_readme.py
    tests/test_reference_facts.py
    tests/test_report.py
    tests/test_routing.py
    tests/test_rundir.py
    tests/test_secrets.py
    tests/test_startup_checks.py
    tests/trainer/test_advantages.py
    tests/trainer/test_async_tool.py
    tests/trainer/test_cli_configs.py
    tests/trainer/test_colocation_trainer.py
    tests/trainer/test_custom_algo.py
    tests/trainer/test_experience.py
    tests/trainer/test_fidelity_configs.py
    tests/trainer/test_fidelity_reference_behaviours.py
    tests/trainer/test_fidelity_skill_context_truncation.py
    tests/trainer/test_iteration_files.py
    tests/trainer/test_modes.py
    tests/trainer/test_pipeline.py
    tests/trainer/test_sft_data.py
    tests/trainer/test_sft_skills.py
    tests/trainer/test_trainer_iteration.py
""".split()
)


def lane_of(nodeid: str) -> str:
    """'paired' or 'alone': the lane of a test by its file."""
    return "paired" if nodeid.split("::", 1)[0] in PAIRED else "alone"


def _units(collection: list[str]) -> tuple[deque, deque]:
    """The collection's indices grouped by file (a file's tests go to one worker together, so module fixtures are
    built once), in collection order: (paired units, alone units)."""
    paired, alone, by_file = deque(), deque(), {}
    for index, nodeid in enumerate(collection):
        path = nodeid.split("::", 1)[0]
        if path not in by_file:
            by_file[path] = []
            (paired if path in PAIRED else alone).append(by_file[path])
        by_file[path].append(index)
    return paired, alone


class LaneScheduling:
    """xdist scheduler: the paired files on every worker, then the others on the last worker left (see the module's
    docstring). The interface is xdist's (xdist/scheduler/protocol.py); a worker runs an item once it knows the next
    one or is told to shut down, so every worker is kept at two or more pending items or shut down."""

    def __init__(self, config, log=None):
        from xdist.remote import Producer
        from xdist.workermanage import parse_tx_spec_config

        self.config = config
        self.numnodes = len(parse_tx_spec_config(config))
        self.log = Producer("lanes") if log is None else log.lanes
        self.node2collection: dict = {}
        self.node2pending: dict = {}
        self.collection: list[str] | None = None
        self.paired: deque = deque()  # units (lists of indices) not yet sent
        self.alone: deque = deque()

    # --- state xdist reads ---------------------------------------------------------------------------------------
    @property
    def nodes(self) -> list:
        return list(self.node2pending)

    @property
    def collection_is_completed(self) -> bool:
        return len(self.node2collection) >= self.numnodes

    @property
    def tests_finished(self) -> bool:
        if not self.collection_is_completed or self.paired or self.alone:
            return False
        return all(len(pending) < 2 for pending in self.node2pending.values())

    @property
    def has_pending(self) -> bool:
        return bool(self.paired or self.alone or any(self.node2pending.values()))

    # --- events --------------------------------------------------------------------------------------------------
    def add_node(self, node) -> None:
        assert node not in self.node2pending
        self.node2pending[node] = []

    def add_node_collection(self, node, collection) -> None:
        assert node in self.node2pending
        if self.collection is not None and list(collection) != self.collection:  # a replacement worker
            from xdist.report import report_collection_diff

            self.log(report_collection_diff(self.collection, list(collection), "the run", node.gateway.id))
            return
        self.node2collection[node] = list(collection)

    def mark_test_complete(self, node, item_index: int, duration: float = 0) -> None:
        self.node2pending[node].remove(item_index)
        self._fill(node)

    def mark_test_pending(self, item: str) -> None:
        assert self.collection is not None
        index = self.collection.index(item)
        (self.paired if lane_of(item) == "paired" else self.alone).appendleft([index])
        for node in self.nodes:
            self._fill(node)

    def remove_pending_tests_from_node(self, node, indices) -> None:
        raise NotImplementedError("work stealing is not supported by the lanes scheduler")

    def remove_node(self, node):
        """A worker ended: shut down normally (nothing pending) or crashed. A crash's first pending item is the one
        that was running (reported as the crash); the rest go back to the front of their lanes."""
        pending = self.node2pending.pop(node)
        crashitem = None
        if pending:
            assert self.collection is not None
            crashitem = self.collection[pending.pop(0)]
            for index in reversed(pending):
                (self.paired if lane_of(self.collection[index]) == "paired" else self.alone).appendleft([index])
        for other in self.nodes:  # the worker left may now take the alone lane, or the returned items
            self._fill(other)
        return crashitem

    def schedule(self) -> None:
        assert self.collection_is_completed
        if self.collection is None:
            collections = list(self.node2collection.values())
            if any(c != collections[0] for c in collections[1:]):
                from xdist.report import report_collection_diff

                self.log(report_collection_diff(collections[0], next(c for c in collections if c != collections[0]),
                                                "worker 0", "another worker"))
                self.log("**Different tests collected, aborting run**")
                return
            self.collection = collections[0]
            self.paired, self.alone = _units(self.collection)
        for node in self.nodes:
            self._fill(node)

    # --- the policy ----------------------------------------------------------------------------------------------
    def _send(self, node, units: deque, stop_at: int | None) -> None:
        """Whole files from `units` to `node`, until it holds `stop_at` pending items (None: all of them)."""
        indices = []
        while units and (stop_at is None or len(self.node2pending[node]) + len(indices) < stop_at):
            indices.extend(units.popleft())
        if indices:
            self.node2pending[node].extend(indices)
            node.send_runtest_some(indices)

    def _fill(self, node) -> None:
        if node.shutting_down or self.collection is None:
            return
        pending = self.node2pending[node]
        if self.paired:
            self._send(node, self.paired, stop_at=2)
        if self.paired or len(pending) >= 2:
            return
        others = [n for n in self.node2pending if n is not node]
        if any(not n.shutting_down for n in others):  # another worker goes on: this one ends
            node.shutdown()
        elif not others:  # the last worker left: the alone lane, nothing beside it
            self._send(node, self.alone, stop_at=None)
            node.shutdown()
        # else: the others are ending; remove_node fills this one when they have


# --- hooks (imported into tests/conftest.py) ------------------------------------------------------------------------
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """The lanes under `-n N` with xdist's default distribution; an explicit other --dist keeps xdist's own."""
    if config.getoption("dist", "no") != "load":
        return None
    return LaneScheduling(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """Tells the workers that the lanes are on (they set their threads per test)."""
    if node.config.getoption("dist", "no") == "load":
        node.workerinput["lanes"] = True


_THREADS: dict = {}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """On a lanes worker: one torch thread and OMP_NUM_THREADS=1 for a paired test, the usual threads otherwise."""
    workerinput = getattr(item.config, "workerinput", None)
    if not workerinput or not workerinput.get("lanes"):
        return
    import torch

    if not _THREADS:
        _THREADS.update(torch=torch.get_num_threads(), omp=os.environ.get("OMP_NUM_THREADS"))
    if lane_of(item.nodeid) == "paired":
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"
    else:
        torch.set_num_threads(_THREADS["torch"])
        if _THREADS["omp"] is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = _THREADS["omp"]
