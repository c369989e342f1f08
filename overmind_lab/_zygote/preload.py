"""What a zygote imports (:data:`DEFAULT_PRELOAD`, the cached entries' classes' modules, the
learned modules), and how it notices staleness.

Note [Third-party only]: only modules whose file lies in the standard library or site-packages
are preloaded; the user's code must come fresh from disk in every kernel. More in docs/notes.md.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import sysconfig
from collections.abc import Callable

from overmind_lab._common.learned import is_third_party, read_learned, third_party_modules

__all__ = [
    "DEFAULT_PRELOAD", "PRELOAD_ENV", "class_module_candidates", "import_third_party",
    "preload_overmind", "read_learned", "snapshot", "stale_reason", "third_party_modules",
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
    # Note [What a kernel imports as it starts]: what ipykernel's initialize imports on its own.
    "ipykernel.debugger",
    "ipykernel.zmqshell",
    "IPython.core.completerlib",
    "IPython.core.debugger",
    "IPython.core.oinspect",
    "IPython.extensions.storemagic",
    "IPython.utils.wildcard",
    "sqlite3",
    "tornado.queues",
    "threadpoolctl",
    "overmind_lab",
)

#: Lazy names of ``overmind_lab`` whose modules a kernel that uses the cache imports.
_OVERMIND_LAZY = ("load", "patch_all", "load_ipython_extension", "Client")

#: A comma-separated list that replaces :data:`DEFAULT_PRELOAD` (part of the identity).
PRELOAD_ENV = "OVERMIND_LAB_PRELOAD"


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


def stale_reason(snap: Snapshot, meanwhile: Callable[[], None] | None = None) -> str | None:
    """The first file that changed or vanished since ``snap``, as a reason; else ``None``.
    ``meanwhile`` is called after every 256 files."""
    for i, (path, st) in enumerate(snap.items()):
        if meanwhile is not None and i % 256 == 255:
            meanwhile()
        now = _stat(path)
        if now != st:
            return f"{path} {'changed' if now else 'was removed'} since the zygote imported it"
    return None
