"""What a zygote imports (:data:`DEFAULT_PRELOAD`, the cached entries' classes' modules, the
learned modules), and how it notices staleness.

Note [Third-party only]: only modules whose file lies in the standard library or site-packages
are preloaded; the user's code must come fresh from disk in every kernel. More in docs/notes.md.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import site
import sys
import sysconfig
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

from overmind_lab._common.learned import is_third_party, read_learned, third_party_modules

__all__ = [
    "DEFAULT_PRELOAD", "HARMLESS_IMPORT_WARNINGS", "PRELOAD_ENV", "Snapshot",
    "class_module_candidates", "import_third_party", "install_change", "install_snapshot",
    "own_files", "preload_overmind", "quiet_imports", "read_learned", "snapshot", "stale_reason",
    "third_party_modules",
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


# Note [A quiet zygote log]: the zygote's log is read when a warm kernel misbehaves, so it says
# what the zygote did and what went wrong, not what its imports say to a user who is not there:
#
# - debugpy (``ipykernel.debugger``) finds frozen standard modules and prints a "Debugger
#   warning" at its import, about breakpoints in the standard library of the process being
#   debugged; the zygote is never debugged. ``PYDEVD_DISABLE_FILE_VALIDATION=1`` during the
#   preload makes that a debug record (the constant pydevd reads from it, which forked kernels
#   keep, serves that report only). Not ``-Xfrozen_modules=off`` on the zygote's command line:
#   every forked kernel would inherit it (``sys._xoptions``, the standard modules' loaders) where
#   a plain launch of the same kernelspec has frozen modules.
# - a few warnings of libraries about features the zygote does not use
#   (:data:`HARMLESS_IMPORT_WARNINGS`), ignored while it imports.
#
# Both only around the preload, and taken out after it: a forked kernel has the user's
# environment (the fork request's) and the filters of a fresh process that imported the same
# modules (IPython's completer adds one at import: it stays), so it shows every warning its code
# raises as a plain kernel does (``tests/test_messages_zygote.py``). Hence no ``catch_warnings``,
# which would also drop the filters the imports added. A warning given once at import is still
# not given again when a warm kernel imports that module: it was imported before the fork (as for
# any preloaded module, these or not).

#: ``(message regex, category, module regex)`` of warnings given at import about features the
#: zygote never uses; ignored while it preloads (Note [A quiet zygote log]).
HARMLESS_IMPORT_WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    # torchvision built without (or mismatched with) its image or video codecs: only the
    # decoders of ``torchvision.io`` need them
    (r"Failed to load (image|video) Python extension", UserWarning, r"torchvision\.io\."),
    # torchvision 0.15-0.16 on an import of ``transforms.v2`` (transformers' fast image
    # processors import it)
    (r"The torchvision\.datapoints and torchvision\.transforms\.v2 namespaces are still Beta",
     UserWarning, r"torchvision\."),
)

#: Note [A quiet zygote log]: debugpy's switch of its frozen-modules report to a debug record.
_DEBUGPY_QUIET = ("PYDEVD_DISABLE_FILE_VALIDATION", "1")


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """Note [A quiet zygote log]: imports inside say nothing the zygote's log need not say; after
    it, the warnings filters are those the imports left (without ours) and the variable of
    :data:`_DEBUGPY_QUIET` is as it was."""
    name, value = _DEBUGPY_QUIET
    had = os.environ.get(name)
    os.environ.setdefault(name, value)
    ours = []
    for message, category, module in HARMLESS_IMPORT_WARNINGS:
        present = len(warnings.filters)
        warnings.filterwarnings("ignore", message, category, module)
        if len(warnings.filters) > present:  # not one the user had already (moved to the front)
            ours.append(warnings.filters[0])
    try:
        yield
    finally:
        filters = cast("list[Any]", warnings.filters)  # a list, typed as a Sequence
        for entry in ours:
            with contextlib.suppress(ValueError):
                filters.remove(entry)
        if had is None:
            os.environ.pop(name, None)


def preload_overmind() -> None:
    import overmind_lab

    for attr in _OVERMIND_LAZY:
        getattr(overmind_lab, attr)


# Note [Installs the zygote sees]: ``site`` reads the ``.pth`` files once, as an interpreter
# starts (editable installs' paths and finders), and libraries note at import what else is
# installed; so a zygote whose installation changed would fork kernels unlike a plain one (a
# package installed since: ``ModuleNotFoundError``). Besides each imported module's file, the
# snapshot checked before each fork (Note [Checked while the old kernel exits] in ``loop.py``)
# watches, any change making the zygote stale (the launch plain, a new zygote started):
#
# - the installation's folders on ``sys.path`` and those ``site`` scans: ``getsitepackages()``,
#   the user site where enabled (absent too: one created later counts), the install scheme's,
#   those in the interpreter's ``lib`` folders, those named ``site-packages``, those an
#   installer wrote a distribution into: their ``stat``, so an entry made or removed (a
#   ``.pth``, a ``.dist-info``, an editable finder, a module) is a change, but ``__pycache__``;
# - in them, each ``.pth``, ``.egg-link``, editable finder (``__editable__*``, ``_editable*``),
#   distribution's ``METADATA``/``PKG-INFO``; and whether each folder a ``.pth`` names exists.
#
# Not the folders of the user's own code on ``sys.path`` (an editable project's root, a
# ``PYTHONPATH`` folder without distributions): each notebook saved there would renew the
# zygote, and a module added there is found by a forked kernel anyway (Note [Import caches after
# the fork]). Two orders matter. ``__main__.py`` reads the installation before any of the
# zygote's imports, so an install during them is seen at the first fork. And a folder's mtime
# has the file system clock's tick (ms; FAT: 2 s): a later change in the same tick leaves it as
# it was, so each folder is listed before its ``stat``, and one changed less than ``_RACY_NS``
# before has its entries compared on each check until it is older (git's "racily clean").
# Cost: 8 ``stat``s more per check here (0.01 ms; the 5 ms of 3,300 files with torch,
# transformers and diffusers are the modules' and the ``METADATA`` already checked). More in
# docs/notes.md.

#: ``(st_mtime_ns, st_size, st_ino)`` of a file or folder as the zygote saw it.
Stat = tuple[int, int, int]

#: Note [Installs the zygote sees]: a folder changed this recently (ns) when it was stat'ed may
#: change again within the same timestamp tick; its entries are compared until it is older.
_RACY_NS = 2_000_000_000
#: Entries of a watched folder that change no import when they come or go.
_IGNORED_ENTRIES = frozenset({"__pycache__"})
#: The install records in a watched folder, each stat'ed on every check (besides every
#: distribution's ``METADATA`` or ``PKG-INFO``): ``.pth`` files, legacy editable links, editable
#: finders (setuptools' ``__editable__*``, scikit-build-core's ``_editable_*``).
_RECORD_SUFFIXES = (".pth", ".egg-link")
_RECORD_PREFIXES = ("__editable__", "_editable")


@dataclass
class Snapshot:
    """What the zygote's imports depended on (Note [Installs the zygote sees])."""

    #: every imported module's file
    modules: dict[str, Stat] = field(default_factory=dict)
    #: the watched folders (``None``: absent)
    folders: dict[str, Stat | None] = field(default_factory=dict)
    #: the entries of each watched folder that exists, listed before its ``stat``
    listings: dict[str, frozenset[str]] = field(default_factory=dict)
    #: folders whose mtime was too recent to show a change made in the same tick
    racy: set[str] = field(default_factory=set)
    #: the install records in them (``None``: absent)
    records: dict[str, Stat | None] = field(default_factory=dict)
    #: the folder a ``.pth`` line names -> (whether it existed, that ``.pth`` file)
    named: dict[str, tuple[bool, str]] = field(default_factory=dict)
    #: the records of the ``overmind-lab`` distribution itself (its metadata, ``.pth``, finder)
    own_records: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.modules) + len(self.folders) + len(self.records) + len(self.named)


