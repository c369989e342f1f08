"""Route ``from_pretrained`` of diffusers and transformers through the cache.

User guide ==========

::

    import overmind_lab
    overmind_lab.patch_all()          # before or after importing diffusers/transformers

    from diffusers import StableDiffusionPipeline
    pipe = StableDiffusionPipeline.from_pretrained("/models/sd15")   # cold, then cached
    # ...restart the kernel, run the same two lines: warm, in milliseconds

    overmind_lab.unpatch_all()        # every patched attribute is exactly the original again

After :func:`patch_all`, ``UNet2DConditionModel.from_pretrained(p, ...)`` is
``overmind_lab.load(<the original bound to UNet2DConditionModel>, p, ...)``: the key names the class
really called. Loads nested inside a cached load run plainly: only the outermost is cached.

Patched: ``from_pretrained`` (or ``from_single_file``) of these bases and every subclass that
defines its own (each transformers ``Auto*`` class carries a copy): diffusers ``ModelMixin``,
``DiffusionPipeline``, ``SchedulerMixin``, ``FromSingleFileMixin``, ``FromOriginalModelMixin``,
``AutoPipelineFor*``, ``AutoModel``; transformers ``PreTrainedModel``, ``PreTrainedTokenizerBase``,
``ProcessorMixin``, ``FeatureExtractionMixin``, ``ImageProcessingMixin`` and the ``Auto*`` classes.
Configurations are not: they load faster than a round trip to the daemon. Classes not yet imported
are patched by an import hook on ``sys.meta_path`` right after their module executes. Like
``gevent.monkey``, originals are saved once: patching twice is harmless and :func:`get_original`
gives them back. Dynamic modules (``diffusers_modules.*``) need nothing here (Note [Dynamic modules]
in ``pickling.py``).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import types
import warnings

from overmind_lab._errors import OvermindWarning
from overmind_lab._extras import require, require_one

# Note [A package that costs nothing to import] (``overmind_lab/__init__.py``): ``patch_all`` is
# the first call of a notebook (``%load_ext``), before torch: no ``typing`` (2-4 ms with ``re``).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import ModuleType
    from typing import Any

__all__ = ["get_original", "is_patched", "patch_all", "patched_names", "unpatch_all",]

_LIBRARIES = ("diffusers", "transformers")

# (module, class, methods): the class and every subclass that defines one of the methods in its own
# __dict__ gets a caching wrapper.
_ROOTS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("diffusers.models.modeling_utils", "ModelMixin", ("from_pretrained",)),
    ("diffusers.pipelines.pipeline_utils", "DiffusionPipeline", ("from_pretrained",)),
    ("diffusers.schedulers.scheduling_utils", "SchedulerMixin", ("from_pretrained",)),
    ("diffusers.loaders.single_file", "FromSingleFileMixin", ("from_single_file",)),
    ("diffusers.loaders.single_file_model", "FromOriginalModelMixin", ("from_single_file",)),
    ("diffusers.pipelines.auto_pipeline", "AutoPipelineForText2Image", ("from_pretrained",)),
    ("diffusers.pipelines.auto_pipeline", "AutoPipelineForImage2Image", ("from_pretrained",)),
    ("diffusers.pipelines.auto_pipeline", "AutoPipelineForInpainting", ("from_pretrained",)),
    ("diffusers.pipelines.auto_pipeline", "AutoPipelineForText2Audio", ("from_pretrained",)),
    ("diffusers.models.auto_model", "AutoModel", ("from_pretrained",)),
    ("transformers.modeling_utils", "PreTrainedModel", ("from_pretrained",)),
    ("transformers.tokenization_utils_base", "PreTrainedTokenizerBase", ("from_pretrained",)),
    ("transformers.processing_utils", "ProcessorMixin", ("from_pretrained",)),
    ("transformers.feature_extraction_utils", "FeatureExtractionMixin", ("from_pretrained",)),
    ("transformers.image_processing_base", "ImageProcessingMixin", ("from_pretrained",)),
    ("transformers.models.auto.auto_factory", "_BaseAutoModelClass", ("from_pretrained",)),
    ("transformers.models.auto.tokenization_auto", "AutoTokenizer", ("from_pretrained",)),
    ("transformers.models.auto.processing_auto", "AutoProcessor", ("from_pretrained",)),
    ("transformers.models.auto.feature_extraction_auto", "AutoFeatureExtractor",
     ("from_pretrained",)),
    ("transformers.models.auto.image_processing_auto", "AutoImageProcessor",
     ("from_pretrained",)),
    ("transformers.models.auto.video_processing_auto", "AutoVideoProcessor",
     ("from_pretrained",)),
)

# Overrides that are not loads from a source: MtpModel.from_pretrained(main_model) builds a head
# around a model object already in memory, there is nothing to cache.
_SKIP = frozenset({"transformers.modeling_layers.MtpModel"})

_ORIGINAL_ATTR = "__overmind_original__"

_lock = threading.RLock()
# (class, method name) -> the attribute exactly as it was in the class __dict__
_saved: dict[tuple[type, str], Any] = {}
_hook: _PatchOnImport | None = None
_libraries: tuple[str, ...] = ()
_failed: set[str] = set()


# --------------------------------------------------------------------------- public API


def patch_all(*, diffusers: bool = True, transformers: bool = True,
              verify: bool | None = None) -> None:
    """Cache ``from_pretrained`` of diffusers and transformers in this process (before or after they
    are imported; again is harmless). ``verify=True`` also loads every hit plainly and compares
    (slow); ``False`` turns it off; ``None`` leaves it (``OVERMIND_LAB_VERIFY=1``).

    >>> import overmind_lab
    >>> overmind_lab.patch_all()
    >>> overmind_lab.is_patched()
    True
    """
    libraries = tuple(
        name for name, wanted in (("diffusers", diffusers), ("transformers", transformers))
        if wanted
    )
    # like load(): a missing extra is named before anything is patched
    require("torch", "overmind_lab.patch_all()")
    require_one(libraries, "overmind_lab.patch_all()")
    if verify is not None:
        from overmind_lab._loading.load import set_verify

        set_verify(verify)
    global _hook, _libraries
    with _lock:
        _libraries = tuple(dict.fromkeys(_libraries + libraries))
        if _hook is None:
            _hook = _PatchOnImport()
            sys.meta_path.insert(0, _hook)
        for root, methods in _loaded_roots():
            for cls in _subclasses(root):
                _patch_class(cls, methods)
    start_ahead()
    _prewarm_go()


def _prewarm_go() -> None:
    """The start-up thread's turn: Note [The thread waits its turn] (``prewarm``)."""
    from overmind_lab._loading import prewarm

    prewarm.go()


