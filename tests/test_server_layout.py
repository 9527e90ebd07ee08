"""The server's layout holds: the folders draw the engine's layers (docs/architecture.md), the packages import only
what docs/layers.md's table allows them (no package cycle: the table is a stack), no import cycle among llmserve's
modules (those made for type checking and inside functions included), the front end imports no backend, no engine
class split across files by inheritance (no mixin, no multiple inheritance, no NotImplementedError stub, no attribute
declared in one class and assigned in another), the engine knows nothing of gRPC, and the front end runs without a
tensor library: no torch import is reachable from engine/frontend/, the shared types and the edge the server process
runs.

Module length is no rule here: a module holds one role, whatever its length (STYLE.md).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import llmserve

PACKAGE = Path(llmserve.__file__).parent
ENGINE = PACKAGE / "engine"
BACKENDS = "llmserve.engine.backends"
LAYER_TABLE = Path(__file__).resolve().parents[1] / "docs" / "layers.md"
TENSOR_LIBRARIES = {"torch", "numpy", "transformers", "triton", "safetensors", "peft"}
# The engine's layers, one folder each (docs/architecture.md).
LAYERS = ("types", "frontend", "core", "sched", "sample", "spec", "lora", "kv_tiers", "backends")
# The modules the server process runs besides engine/frontend/ (the engine in a process of its own): the flags,
# the gRPC edge, its stores and its telemetry, the types they share with the engine, and the torch-free side of the
# core it talks to.
SERVER_PROCESS = (
    "__main__",
    "app",
    "config",
    "flags",
    "process_settings",
    "auth",
    "api",
    "history",
    "telemetry",
    "engine.types",
)
# Packages whose __init__.py holds only their docstring: no package of their own in the layer table.
DOCSTRING_PACKAGES = ("llmserve", "llmserve.engine")
CORE_CLIENT_SIDE = ("engine.core.client", "engine.core.process")


def module_name(path: Path) -> str:
    parts = ["llmserve", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def _module_level(tree: ast.Module) -> Iterator[ast.AST]:
    """The nodes that run when the module is imported: not inside functions, not under `if TYPE_CHECKING:`."""
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def imported(path: Path, *, at_import_only: bool) -> set[str]:
    """The modules a file names in its imports, llmserve's resolved to a module of MODULES (`from pkg import mod`
    names mod), others by their full dotted name. `at_import_only`: what runs when the module is imported (not inside
    functions, not for type checking); else every import, type-level and lazy ones included."""
    tree = ast.parse(path.read_text())
    nodes = _module_level(tree) if at_import_only else ast.walk(tree)
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in MODULES else node.module)
    return found


def llmserve_graph(*, at_import_only: bool) -> dict[str, set[str]]:
    """Every llmserve module -> the llmserve modules it imports."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        owners = {_owner(m) for m in imported(path, at_import_only=at_import_only)}
        graph[name] = {m for m in owners if m is not None and m != name}
    return graph


def _owner(name: str) -> str | None:
    """The llmserve module that `name` is or is in (an attribute path resolves to its module), or None."""
    while name and name not in MODULES:
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return name or None


def first_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """The first import cycle found in a module -> imported modules graph, or None."""
    visiting: list[str] = []
    done: set[str] = set()

    def visit(name: str) -> list[str] | None:
        if name in done:
            return None
        if name in visiting:
            return [*visiting[visiting.index(name) :], name]
        visiting.append(name)
        for dep in sorted(graph[name]):
            cycle = visit(dep)
            if cycle is not None:
                return cycle
        visiting.pop()
        done.add(name)
        return None

    for name in sorted(graph):
        cycle = visit(name)
        if cycle is not None:
            return cycle
    return None


def test_the_folders_are_the_engines_layers() -> None:
    folders = {p.name for p in ENGINE.iterdir() if (p / "__init__.py").exists()}
    assert set(LAYERS) <= folders, sorted(set(LAYERS) - folders)
    loose = sorted(p.name for p in ENGINE.glob("*.py") if p.name not in {"__init__.py", "config.py"})
    assert loose == [], f"every engine module lives in its layer's folder: {loose}"