def _stat(path: str) -> Stat | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def _listing(folder: str) -> frozenset[str] | None:
    try:
        return frozenset(os.listdir(folder))
    except OSError:
        return None


def _site_folders() -> list[str]:
    """The folders a fresh interpreter's ``site`` scans for ``.pth`` files (the user site only
    where it is enabled, whether or not it exists yet), and the install scheme's."""
    out: list[str] = []
    try:
        out += site.getsitepackages()
    except AttributeError:  # an old virtualenv's site module
        pass
    if site.ENABLE_USER_SITE:
        out.append(site.getusersitepackages())
    paths = sysconfig.get_paths()
    out += [paths[k] for k in ("purelib", "platlib") if k in paths]
    return out


def _lib_roots() -> tuple[str, ...]:
    """The interpreter's ``lib`` folders (the standard library, ``python3X.zip``, site folders),
    each ending with a separator: not the prefixes themselves (a project in ``/usr/src/app`` is
    the user's code where the prefix is ``/usr``)."""
    libs = {"lib", "lib64", getattr(sys, "platlibdir", "lib")}
    return tuple({os.path.join(os.path.abspath(prefix), lib, "") for lib in libs for prefix in (
        sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)})


def _is_installation(folder: str, names: frozenset[str] | None, sites: set[str],
                     libs: tuple[str, ...]) -> bool:
    """Whether a folder on ``sys.path`` is the installation's (watched), not the user's own code:
    a site folder, one in the interpreter's ``lib`` folders, or one an installer wrote
    distributions into (``pip install --target``, a ``PYTHONPATH`` folder of packages)."""
    return (folder in sites or folder.startswith(libs)
            or os.path.basename(folder) in ("site-packages", "dist-packages")
            or any(n.endswith((".dist-info", ".egg-info")) for n in names or ()))


