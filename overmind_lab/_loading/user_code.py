"""The user's own code in cache keys: which code is not a regular installed distribution's, and a
digest of it.

Library versions say what library code is; nothing says what the user's code is (a model class in
the notebook's folder, ``__main__``, a cell, an HF dynamic module, an editable install), and editing
a model class then restarting is the loop this serves. So it enters by a digest
(Note [Code in the key]): :func:`code_of` the loader's, for the key; :func:`graph_code` the classes
and functions in the result, stored with the entry, compared on a hit by :func:`changed`. Regular
code (Note [Regular code]) costs a cached dictionary lookup per class.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import json
import os
import re
import sys
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Literal
from urllib.parse import unquote, urlparse

from overmind_lab._common.outside import regular_folders
from overmind_lab._errors import NotCacheable

__all__ = ["code_of", "graph_code", "changed", "is_regular_file", "file_digest", "object_digest"]

#: Hex digits kept of a sha256.
_DIGEST = 32


# Note [Regular code]: a module file is regular when the longest root it lies under is regular: the
# standard library (sysconfig's stdlib and platstdlib of every prefix), site-packages and
# dist-packages folders (site's, and any on ``sys.path``), any folder on ``sys.path`` an installer
# wrote a ``.dist-info`` into (``pip install --target``). Editable installs are roots of their own,
# not regular: a dist-info's ``direct_url.json`` editable folder (PEP 610/660), an ``.egg-link``
# target, ``__editable__*.pth`` folders, setuptools' editable finders' ``MAPPING``. Longest wins
# both ways: this repository is an editable root holding ``.venv``, whose site-packages stays
# regular. Only the site folders on ``sys.path`` are searched, and direct_url.json only read when a
# ``.pth`` is named after it (~0.3 ms in all). Everything outside every root (the notebook's folder,
# HF_MODULES_CACHE) is user code. Computed once per process.
@functools.lru_cache(maxsize=1)
def _roots() -> tuple[tuple[str, bool], ...]:
    """(root + separator, regular?) pairs, longest first."""
    regular, sites = regular_folders()
    # Installers write editable installs' metadata into the site folders only.
    editable = set(_editable_roots([p for p in sys.path if p in sites]))
    roots = {_as_root(p): True for p in regular if p}
    roots.update({_as_root(p): False for p in editable if p})
    return tuple(sorted(roots.items(), key=lambda r: len(r[0]), reverse=True))


def prewarm() -> None:
    """This module's once-per-process work, ahead of the first key (``keys.prewarm``)."""
    _roots()
    _process_start_ns()


def forget_roots() -> None:
    """Compute the roots again (the installation changed: ``keys._settle``)."""
    _roots.cache_clear()
    is_regular_file.cache_clear()
    _packages.clear()


def _as_root(path: str) -> str:
    return os.path.realpath(path).rstrip(os.sep) + os.sep


_EDITABLE_SUFFIXES = (".dist-info", ".egg-link", ".pth", "_finder.py")


def _editable_roots(entries: list[str]) -> list[str]:
    found: list[str] = []
    for entry in entries:
        try:
            names = os.listdir(entry)
        except OSError:
            continue
        # An editable wheel works through a .pth file named after the project: only those projects'
        # direct_url.json is read, not one per distribution (~1 ms).
        pths = "|".join(_canonical(n) for n in names if n.endswith(".pth"))
        for name in names:
            if not name.endswith(_EDITABLE_SUFFIXES) or (
                    name.endswith(".dist-info")
                    and _canonical(name.partition("-")[0]) not in pths):
                continue
            path = os.path.join(entry, name)
            if name.endswith(".dist-info"):
                root = _direct_url_root(os.path.join(path, "direct_url.json"))
                if root is not None:
                    found.append(root)
            elif name.endswith(".egg-link"):
                found.extend(_lines(path)[:1])
            elif name.startswith("__editable__") and name.endswith(".pth"):
                found.extend(line for line in _lines(path)
                             if not line.startswith(("import ", "import\t", "#")))
            elif name.startswith("__editable__") and name.endswith("_finder.py"):
                found.extend(_finder_mapping(path))
    return [os.path.abspath(p) for p in found if p]


def _canonical(name: str) -> str:
    return name.replace("-", "_").replace(".", "_").lower()


