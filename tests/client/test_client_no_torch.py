"""The client library imports and runs with its declared dependencies alone: no torch, no transformers,
no server package. Python runs isolated (-I -S) with a path holding only the client and those packages."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

CLIENT = Path(__file__).resolve().parents[2] / "client"


def _requirement_names(requirements: list[str]) -> list[str]:
    return [re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0] for r in requirements]


def _closure(names: list[str]) -> set[str]:
    """The distributions `names` need, transitively, as installed here."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        dist = importlib.metadata.distribution(todo.pop())
        if dist.metadata["Name"].lower() in seen:
            continue
        seen.add(dist.metadata["Name"].lower())
        todo += [n for r in dist.requires or [] if "extra ==" not in r for n in _requirement_names([r])]
    return seen


def _site_with_only(dists: set[str], site: Path) -> None:
    """Link each distribution's top-level modules and packages into `site`."""
    for name in dists:
        dist = importlib.metadata.distribution(name)
        for top in {file.parts[0] for file in dist.files or []}:
            if top.endswith(".dist-info") or top in ("..", "__pycache__") or (site / top).exists():
                continue
            (site / top).symlink_to(Path(dist.locate_file(top)).resolve())


def test_client_imports_and_runs_without_torch(tmp_path: Path) -> None:
    declared = tomllib.loads((CLIENT / "pyproject.toml").read_text())["project"]["dependencies"]
    dists = _closure(_requirement_names(declared))
    assert {"grpcio", "protobuf"} <= dists
    assert not dists & {"torch", "transformers", "llmserve", "grpcio-health-checking"}
    site = tmp_path / "site"
    site.mkdir()
    _site_with_only(dists, site)

    script = """
import sys
sys.path[:0] = [SITE, CLIENT]
import llmserve_client
from llmserve_client import AsyncClient, Client, build_request, embed_request, pb
from llmserve_client import cli, health
for name in ("torch", "transformers", "llmserve", "grpc_health"):
    try:
        __import__(name)
    except ImportError:
        pass
    else:
        raise SystemExit(f"{name} is importable")
assert build_request("hi", max_new_tokens=3).stopping.max_new_tokens == 3
assert embed_request(["hi", [1, 2]], dimensions=8).inputs[1].token_ids.ids == [1, 2]
Client("localhost:1").close()
print("ok", sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "llmserve")))
""".replace("SITE", repr(str(site))).replace("CLIENT", repr(str(CLIENT)))
    out = subprocess.run([sys.executable, "-I", "-S", "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok []"