#: Note [A daemon started ahead] (``client``): ``0`` turns it off (the test suite, whose tests
#: stop what they start).
AHEAD_ENV = "OVERMIND_LAB_START_AHEAD"
_ahead: list[threading.Thread] = []


def start_ahead() -> None:
    """Start the user's daemon in a thread where no socket exists (Note [A daemon started ahead]
    in ``client``); once per process."""
    if _ahead or os.environ.get(AHEAD_ENV, "1") == "0":
        return
    # the usual case, a daemon listening, seen here without a thread: a thread started now would
    # hold the GIL for up to 5 ms of its imports before ``start()`` returns to the caller
    from overmind_lab._common.zygote_identity import daemon_socket_at_once

    known = daemon_socket_at_once(os.environ)
    if known and os.path.exists(known):
        return

    def run() -> None:
        from overmind_lab._common.naming import socket_path

        if socket_path().exists():  # a daemon runs, or the load replaces a dead one
            return
        from overmind_lab._loading.client import reach_ahead

        reach_ahead()

    thread = threading.Thread(target=run, name="overmind-lab-daemon-ahead", daemon=True)
    from overmind_lab._loading import prewarm

    prewarm.importing(thread)  # Note [A fork while the thread imports], 5 (``prewarm``)
    _ahead.append(thread)
    thread.start()


