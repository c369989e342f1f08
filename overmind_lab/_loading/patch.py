"""Route ``from_pretrained`` of diffusers and transformers through the cache.

User guide
==========

::

    import overmind_lab
    overmind_lab.patch_all()          # before or after importing diffusers/transformers

    from diffusers import StableDiffusionPipeline
    pipe = StableDiffusionPipeline.from_pretrained("/models/sd15")   # cold, then cached
    # ...restart the kernel, run the same two lines: warm, in milliseconds

    overmind_lab.unpatch_all()        # every patched attribute is exactly the original again

After :func:`patch_all`, a call such as ``UNet2DConditionModel.from_pretrained(p, ...)`` is
``overmind_lab.load(<the original from_pretrained bound to UNet2DConditionModel>, p, ...)``:
the cache key names the class that was really called, so ``CLIPTextModel`` and
``CLIPTextModelWithProjection`` loaded from one directory are two entries. Loads nested
inside a cached load (a pipeline loading its components, ``AutoModel`` delegating to
``BertModel``) run plainly inside it: only the outermost call is cached.

What is patched
---------------

The ``from_pretrained`` (or ``from_single_file``) classmethod of these base classes, and of
every subclass that defines its own (``LegacyModelMixin``, ``MultiControlNetModel``, each
transformers ``Auto*`` class, which all carry their own copy of the method):

- diffusers: ``ModelMixin``, ``DiffusionPipeline``, ``SchedulerMixin``,
  ``FromSingleFileMixin`` and ``FromOriginalModelMixin`` (``from_single_file``), the
  ``AutoPipelineFor*`` classes and ``AutoModel``;
- transformers: ``PreTrainedModel``, ``PreTrainedTokenizerBase``, ``ProcessorMixin``,
  ``FeatureExtractionMixin``, ``ImageProcessingMixin`` (and so video processors), and the
  ``Auto*`` classes (``AutoModel*``, ``AutoTokenizer``, ``AutoProcessor``,
  ``AutoFeatureExtractor``, ``AutoImageProcessor``, ``AutoVideoProcessor``).

Configurations (``AutoConfig``, ``PretrainedConfig``) are not patched: they load in
milliseconds from a small JSON file, faster than a round trip to the daemon.

Both libraries import most of their modules lazily. Classes that are already imported
are patched at once; for the rest, :func:`patch_all` installs an import hook on
``sys.meta_path`` that patches each module of diffusers/transformers right after it has
executed. :func:`unpatch_all` removes the hook.

Like ``gevent.monkey``, originals are saved once (``setdefault``): patching twice is
harmless, and :func:`get_original` gives the saved original back.

diffusers dynamic modules
-------------------------

Custom pipelines and ``trust_remote_code`` models are instances of classes in
``diffusers_modules.*`` / ``transformers_modules.*``, packages under the Hugging Face
modules cache that the libraries put on ``sys.path`` only when they import such code. A
warm load in a fresh process needs nothing from here: the cache's unpickler puts that
directory on ``sys.path`` before it imports them (Note [Dynamic modules] in
``_loading/pickling.py``).
"""

from __future__ import annotations

import functools
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from overmind_lab._errors import OvermindWarning

__all__ = [
    "get_original",
    "is_patched",
    "patch_all",
    "patched_names",
    "unpatch_all",
]

_LIBRARIES = ("diffusers", "transformers")

# (module, class, methods): the class and every subclass that defines one of the methods
# in its own __dict__ gets a caching wrapper.
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

# Overrides that are not loads from a source: MtpModel.from_pretrained(main_model) builds a
# head around a model object already in memory, there is nothing to cache.
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
    """Cache ``from_pretrained`` of diffusers and transformers in this process.

    Works before or after those libraries are imported; calling it again is harmless.
    ``verify=True`` also loads every hit plainly and compares the two (slow: for proof
    and tests); ``False`` turns that off again; ``None`` leaves it as it is (it is also
    on when ``OVERMIND_LAB_VERIFY=1``).

    >>> import overmind_lab
    >>> overmind_lab.patch_all()
    >>> overmind_lab.is_patched()
    True
    """
    if verify is not None:
        from overmind_lab._loading.load import set_verify

        set_verify(verify)
    libraries = tuple(
        name for name, wanted in (("diffusers", diffusers), ("transformers", transformers))
        if wanted
    )
    global _hook, _libraries
    with _lock:
        _libraries = tuple(dict.fromkeys(_libraries + libraries))
        if _hook is None:
            _hook = _PatchOnImport()
            sys.meta_path.insert(0, _hook)
        for root, methods in _loaded_roots():
            for cls in _subclasses(root):
                _patch_class(cls, methods)


def unpatch_all() -> None:
    """Undo :func:`patch_all`: restore every saved original and remove the import hook.

    Afterwards each patched class ``__dict__`` holds exactly the object it held before.
    """
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
    """Without arguments: whether :func:`patch_all` is in effect in this process.

    With a class and a method name, or with a method (``UNet2DConditionModel.from_pretrained``):
    whether that method goes through the cache now.
    """
    if obj is None:
        return _hook is not None
    return _find_wrapper(obj, name) is not None


def get_original(obj: Any, name: str | None = None) -> Any:
    """The original, uncached method behind a patched one, bound like the patched one.

    ``get_original(UNet2DConditionModel.from_pretrained)`` and
    ``get_original(UNet2DConditionModel, "from_pretrained")`` both return diffusers' own
    ``from_pretrained`` bound to ``UNet2DConditionModel``. Anything not patched is returned
    unchanged (for the two-argument form, ``getattr(obj, name)``).
    """
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
        # Note [The wrapper looks load up per call]: ``overmind_lab.load`` is read from the
        # package on every call, not bound once here, so that whoever replaces that
        # attribute reaches every patched ``from_pretrained`` too: the peer test's plugin
        # (``peer/overmind_peer.py``) wraps it to make each load twice and compare, and a
        # user may wrap it to log. The lookup is one module attribute (the lazy import has
        # run by the first call), nothing next to a load.
        import overmind_lab

        # Bound to cls, the class really called: the key names it, not the definer.
        return overmind_lab.load(original.__get__(None, cls), *args, **kwargs)

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


# Note [Copied wrappers]
# transformers builds each Auto class's method as a copy of the base one, at import time:
# ``cls.from_pretrained = classmethod(copy_func(_BaseAutoModelClass.from_pretrained))``.
# When the base is already patched, that copies our wrapper (code, closure and the
# ``__overmind_original__`` mark). Such an attribute never had an unpatched form, so we
# build the one the library would have built from the original (same code, the copy's
# docstring), save that as the original, and wrap it like any other.
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
    """``sys.meta_path`` finder: patches diffusers/transformers modules right after they
    execute. It finds the spec with the finders after it, so imports resolve exactly as
    they would without it, and only wraps the loader."""

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> Any:
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