def _direct_url_root(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):  # no such file: installed from an index
        return None
    info = record.get("dir_info") if isinstance(record, dict) else None
    url = urlparse(str(record.get("url", ""))) if isinstance(record, dict) else None
    if isinstance(info, dict) and info.get("editable") and url is not None \
            and url.scheme == "file":
        return unquote(url.path)
    return None


def _lines(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return [line.strip() for line in f if line.strip()]
    except (OSError, UnicodeDecodeError):
        return []


def _finder_mapping(path: str) -> list[str]:
    """The package folders of a setuptools editable finder (``MAPPING = {...}``)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        match = re.search(r"^MAPPING\s*(?::[^=]*)?=\s*(\{.*?\})\s*$", text, re.M | re.S)
        mapping = ast.literal_eval(match.group(1)) if match else {}
    except (OSError, ValueError, SyntaxError, UnicodeDecodeError):
        return []
    return [str(v) for v in mapping.values()] if isinstance(mapping, dict) else []


@functools.lru_cache(maxsize=4096)
def is_regular_file(path: str) -> bool:
    """Whether module file ``path`` is regular (Note [Regular code])."""
    # As resolved, then as named: a folder of links into a site folder is installed code.
    for candidate in dict.fromkeys((os.path.realpath(path), os.path.abspath(path))):
        for root, regular in _roots():
            if candidate.startswith(root):
                if regular:
                    return True
                break
    return False


#: top-level package -> (its folder, regular?): Note [One decision per package]
_packages: dict[str, tuple[str, bool]] = {}


# Note [One decision per package]: resolving a path costs ~25 µs (an ``lstat`` per component); a
# module whose file lies in its top-level package's folder gets that package's decision.
def _regular_module_file(name: str, file: str) -> bool:
    top = name.partition(".")[0]
    known = _packages.get(top)
    if known is None:
        package = sys.modules.get(top)
        top_file = getattr(package, "__file__", None)
        if not isinstance(top_file, str) or os.path.basename(top_file) != "__init__.py":
            return is_regular_file(file)  # a plain module, or a namespace package
        known = _packages[top] = (os.path.dirname(top_file) + os.sep, is_regular_file(top_file))
    if file.startswith(known[0]):
        return known[1]
    return is_regular_file(file)


def _module_file(module: types.ModuleType | None) -> str | None | Literal[False]:
    """The file of a user module, ``None`` for a user module without one (``__main__`` of ``python
    -c``, a notebook's), ``False`` for a regular module (or an unknown one)."""
    if module is None:
        return False
    file = getattr(module, "__file__", None)
    if isinstance(file, str):
        if not os.path.isabs(file):
            return False  # ``torch.ops``' "_ops.py": a library's made-up module, no file of its own
        return False if _regular_module_file(module.__name__, file) else file
    name = module.__name__
    if name in sys.builtin_module_names:
        return False
    spec = getattr(module, "__spec__", None)
    if spec is not None and getattr(spec, "origin", None) in ("built-in", "frozen"):
        return False
    if spec is not None and getattr(spec, "submodule_search_locations", None) is not None:
        return False  # a namespace package: defines no classes of its own
    return None


# -- digests ------------------------------------------------------------------------------
_file_digests: dict[tuple[str, int, int, int, int, int], str] = {}


def file_digest(path: str, *, cached: bool = True) -> str:
    """sha256 of a file's content, cached per process by path and identity (``cached=False``: read
    again whatever the cache holds, Note [Racy signatures] in ``manifest``)."""
    st = os.stat(path)
    sig = (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    digest = _file_digests.get(sig) if cached else None
    if digest is None:
        with open(path, "rb") as f:
            digest = _file_digests[sig] = hashlib.sha256(f.read()).hexdigest()[:_DIGEST]
    return digest


@functools.lru_cache(maxsize=1)
def _process_start_ns() -> int:
    """When this process started (``/proc``; 0 if unreadable), rounded down: a file changed just
    before may look changed after, never the reverse."""
    try:
        with open("/proc/self/stat", "rb") as f:
            ticks = int(f.read().rpartition(b")")[2].split()[19])
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime"))
        return (boot * 10**9 + ticks * 10**9 // os.sysconf("SC_CLK_TCK")) - 10**9
    except (OSError, ValueError, IndexError, StopIteration):
        return 0


# Read at import, before the load: a background store's fork judges files by its parent's start.
_process_start_ns()


# Note [A file changed under a running process]: a module file's digest is of the file on disk, but
# the process runs what it imported. If the user edits a module after its import, a miss would store
# the old code's object under the new file's digest. So a user file changed (ctime) after this
# process started is compiled, and every function and method the module defines must be one of its
# code objects (they compare by bytecode, constants, names, lines). A module first written then
# imported in the session (``%%writefile``) passes; one edited after its import raises NotCacheable
# (uncached until a restart). Class constants are not compared; HF_MODULES_CACHE is exempt
# (transformers re-executes a changed dynamic module).
_checked_files: set[tuple[str, int, int, int]] = set()


def _current_in_memory(module: types.ModuleType, path: str) -> bool:
    st = os.stat(path)
    if st.st_ctime_ns < _process_start_ns() or _in_hf_modules(path):
        return True
    sig = (path, st.st_ino, st.st_size, st.st_ctime_ns)
    if sig in _checked_files:
        return True
    # Only a match is remembered: a reload can make a module match its file again.
    if not _matches_source(module, path):
        return False
    _checked_files.add(sig)
    return True


def _in_hf_modules(path: str) -> bool:
    home = os.environ.get("HF_HOME", os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "huggingface"))
    cache = os.environ.get("HF_MODULES_CACHE", os.path.join(home, "modules"))
    return os.path.realpath(path).startswith(_as_root(cache))


def _matches_source(module: types.ModuleType, path: str) -> bool:
    try:
        with open(path, "rb") as f:
            source = f.read()
        compiled = compile(source, path, "exec", dont_inherit=True)
    except (OSError, SyntaxError, ValueError):
        return False
    if not _constants_match(module, source, path):
        return False
    known: set[types.CodeType] = set()
    stack = [compiled]
    while stack:
        code = stack.pop()
        known.add(code)
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    for code in _module_codes(module, path):
        if code not in known:
            return False
    return True


def _constants_match(module: types.ModuleType, source: bytes, path: str) -> bool:
    """Whether each module-level name the file binds once to a literal (``WIDTH = 4``) still has
    that value in ``module``: a constant edited after the import changes no code object."""
    try:
        tree = ast.parse(source, path)
    except (SyntaxError, ValueError):
        return False
    state = vars(module)
    for name, values in _bindings(tree).items():
        if len(values) != 1 or values[0] is None or name not in state:
            continue  # bound twice, by ``+=``, without a value
        try:
            literal = ast.literal_eval(values[0])
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue  # not a literal: its code is compared above
        if type(literal) is not type(state[name]) or literal != state[name]:
            return False
    return True


def _module_codes(module: types.ModuleType, path: str) -> Iterable[types.CodeType]:
    """The code objects of the functions and methods ``module`` defines from ``path``."""
    seen: set[int] = set()
    stack: list[Any] = list(vars(module).values())
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, type) and value.__module__ == module.__name__:
            stack.extend(vars(value).values())
            continue
        func = _function_of(value)
        if func is not None:
            for inner in _inner_functions(func):
                if inner.__code__.co_filename == path:
                    yield inner.__code__


def _function_of(value: Any) -> types.FunctionType | None:
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    elif isinstance(value, property):
        value = value.fget
    return value if isinstance(value, types.FunctionType) else None


def _inner_functions(func: types.FunctionType) -> list[types.FunctionType]:
    """``func``, and what a decorator wrapped in it (``__wrapped__``, closure cells)."""
    out: list[types.FunctionType] = []
    stack = [func]
    while stack and len(out) < 16:
        f = stack.pop()
        if any(f is o for o in out):
            continue
        out.append(f)
        wrapped = _function_of(getattr(f, "__wrapped__", None))
        if wrapped is not None:
            stack.append(wrapped)
        for cell in f.__closure__ or ():
            try:
                inner = _function_of(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
            if inner is not None:
                stack.append(inner)
    return out


# Note [Globals set at run time]: a helper module's file says ``WIDTH = 4``, a cell runs
# ``myhelpers.WIDTH = 8``, then loads: the plain load builds with 8, and the file's digest says
# nothing of it. So an entry records, per module of the user's, a digest of the immutable values
# (numbers, text, tuples of them, classes and functions by name) of its globals, marked ``~`` where
# one differs from the file's single literal binding. A hit compares them with this process's
# module if imported; a module not imported yet will run its file, so a ``~`` entry (built from
# values set at run time) is a miss there. A script's ``__main__`` counts only the globals its own
# code reads (``co_names`` of every function and method it defines): a loop's variable is not an
# input. Mutable values (a cache filled by the load) are left out.
_read_names: dict[tuple[int, str, int, int], tuple[str, ...]] = {}
_literals: dict[tuple[str, int, int], dict[str, Any]] = {}


def globals_state(module: types.ModuleType, path: str) -> str | None:
    """The digest of ``module``'s immutable globals (Note [Globals set at run time]), ``~`` first
    where one was set at run time; ``None`` if it has none."""
    st = os.stat(path)
    key = (id(module), path, st.st_ino, st.st_mtime_ns)
    names = _read_names.get(key) if module.__name__ == "__main__" else tuple(sorted(vars(module)))
    if names is None:
        found: set[str] = set()
        for code in _module_codes(module, path):
            stack = [code]
            while stack:
                c = stack.pop()
                found.update(c.co_names)
                stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
        names = _read_names[key] = tuple(sorted(found))
    state = vars(module)
    h = hashlib.sha256()
    set_at_run_time = False
    literals: dict[str, Any] | None = None
    count = 0
    for name in names:
        if name not in state or name.startswith("__"):
            continue
        value = state[name]
        if not _immutable(value):
            continue
        count += 1
        h.update(f"\0{name}={_plain_repr(value)}".encode())
        if not set_at_run_time and not isinstance(value, type) and _function_of(value) is None:
            if literals is None:
                literals = _file_literals(path, st)
            if name in literals and (type(literals[name]) is not type(value)
                                     or literals[name] != value):
                set_at_run_time = True
    if not count:
        return None
    return ("~" if set_at_run_time else "") + h.hexdigest()[:_DIGEST]


def _immutable(value: Any, depth: int = 0) -> bool:
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, type)):
        return True
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        return True
    if isinstance(value, (tuple, frozenset)) and depth < 4 and len(value) <= _PLAIN_ITEMS:
        return all(_immutable(v, depth + 1) for v in value)
    return False


def _file_literals(path: str, st: os.stat_result) -> dict[str, Any]:
    """Module-level names the file binds once, to a literal: their values."""
    key = (path, st.st_ino, st.st_mtime_ns)
    found = _literals.get(key)
    if found is not None:
        return found
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        tree = ast.Module(body=[], type_ignores=[])
    found = _literals[key] = {}
    for name, values in _bindings(tree).items():
        if len(values) == 1 and values[0] is not None:
            try:
                found[name] = ast.literal_eval(values[0])
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                continue
    return found


def _bindings(tree: ast.Module) -> dict[str, list[ast.expr | None]]:
    """Each module-level name a file binds by assignment: the values (``None`` for ``+=``)."""
    bound: dict[str, list[ast.expr | None]] = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        for target in targets:
            if isinstance(target, ast.Name):
                bound.setdefault(target.id, []).append(value)
    return bound


def object_digest(obj: Any) -> str | None:
    """The digest of a class's or function's code; ``None`` for regular code. Raises
    :class:`NotCacheable` when its file changed after its import
    (Note [A file changed under a running process])."""
    name = getattr(obj, "__module__", None) or ""
    if name.partition(".")[0] == "overmind_lab":
        return None  # our own reducers: FORMAT_VERSION says what they are
    module = sys.modules.get(name)
    file = _module_file(module)
    if file is False:
        return None
    return _digest(obj, module, file)


def _digest(obj: Any, module: types.ModuleType | None, file: str | None) -> str:
    if file is not None and module is not None:
        if not _current_in_memory(module, file):
            raise NotCacheable(f"{file} changed after this process imported it; restart "
                               "(or reload the module) to cache loads that use it")
        return file_digest(file)
    h = hashlib.sha256()
    _hash_object(obj, h, set())
    return h.hexdigest()[:_DIGEST]


# Note [Code without a file]: ``python -c``'s ``__main__`` and notebook cells have no module file. A
# function enters by its source (linecache holds IPython's cells), else its code objects
# recursively, and its defaults; a class by its name, bases and its ``__dict__`` in name order
# (functions as above, also behind staticmethod, classmethod, property; nested classes; plain values
# by ``repr``, others by type). Not ``marshal``: its output depends on reference counts.
def _hash_object(obj: Any, h: Any, seen: set[int]) -> None:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, type):
        h.update(f"class {obj.__qualname__}{[b.__qualname__ for b in obj.__bases__]}" .encode())
        for name in sorted(vars(obj)):
            if name in _NOT_THE_CLASS:
                continue
            value = vars(obj)[name]
            h.update(f"\0{name}=".encode())
            if isinstance(value, type) and value.__qualname__.startswith(obj.__qualname__):
                _hash_object(value, h, seen)
            elif isinstance(value, property):
                for part in (value.fget, value.fset, value.fdel):
                    _hash_function(part, h, seen)
            elif _function_of(value) is not None:
                _hash_function(_function_of(value), h, seen)
            else:
                h.update(_plain_repr(value).encode())
        return
    func = _function_of(obj)
    if func is not None:
        _hash_function(func, h, seen)
    else:
        h.update(_plain_repr(obj).encode())