def _records(folder: str, names: frozenset[str]) -> list[str]:
    out = []
    for name in sorted(names):
        path = os.path.join(folder, name)
        if name.endswith(".dist-info"):
            out.append(os.path.join(path, "METADATA"))
        elif name.endswith(".egg-info"):
            out.append(os.path.join(path, "PKG-INFO") if os.path.isdir(path) else path)
        elif name.endswith(_RECORD_SUFFIXES) or name.startswith(_RECORD_PREFIXES):
            out.append(path)
    return out


def _named_by(pth: str, folder: str, named: dict[str, tuple[bool, str]]) -> None:
    """The folders the path lines of ``pth`` name: ``site`` adds those that exist."""
    try:
        with open(pth, "rb") as f:
            text = f.read().decode("utf-8-sig", errors="replace")
    except OSError:
        return
    for line in text.splitlines():
        if not line.strip() or line.startswith(("#", "import ", "import\t")):
            continue
        path = os.path.abspath(os.path.join(folder, line.rstrip()))
        named.setdefault(path, (os.path.exists(path), pth))


def _is_own(record: str, folder: str) -> bool:
    """Whether ``record`` (in ``folder``) belongs to the ``overmind-lab`` distribution."""
    entry = os.path.relpath(record, folder).split(os.sep)[0]
    return "overmind_lab" in entry.lower().replace("-", "_").replace(".", "_")


def install_snapshot() -> Snapshot:
    """The installation the zygote imports from, now (Note [Installs the zygote sees])."""
    snap = Snapshot()
    libs = _lib_roots()
    sites = {os.path.abspath(p) for p in _site_folders()}
    for folder in dict.fromkeys([*sorted(sites), *(os.path.abspath(p) for p in sys.path if p)]):
        began = time.time_ns()
        names = _listing(folder)  # before the stat: Note [Installs the zygote sees]
        st = _stat(folder)
        if not _is_installation(folder, names, sites, libs):
            continue
        snap.folders[folder] = st
        if names is None:
            continue
        snap.listings[folder] = names
        if st is not None and st[0] + _RACY_NS > began:
            snap.racy.add(folder)
        for record in _records(folder, names):
            snap.records[record] = _stat(record)
            if record.endswith(".pth"):
                _named_by(record, folder, snap.named)
            if _is_own(record, folder):
                snap.own_records.append(record)
    return snap


