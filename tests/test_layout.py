"""The package layout, proven from the source: which side may import what.

The daemon (``_daemon``) and the kernel side (``_client``) meet only through ``_common``,
``_errors`` and the top-level package. The daemon never imports torch or the model
libraries, directly or through the client side. Every ``import`` statement counts,
including those inside functions and ``if TYPE_CHECKING:`` blocks.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "overmind_lab"
SIDES = ("_common", "_daemon", "_client", "_jupyter", "_kernel", "bench")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, text: str | None = None) -> set[str]:
    """Every module ``path`` (or ``text`` as if it lay there) imports, as dotted names."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    source = path.read_text() if text is None else text
    for node in ast.walk(ast.parse(source, str(path))):
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


def modules(side: str) -> list[Path]:
    return sorted((PACKAGE / side).rglob("*.py")) if (PACKAGE / side).is_dir() else []


def own(name: str) -> bool:
    return name == "overmind_lab" or name.startswith("overmind_lab.")


def side_of(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in SIDES else None


def package_imports(path: Path) -> set[str]:
    return {m for m in imports(path) if own(m)}


def test_the_tree_has_both_sides() -> None:
    assert modules("_daemon") and modules("_client") and modules("_common")


@pytest.mark.parametrize("path", modules("_daemon"), ids=lambda p: p.name)
def test_the_daemon_imports_only_itself_common_and_the_standard_library(path: Path) -> None:
    for name in imports(path):
        if own(name):
            assert side_of(name) in (None, "_common", "_daemon"), f"{path.name} imports {name}"
            assert not name.startswith(("overmind_lab._native", "overmind_lab.cli")), name
        else:
            top = name.split(".")[0]
            assert top in sys.stdlib_module_names, f"{path.name} imports {name}"


@pytest.mark.parametrize("path", modules("_client"), ids=lambda p: p.name)
def test_the_client_never_imports_the_daemon(path: Path) -> None:
    for name in package_imports(path):
        assert side_of(name) not in ("_daemon", "_jupyter", "_kernel", "bench"), (
            f"{path.name} imports {name}")


@pytest.mark.parametrize("path", modules("_common"), ids=lambda p: p.name)
def test_common_depends_on_neither_side(path: Path) -> None:
    for name in imports(path):
        if own(name):
            assert side_of(name) in (None, "_common"), f"{path.name} imports {name}"
            assert not name.startswith("overmind_lab._native"), name
        else:
            assert name.split(".")[0] in sys.stdlib_module_names, f"{path.name} imports {name}"


def test_the_checker_sees_a_forbidden_import() -> None:
    # The rules above are only as good as ``imports``: it must resolve relative and
    # nested imports to the names the rules test.
    text = "def f():\n    from .._client import load\n    import torch\n"
    found = imports(PACKAGE / "_daemon" / "server.py", text)
    assert "overmind_lab._client.load" in found and "torch" in found
    assert side_of("overmind_lab._client.load") == "_client"
