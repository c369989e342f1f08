"""What a result may share with the world outside it: the user's modules and their globals, the
bytes a numpy array spans. ``fingerprint`` records what it finds (Note [Sharing with the outside]);
``_loading/faithful.py`` refuses to cache it. Standard library only.
"""

from __future__ import annotations

import functools
import os
import site
import sys
from typing import Any

__all__ = ["regular_folders", "regular_roots", "is_regular_file", "is_user_module", "user_globals",
           "array_bounds"]


def regular_folders() -> tuple[set[str], set[str]]:
    """(the standard library's and the site folders, the site folders alone), as named: Note
    [Regular code] in ``_loading/user_code.py``."""
    # sysconfig's paths without ``sysconfig.get_paths()`` (which imports ``_sysconfigdata``).
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    regular = {os.path.dirname(os.__file__), *(
        os.path.join(prefix, lib, version)
        for prefix in {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
        for lib in ("lib", "lib64", getattr(sys, "platlibdir", "lib")))}
    sites: set[str] = set()
    try:
        sites.update(site.getsitepackages())
    except AttributeError:  # an old virtualenv's site module
        pass
    user_site = site.getusersitepackages()
    if isinstance(user_site, str):
        sites.add(user_site)
    sites.update(p for p in sys.path
                 if os.path.basename(p.rstrip(os.sep)) in ("site-packages", "dist-packages"))
    sites.update(p for p in sys.path if p and p not in sites and p not in regular
                 and _holds_distributions(p))
    return regular | sites, sites


def _holds_distributions(folder: str) -> bool:
    """Whether an installer wrote into ``folder`` (``pip install --target``, a folder of
    installed packages on ``PYTHONPATH`` or in a ``.pth``): it holds a ``.dist-info``."""
    try:
        with os.scandir(folder) as entries:
            return any(e.name.endswith(".dist-info") for e in entries)
    except OSError:
        return False


@functools.lru_cache(maxsize=1)
def regular_roots() -> tuple[str, ...]:
    """The standard library's and the site folders, real paths, each ending with a separator."""
    return tuple(os.path.realpath(p).rstrip(os.sep) + os.sep for p in regular_folders()[0] if p)


@functools.lru_cache(maxsize=4096)
def is_regular_file(path: str) -> bool:
    """Under a regular root as named or as resolved (a folder of links into site-packages)."""
    roots = regular_roots()
    return os.path.realpath(path).startswith(roots) or os.path.abspath(path).startswith(roots)


#: module name -> (module, whether it is the user's): a module's verdict does not change
_verdicts: dict[str, tuple[Any, bool]] = {}


def user_globals() -> list[tuple[str, Any]]:
    """``("module.NAME", value)`` for the globals of the user's modules but ``__dunder__`` ones."""
    found = []
    modules: set[int] = set()  # one name each (``__main__`` is also ``__mp_main__``)
    for name, module in list(sys.modules.items()):
        known = _verdicts.get(name)
        if known is None or known[0] is not module:
            known = _verdicts[name] = (module, is_user_module(name, module))
        if known[1] and id(module) not in modules:
            modules.add(id(module))
            try:
                items = list(vars(module).items())
            except TypeError:  # not a module: no globals
                continue
            found += [(f"{name}.{attr}", value) for attr, value in items
                      if not attr.startswith("__")]
    return found


def is_user_module(name: str, module: Any) -> bool:
    top = name.partition(".")[0]
    if module is None or top == "overmind_lab":
        return False
    if name == "__main__":
        return True
    file = getattr(module, "__file__", None)
    if not isinstance(file, str) or not os.path.isabs(file):  # ``torch.ops``: "_ops.py"
        file = None
    if top != name:
        package = sys.modules.get(top)
        top_file = getattr(package, "__file__", None)
        if isinstance(top_file, str) and os.path.basename(top_file) == "__init__.py" and (
                not isinstance(file, str) or file.startswith(os.path.dirname(top_file))):
            return is_user_module(top, package)  # one decision per package
    if file is not None:
        return not is_regular_file(file)
    if name in sys.builtin_module_names or top != name:
        return False
    spec = getattr(module, "__spec__", None)
    if spec is not None and (getattr(spec, "origin", None) in ("built-in", "frozen")
                             or getattr(spec, "submodule_search_locations", None) is not None):
        return False  # built in, frozen, or a namespace package
    loader = getattr(type(getattr(spec, "loader", None)), "__module__", None)
    if isinstance(loader, str) and loader != name and loader not in ("builtins", "__main__") \
            and not is_user_module(loader, sys.modules.get(loader)):
        return False  # made by a library (torch's ``_remote_module_non_scriptable``)
    return True  # code without a file: ``python -c``'s, a notebook's



def array_bounds(a: Any) -> tuple[int, int] | None:
    """The bytes numpy array ``a`` spans, ``None`` for an empty or object array."""
    if not a.size or a.dtype.hasobject:
        return None
    low = high = int(a.__array_interface__["data"][0])
    for n, step in zip(a.shape, a.strides, strict=True):
        if step < 0:
            low += (n - 1) * step
        else:
            high += (n - 1) * step
    return low, high + a.itemsize