def test_no_import_cycle_among_llmserves_modules_type_level_ones_included() -> None:
    graph = llmserve_graph(at_import_only=False)
    assert {"llmserve.api.servicer", "llmserve.engine.core.engine_core", "llmserve.config"} <= set(graph)
    cycle = first_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_first_cycle_finds_a_cycle() -> None:
    assert first_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert first_cycle({"a": {"b"}, "b": set()}) is None


def package_of(module: str) -> str:
    """The package a module belongs to, as docs/layers.md names it: `api/`, `engine/sched/`, a loose module by its
    file name (`config.py`, `engine/config.py`)."""
    parts = module.split(".")[1:]
    if parts[:1] == ["engine"] and len(parts) > 1:
        return f"engine/{parts[1]}/" if (ENGINE / parts[1]).is_dir() else f"engine/{parts[1]}.py"
    return f"{parts[0]}/" if (PACKAGE / parts[0]).is_dir() else f"{parts[0]}.py"


def layer_table(text: str) -> dict[str, set[str]]:
    """A layer table's rows: each package (its first cell) -> the packages it may import (those named in its last
    cell; "nothing" names none)."""
    rows: dict[str, set[str]] = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 2 or not re.fullmatch(r"`[^`]+`", cells[0]):
            continue
        rows[cells[0].strip("`")] = set(re.findall(r"`([^`]+)`", cells[-1]))
    return rows