#: What a class's digest leaves out: what Python and the libraries add to a class after it is
#: defined (``copyreg`` caches ``__slotnames__`` on it at the first pickle, ``abc`` its cache), so
#: that a digest taken after a load equals one taken before (a class in a cell stays warm).
_NOT_THE_CLASS = frozenset({"__dict__", "__weakref__", "__module__", "__doc__", "__qualname__",
                            "__slotnames__", "_abc_impl", "__abstractmethods__"})


def _hash_function(func: Any, h: Any, seen: set[int]) -> None:
    func = _function_of(func)
    if func is None:
        h.update(b"-")
        return
    for inner in _inner_functions(func):
        try:
            h.update(inspect.getsource(inner).encode())
        except Exception:  # noqa: BLE001 - no source (OSError), or none inspect can parse
            _hash_code(inner.__code__, h)
        h.update(_plain_repr((inner.__defaults__, inner.__kwdefaults__)).encode())
        _hash_globals(inner, h, seen)


# Note [Globals a cell's code reads]: a method of a class in a cell (or ``python -c``) that reads a
# global set in another cell (``WIDTH = 4``, ``ACT = nn.GELU``) builds another object when that
# cell changes, with the class's source unchanged. So the digest of code without a file includes
# each global its code objects name (``co_names``, nested code too) that the function's globals
# hold: plain values by ``repr``, classes and functions by name, or by their own digest where they
# are code without a file too (a factory in a cell), modules by name, objects by their type and
# plain attributes. A name that is an attribute, not a global, only adds a value that must stay the
# same for a hit: a miss too many, never a stale hit.
def _hash_globals(func: types.FunctionType, h: Any, seen: set[int]) -> None:
    names: set[str] = set()
    stack = [func.__code__]
    while stack:
        code = stack.pop()
        names.update(code.co_names)
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    scope = func.__globals__
    for name in sorted(names):
        if name not in scope or name.startswith("__"):
            continue
        value = scope[name]
        h.update(f"\0global {name}=".encode())
        if isinstance(value, types.ModuleType):
            h.update(f"module {value.__name__}".encode())
        elif (isinstance(value, type) or _function_of(value) is not None) and \
                sys.modules.get(getattr(value, "__module__", None) or "") is not None and \
                _module_file(sys.modules[value.__module__]) is None:
            _hash_object(value, h, seen)  # code without a file, as its reader
        else:
            h.update(_plain_repr(value).encode())