def wait_ahead(timeout: float | None = None) -> None:
    """Wait for the thread of ``start_ahead`` (tests)."""
    for thread in _ahead:
        thread.join(timeout)


def unpatch_all() -> None:
    """Undo :func:`patch_all`: each class ``__dict__`` holds exactly what it held before."""
    global _hook, _libraries
    with _lock:
        if _hook is not None:
            try:
                sys.meta_path.remove(_hook)
            except ValueError:
                pass
            _hook = None
        for (cls, name), original in list(_saved.items()):
            if _is_wrapper(cls.__dict__.get(name)):
                setattr(cls, name, original)
            # else someone replaced our wrapper after us: theirs stays.
        _saved.clear()
        _libraries = ()


def is_patched(obj: Any = None, name: str | None = None) -> bool:
    """Whether :func:`patch_all` is in effect; with a class and a method name, or a method, whether
    that method goes through the cache now."""
    if obj is None:
        return _hook is not None
    return _find_wrapper(obj, name) is not None


def get_original(obj: Any, name: str | None = None) -> Any:
    """The original method behind a patched one, bound like it: ``get_original(cls.
    from_pretrained)`` or ``get_original(cls, "from_pretrained")``. Anything not patched is returned
    unchanged (``getattr(obj, name)``)."""
    found = _find_wrapper(obj, name)
    if found is None:
        return getattr(obj, name) if name is not None else obj
    wrapper, owner = found
    original = getattr(wrapper, _ORIGINAL_ATTR)
    return original.__get__(None, owner) if hasattr(original, "__get__") else original


def patched_names() -> list[str]:
    """``module.Class.method`` of every attribute patched now (for status lines, tests)."""
    with _lock:
        return sorted(f"{c.__module__}.{c.__qualname__}.{n}" for c, n in _saved)


# --------------------------------------------------------------------------- internals


def _make_wrapper(original: classmethod) -> classmethod:  # type: ignore[type-arg]
    func = original.__func__

    @functools.wraps(func)
    def cached(cls: type, *args: Any, **kwargs: Any) -> Any:
        # Note [The wrapper looks load up per call]: ``overmind_lab.load`` is read from the package
        # per call, so whoever replaces it reaches every patched method too (the peer test's plugin
        # ``peer/overmind_peer.py``, a user's logging wrapper); it costs nothing.
        import overmind_lab

        try:
            # Bound to cls, the class really called: the key names it, not the definer.
            return overmind_lab.load(original.__get__(None, cls), *args, **kwargs)
        except BaseException as error:
            from overmind_lab._loading.load import loader_traceback

            found, loader_frames = loader_traceback(error.__traceback__)
            if not found:
                raise
            # Note [Tracebacks that show the user's code] in ``load``: this frame, then the loader's
            error.with_traceback(loader_frames)
            raise error  # the loader's own exception, with its frames below (none of ours)

    setattr(cached, _ORIGINAL_ATTR, original)
    return classmethod(cached)


def _is_wrapper(attr: Any) -> bool:
    return isinstance(attr, classmethod) and hasattr(attr.__func__, _ORIGINAL_ATTR)


def _find_wrapper(obj: Any, name: str | None) -> tuple[Any, type] | None:
    """(wrapper function, class it is bound to) for a patched method, else None."""
    if name is None:
        func = getattr(obj, "__func__", None)
        owner = getattr(obj, "__self__", None)
        if func is not None and hasattr(func, _ORIGINAL_ATTR) and isinstance(owner, type):
            return func, owner
        return None
    if not isinstance(obj, type):
        return None
    for klass in obj.__mro__:
        if name in klass.__dict__:
            attr = klass.__dict__[name]
            return (attr.__func__, obj) if _is_wrapper(attr) else None
    return None


