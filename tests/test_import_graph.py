"""The package floor plan holds: no import cycles, and each layer imports only those below it.

Every import counts: the lazy ones inside functions and those under ``if TYPE_CHECKING:`` too
(a type-only import is a dependency of the reader all the same, and a cycle through one means
two modules that cannot be understood apart).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rolloutstore", "trainer")

# rolloutstore's layers, lowest first: a module may import its own layer's modules and lower
# ones. The facade (RolloutStore) sits on the log and the operations built on it.
STORE_LAYERS = [
    ("rolloutstore.errors", "rolloutstore.options"),
    ("rolloutstore.schema",),
    ("rolloutstore.query",),
    ("rolloutstore.store",),
    ("rolloutstore.retention", "rolloutstore.io"),
    ("rolloutstore.facade",),
    ("rolloutstore.replay", "rolloutstore.integrations"),
    ("rolloutstore.cli", "rolloutstore.__main__", "rolloutstore"),
]

# trainer's layers, lowest first.
LAYERS = [
    ("trainer.errors", "trainer.tasks", "trainer.models"),
    ("trainer.algo",),
    ("trainer.rollout",),
    ("trainer.control", "trainer.config_sections", "trainer.config"),
    ("trainer.run",),
    ("trainer.cli", "trainer.__main__", "trainer.store_commands", "trainer"),
]


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def resolve(mod: str) -> str | None:
        while mod and mod not in known:  # `from a.b import c` may name a function of a.b
            mod = mod.rpartition(".")[0]
        return mod or None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (m := resolve(alias.name)) is not None:
                    found.add(m)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                if (m := resolve(f"{base}.{alias.name}")) is not None:
                    found.add(m)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    found.discard(name)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(name, path, known) for name, path in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def _layer(module: str, layers=LAYERS) -> int | None:
    best = None
    for i, prefixes in enumerate(layers):
        for p in prefixes:
            inside = module == p or module.startswith(p + ".")
            if inside and (best is None or len(p) > best[1]):
                best = (i, len(p))
    return None if best is None else best[0]


def test_the_graph_is_read():
    graph = _graph()
    # A sanity floor, so a broken parser cannot pass the checks below vacuously.
    assert "trainer.algo.learner" in graph["trainer.run.setup"]
    assert "rolloutstore.facade" in graph["rolloutstore"]
    assert "rolloutstore.store.log" in graph["rolloutstore.retention.rescore"]  # type-only


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_rolloutstore_never_imports_trainer():
    bad = {
        (m, d)
        for m, deps in _graph().items()
        if m.startswith("rolloutstore")
        for d in deps
        if d.split(".")[0] == "trainer"
    }
    assert not bad, f"the store layer must not depend on the trainer: {sorted(bad)}"


@pytest.mark.parametrize("module", sorted(m for m in _modules() if m.startswith("trainer")))
def test_trainer_layers(module):
    graph = _graph()
    mine = _layer(module)
    assert mine is not None, f"{module} belongs to no layer; add it to LAYERS"
    upward = [d for d in graph[module] if d.startswith("trainer") and (_layer(d) or 0) > mine]
    assert not upward, f"{module} (layer {mine}) imports higher layers: {upward}"


@pytest.mark.parametrize("module", sorted(m for m in _modules() if m.startswith("rolloutstore")))
def test_store_layers(module):
    graph = _graph()
    mine = _layer(module, STORE_LAYERS)
    assert mine is not None, f"{module} belongs to no layer; add it to STORE_LAYERS"
    upward = [
        d for d in graph[module] if (_layer(d, STORE_LAYERS) or 0) > mine and d != "rolloutstore"
    ]
    assert not upward, f"{module} (layer {mine}) imports higher layers: {upward}"


def test_the_checker_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_architecture_doc_names_every_module():
    """docs/architecture.md matches the tree: each module (or its package) is named there."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    missing = []
    for path in _modules().values():
        if path.name in ("__init__.py", "__main__.py"):
            continue
        rel = path.relative_to(ROOT).as_posix()
        if path.name not in doc and rel not in doc:
            missing.append(rel)
    assert not missing, f"docs/architecture.md does not mention: {missing}"
