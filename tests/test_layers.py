"""The package's import graph has no circle and no import from a lower layer to a higher one (docs/architecture.md).

Every `import` / `from ... import` of opid_mega in the package's source counts, function-level ones included (read
with `ast`, nothing is imported). A node is a sub-package (opid_mega.rollout, ...) or a module at the package's top
(opid_mega.trainer, ...); an import inside one node is free, an import across nodes must go to a strictly lower layer.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# low -> high; a node imports only nodes of lower layers
LAYERS = [
    ["opid_mega.warm_starts"],
    ["opid_mega", "opid_mega.infra", "opid_mega.models", "opid_mega.placement", "opid_mega.kernels",
     "opid_mega.plugins"],
    ["opid_mega.algo"],
    ["opid_mega.batching"],
    ["opid_mega.scoring"],
    ["opid_mega.envs"],
    ["opid_mega.skills"],
    ["opid_mega.config"],
    ["opid_mega.rollout"],
    ["opid_mega.megatron"],
    ["opid_mega.experience", "opid_mega.metrics", "opid_mega.rundir", "opid_mega.sft",
     "opid_mega.plan", "opid_mega.checks"],
    ["opid_mega.pipeline"],
    ["opid_mega.export", "opid_mega.report", "opid_mega.trainer"],
    ["opid_mega.cli", "opid_mega.bench"],
]
LAYER = {node: i for i, nodes in enumerate(LAYERS) for node in nodes}


def _modules() -> dict:
    """module name -> source file (the kernels' sources live in kernels/ and install as opid_mega.kernels)."""
    out = {}
    for base, prefix in ((ROOT / "opid_mega", ["opid_mega"]), (ROOT / "kernels", ["opid_mega", "kernels"])):
        for p in base.rglob("*.py"):
            rel = list(p.relative_to(base).with_suffix("").parts)
            if "cpu_shims" in rel:  # stand-ins for other packages, loaded by SGLang's server process only
                continue
            name = ".".join(prefix + (rel[:-1] if rel[-1] == "__init__" else rel))
            out[name] = p
    return out


def _imports(name: str, path: Path, modules: dict) -> set:
    def known(mod: str):
        while mod and mod not in modules:
            mod = mod.rpartition(".")[0]
        return mod or None

    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Import):
            targets = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                parts = pkg.split(".")
                base = ".".join(parts[:len(parts) - (n.level - 1)] + ([n.module] if n.module else []))
            # `from pkg import name`: the module pkg.name when it is one, else pkg itself
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in n.names]
        else:
            continue
        out |= {known(t) for t in targets if t.startswith("opid_mega")}
    out.discard(None)
    out.discard(name)
    return out


def _node(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2])


def _graph():
    modules = _modules()
    return modules, {m: _imports(m, p, modules) for m, p in modules.items()}


def _circles(graph: dict) -> list:
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_every_node_has_a_layer():
    modules, _ = _graph()
    assert sorted({_node(m) for m in modules} - set(LAYER)) == []


def test_no_import_circle_between_files():
    _, graph = _graph()
    # a package's __init__ re-exporting its own modules is not a circle with them
    files = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}
    assert _circles(files) == []


def test_no_import_runs_up_a_layer_or_in_a_circle_between_folders():
    _, graph = _graph()
    up = sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts
                if _node(m) != _node(t) and LAYER[_node(t)] >= LAYER[_node(m)])
    assert up == []
    nodes: dict = {}
    for m, ts in graph.items():
        nodes.setdefault(_node(m), set()).update(_node(t) for t in ts if _node(t) != _node(m))
    assert _circles(nodes) == []


def test_the_checker_sees_an_upward_and_a_function_level_import(tmp_path):
    """The graph reads imports inside functions and relative ones (what the checks above rely on)."""
    pkg = tmp_path / "opid_mega"
    (pkg / "algo").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "algo" / "__init__.py").write_text("from .x import f\n")
    (pkg / "algo" / "x.py").write_text("def f():\n    from opid_mega.trainer import Trainer\n    return Trainer\n")
    (pkg / "trainer.py").write_text("from opid_mega import algo\n")
    modules = {"opid_mega": pkg / "__init__.py", "opid_mega.algo": pkg / "algo" / "__init__.py",
               "opid_mega.algo.x": pkg / "algo" / "x.py", "opid_mega.trainer": pkg / "trainer.py"}
    assert _imports("opid_mega.algo.x", modules["opid_mega.algo.x"], modules) == {"opid_mega.trainer"}
    assert _imports("opid_mega.algo", modules["opid_mega.algo"], modules) == {"opid_mega.algo.x"}
    assert _imports("opid_mega.trainer", modules["opid_mega.trainer"], modules) == {"opid_mega.algo"}
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    assert _circles({_node(m): {_node(t) for t in ts if _node(t) != _node(m)} for m, ts in graph.items()}) == \
        [["opid_mega.algo", "opid_mega.trainer"]]
