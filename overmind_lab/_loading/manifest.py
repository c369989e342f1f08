"""What a load depends on, observed while it runs: the entry's dependency manifest.

A list of input kinds in the key is never complete (a helper module, a config folder passed by
path, a custom pipeline's file, a hub cache folder, a reinstalled package). So the cold load is
watched as it runs (:class:`Recorder`: an audit hook sees every file it opens and folder it lists,
``sys.modules`` every module it imports), and the entry carries what it found (:func:`build`);
every hit checks it against the disk and this process (:func:`changed`): any difference is a miss
that replaces the entry (Note [Code that changed under an entry] in ``load``).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import os
import sys
import threading
import time
import types
from collections.abc import Callable, Iterable
from typing import Any

from overmind_lab._errors import NotCacheable
from overmind_lab._loading import user_code
from overmind_lab._loading.keys import _file_identity as _identity

__all__ = ["Recorder", "build", "changed"]

# Note [What a load depends on]: the manifest lists, each with the signature it had when stored:
# - files: every file the cold load opened for reading (the audit event ``open``: ``open``,
#   ``io.open_code``, ``os.open``), and folders it listed (``os.listdir``, ``os.scandir``, not the
#   import system's own listings nor ``sys.path``'s folders: a script's folder changes with every
#   file saved beside it, and ``importlib.metadata`` lists it for each ``version()``), outside the
#   source folder (the key signs that whole tree), outside the standard library and site folders
#   (their distributions stand for them), and outside ``/proc``, ``/sys``, ``/dev``;
# - modules: every module of the user's (Note [Regular code] in ``user_code``) that the load
#   imported, or that the result's classes or the loader come from, and transitively what those
#   import (by their ``import`` statements and by the modules their globals come from): a helper
#   module that only lends a constant or a layer factory counts; with the values of the globals
#   its code reads (Note [Globals set at run time] in ``user_code``);
# - code: the files of the regular modules the result's classes come from (an edit inside
#   site-packages keeps every version string);
# - distributions: the ``RECORD`` of each installed distribution whose modules the result's classes
#   come from or the load imported (``pip install .`` again rewrites it, same version or not).
# A signature is (device, inode, size, mtime_ns, ctime_ns) (Note [File signatures] in ``keys``) and
# a digest of the content where it is small: on a hit an equal signature costs one ``stat``; an
# unequal one falls back to the digest (a ``touch``, a checkout of the same content, another
# environment with the same files stay warm). What native code reads (safetensors) is not seen;
# source files are signed by the key. The globals a cell's or ``python -c``'s code reads enter its
# digest (Note [Code without a file] in ``user_code``).

#: Files up to this size are also digested (configs, code); larger ones by signature alone.
DIGEST_LIMIT = 16 << 20
#: More than this many dependencies of one kind: the load is not cached (a load that walks a tree).
MAX_DEPENDENCIES = 2000
_SKIPPED_PREFIXES = ("/proc/", "/sys/", "/dev/")
#: Callers whose listings are the import system's, not the load's: finders filling their caches,
#: ``importlib.metadata`` looking for distributions along ``sys.path`` (``version()``).
_IMPORT_SYSTEM = ("<frozen importlib", "<frozen zipimport")
_IMPORTLIB = f"{os.sep}importlib{os.sep}"
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

#: the recorders now running (any thread): the audit hook's only state
_active: list[Recorder] = []
_hook_lock = threading.Lock()
_hooked = False


def _audit(event: str, args: tuple[Any, ...]) -> None:
    # Note [An audit hook for the whole process]: an audit hook cannot be removed, and runs for
    # every audited event in every thread (``sys._getframe``, ``pickle.find_class``...); outside a
    # cold load it returns on its first test. It must never raise: an exception here would fail
    # the user's ``open``.
    if not _active:
        return
    try:
        if event == "open":
            path, mode, flags = args
            if isinstance(mode, str):
                if "w" in mode or "a" in mode or "x" in mode or "+" in mode:
                    return
            elif isinstance(flags, int) and flags & _WRITE_FLAGS:
                return
            target = "files"
        elif event in ("os.listdir", "os.scandir"):
            path = args[0]
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(_IMPORT_SYSTEM) or _IMPORTLIB in caller:
                return  # the import system's cache of a folder, importlib.metadata's searches
            target = "dirs"
        else:
            return
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        elif path is None:
            path = "."
        if not isinstance(path, str):
            return  # a descriptor
        if not path.startswith("/"):
            path = os.path.join(os.getcwd(), path)
        for recorder in _active:
            getattr(recorder, target).setdefault(path, None)
    except Exception:  # noqa: BLE001, S110 - see the Note: the user's call must go on
        pass


class Recorder:
    """Watches a cold load: the files it opens, the folders it lists, the modules it imports."""

    __slots__ = ("files", "dirs", "_modules_before", "new_modules")

    def __init__(self) -> None:
        self.files: dict[str, None] = {}
        self.dirs: dict[str, None] = {}
        self._modules_before: set[str] = set()
        self.new_modules: list[str] = []

    def __enter__(self) -> Recorder:
        global _hooked
        if not _hooked:
            with _hook_lock:
                if not _hooked:
                    sys.addaudithook(_audit)
                    _hooked = True
        self._modules_before = set(sys.modules)
        _active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _active[:] = [r for r in _active if r is not self]  # by identity
        self.new_modules = [n for n in list(sys.modules) if n not in self._modules_before]
        self._modules_before = set()


# -- signatures (Note [File signatures] in ``keys``) -------------------------------------
#: (folder, identity) -> digest of its names, per process
_listings: dict[tuple[str, tuple[int, ...]], str] = {}


def _content_digest(path: str, is_dir: bool, cached: bool = True) -> str:
    """A file's digest (``user_code.file_digest``), or a folder's: of its sorted names; cached per
    process by identity unless ``cached`` is false."""
    if not is_dir:
        return user_code.file_digest(path, cached=cached)
    key = (path, tuple(_identity(os.stat(path))))
    found = _listings.get(key) if cached else None
    if found is None:
        names = "\0".join(sorted(os.listdir(path))).encode("utf-8", "surrogateescape")
        found = _listings[key] = hashlib.sha256(names).hexdigest()[:32]
    return found


# Note [Racy signatures]: a file written twice within one timestamp tick (a few ms before Linux
# 6.13), in place, to the same size, keeps its signature. As git does for its index ("racy git"),
# a file changed less than ``RACY_NS`` before its signature was taken is marked (its digest starts
# with ``!``) and its content is compared on every hit, whatever its signature says.
RACY_NS = 2 * 10**9


def _record(path: str, is_dir: bool = False) -> list[Any] | None:
    """``[path, identity, digest or None]`` of a file or folder, ``None`` if it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    ident = _identity(st)
    digest = None
    if is_dir or st.st_size <= DIGEST_LIMIT:
        racy = time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) < RACY_NS
        try:
            digest = _content_digest(path, is_dir, cached=not racy)
        except OSError:
            return None
        digest = f"!{digest}" if racy else digest
    return [path, ident, digest]


