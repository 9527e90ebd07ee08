"""The server's layout holds across its packages: no import cycle among llmserve's modules, none of them past
400 lines, the engine knows nothing of gRPC, and the edge (the api package, config, history, auth, request log)
imports no tensor library itself.

The engine's own rules (the backend seam, device checks) are in tests/engine/test_layout.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import llmserve
from tests.engine.test_layout import MAX_LINES, assert_acyclic

PACKAGE = Path(llmserve.__file__).parent
# Modules the gRPC edge and the flags are made of: they must load without torch (the served process makes its
# process settings before torch loads; see tests/test_process.py for the import itself).
TORCH_FREE = (
    "config",
    "api/__init__",
    "api/admission",
    "api/convert",
    "api/errors",
    "api/limits",
    "api/prompts",
    "api/servicer",
    "api/adapter_servicer",
    "flags",
    "history/__init__",
    "history/codec",
    "history/config",
    "history/errors",
    "history/reasons",
    "history/records",
    "history/store",
    "history/lease",
    "history/memory",
    "history/sqlite_store",
    "history/redis_store",
    "auth",
    "telemetry/request_log",
    "telemetry/call",
    "telemetry/histogram",
    "process",
    "__main__",
    "engine/request",
    "engine/errors",
    "engine/delta",
    "engine/sequence",
    "engine/outputs",
    "engine/commands",
    "engine/protocol",
    "engine/facts",
    "engine/constraints",
    "engine/compiling",
    "engine/core_client",
    "engine/core_messages",
    "engine/core_process",
)


def module_name(path: Path) -> str:
    parts = ["llmserve", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, *, module_level_only: bool = False) -> set[str]:
    """The modules a file imports (inside functions too unless module_level_only; not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    nodes: list[ast.AST] = []
    if module_level_only:
        for node in tree.body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            nodes.extend(ast.walk(node))
    else:
        nodes = list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_no_import_cycle_among_the_servers_modules() -> None:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {
        name: {m for m in imports(path, module_level_only=True) if m in modules and m != name}
        for name, path in modules.items()
    }
    assert {"llmserve.api.servicer", "llmserve.engine.core", "llmserve.config"} <= set(graph)
    assert_acyclic(graph)


def test_every_module_is_at_most_400_lines() -> None:
    lengths = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {name: n for name, n in lengths.items() if n > MAX_LINES} == {}


def test_the_engine_imports_no_grpc() -> None:
    offenders = {
        str(p.relative_to(PACKAGE)): sorted(m for m in imports(p) if m.split(".")[0] in {"grpc", "google"})
        for p in (PACKAGE / "engine").rglob("*.py")
    }
    assert not {k: v for k, v in offenders.items() if v}


def test_the_edge_and_the_flags_import_no_tensor_library() -> None:
    offenders = {}
    for name in TORCH_FREE:
        found = imports(PACKAGE / f"{name}.py", module_level_only=True)
        heavy = sorted(m for m in found if m.split(".")[0] in {"torch", "numpy", "transformers"})
        if heavy:
            offenders[name] = heavy
    assert not offenders


@pytest.mark.parametrize("module", ["request", "constraints", "core_process"])
def test_the_request_types_the_constraints_and_the_core_client_import_no_tensor_library_at_all(module: str) -> None:
    """engine/request.py names no tensor type, not even for type checking (the sampler keeps the random streams,
    engine/generators.py); the constraint checker and compiler are torch-free (the masks are the sampler's); the
    engine process's client loads none (the server starts it before torch). Importing each in a fresh interpreter
    loads no tensor library."""
    import subprocess
    import sys

    if module == "request":
        found = imports(PACKAGE / "engine" / "request.py")
        assert not sorted(m for m in found if m.split(".")[0] in {"torch", "numpy", "transformers"})
    code = (
        f"import sys, llmserve.engine.{module}; "
        "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]
