"""overmind-lab: warm model reloads for notebook development.

The first ``from_pretrained`` (or any call passed to :func:`load`) parks its result in shared
memory held by a per-user daemon; every later load, from any process of the user, comes back in
milliseconds, zero-copy and copy-on-write isolated. Importing this package is cheap.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "load",
    "bypass",
    "refreshing",
    "record_loads",
    "key_of",
    "wait_for_stores",
    "LoadEvent",
    "Client",
    "OvermindError",
    "DaemonUnavailable",
    "ProtocolError",
    "UnknownEntry",
    "NotCacheable",
    "MissingDependency",
    "OvermindWarning",
    "VerifyMismatch",
    "verifying",
    "patch_all",
    "unpatch_all",
    "is_patched",
    "get_original",
    "widget",
    "load_ipython_extension",
    "unload_ipython_extension",
]

# Note [A package that costs nothing to import]: every public name is imported when first used
# (``__getattr__``), even ``typing`` and the exception classes: ``overmind-lab run`` imports this
# package before it ``exec``s plain Python, and every millisecond here is a millisecond that run is
# slower than plain (``_launcher/run.py``). The daemon imports this package too, and stays free of
# torch, IPython and ipywidgets.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from overmind_lab._errors import (
        DaemonUnavailable,
        NotCacheable,
        OvermindError,
        OvermindWarning,
        ProtocolError,
        UnknownEntry,
        VerifyMismatch,
    )

#: Lazily imported names: the module that defines each.
_LAZY = {
    "OvermindError": "_errors", "DaemonUnavailable": "_errors", "ProtocolError": "_errors",
    "UnknownEntry": "_errors", "NotCacheable": "_errors", "OvermindWarning": "_errors",
    "VerifyMismatch": "_errors",
    "load": "_loading.load", "bypass": "_loading.load", "refreshing": "_loading.load",
    "record_loads": "_loading.load", "verifying": "_loading.load",
    "key_of": "_loading.load", "LoadEvent": "_loading.load",
    "wait_for_stores": "_loading.background",
    "MissingDependency": "_extras",
    "Client": "_loading.client",
    "patch_all": "_loading.patch", "unpatch_all": "_loading.patch", "is_patched": "_loading.patch",
    "get_original": "_loading.patch",
    "widget": "_loading.widget",
    "load_ipython_extension": "_loading.magics", "unload_ipython_extension": "_loading.magics",
    "_jupyter_server_extension_points": "_jupyter_server",
    "_jupyter_labextension_paths": "_jupyter_server",
    "_load_jupyter_server_extension": "_jupyter_server",
}


#: The lazy modules the start-up thread imports itself (``prewarm._run``: ``load`` and with it
#: ``client``).
_THREAD_IMPORTS = ("_loading.load", "_loading.client")


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'overmind_lab' has no attribute {name!r}")
    import importlib

    if module in _THREAD_IMPORTS:
        from overmind_lab._loading import prewarm

        # Waiting for the thread costs nothing the import would not: it does this import, and the
        # two never compete for the GIL (Note [The first call's work, earlier]); ``wait`` lets it
        # begin at once. A name of a module it does not import (``patch_all``,
        # ``load_ipython_extension``) waits for nothing, and the thread waits for those to end
        # (Note [The thread waits its turn]): in a notebook, ``%load_ext`` and ``%overmind_load``
        # come before the imports of torch and diffusers, and the thread's 25-70 ms of imports
        # then overlap those, not the cell.
        prewarm.wait()
    value = getattr(importlib.import_module(f"overmind_lab.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def _prewarm() -> None:
    # Note [The first call's work, earlier] (``_loading/prewarm.py``): the first ``load``'s imports
    # and installation scans, in a background thread, while the user imports torch and the rest.
    from overmind_lab._loading import prewarm

    prewarm.start()


_prewarm()