def _patch_class(cls: type, methods: tuple[str, ...]) -> None:
    if f"{cls.__module__}.{cls.__qualname__}" in _SKIP:
        return
    for name in methods:
        attr = cls.__dict__.get(name)
        if not isinstance(attr, classmethod) or (cls, name) in _saved:
            continue
        if _is_wrapper(attr):
            # Note [Copied wrappers]
            attr = _unwrapped_copy(attr)
        original = _saved.setdefault((cls, name), attr)
        setattr(cls, name, _make_wrapper(original))


# Note [Copied wrappers]: transformers builds each Auto class's method as a copy of the base one at
# import (``classmethod(copy_func(...))``), which copies our wrapper when the base is patched. It
# never had an unpatched form: the one the library would have built from the original is saved as
# the original, and wrapped like any other.
def _unwrapped_copy(attr: classmethod) -> classmethod:  # type: ignore[type-arg]
    copy = attr.__func__
    func = getattr(copy, _ORIGINAL_ATTR).__func__
    rebuilt = types.FunctionType(
        func.__code__, func.__globals__, func.__name__, func.__defaults__, func.__closure__
    )
    functools.update_wrapper(rebuilt, func)
    rebuilt.__kwdefaults__ = func.__kwdefaults__
    rebuilt.__doc__ = copy.__doc__
    return classmethod(rebuilt)


def _subclasses(root: type) -> Iterator[type]:
    seen: set[type] = set()
    stack = [root]
    while stack:
        cls = stack.pop()
        if cls in seen:
            continue
        seen.add(cls)
        yield cls
        try:
            stack.extend(type.__subclasses__(cls))
        except TypeError:
            continue


def _loaded_roots() -> Iterator[tuple[type, tuple[str, ...]]]:
    for module_name, class_name, methods in _ROOTS:
        if module_name.partition(".")[0] not in _libraries:
            continue
        module = sys.modules.get(module_name)
        root = getattr(module, class_name, None) if module is not None else None
        if isinstance(root, type):
            yield root, methods


def _patch_module(module: ModuleType) -> None:
    """Patch the roots and the overriding subclasses that ``module`` defines."""
    with _lock:
        if _hook is None or module.__name__.partition(".")[0] not in _libraries:
            return
        roots = list(_loaded_roots())
        for value in list(vars(module).values()):
            if not isinstance(value, type) or value.__module__ != module.__name__:
                continue
            for root, methods in roots:
                if issubclass(value, root):
                    _patch_class(value, methods)


class _PatchOnImport:
    """``sys.meta_path`` finder: patches diffusers/transformers modules after they execute. It finds
    the spec with the finders after it and only wraps the loader."""

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None) -> Any:
        if fullname.partition(".")[0] not in _LIBRARIES:
            return None
        for finder in list(sys.meta_path):
            if finder is self or isinstance(finder, _PatchOnImport):
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchingLoader(spec.loader)
        return spec

    def invalidate_caches(self) -> None:
        pass


class _PatchingLoader:
    """Delegates to the real loader, then patches the executed module."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def create_module(self, spec: Any) -> ModuleType | None:
        create: Callable[[Any], ModuleType | None] | None = getattr(
            self.loader, "create_module", None
        )
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        # The module should name its real loader (inspect.getsource, importlib.resources).
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self.loader
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self.loader
        self.loader.exec_module(module)
        try:
            _patch_module(module)
        except Exception as exc:  # noqa: BLE001 - the user's import must never fail because of us
            if module.__name__ not in _failed:
                _failed.add(module.__name__)
                warnings.warn(
                    f"overmind-lab could not patch {module.__name__} ({exc!r}); loads of "
                    "its classes run uncached. Please report this with your diffusers and "
                    "transformers versions.",
                    OvermindWarning,
                    stacklevel=2,
                )