def _differs(path: str, ident: list[int], digest: str | None, is_dir: bool = False) -> str | None:
    """Why the file or folder at ``path`` is not what was recorded, or ``None``."""
    try:
        st = os.stat(path)
    except OSError:
        return f"{path} was removed"
    now = _identity(st)
    racy = digest is not None and digest.startswith("!")  # Note [Racy signatures]
    if now == ident and not racy:
        return None
    if digest is None or (not is_dir and st.st_size != ident[2]):
        return f"{path} changed"
    try:
        if _content_digest(path, is_dir, cached=not racy) == digest.lstrip("!"):
            return None
    except OSError:
        return f"{path} cannot be read"
    return f"{path} changed"


# -- building the manifest ---------------------------------------------------------------
def _skipped(path: str, roots: tuple[str, ...]) -> bool:
    return (path.startswith(_SKIPPED_PREFIXES) or path.startswith(roots)
            or "/__pycache__/" in path or user_code.is_regular_file(path))


def build(recorder: Recorder, classes: Iterable[Any], loader: Callable[..., Any] | None,
          source: str | None) -> dict[str, list[list[Any]]]:
    """The manifest of a cold load watched by ``recorder``, whose result's stream names ``classes``;
    ``source``: the folder or file the key signs. Raises :class:`NotCacheable` when a module of the
    user's changed on disk after this process imported it (Note [A file changed under a running
    process] in ``user_code``)."""
    roots = (_root(source),) if source else ()
    # What the standard library and site folders hold goes before any ``realpath`` (an import
    # during the load opens hundreds of their files: ~50 µs each resolved).
    regular = tuple(root for root, is_regular in user_code._roots() if is_regular)
    # Each path as it was opened (a symlink retargeted is another file: ``stat`` follows it), judged
    # where it leads (a link into the source folder or a site folder is theirs).
    opened = {os.path.normpath(p): None for p in recorder.files
              if not p.startswith(regular) and "/__pycache__/" not in p}
    files = [r for p in opened if not _skipped(os.path.realpath(p), roots)
             and os.path.isfile(p) and (r := _record(p)) is not None]
    search = {os.path.realpath(p or ".") for p in sys.path}  # what imports list, not loads
    dirs = [r for p in {os.path.normpath(p): None for p in recorder.dirs}
            if (real := os.path.realpath(p)) not in search
            and not _skipped(real + os.sep, roots) and os.path.isdir(p)
            and (r := _record(p, is_dir=True)) is not None]
    anchors = {getattr(c, "__module__", None) for c in classes}
    if loader is not None:
        owner = getattr(loader, "__self__", None)
        anchors.add(getattr(owner if isinstance(owner, type) else loader, "__module__", None))
    names = [n for n in anchors if isinstance(n, str)] + recorder.new_modules
    modules, code, tops = _code_dependencies(names, {n for n in anchors if isinstance(n, str)})
    dists = [[top, *r] for top in sorted(tops)
             if (path := _distribution_index().get(top)) is not None
             and (r := _record(path)) is not None]
    out = {"files": files, "dirs": dirs, "modules": modules, "code": code, "dists": dists}
    for kind, items in out.items():
        if len(items) > MAX_DEPENDENCIES:
            raise NotCacheable(f"the load depends on more than {MAX_DEPENDENCIES} {kind}")
    return {k: v for k, v in out.items() if v}


