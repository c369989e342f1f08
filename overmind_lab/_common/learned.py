"""The *learned* modules: third-party modules earlier warm kernels imported, which the next
zygote of the same identity preloads; a forked kernel records them at exit.

Note [Importable by name]: learned only when a fresh interpreter imports it by name (its top
level directly in the standard library or site-packages; not debugpy's vendored pydevd), else
a zygote would report it as not preloaded. More in docs/notes.md.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path

from overmind_lab._common.trust import open_private

__all__ = ["importable_by_name", "is_third_party", "read_learned", "record_learned",
           "third_party_modules"]

_MAX_LEARNED = 5000


def _roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib")
             if k in paths}
    return tuple(sorted(r.rstrip(os.sep) + os.sep for r in roots))


_ROOTS = _roots()


def _top_dirs() -> frozenset[str]:
    """The directories a top-level module importable by name lies directly in."""
    dirs = {r.rstrip(os.sep) for r in _ROOTS}
    paths = sysconfig.get_paths()
    dirs.update(os.path.realpath(os.path.join(paths[k], "lib-dynload"))
                for k in ("stdlib", "platstdlib") if k in paths)
    return frozenset(dirs)


_TOP_DIRS = _top_dirs()
_TOP_OK: dict[str, bool] = {}


def _top_level_ok(top: str) -> bool:
    """Note [Importable by name]: whether ``top`` lies in a standard directory (cached)."""
    ok = _TOP_OK.get(top)
    if ok is not None:
        return ok
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    ok = False
    if spec is not None:
        if spec.submodule_search_locations:  # a package: the directory above its own
            ok = any(os.path.dirname(os.path.realpath(p)) in _TOP_DIRS
                     for p in spec.submodule_search_locations)
        elif spec.origin and os.path.isabs(spec.origin):
            ok = os.path.dirname(os.path.realpath(spec.origin)) in _TOP_DIRS
    _TOP_OK[top] = ok
    return ok


def importable_by_name(name: str) -> bool:
    """Whether a fresh interpreter imports ``name`` from the standard library or site-packages
    (Note [Importable by name])."""
    top = name.partition(".")[0]
    mod = sys.modules.get(top)
    if mod is None:
        return _top_level_ok(top)
    paths = list(getattr(mod, "__path__", None) or ())
    file = getattr(mod, "__file__", None)
    if paths:
        return any(os.path.dirname(os.path.realpath(p)) in _TOP_DIRS for p in paths)
    if isinstance(file, str):
        return os.path.dirname(os.path.realpath(file)) in _TOP_DIRS
    return False  # a built-in module: nothing to preload


def is_third_party(path: str | None) -> bool:
    """Whether ``path`` (a module's file) is in the standard library or site-packages."""
    if not path:
        return False
    return os.path.realpath(path).startswith(_ROOTS)


def third_party_modules(names: Iterable[str] | None = None) -> list[str]:
    """The imported modules (of ``names``, default all) that are third-party and importable by name.
    """
    out = []
    tops: dict[str, bool] = {}
    for name in list(sys.modules) if names is None else names:
        mod = sys.modules.get(name)
        file = getattr(mod, "__file__", None)
        if not (isinstance(file, str) and is_third_party(file)) or name.startswith("__"):
            continue
        top = name.partition(".")[0]
        if top not in tops:
            tops[top] = importable_by_name(top)
        if tops[top]:
            out.append(name)
    return sorted(out)


def read_learned(path: Path) -> list[str]:
    """The learned modules importable by name (an older file may hold others)."""
    fd = open_private(path)  # Note [Trust no neighbour]: ours, and only ours to write
    if fd is None:
        return []
    try:
        with os.fdopen(fd, "rb") as f:
            data = json.loads(f.read())
    except (OSError, ValueError):
        return []
    names = [str(n) for n in data.get("modules", [])] if isinstance(data, dict) else []
    return [n for n in names if importable_by_name(n)]


def record_learned(path: Path, modules: Iterable[str]) -> None:
    """Add ``modules`` to the learned set (atomic replace; a lost race loses one kernel's)."""
    known = set(read_learned(path))
    new = known | set(modules)
    if new == known or len(new) > _MAX_LEARNED:
        return
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"modules": sorted(new)}))
    os.replace(tmp, path)
