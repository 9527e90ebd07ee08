"""The engine's layout holds: no import cycle among its modules, none of them past ~400 lines, the step plan and
the backend protocol where a reader looks for them, and only the backend factory asking which device it is on."""

from __future__ import annotations

import ast
from pathlib import Path

import llmserve.engine

ENGINE = Path(llmserve.engine.__file__).parent
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = ["llmserve", "engine", *path.relative_to(ENGINE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def engine_imports() -> dict[str, set[str]]:
    """Every engine module -> the engine modules it imports (at module level or inside functions; not the imports
    made for type checking only, which never run)."""
    modules = {module_name(p): p for p in ENGINE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        tree = ast.parse(path.read_text())
        for guard in [n for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)]:
            guard.body = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def assert_acyclic(graph: dict[str, set[str]]) -> None:
    """Fails naming the first import cycle found in a module -> imported modules graph."""
    visiting: list[str] = []
    done: set[str] = set()

    def visit(name: str) -> None:
        if name in done:
            return
        assert name not in visiting, " -> ".join([*visiting[visiting.index(name) :], name])
        visiting.append(name)
        for dep in sorted(graph[name]):
            visit(dep)
        visiting.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def test_no_import_cycle_among_engine_modules() -> None:
    graph = engine_imports()
    assert "llmserve.engine.core" in graph and "llmserve.engine.backends.cpu.backend" in graph
    assert_acyclic(graph)


def test_engine_modules_stay_short() -> None:
    long = {p.name: n for p in ENGINE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_the_seam_is_where_a_reader_looks() -> None:
    from llmserve.engine.backends.base import Backend
    from llmserve.engine.plan import SeqStep, StepPlan

    assert {"execute", "num_blocks", "name", "description"} <= set(dir(Backend)) | set(Backend.__annotations__)
    assert {"start", "token_ids", "block_table", "sample"} <= set(SeqStep.__slots__)
    assert {"seqs", "copies"} <= set(StepPlan.__slots__)
    backends = {p.stem for p in (ENGINE / "backends").iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert {"base", "torch_paged", "cpu", "cuda"} <= backends


def test_only_the_backends_ask_which_device_they_are_on() -> None:
    """`device.type` and `is_cuda` checks live in backends/ (the factory picks one; each knows its own)."""
    askers = {
        str(p.relative_to(ENGINE))
        for p in ENGINE.rglob("*.py")
        if ".type ==" in p.read_text() or "is_cuda" in p.read_text() or "cuda.is_available" in p.read_text()
    }
    assert all(a.startswith("backends/") or a == "sampler.py" for a in askers), askers