def _root(source: str) -> str:
    real = os.path.realpath(source)
    return real + os.sep if os.path.isdir(real) else real


def _code_dependencies(names: list[str], anchors: set[str]) -> tuple[
        list[list[Any]], list[list[Any]], set[str]]:
    """(user modules ``[name, path, identity, digest]``, regular files of the ``anchors``
    ``[name, path, identity, digest]``, top-level names of the regular packages involved)."""
    modules: list[list[Any]] = []
    code: list[list[Any]] = []
    tops: set[str] = set()
    seen: set[str] = set()
    stack = list(dict.fromkeys(names))
    while stack:
        name = stack.pop()
        if name in seen or name.partition(".")[0] == "overmind_lab":
            continue
        seen.add(name)
        module = sys.modules.get(name)
        if not isinstance(module, types.ModuleType):
            continue
        file = user_code._module_file(module)
        if file is None:
            continue  # a cell, ``python -c``: its code is digested by ``user_code``
        if file is False:
            where = getattr(module, "__file__", None)
            if isinstance(where, str) and not name.startswith("_"):
                tops.add(name.partition(".")[0])
                if name in anchors and (r := _record(where)) is not None:
                    code.append([name, *r])
            continue
        try:
            current = user_code._current_in_memory(module, file)
        except OSError as exc:
            raise NotCacheable(f"{file} cannot be read: {exc}") from exc
        if not current:
            raise NotCacheable(f"{file} changed after this process imported it; restart "
                               "(or reload the module) to cache loads that use it")
        recorded = _record(file)
        if recorded is None:
            continue
        modules.append([name, *recorded, user_code.globals_state(module, file)])
        stack.extend(n for n in _imports(module, file, recorded[1]) if n not in seen)
    if len(modules) + len(code) > MAX_DEPENDENCIES:
        raise NotCacheable(f"the load depends on more than {MAX_DEPENDENCIES} modules")
    return sorted(modules), sorted(code), tops


#: (path, identity) -> the module names its import statements name
_parsed: dict[tuple[str, tuple[int, ...]], list[str]] = {}