def snapshot(installed: Snapshot | None = None) -> Snapshot:
    """``installed`` (taken before the imports; else the installation now) and the (mtime, size,
    inode) of every imported module's file."""
    snap = install_snapshot() if installed is None else installed
    files = {m.__file__ for m in list(sys.modules.values())
             if isinstance(getattr(m, "__file__", None), str)}
    for f in files:
        st = _stat(f)  # type: ignore[arg-type]
        if st is not None:
            snap.modules[f] = st  # type: ignore[index]
    return snap


def _how(before: Stat | None, now: Stat | None) -> str:
    return "was created" if before is None else "was removed" if now is None else "changed"


def _few(names: frozenset[str]) -> str:
    shown = sorted(names)
    more = f" and {len(shown) - 4} more" if len(shown) > 4 else ""
    return ", ".join(shown[:4]) + more


def _folder_change(snap: Snapshot, folder: str, before: Stat | None, now: Stat | None,
                   began: int) -> str | None:
    """Why ``folder`` now finds other entries than at the snapshot; ``None`` when only ignored
    ones changed (then its new state is the one compared from now on)."""
    if before is None or now is None:
        if before == now:  # absent then and now
            snap.racy.discard(folder)
            return None
        return f"{folder} {_how(before, now)} since the zygote started"
    names, old = _listing(folder), snap.listings.get(folder)
    if names is None or old is None:
        return f"{folder} changed since the zygote started"
    added, removed = names - old - _IGNORED_ENTRIES, old - names - _IGNORED_ENTRIES
    if added or removed:
        what = [*([f"added {_few(added)}"] if added else []),
                *([f"removed {_few(removed)}"] if removed else [])]
        return f"{folder} changed since the zygote started ({'; '.join(what)})"
    snap.folders[folder], snap.listings[folder] = now, names
    if now[0] + _RACY_NS > began:
        snap.racy.add(folder)
    else:
        snap.racy.discard(folder)
    return None


def install_change(snap: Snapshot) -> str | None:
    """What changed in the installation since ``snap`` (Note [Installs the zygote sees]), as a
    reason; else ``None``."""
    began = time.time_ns()
    for folder, before in list(snap.folders.items()):
        now = _stat(folder)
        if now != before or folder in snap.racy:
            why = _folder_change(snap, folder, before, now, began)
            if why:
                return why
    for path, before in snap.records.items():
        now = _stat(path)
        if now != before:
            return f"{path} {_how(before, now)} since the zygote started"
    for path, (existed, pth) in snap.named.items():
        if os.path.exists(path) != existed:
            return (f"{path}, which {pth} names, "
                    f"{'was removed' if existed else 'was created'} since the zygote started")
    return None


def stale_reason(snap: Snapshot, meanwhile: Callable[[], None] | None = None) -> str | None:
    """The first change since ``snap``: of the installation, or of a file the zygote imported, as
    a reason; else ``None``. ``meanwhile`` is called after every 256 files."""
    why = install_change(snap)
    if why:
        return why
    for i, (path, st) in enumerate(snap.modules.items()):
        if meanwhile is not None and i % 256 == 255:
            meanwhile()
        now = _stat(path)
        if now != st:
            return f"{path} {'changed' if now else 'was removed'} since the zygote imported it"
    return None


def own_files(snap: Snapshot) -> list[str]:
    """Note [A zygote whose package is gone] (``loop.py``): the files whose removal means that
    the overmind-lab this zygote runs was uninstalled: its package's own files and the records of
    its distribution that existed at the snapshot."""
    import overmind_lab

    package = os.path.dirname(os.path.abspath(overmind_lab.__file__ or ""))
    here = os.path.dirname(os.path.abspath(__file__))
    files = [os.path.join(package, "__init__.py"), os.path.join(here, "loop.py"),
             os.path.join(here, "__main__.py")]
    return [*files, *(r for r in snap.own_records if snap.records.get(r) is not None)]