def _hash_code(code: types.CodeType, h: Any) -> None:
    h.update(code.co_code)
    h.update(repr((code.co_name, code.co_names, code.co_varnames, code.co_freevars,
                   code.co_cellvars, code.co_argcount, code.co_posonlyargcount,
                   code.co_kwonlyargcount, code.co_flags)).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _hash_code(const, h)
        else:
            h.update(_plain_repr(const).encode())


#: Containers larger than this enter a digest by their type and length only.
_PLAIN_ITEMS = 1000


def _plain_repr(value: Any, depth: int = 0) -> str:
    """``repr`` of plain values (sets sorted: their order is salted); classes and functions by
    name; an object by its type and its plain attributes; the type otherwise."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return repr(value)
    if isinstance(value, type) or isinstance(value, (types.FunctionType,
                                                     types.BuiltinFunctionType)):
        return f"<{type(value).__name__} {getattr(value, '__module__', None)}." \
               f"{getattr(value, '__qualname__', '?')}>"
    kind = f"<{type(value).__module__}.{type(value).__qualname__}>"
    if depth > 4:
        return kind
    if isinstance(value, (tuple, list, set, frozenset, dict)) and len(value) > _PLAIN_ITEMS:
        return f"{kind}[{len(value)}]"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({','.join(_plain_repr(v, depth + 1) for v in value)})"
    if isinstance(value, (set, frozenset)):
        return f"set({','.join(sorted(_plain_repr(v, depth + 1) for v in value))})"
    if isinstance(value, dict):
        items = sorted(f"{_plain_repr(k, depth + 1)}:{_plain_repr(v, depth + 1)}"
                       for k, v in value.items())
        return f"dict({','.join(items)})"
    state = getattr(value, "__dict__", None)
    if type(state) is dict and type(value).__module__ in ("types", "argparse", "__main__") \
            and len(state) <= _PLAIN_ITEMS:  # a namespace of settings
        return f"{kind}{_plain_repr(state, depth + 1)}"
    return kind


# -- what enters keys and entries ----------------------------------------------------------
def _name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', None)}:{getattr(obj, '__qualname__', '?')}"


def _with_mros(items: Iterable[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        for part in (item.__mro__ if isinstance(item, type) else (item,)):
            out.setdefault(_name(part), part)
    return out


def _digests(items: Iterable[Any]) -> dict[str, str]:
    out = {}
    for name, obj in _with_mros(items).items():
        digest = object_digest(obj)
        if digest is not None:
            out[name] = digest
    return dict(sorted(out.items()))


def code_of(fn: Callable[..., Any]) -> dict[str, str]:
    """``{"module:qualname": digest}`` of the user's code among the loader: ``fn``, the class a
    classmethod is bound to and its MRO, or ``fn``'s MRO; ``{}`` for a library's loader."""
    owner = getattr(fn, "__self__", None)
    func = getattr(fn, "__func__", fn)
    anchor = owner if isinstance(owner, type) else func
    try:
        if _regular_loaders.get(anchor) is func:
            return {}
    except TypeError:  # not weakly referenceable
        anchor = None
    items: list[Any] = [func]
    if isinstance(owner, type):
        items.append(owner)
    out = _guarded(_digests, items)
    if not out and anchor is not None:
        _regular_loaders[anchor] = func
    return out


#: class (or function) -> loader function found all regular: a repeated key skips the MRO walk (~10
#: µs); regularity and MROs do not change in a process.
_regular_loaders: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _guarded(digests: Callable[[list[Any]], dict[str, str]], items: list[Any]) -> dict[str, str]:
    """Note [Digests never fail a load]: whatever goes wrong (a file deleted since import, a source
    inspect cannot parse) makes the load uncached (:class:`NotCacheable`), never fails."""
    try:
        return digests(items)
    except NotCacheable:
        raise
    except Exception as exc:  # noqa: BLE001 - see the Note
        raise NotCacheable(f"the code of the load cannot be digested: {exc!r}") from exc


def graph_code(objects: Iterable[Any]) -> dict[str, str]:
    """The user's code among the classes and functions a result's stream names (and MROs), as
    :func:`code_of` lists it; what has no name nor file (a lambda in ``python -c``) is left out:
    pickle stores it by value."""
    out = _guarded(_digests, list(objects))
    for name in list(out):
        if _resolve(name) is None and _module_file(sys.modules.get(name.partition(":")[0])) is None:
            del out[name]
    return out


def _resolve(name: str) -> Any:
    module_name, _, qualname = name.partition(":")
    module = sys.modules.get(module_name)
    if module is None and module_name != "__main__":
        from overmind_lab._loading.pickling import import_path_for

        import_path_for(module_name)  # Note [Dynamic modules]: a model's own code
        try:
            module = importlib.import_module(module_name)
        except Exception:  # noqa: BLE001 - any import failure: the code is gone
            return None
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def changed(recorded: dict[str, str] | None) -> str | None:
    """Why an entry's code differs from this process's, or ``None`` (free without user code)."""
    if not recorded:
        return None
    try:
        return _changed(recorded)
    except Exception as exc:  # noqa: BLE001 - Note [Digests never fail a load]
        return f"the code could not be compared: {exc!r}"


def _changed(recorded: dict[str, str]) -> str | None:
    for name, digest in recorded.items():
        module_name = name.partition(":")[0]
        obj = _resolve(name)
        module = sys.modules.get(module_name)
        if module is None:
            return f"{module_name} cannot be imported"
        file = _module_file(module)
        if file is False:
            return f"{name} is no longer the user's code"
        if obj is None and file is None:
            return f"{name} is not defined in this process"
        try:
            now = _digest(obj, module, file)
        except Exception as exc:  # noqa: BLE001 - Note [Digests never fail a load]
            return str(exc)
        if now != digest:
            return f"the code of {name} changed"
    return None