def _imports(module: types.ModuleType, file: str, ident: list[int]) -> list[str]:
    """The modules a user module depends on: those its ``import`` statements name (and a name
    imported from a package, which may be a submodule), those its globals come from."""
    key = (file, tuple(ident))
    named = _parsed.get(key)
    if named is None:
        named = _parsed[key] = _imported_names(file, getattr(module, "__package__", None) or "")
    out = [n for n in named if n in sys.modules]
    for value in list(vars(module).values()):
        try:
            if isinstance(value, types.ModuleType):
                out.append(value.__name__)
            else:
                owner = getattr(value, "__module__", None)
                if isinstance(owner, str):
                    out.append(owner)
        except Exception:  # noqa: BLE001, S112 - a global whose attribute lookup raises
            continue
    return out


def _imported_names(file: str, package: str) -> list[str]:
    try:
        with open(file, "rb") as f:
            tree = ast.parse(f.read(), file)
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                names.extend(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        elif isinstance(node, ast.ImportFrom):
            try:
                base = importlib.util.resolve_name("." * node.level + (node.module or ""),
                                                   package) if node.level else node.module
            except (ImportError, ValueError):
                continue
            if not base:
                continue
            names.append(base)
            names.extend(f"{base}.{alias.name}" for alias in node.names)
    return names


@functools.lru_cache(maxsize=1)
def _distribution_index() -> dict[str, str]:
    """Top-level name -> ``RECORD`` path, first along ``sys.path``: by the distribution's name,
    else its ``top_level.txt`` (once per process, at the first store)."""
    out: dict[str, str] = {}
    for entry in sys.path:
        try:
            names = sorted(os.listdir(entry or "."))
        except OSError:
            continue
        for name in names:
            if not name.endswith(".dist-info"):
                continue
            record = os.path.join(entry, name, "RECORD")
            if not os.path.isfile(record):
                continue
            tops = {name.partition("-")[0]}
            try:
                with open(os.path.join(entry, name, "top_level.txt"), encoding="utf-8") as f:
                    tops.update(line.strip() for line in f if line.strip())
            except OSError:
                pass
            for top in tops:
                out.setdefault(top, record)
                out.setdefault(top.lower().replace("-", "_"), record)
    return out


# -- checking it on a hit ----------------------------------------------------------------
def changed(manifest: Any) -> str | None:
    """Why a stored manifest no longer holds for this process, or ``None`` (free when empty)."""
    if not manifest:
        return None
    try:
        return _changed(manifest)
    except Exception as exc:  # noqa: BLE001 - Note [Digests never fail a load] in user_code
        return f"the load's dependencies could not be checked: {exc!r}"


def _changed(manifest: dict[str, list[list[Any]]]) -> str | None:
    for path, ident, digest in manifest.get("files", ()):
        why = _differs(path, ident, digest)
        if why is not None:
            return why
    for path, ident, digest in manifest.get("dirs", ()):
        why = _differs(path, ident, digest, is_dir=True)
        if why is not None:
            return f"the folder {why}"
    for name, path, ident, digest, state in manifest.get("modules", ()):
        module = sys.modules.get(name)
        here = getattr(module, "__file__", None)
        if isinstance(here, str) and here != path:
            path = here  # another checkout of the same module: its content decides
        why = _differs(path, ident, digest)
        if why is not None:
            return f"the module {name}: {why}"
        if module is None:
            if state is not None and state.startswith("~"):  # Note [Globals set at run time]
                return f"the module {name} had globals set at run time"
            continue
        if not user_code._current_in_memory(module, path):
            return f"the module {name} changed after this process imported it"
        if user_code.globals_state(module, path) != state:
            return f"the globals of the module {name} changed"
    for name, path, ident, digest in manifest.get("code", ()):
        here = getattr(sys.modules.get(name), "__file__", None)
        why = _differs(here if isinstance(here, str) else path, ident, digest)
        if why is not None:
            return f"the installed module {name}: {why}"
    for top, path, ident, digest in manifest.get("dists", ()):
        why = _differs(path, ident, digest)
        if why is not None:
            return f"the installed distribution of {top}: {why}"
    return None
