"""The package layout, proven from the source: one folder per process, and which folder
may import which.

Each folder under ``overmind_lab/`` names the process its code runs in (``FOLDERS``;
``docs/internals.md`` draws the map). A folder imports only itself, the folders listed as
below it in ``MAY_IMPORT``, and the top-level modules (``__init__``, ``_errors``,
``_extras``), so no path climbs back up: from the provisioner's launch to a running forked
kernel the imports go ``_jupyter_server`` -> ``_common`` (the zygote is another process,
started by command) and ``_zygote`` -> ``_forked`` -> ``_common``. The daemon and
``_common`` import nothing outside the standard library (so never torch). Every
``import`` statement counts, including those inside functions; for the rules also those
under ``if TYPE_CHECKING:``, which only the circle check leaves out.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "overmind_lab"

#: Each folder and the process that runs it.
FOLDERS = {
    "_common": "any of ours: shared code (the wires, names, sizes, fingerprints)",
    "_loading": "the loading process (a notebook kernel, a script): load(), the hook",
    "_daemon": "the per-user cache daemon",
    "_jupyter_server": "the Jupyter server: REST, the provisioner, kernelspecs",
    "_launcher": "the kernelspec launcher, where a frontend runs the argv itself",
    "_zygote": "the zygote that forks warm kernels",
    "_forked": "a forked child of the zygote, becoming a kernel",
}

#: The folders each folder may import besides itself and the top-level modules.
MAY_IMPORT: dict[str, set[str]] = {
    "_common": set(),
    "_daemon": {"_common"},
    "_loading": {"_common"},
    "_forked": {"_common"},
    "_zygote": {"_common", "_forked"},
    "_launcher": {"_common"},
    "_jupyter_server": {"_common", "_loading"},  # the REST handlers are daemon clients
}

#: Folders that import nothing outside the standard library and this package.
STDLIB_ONLY = ("_common", "_daemon", "_launcher")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_blocks(tree: ast.AST) -> set[int]:
    """The ids of the import nodes under ``if TYPE_CHECKING:``."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                out.update(id(n) for n in ast.walk(inner))
    return out


def imports(path: Path, text: str | None = None, runtime_only: bool = False) -> set[str]:
    """Every module ``path`` (or ``text`` as if it lay there) imports, as dotted names."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text() if text is None else text, str(path))
    skip = _type_checking_blocks(tree) if runtime_only else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.add(module)
            # ``from overmind_lab import _errors`` names a module too
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def modules(folder: str) -> list[Path]:
    return sorted((PACKAGE / folder).rglob("*.py")) if (PACKAGE / folder).is_dir() else []


def own(name: str) -> bool:
    return name == "overmind_lab" or name.startswith("overmind_lab.")


#: Standard modules that another supported Python names differently (the built-in SHA-256:
#: ``_sha256`` up to 3.11, ``_sha2`` from 3.12).
STDLIB_ELSEWHERE = frozenset({"_sha2", "_sha256"})


def folder_of(name: str) -> str | None:
    """The folder a dotted name lies in; ``None`` for the top-level modules."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else None


def test_every_folder_names_its_process() -> None:
    on_disk = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert on_disk == set(FOLDERS) - {f for f in FOLDERS if not (PACKAGE / f).is_dir()}
    assert on_disk <= set(MAY_IMPORT), on_disk - set(MAY_IMPORT)
    internals = (PACKAGE.parent / "docs" / "internals.md").read_text()
    for folder in on_disk:
        assert f"`{folder}/`" in internals, f"docs/internals.md does not map {folder}/"


@pytest.mark.parametrize("path", [p for f in MAY_IMPORT for p in modules(f)],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_folder_imports_only_what_lies_below_it(path: Path) -> None:
    folder = folder_of(module_name(path))
    assert folder is not None
    allowed = MAY_IMPORT[folder] | {folder, None}
    runtime = imports(path, runtime_only=True)
    for name in imports(path):
        if own(name):
            assert folder_of(name) in allowed, f"{path.name} ({folder}) imports {name}"
            if folder in STDLIB_ONLY:
                assert not name.startswith(("overmind_lab._native", "overmind_lab.cli")), name
        elif folder in STDLIB_ONLY and name in runtime:
            # what runs: an import for type checking only (``typing_extensions`` for a name
            # ``typing`` has only from 3.11 on) needs nothing installed
            top = name.split(".")[0]
            assert top in sys.stdlib_module_names | STDLIB_ELSEWHERE, f"{path.name} imports {name}"


def _graph() -> dict[str, set[str]]:
    """Runtime imports between our modules (a ``from pkg import name`` edge goes to the
    module ``pkg.name`` where that is a module, else to ``pkg``)."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        edges = set()
        for target in imports(path, runtime_only=True):
            if own(target) and target in paths and target != name:
                edges.add(target)
        graph[name] = edges
    # ``from overmind_lab._common import inherit`` adds both ``_common`` and
    # ``_common.inherit``; a package's ``__init__`` importing nothing back is enough.
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles() -> None:
    graph = _graph()
    assert "overmind_lab._zygote.loop" in graph
    assert _circles(graph) == []


def test_the_checkers_see_a_forbidden_import_and_a_circle() -> None:
    # The rules above are only as good as ``imports``: it must resolve relative and
    # nested imports to the names the rules test, and skip TYPE_CHECKING only on request.
    text = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import json\n"
            "def f():\n    from .._loading import load\n    import torch\n")
    found = imports(PACKAGE / "_daemon" / "server.py", text)
    assert {"overmind_lab._loading.load", "torch", "json"} <= found
    assert "json" not in imports(PACKAGE / "_daemon" / "server.py", text, runtime_only=True)
    assert folder_of("overmind_lab._loading.load") == "_loading"
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
