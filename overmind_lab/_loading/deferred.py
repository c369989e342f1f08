"""A transformers tokenizer's Rust tokenizer, rebuilt on first use: Note [A tokenizer built on
first use].

Note [A tokenizer built on first use]: a warm SD 1.5 pipeline took ~50 ms, 31 of them for its CLIP
tokenizer's ``tokenizers.Tokenizer``: 8.5 ms to unpickle its 49,408-token vocabulary and 48,894
merges, 23 ms in ``tokenizers.models.BPE(vocab, merges)`` (10 ms for the vocabulary alone: the
library's constructor, holding the GIL; its other ways in, JSON or files, take longer). Nothing
cheaper builds that object, so a hit builds it when it is first read:

- Storing (``pickling.reduce_deferring``): a ``TokenizersBackend`` (transformers' tokenizer over a
  Rust one) with the default pickling has its ``_tokenizer`` pickled apart, as bytes in the stream;
  its value in the instance's dictionary is a ``Deferred`` holding them, in its place (same order).
- The owner gets back the same object graph either way only if nothing else refers to what the
  bytes copy: the Rust tokenizer and what hangs off it (CLIP's ``decode`` wrapper, a closure over a
  bound method of it). ``closed`` counts every reference to each (``sys.getrefcount``) against those
  from within (``gc.get_referents``) and the owner's; any other holder, or anything in the bytes
  that is not self-contained (a storage, a hook), and the tokenizer is pickled in place, as before.
- On a hit nothing is built. transformers reads the attribute as ``self._tokenizer`` everywhere
  (``encode``, ``len``, ``get_vocab``, ``backend_tokenizer``). The class attribute,
  ``TokenizersBackend._tokenizer = None``, is replaced by ``install`` (in the first process that
  unpickles a ``Deferred``) with ``_BuiltOnFirstRead``, a data descriptor, so it sees every read,
  write and ``del`` of the attribute on any instance: ``None`` as before for the class and for an
  instance without the attribute; the instance's own value otherwise, except a ``Deferred``, which
  it unpickles (under a lock: one build) and puts in its place in the same dictionary, then
  returns. Writes and ``del`` go to the instance's dictionary as without it. The dictionary is never
  replaced: a reference to it taken before the first read (``vars(tok)``) sees what is written
  later, and ``del tok._tokenizer`` before it works as on a plain load. A read costs one Python
  call more than an attribute lookup (~0.1 µs; a prompt's encoding takes ~50 µs).
- Copying or pickling the owner first completes it: ``install`` gives the class a ``__getstate__``
  that completes, then returns what the default returns. So ``copy``, ``deepcopy``, ``pickle``,
  verify mode's fingerprint and our own stores see a plain load's object. What still tells them
  apart before the first read: ``vars(tok)["_tokenizer"]`` is the ``Deferred``.
- The first read pays the build (31 ms for CLIP, once), which a plain load paid inside
  ``from_pretrained``; the benchmark reports the pipeline's load and its first prompt encoding.
"""

from __future__ import annotations

import gc
import sys
import threading
import types
from typing import Any

#: the attributes deferred (transformers' Rust tokenizer): a ``Deferred`` is their value in the
#: owner's dictionary until the first read
NAMES = ("_tokenizer",)

_lock = threading.RLock()


class Deferred:
    """Attributes of one object as pickled bytes, unpickled on first use by ``load`` (``pickling``
    passes its own: this module does not import it)."""

    __slots__ = ("blob", "kind", "load", "rebuild")

    def __init__(self, blob: bytes, kind: str, load: Any, rebuild: Any) -> None:
        self.blob = blob
        self.kind = kind
        self.load = load
        self.rebuild = rebuild

    def complete(self, owner: Any) -> None:
        """``complete(owner)``, for modules that do not import this one (the fingerprint's)."""
        complete(owner)

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.rebuild, (self.blob, self.kind))

    def values(self) -> dict[str, Any]:
        return self.load(self.blob, self.kind)  # type: ignore[no-any-return]


def pending(owner: Any) -> bool:
    """Whether an owner still has attributes to build."""
    state = getattr(owner, "__dict__", None)
    return isinstance(state, dict) and any(type(state.get(n)) is Deferred for n in NAMES)


def complete(owner: Any) -> None:
    """Set an owner's deferred attributes (if it has some left), as a plain load had them."""
    if not pending(owner):
        return
    with _lock:  # one build, whichever thread reads first
        state = owner.__dict__
        held = next((state[n] for n in NAMES if type(state.get(n)) is Deferred), None)
        if held is None:
            return
        values = held.values()
        # Each value in place of its ``Deferred`` (a plain load's order of attributes), one the
        # user set or deleted meanwhile left alone: one store each, in the same dictionary.
        for name, value in values.items():
            if state.get(name) is held:
                state[name] = value


# -- the class's side -----------------------------------------------------------------------------
_installed: dict[str, Any] = {}


def _backend() -> Any:
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    return TokenizersBackend


