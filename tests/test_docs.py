"""The README and docs/ hold together: every relative link resolves (to a file or folder of the repository, and a
`#anchor` to a heading of its target, as GitHub and GitLab both spell it), every `--flag` they name exists (the
server's from llmserve.flags.FLAGS, the client CLI's from its parser, a few other programs' by name), every
server flag has its row in docs/configuration.md, and every Python file a page names (and every path of the
architecture page's tree) is in the repository."""

from __future__ import annotations

import argparse
import functools
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmserve.flags import FLAGS
from llmserve_client import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted([ROOT / "README.md", *DOCS.rglob("*.md")])

# Flags of other programs that the pages name, by program. Each must still be named somewhere (so that the list does
# not outlive its use) and must not be one of llmserve's own (so that it hides no typo of theirs).
OTHER_PROGRAMS: dict[str, set[str]] = {
    "argparse (every parser)": {"help"},
    "benchmarks/run.py": {"mode", "list", "quick", "systems", "sessions", "turns"},
    "tests/mutation.py": {"resume"},
    "pip": {"index-url"},
    "docker, podman": {
        "build-arg",
        "gpus",
        "runtime",
        "rm",
        "network",
        "isolation",
        "format",
        "user",
        "read-only",
        "cap-drop",
        "security-opt",
    },
    "smg": {"policy", "api-key"},
    "vLLM's server": {"grpc"},
}

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.+?)[ \t#]*$", re.M)
FLAG = re.compile(r"(?<![\w-])--([a-z0-9](?:[a-z0-9-]*[a-z0-9])?)")
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)


def prose(text: str) -> str:
    """The text outside code: fenced blocks dropped, inline code spans replaced by a word."""
    return CODE_SPAN.sub("code", FENCE.sub("", text))


def relative_links(page: Path) -> Iterator[str]:
    for match in LINK.finditer(prose(page.read_text())):
        target = match.group(1)
        if not SCHEME.match(target):
            yield target


def heading_text(raw: str) -> str:
    """A heading as a forge renders it to text: code spans and emphasis unwrapped, a link reduced to its text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", raw)
    return text.replace("`", "").replace("*", "")


def github_slug(text: str) -> str:
    """github-slugger: lower case, drop what is not a word character, a space or a hyphen, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def gitlab_slug(text: str) -> str:
    """GitLab: the same, and runs of hyphens made one."""
    return re.sub(r"-{2,}", "-", github_slug(text.strip()))


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings that GitHub and GitLab both give (a repeated heading gets -1, -2, ...)."""
    text = FENCE.sub("", page.read_text())
    found: dict[str, set[str]] = {}
    for slug in (github_slug, gitlab_slug):
        seen: dict[str, int] = {}
        names = found.setdefault(slug.__name__, set())
        for match in HEADING.finditer(text):
            name = slug(heading_text(match.group(2)))
            count = seen.get(name, 0)
            seen[name] = count + 1
            names.add(name if count == 0 else f"{name}-{count}")
    return found["github_slug"] & found["gitlab_slug"]


def client_flags() -> set[str]:
    """Every option of `llmserve-client`, its subcommands' included."""
    flags: set[str] = set()
    parsers = [cli._parser()]
    while parsers:
        parser = parsers.pop()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
            flags.update(s[2:] for s in action.option_strings if s.startswith("--"))
    return flags


SERVER_FLAGS = {flag.name.removeprefix("--") for _, group in FLAGS for flag in group}


def named_flags(page: Path) -> set[str]:
    return set(FLAG.findall(page.read_text()))


