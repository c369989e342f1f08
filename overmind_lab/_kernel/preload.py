"""What a zygote imports, what kernels may learn into it, and how it notices staleness.

The preload set is, in order: :data:`DEFAULT_PRELOAD`; the modules that define the classes
of the entries now in the cache (the daemon records each entry's class, and importing e.g.
``transformers.models.llama.modeling_llama`` is most of a warm Llama load); and the
*learned* modules, the third-party modules earlier warm kernels of the same identity had
imported when they exited.

Note [Third-party only]: a module is preloaded only when its file lies in the interpreter's
standard library or site-packages. The user's own code (the notebook's folder, anything on
a path of their own, editable installs, whose files live in a source tree) is never
preloaded: it must come fresh from disk in every kernel.

Note [Importable by name]: a module is learned only when a fresh interpreter imports it by
its name: its top-level module or package lies directly in the standard library
(``lib-dynload`` included) or in site-packages. debugpy's vendored pydevd
(``_pydev_bundle``, ``_pydevd_bundle``, ``pydevd_plugins``...) lies inside site-packages
but under ``debugpy/_vendored/``, on ``sys.path`` only after debugpy put it there: a
zygote cannot import those, and its "not preloaded" report would list dozens of names no
user knows. Such modules are neither learned nor read back from a learned file.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "DEFAULT_PRELOAD", "PRELOAD_ENV", "is_third_party", "class_module_candidates", "read_learned",
    "record_learned", "snapshot", "stale_reason", "third_party_modules",
]

DEFAULT_PRELOAD = (
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "diffusers",
    "diffusers.models.modeling_utils",
    "diffusers.pipelines.pipeline_utils",
    "IPython",
    "ipykernel",
    "ipykernel.kernelapp",
    "ipykernel.ipkernel",
    "threadpoolctl",
    "overmind_lab",
)

#: Lazy names of ``overmind_lab`` whose modules a kernel that uses the cache imports.
_OVERMIND_LAZY = ("load", "patch_all", "load_ipython_extension", "Client")

_MAX_LEARNED = 5000
#: A comma-separated list that replaces :data:`DEFAULT_PRELOAD` (part of the identity).
PRELOAD_ENV = "OVERMIND_LAB_PRELOAD"


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
    """Note [Importable by name]: whether top-level ``top`` lies in a standard directory
    (found without importing it; cached per process)."""
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
    """Whether a fresh interpreter imports ``name`` from the standard library or
    site-packages (Note [Importable by name])."""
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
    """The imported modules (of ``names``, default all) that are third-party and
    importable by name (Note [Importable by name])."""
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


def class_module_candidates(cls: str) -> list[str]:
    """``"pkg.mod.Outer.Inner"`` -> ``["pkg.mod.Outer", "pkg.mod", "pkg"]`` (longest first)."""
    parts = cls.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def import_third_party(name: str) -> str | None:
    """Import ``name`` if it (and its top-level package) is third-party; why not, else."""
    try:
        spec = importlib.util.find_spec(name.partition(".")[0])
    except (ImportError, ValueError) as exc:
        return f"{name}: {exc}"
    if spec is None:
        return f"{name}: not found"
    origin = spec.origin or next(iter(spec.submodule_search_locations or ()), None)
    if not is_third_party(origin) and name.partition(".")[0] != "overmind_lab":
        return f"{name}: not third-party ({origin})"
    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - any import failure only drops the module
        return f"{name}: {type(exc).__name__}: {exc}"
    return None


def preload_overmind() -> None:
    import overmind_lab

    for attr in _OVERMIND_LAZY:
        getattr(overmind_lab, attr)


def read_learned(path: Path) -> list[str]:
    """The learned modules a fresh interpreter can import by name (a file written before
    Note [Importable by name] may hold others)."""
    try:
        data = json.loads(path.read_text())
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


Snapshot = dict[str, tuple[int, int]]


def _stat(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size)


def snapshot() -> Snapshot:
    """(mtime, size) of every imported module's file and every installed dist-info."""
    files = {m.__file__ for m in list(sys.modules.values())
             if isinstance(getattr(m, "__file__", None), str)}
    for root in {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}:
        try:
            entries = list(os.scandir(root))
        except OSError:
            continue
        files.update(os.path.join(e.path, "METADATA") for e in entries
                     if e.name.endswith(".dist-info"))
    out: Snapshot = {}
    for f in files:
        st = _stat(f)  # type: ignore[arg-type]
        if st is not None:
            out[f] = st  # type: ignore[index]
    return out


def stale_reason(snap: Snapshot) -> str | None:
    """The first file that changed or vanished since ``snap``, as a reason; else ``None``."""
    for path, st in snap.items():
        now = _stat(path)
        if now != st:
            return f"{path} {'changed' if now else 'was removed'} since the zygote imported it"
    return None