class _BuiltOnFirstRead:
    """``TokenizersBackend._tokenizer``, which was ``None``: still ``None`` for the class and an
    instance without one, the instance's own value otherwise, built first where it is a
    ``Deferred``. A data descriptor: writes and ``del`` go to the instance's dictionary."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return None
        value = obj.__dict__.get(self.name)
        if type(value) is Deferred:
            complete(obj)
            return obj.__dict__.get(self.name)
        return value

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.name] = value

    def __delete__(self, obj: Any) -> None:
        try:
            del obj.__dict__[self.name]
        except KeyError:
            raise AttributeError(self.name) from None


def install() -> None:
    """Put ``_BuiltOnFirstRead`` in the place of ``TokenizersBackend._tokenizer`` and give the
    class a ``__getstate__`` that completes first (once per process; the Note above)."""
    if _installed:
        return
    with _lock:
        if _installed:
            return
        backend = _backend()

        def __getstate__(self: Any) -> Any:
            complete(self)
            default = getattr(object, "__getstate__", None)  # Python 3.11+
            return default(self) if default is not None else self.__dict__

        if vars(backend).get(NAMES[0], ...) is None:
            setattr(backend, NAMES[0], _BuiltOnFirstRead(NAMES[0]))
        if "__getstate__" not in vars(backend):
            backend.__getstate__ = __getstate__
        _installed.update(getstate=__getstate__)


def defers(cls: type) -> bool:
    """Whether instances of ``cls`` can have their Rust tokenizer deferred: a transformers tokenizer
    whose class attribute ``_tokenizer`` is ``TokenizersBackend``'s, with the default pickling (the
    Note above)."""
    if not any(k.__name__ == "TokenizersBackend" and k.__module__.startswith("transformers.")
               for k in cls.__mro__):
        return False
    backend = _backend()
    owner = next((k for k in cls.__mro__ if NAMES[0] in vars(k)), None)
    default = vars(backend).get(NAMES[0], ...)
    getstate = getattr(cls, "__getstate__", None)
    return (owner is backend and (default is None or isinstance(default, _BuiltOnFirstRead))
            and getstate in (getattr(object, "__getstate__", None), _installed.get("getstate"))
            and getattr(cls, "__reduce_ex__", None) is object.__reduce_ex__
            and getattr(cls, "__reduce__", None) is object.__reduce__
            and "__setstate__" not in dir(cls)
            and not any("__slots__" in vars(k) for k in cls.__mro__[:-1]))


# -- storing --------------------------------------------------------------------------------------
#: immutable: a copy is as good as the object (its mutable contents are checked themselves)
_IMMUTABLE = (str, bytes, int, float, complex, bool, type(None), tuple, frozenset, types.CodeType)


def _shared(obj: Any) -> bool:
    """Whether unpickling gives back this very object, not a copy: classes, modules, functions
    pickled by name, a module's globals."""
    if isinstance(obj, (type, types.ModuleType)):
        return True
    if isinstance(obj, types.BuiltinFunctionType):
        return obj.__self__ is None or isinstance(obj.__self__, types.ModuleType)
    if isinstance(obj, types.FunctionType):
        module = sys.modules.get(obj.__module__)
        return module is not None and getattr(module, obj.__qualname__, None) is obj
    if type(obj) is dict and isinstance(obj.get("__name__"), str):
        module = sys.modules.get(obj["__name__"])
        return module is not None and getattr(module, "__dict__", None) is obj
    return False


#: more objects than this hanging off a tokenizer: not looked into, pickled in place
_MAX_OBJECTS = 10_000


def closed(root: Any, root_held: int, holders: tuple[Any, ...] = ()) -> bool:
    """Whether the objects a pickle of ``root`` copies (what it reaches, short of classes, modules,
    globals and functions named) are referred to only by each other and by the caller's ``holders``
    (containers), and ``root`` also by its owner's attribute and ``root_held`` references of the
    caller's.

    Counted: each object's ``sys.getrefcount`` against the references from the others
    (``gc.get_referents``; an object without GC support hides its instance dictionary: counted as
    its own). Any other holder would keep the original while the owner got a copy.
    """
    reached: list[Any] = [root]
    seen = {id(root)}
    i = 0
    while i < len(reached):
        o = reached[i]
        i += 1
        referents = gc.get_referents(o)
        if not gc.is_tracked(o) and type(getattr(o, "__dict__", None)) is dict:
            referents.append(o.__dict__)
        for r in referents:
            if id(r) not in seen and not _shared(r):
                seen.add(id(r))
                reached.append(r)
        if len(reached) > _MAX_OBJECTS:
            return False
    inside: dict[int, int] = {}
    for o in (*reached, *holders):
        for r in gc.get_referents(o):
            inside[id(r)] = inside.get(id(r), 0) + 1
        if not gc.is_tracked(o) and type(getattr(o, "__dict__", None)) is dict:
            inside[id(o.__dict__)] = inside.get(id(o.__dict__), 0) + 1
    calibration: list[Any] = []  # held as each reached object is (``reached``, the loop, the call)
    reached.append(calibration)
    referents = []  # no stray reference to a reached object
    r = o = None
    baseline = 0
    for o in reversed(reached):  # the calibration first
        if o is calibration:
            baseline = sys.getrefcount(o) - 1  # less this function's own name for it
            continue
        if isinstance(o, _IMMUTABLE):
            continue  # a copy is as good (what it holds is checked itself)
        expected = inside.get(id(o), 0) + baseline
        if o is root:
            expected += 2 + root_held  # the owner's attribute, this function's parameter
        if sys.getrefcount(o) != expected:
            return False
    return True