def test_the_pages_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/README.md", "docs/architecture.md", "docs/configuration.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        path_part, _, anchor = target.partition("#")
        path = (page.parent / path_part).resolve() if path_part else page
        if not path.is_relative_to(ROOT) or not path.exists():
            broken.append(f"{target}: no such file or folder")
        elif anchor and (path.suffix != ".md" or anchor not in anchors(path)):
            broken.append(f"{target}: no heading with the anchor #{anchor} in {path.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_flag_named_exists(page: Path) -> None:
    known = SERVER_FLAGS | client_flags() | set().union(*OTHER_PROGRAMS.values())
    unknown = sorted(named_flags(page) - known)
    assert not unknown, f"{page.relative_to(ROOT)} names flags that no parser has: " + ", ".join(
        f"--{f}" for f in unknown
    )


def test_other_programs_flags_are_named_and_not_llmservers() -> None:
    named = set().union(*(named_flags(p) for p in PAGES))
    for program, flags in OTHER_PROGRAMS.items():
        assert flags <= named, f"{program}: no page names {sorted(flags - named)} any more; drop them from the list"
        assert not flags & SERVER_FLAGS, f"{program}: {sorted(flags & SERVER_FLAGS)} are the server's own flags"


def test_every_server_flag_has_its_row_in_configuration() -> None:
    text = (DOCS / "configuration.md").read_text()
    rows = {flag for line in text.splitlines() if line.startswith("| `--") for flag in FLAG.findall(line.split("|")[1])}
    missing = sorted(SERVER_FLAGS - rows)
    assert not missing, "docs/configuration.md has no row for " + ", ".join(f"--{f}" for f in missing)


def test_the_checks_catch_what_they_look_for(tmp_path: Path) -> None:
    """The link and anchor checks themselves: a missing file, a missing heading, a heading the forges spell apart."""
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Shutdown, failures and long streams\n\n## A - B\n\n```sh\n# not a heading\n```\n")
    assert {"title", "shutdown-failures-and-long-streams"} == anchors(page)  # "a---b" (GitHub) is "a-b" on GitLab
    page.write_text("[a](x.md) `[b](y.md)` [c](#z) [d](https://example.com/) ![e](img.png)\n```\n[f](w.md)\n```\n")
    assert list(relative_links(page)) == ["x.md", "#z", "img.png"]
    assert github_slug(heading_text("`--dtype` and [CPU](cpu.md) *levels*")) == "--dtype-and-cpu-levels"


# A Python file a page names in code (`models/gguf_file.py`, `steps.py`), or a path in the architecture page's tree.
PYTHON_FILE = re.compile(r"`([\w./-]*\w\.py)\b")
TREE_PATH = re.compile(r"^[\w.-]+(/[\w.-]+)*/?$")


@functools.cache
def path_ends() -> frozenset[str]:
    """Every file of the repository and every folder above one, as posix paths relative to its root, and every end
    of each (`core/steps.py`, `steps.py`); caches, builds and virtual environments left out."""
    skip = {".git", ".venv", ".cache", "build", "node_modules", "__pycache__", ".mypy_cache", ".ruff_cache"}
    ends: set[str] = set()
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in skip and not d.startswith(".venv")]
        relative = Path(folder).relative_to(ROOT).parts
        for name in [*files, *dirs]:
            parts = [*relative, name]
            ends.update("/".join(parts[i:]) for i in range(len(parts)))
    return frozenset(ends)


def named_python_files(page: Path) -> set[str]:
    """The Python files a page names in code spans or blocks, and, in docs/architecture.md's tree, every path of its
    first column (a folder with its slash)."""
    text = page.read_text()
    names = set(PYTHON_FILE.findall(text))
    if page.name == "architecture.md":
        tree = text.split("## The tree", 1)[1].split("```", 2)[1]
        for line in tree.splitlines():
            if line and len(line) - len(line.lstrip()) <= 8:  # deeper lines continue a description
                names.update(t for t in re.split(r"\s{2,}", line.strip(), maxsplit=1)[0].split() if TREE_PATH.match(t))
    return names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_python_file_and_tree_path_named_exists(page: Path) -> None:
    """A moved or renamed module leaves no page naming its old place: each name is some file's or folder's path, or
    the end of one (`steps.py`, `core/steps.py`, `server/llmserve/engine/core/steps.py` all name the same file)."""
    missing = sorted(name for name in named_python_files(page) if name.rstrip("/") not in path_ends())
    assert not missing, f"{page.relative_to(ROOT)} names what is not in the repository: {missing}"