def package_imports(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """(package, package it imports) -> the module imports that make the edge, from a module graph."""
    edges: dict[tuple[str, str], list[str]] = {}
    for name, deps in graph.items():
        if name in DOCSTRING_PACKAGES:
            continue
        for dep in deps:
            if dep not in DOCSTRING_PACKAGES and package_of(name) != package_of(dep):
                edges.setdefault((package_of(name), package_of(dep)), []).append(f"{name} -> {dep}")
    return edges


def test_package_of_names_packages_as_the_table_does() -> None:
    assert package_of("llmserve.engine.sched.scheduler") == "engine/sched/"
    assert package_of("llmserve.engine.backends.cpu.quant") == "engine/backends/"
    assert package_of("llmserve.engine.config") == "engine/config.py"
    assert package_of("llmserve.models.loader") == "models/"
    assert package_of("llmserve.api") == "api/"
    assert package_of("llmserve.config") == "config.py"


def test_the_layer_table_names_every_package_once_and_is_a_stack() -> None:
    """docs/layers.md has a row for every package of llmserve and for nothing else, every package a row allows is
    one of them, and the rows form no cycle (so that no two packages can import each other within the rules)."""
    table = layer_table(LAYER_TABLE.read_text())
    packages = {package_of(m) for m in MODULES if m not in DOCSTRING_PACKAGES}
    missing, extra = sorted(packages - set(table)), sorted(set(table) - packages)
    assert set(table) == packages, {"no row": missing, "no package": extra}
    assert {p for allowed in table.values() for p in allowed} <= packages
    cycle = first_cycle(table)
    assert cycle is None, " -> ".join(cycle or [])
    assert layer_table("| `a/` | what | `b/`, `c.py` |\n| `b/` | what | nothing |\n| x | y | z |") == {
        "a/": {"b/", "c.py"},
        "b/": set(),
    }


def test_packages_import_only_what_the_layer_table_allows() -> None:
    """Every import across packages (type-level and lazy ones included) is one its package's row of docs/layers.md
    allows; the packages docstring-only import nothing of llmserve."""
    table = layer_table(LAYER_TABLE.read_text())
    graph = llmserve_graph(at_import_only=False)
    assert all(not graph[name] for name in DOCSTRING_PACKAGES), {name: graph[name] for name in DOCSTRING_PACKAGES}
    unlisted = {
        f"{package} -> {imported_package}": sorted(via)
        for (package, imported_package), via in package_imports(graph).items()
        if imported_package not in table.get(package, set())
    }
    assert unlisted == {}


def test_no_import_cycle_among_llmserves_packages() -> None:
    """The packages' own graph, from the imports themselves (whatever the table says): no cycle."""
    edges = package_imports(llmserve_graph(at_import_only=False))
    packages: dict[str, set[str]] = {}
    for package, imported_package in edges:
        packages.setdefault(package, set()).add(imported_package)
        packages.setdefault(imported_package, set())
    assert {"engine/sched/", "engine/lora/", "engine/kv_tiers/", "engine/types/", "models/"} <= set(packages)
    cycle = first_cycle(packages)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_front_end_imports_no_backend() -> None:
    """No module of engine/frontend/ imports engine/backends/, not even for type checking or inside a function: what
    it needs of a loaded model is engine/types/model.py's."""
    graph = llmserve_graph(at_import_only=False)
    offenders = {
        name: sorted(dep for dep in deps if dep.startswith("llmserve.engine.backends"))
        for name, deps in graph.items()
        if name.startswith("llmserve.engine.frontend")
    }
    assert {name: deps for name, deps in offenders.items() if deps} == {}


def _engine_classes() -> Iterator[tuple[str, ast.ClassDef]]:
    for name, path in MODULES.items():
        if name.startswith("llmserve.engine"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    yield name, node


def _is_stub(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    body = [s for s in function.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return (
        len(body) == 1
        and isinstance(body[0], ast.Raise)
        and body[0].exc is not None
        and "NotImplementedError" in ast.unparse(body[0].exc)
    )


def _declares_only(node: ast.ClassDef) -> bool:
    """Whether the class's annotations are its fields or its interface (a dataclass, a protocol, a named tuple, an
    enum, a typed dict): there an annotation without a value is no promise that another class assigns it."""
    bases = {ast.unparse(b).split("[")[0].rsplit(".", 1)[-1] for b in node.bases}
    decorators = {ast.unparse(d).split("(")[0].rsplit(".", 1)[-1] for d in node.decorator_list}
    return bool(bases & {"Protocol", "NamedTuple", "TypedDict", "Enum", "IntEnum"} or "dataclass" in decorators)


def test_no_engine_class_is_split_across_files_by_inheritance() -> None:
    """No mixin among the engine's classes: no multiple inheritance, no method that only raises NotImplementedError
    (for a subclass elsewhere to fill in), and no attribute a class declares but never assigns itself (so that
    another class, mixed in with it, must)."""
    several, stubs, declared = [], [], []
    for module, node in _engine_classes():
        bases = [ast.unparse(b) for b in node.bases if ast.unparse(b).split("[")[0] not in {"Generic", "Protocol"}]
        if len(bases) > 1:
            several.append(f"{module}.{node.name}({', '.join(bases)})")
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_stub(item):
                stubs.append(f"{module}.{node.name}.{item.name}")
        if _declares_only(node):
            continue
        annotated = {
            item.target.id
            for item in node.body
            if isinstance(item, ast.AnnAssign) and item.value is None and isinstance(item.target, ast.Name)
        }
        assigned = {
            target.attr
            for item in ast.walk(node)
            if isinstance(item, (ast.Assign, ast.AnnAssign, ast.AugAssign))
            for target in (item.targets if isinstance(item, ast.Assign) else [item.target])
            for target in ([target] if not isinstance(target, ast.Tuple) else target.elts)
            if isinstance(target, ast.Attribute) and ast.unparse(target.value) in {"self", "cls"}
        }
        declared += [f"{module}.{node.name}.{attr}" for attr in sorted(annotated - assigned)]
    found = {"multiple inheritance": several, "NotImplementedError stubs": stubs, "declared, never assigned": declared}
    assert found == {kind: [] for kind in found}


def test_the_engine_imports_no_grpc() -> None:
    offenders = {
        name: sorted(m for m in imported(path, at_import_only=False) if m.split(".")[0] in {"grpc", "google"})
        for name, path in MODULES.items()
        if name.startswith("llmserve.engine")
    }
    assert not {k: v for k, v in offenders.items() if v}


def _server_process_roots() -> list[str]:
    roots = [n for n in MODULES if n.startswith("llmserve.engine.frontend")]
    roots += [f"llmserve.{n}" for n in CORE_CLIENT_SIDE]
    for part in SERVER_PROCESS:
        roots += [n for n in MODULES if n == f"llmserve.{part}" or n.startswith(f"llmserve.{part}.")]
    return roots


def test_no_tensor_library_is_reachable_from_the_front_end_and_the_edge() -> None:
    """Following the imports that run at import time (not those inside functions, which a LoadedModel's holder
    runs, nor those made for type checking), from every module of engine/frontend/, the core's client side and the
    edge the server process runs: no tensor library is reached. Names the first path to one."""
    roots = _server_process_roots()
    assert "llmserve.engine.frontend.async_engine" in roots and "llmserve.api.servicer" in roots
    seen: dict[str, list[str]] = {root: [root] for root in roots}
    queue = list(roots)
    reached: dict[str, list[str]] = {}
    while queue:
        name = queue.pop()
        for found in imported(MODULES[name], at_import_only=True):
            top = found.split(".")[0]
            if top in TENSOR_LIBRARIES:
                reached.setdefault(top, [*seen[name], found])
            owner = _owner(found)
            # Importing a module imports its parent packages first.
            for module in _with_parents(owner):
                if module not in seen:
                    seen[module] = [*seen[name], module]
                    queue.append(module)
    assert reached == {}, {lib: " -> ".join(path) for lib, path in reached.items()}


def _with_parents(name: str | None) -> list[str]:
    if name is None:
        return []
    parts = name.split(".")
    return [m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if m in MODULES]


def test_importing_the_front_end_and_the_edge_loads_no_tensor_library() -> None:
    """The same in a fresh interpreter: every such module imported, none of the tensor libraries is loaded."""
    roots = [m for m in _server_process_roots() if m != "llmserve.__main__"]
    code = (
        f"import importlib, sys; [importlib.import_module(m) for m in {sorted(roots)!r}]; "
        f"print(sorted(m for m in {sorted(TENSOR_LIBRARIES)!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]


def test_the_layers_import_only_what_the_layer_rules_say() -> None:
    """docs/layers.md: the books (sched/) and sampling (sample/) import no step loop, backend, speculation or
    asyncio front end; backends/ import no step loop, speculation or front end; speculation, LoRA and the KV tiers,
    each reached through one object the core holds, import no step loop; the front end imports of the core only its
    client side; the core imports nothing of the front end's asyncio side; the models package is imported by the
    engine process's loading alone, inside the function that loads. Type-level imports count."""
    graph = llmserve_graph(at_import_only=False)
    front_async = {
        f"llmserve.engine.frontend.{m}" for m in ("async_engine", "output_processor", "detokenizer", "fanout")
    }
    core = {n for n in MODULES if n.startswith("llmserve.engine.core.")}
    client_side = {f"llmserve.{n}" for n in CORE_CLIENT_SIDE}
    backends = {n for n in MODULES if n.startswith("llmserve.engine.backends")}
    spec = {n for n in MODULES if n.startswith("llmserve.engine.spec")}
    forbidden = {
        "llmserve.engine.sched": core | backends | front_async | spec,
        "llmserve.engine.sample": core | backends | front_async | spec,
        "llmserve.engine.backends": core | front_async | spec,
        "llmserve.engine.spec": core | front_async,
        "llmserve.engine.lora": core | front_async | spec,
        "llmserve.engine.kv_tiers": core | front_async | spec,
        "llmserve.engine.frontend": core - client_side,
        "llmserve.engine.core.": front_async,
    }
    # The one lazy import across: AsyncEngine handed a LoadedModel (torch is loaded already) builds its core here.
    composed = {"llmserve.engine.frontend.async_engine": {"llmserve.engine.core.engine_core"}}
    broken = {
        name: sorted(graph[name] & never - composed.get(name, set()))
        for prefix, never in forbidden.items()
        for name in graph
        if name.startswith(prefix) and graph[name] & never - composed.get(name, set())
    }
    assert broken == {}
    models = {n for n in MODULES if n.startswith("llmserve.models")}
    loaders = {n for n in graph if graph[n] & models and n not in models}
    assert loaders == {"llmserve.engine.core.process"}
    assert not llmserve_graph(at_import_only=True)["llmserve.engine.core.process"] & models


def test_the_seam_is_where_a_reader_looks() -> None:
    from llmserve.engine.backends.base import Backend
    from llmserve.engine.sched.plan import SeqStep, StepPlan

    seam = set(dir(Backend)) | set(Backend.__annotations__)
    assert {"execute", "release", "num_blocks", "name", "description"} <= seam
    assert {"start", "token_ids", "block_table", "sample"} <= set(SeqStep.__slots__)
    assert {"seqs", "copies"} <= set(StepPlan.__slots__)
    backends = {p.stem for p in (ENGINE / "backends").iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert {"base", "paged", "torch_paged", "cpu", "cuda"} <= backends


def test_no_backend_derives_from_another() -> None:
    """The backends share code through collaborators each holds (backends/paged.py), never by deriving from one
    another and undoing what the parent's constructor built."""
    classes = {node.name: (module, node) for module, node in _engine_classes() if module.startswith(BACKENDS)}
    derived = [
        f"{module}.{node.name}({ast.unparse(base)})"
        for module, node in classes.values()
        for base in node.bases
        if ast.unparse(base).rsplit(".", 1)[-1] in classes
    ]
    assert derived == []


def test_what_a_backend_keeps_per_sequence_is_read_only_behind_it() -> None:
    """Random streams, pooling states and prompt scores live behind the Backend protocol: no module outside
    backends/ reaches into a backend's attributes for them (the core calls `release`, speculation `mark_stream`,
    the overlapped runner `rewind_stream`)."""
    reaching = []
    for name, path in MODULES.items():
        if name.startswith("llmserve.engine") and not name.startswith(BACKENDS):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr in {"streams", "pooling", "prompt_scores", "paged"}:
                    if ast.unparse(node.value).rsplit(".", 1)[-1] == "backend":
                        reaching.append(f"{name}: {ast.unparse(node)}")
    assert reaching == []


def test_only_the_backends_and_the_sampler_ask_which_device_they_are_on() -> None:
    """`device.type` and `is_cuda` checks live in backends/ (the factory picks one; each knows its own) and in the
    sampler (which picks its top-p method by device)."""
    askers = {
        str(p.relative_to(ENGINE))
        for p in ENGINE.rglob("*.py")
        if ".type ==" in p.read_text() or "is_cuda" in p.read_text() or "cuda.is_available" in p.read_text()
    }
    assert all(a.startswith("backends/") or a == "sample/sampler.py" for a in askers), askers


@pytest.mark.parametrize("module", ["types.request", "sample.constraints", "core.process"])
def test_the_request_types_the_constraints_and_the_core_client_import_no_tensor_library_at_all(module: str) -> None:
    """types/request.py names no tensor type, not even for type checking (the sampler keeps the random streams,
    sample/streams.py); the constraint checker and compiler are torch-free (the masks are the sampler's); the
    engine process's client loads none (the server starts it before torch). Importing each in a fresh interpreter
    loads no tensor library."""
    if module == "types.request":
        found = imported(ENGINE / "types" / "request.py", at_import_only=False)
        assert not sorted(m for m in found if m.split(".")[0] in TENSOR_LIBRARIES)
    code = (
        f"import sys, llmserve.engine.{module}; "
        f"print(sorted(m for m in {sorted(TENSOR_LIBRARIES)!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]
