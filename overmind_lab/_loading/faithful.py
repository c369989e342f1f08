"""What a warm rebuild could not give back, found in the cold result before it is stored.

:func:`check` walks the result once and raises :class:`NotCacheable` naming the first path (such as
``unet.conv_in.weight``) where pickling would silently drop or copy something a plain load keeps
(Note [What pickling cannot carry]); the load then returns the plain result uncached, with one
warning.
"""

from __future__ import annotations

import enum
import functools
import gc
import re
import sys
import types
import weakref
from bisect import bisect_left
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable
from itertools import chain
from typing import Any

from overmind_lab._common.outside import array_bounds
from overmind_lab._errors import NotCacheable
from overmind_lab._loading.pickling import hook_owners, slot_names
from overmind_lab._loading.user_code import _module_file

__all__ = ["check"]

# Note [What pickling cannot carry]: a warm hit is the result unpickled, so what pickle drops or
# copies without an error would make a hit differ from the plain load. ``check`` looks for it in one
# walk of the cold result before it is stored (modules, tensors, ``__dict__``s, slots, containers,
# weak containers; the closures, defaults and partials of what is pickled by value), and the load
# is uncached, with one warning naming the path:
#
# 1. a tensor's hooks (``register_hook``: ``_backward_hooks``; ``_post_accumulate_grad_hooks``):
#    torch's reduction drops them;
# 2. compiled code: ``nn.Module.compile()`` (``_compiled_call_impl``, which ``Module.__getstate__``
#    drops), a ``torch.compile`` wrapper (``OptimizedModule``), a compiled function;
# 3. inference tensors (``is_inference()``, made under ``torch.inference_mode``): rebuilt normal;
# 4. a weak reference (``weakref.ref`` and subclasses, proxies, the weak containers) to an object
#    outside the result: the rebuild copies the referent, which then dies; a live
#    ``weakref.finalize``: the rebuilt one is registered nowhere and never runs;
# 5. a mutable object (dict, list, set, tensor, array, module, an instance of a user class) that
#    is a module-level global of the user's code (Note [Regular code] in ``user_code``;
#    ``__main__`` too): the rebuild is a copy, no longer the global;
# 6. a tensor and a numpy array sharing memory (``torch.from_numpy``, ``Tensor.numpy()``), both in
#    the result or the array a global of the user's: each is rebuilt over its own bytes. torch shows
#    no CPU storage's owner (its ``DataPtr``'s deleter), so a ``from_numpy`` tensor whose array is
#    held only elsewhere (a caller's local, a library's cache) looks like any other tensor;
# 7. a hook handle (``RemovableHandle``) that ``pickling.renumber_hooks`` does not reach (only in a
#    closure, a default, a partial): its hook gets a new id (Note [Hook ids]) but the handle keeps
#    the old one, so a one-shot hook that removes itself fires again after a rebuild.
#
# A function or class pickled by name comes back as itself: its closure is not walked. Neither are
# the call's components (``by_reference``), nor weak referents (what else refers to them decides).
# The walk is bounded (``LIMIT`` objects) and never fails a load: where it cannot tell (past the
# bound, an object that raises when looked at), it reports nothing. An SD 1.5 UNet takes ~6 ms.

#: Objects the walk records at most (an SD 1.5 UNet: ~3,000): past it, it judges nothing.
LIMIT = 2_000_000

# How a step of a path is written: ``.name``, ``[key]``, or as it is.
_ATTR, _ITEM, _RAW = 0, 1, 2

_ATOMIC = frozenset({str, bytes, int, float, bool, complex, type(None), type(Ellipsis), range,
                     slice, types.CodeType, types.ModuleType,
                     types.MethodWrapperType, types.WrapperDescriptorType, property,
                     types.GetSetDescriptorType, types.MemberDescriptorType})
_NAMED_TABLES = frozenset({"_parameters", "_buffers", "_modules"})
#: ``nn.Module``'s hook tables (``pickling._HOOK_TABLES``, without importing torch)
_HOOK_TABLES = frozenset({
    "_backward_pre_hooks", "_backward_hooks", "_forward_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks"})
#: Containers at least this long are first looked at in C (``_plain``).
_MANY = 64
#: Containers that, empty, hold nothing to look at.
_EMPTIABLE = frozenset({dict, OrderedDict, list, set, tuple, frozenset})
_WEAK_CONTAINERS = (weakref.WeakValueDictionary, weakref.WeakKeyDictionary, weakref.WeakSet)
_PROXIES = (weakref.ProxyType, weakref.CallableProxyType)
#: ``<weakproxy at 0x...; to 'pkg.Cls' at 0x...>``: the referent's address (id).
_PROXY_TARGET = re.compile(r"at (0x[0-9a-fA-F]+)>$")


class _Found(Exception):
    """Carries a reason out of the walk (only :func:`check` raises :class:`NotCacheable`)."""


def check(result: Any, by_reference: Collection[int] = ()) -> None:
    """Raise :class:`NotCacheable` (``reason``) when a warm rebuild of ``result`` could not be the
    plain load's object (Note [What pickling cannot carry]); the reason names the attribute path
    (e.g. ``unet.conv_in.weight``) and what it is.

    ``by_reference``: the ``id()`` of the objects the stream holds by reference (the call's
    components, Note [Components by reference] in ``pickling``): a hit has them as they are, so they
    are neither walked nor judged.
    """
    collecting = gc.isenabled()
    gc.disable()  # the walk's records are containers: a collection would walk the whole heap
    try:
        _Walk(result, by_reference).run()
    except _Found as found:
        raise NotCacheable(str(found)) from None
    except Exception:  # noqa: BLE001 - an object that raises when looked at (a property, its
        # repr, a tensor subclass): cannot tell, and this check never fails a load (Note [Never
        # worse than plain] in ``load``)
        return
    finally:
        if collecting:
            gc.enable()


class _Walk:
    """One breadth-first walk: the first path to each object (``records``), and what needs the
    whole walk to judge (weak referents, tensors and arrays that may share memory)."""

    def __init__(self, root: Any, by_reference: Collection[int] = ()) -> None:
        self.torch: Any = sys.modules.get("torch")  # none imported: no tensor to find
        self.numpy: Any = sys.modules.get("numpy")
        self.root = root
        self.by_reference = by_reference
        #: id -> index into ``records``: (parent index, how written, step); what is held by
        #: reference counts as seen (part of the result), and is never queued
        self.seen: dict[int, int] = dict.fromkeys(by_reference, 0)
        self.records: list[tuple[int, int, Any]] = [(-1, _RAW, "")]
        self.queue: deque[tuple[Any, int, bool]] = deque()
        if id(root) not in self.seen:
            self.seen[id(root)] = 0
            self.queue.append((root, 0, False))
        self.weak: list[tuple[int, int]] = []  # (record, referent id)
        self.tensors: list[tuple[Any, int]] = []  # (tensor, record)
        #: the tensors' storages (start, end, record), sorted, and the largest end up to each
        self.spans: list[tuple[int, int, int]] | None = None
        self.reach: list[int] = []
        self.arrays: list[tuple[int, int, int]] = []
        #: (record, id) of the hook handles first reached through a closure, a default...
        self.hidden_handles: list[tuple[int, int]] = []
        self.kinds: dict[type, str] = {}
        self.visitors: dict[type, Callable[[Any, int, bool], None]] = {}

    # -- paths ----------------------------------------------------------------------------
    def path(self, index: int) -> str:
        parts: list[str] = []
        while index > 0:
            parent, how, step = self.records[index]
            if how == _ATTR:
                parts.append(f".{step}")
            elif how == _ITEM:
                parts.append(f"[{_key_text(step)}]")
            else:
                parts.append(step)
            index = parent
        text = "".join(reversed(parts)).removeprefix(".")
        return f"`{text}`" if text else "the result itself"

    def found(self, index: int, what: str) -> _Found:
        return _Found(f"{self.path(index)} {what}")

    def push(self, obj: Any, parent: int, how: int, step: Any, hidden: bool) -> None:
        self.push_all(((step, obj),), parent, how, hidden)

    def push_all(self, steps: Iterable[tuple[Any, Any]], parent: int, how: int,
                 hidden: bool) -> None:
        """Queue each (step, object) not seen yet, its first path through ``parent``."""
        seen, records, queue, atomic = self.seen, self.records, self.queue, _ATOMIC
        for step, obj in steps:
            cls = type(obj)
            if cls in atomic:
                continue
            key = id(obj)
            if key in seen:
                continue
            seen[key] = index = len(records)
            records.append((parent, how, step))
            if cls in _EMPTIABLE and not obj:
                continue  # nothing inside: seen, not visited
            queue.append((obj, index, hidden))

    # -- the walk -------------------------------------------------------------------------
    def run(self) -> None:
        queue, records, visitors = self.queue, self.records, self.visitors
        while queue:
            if len(records) > LIMIT:
                return  # too large to judge: what was not seen is not reported
            obj, index, hidden = queue.popleft()
            visit = visitors.get(type(obj))
            if visit is None:
                kind = self.kinds[type(obj)] = self.kind_of(type(obj))
                visit = visitors[type(obj)] = getattr(self, f"visit_{kind}")
            visit(obj, index, hidden)
        self.judge_weak()
        self.judge_handles()
        self.judge_globals()
        self.judge_sharing()

    def kind_of(self, cls: type) -> str:
        torch = self.torch
        if issubclass(cls, (type, enum.Enum)):
            return "skip"  # classes and enum members are pickled by name
        if issubclass(cls, _WEAK_CONTAINERS):
            return "weak_container"
        if issubclass(cls, dict):
            return "dict"
        if issubclass(cls, (list, tuple, set, frozenset, deque)):
            return "sequence"
        if issubclass(cls, weakref.ref):
            return "weakref"
        if issubclass(cls, _PROXIES):
            return "proxy"
        if issubclass(cls, weakref.finalize):
            return "finalize"
        if issubclass(cls, types.FunctionType):
            return "function"
        if issubclass(cls, (types.MethodType, types.BuiltinMethodType)):
            return "method"
        if issubclass(cls, functools.partial):
            return "partial"
        if torch is not None:
            if issubclass(cls, torch.Tensor):
                return "tensor"
            if issubclass(cls, torch.nn.Module):
                return "module"
            hooks = sys.modules.get("torch.utils.hooks")
            if hooks is not None and issubclass(cls, hooks.RemovableHandle):
                return "handle"
        if self.numpy is not None and issubclass(cls, self.numpy.ndarray):
            return "array"
        return "object"

    def visit_skip(self, obj: Any, index: int, hidden: bool) -> None:
        pass

    def visit_object(self, obj: Any, index: int, hidden: bool) -> None:
        try:  # not ``getattr``: past a class's own ``__getattribute__`` / ``__getattr__``
            state = object.__getattribute__(obj, "__dict__")
        except AttributeError:
            state = None
        if type(state) is dict:
            self.push_all(state.items(), index, _ATTR, hidden)
        for name in slot_names(type(obj)):
            try:
                value = object.__getattribute__(obj, name)
            except AttributeError:
                continue  # unset
            self.push(value, index, _ATTR, name, True)

    def visit_dict(self, obj: dict[Any, Any], index: int, hidden: bool) -> None:
        if len(obj) < _MANY or not _plain(dict.values(obj)):
            self.push_all(dict.items(obj), index, _ITEM, hidden)
        if not _plain(dict.keys(obj)):
            for key in dict.keys(obj):
                if type(key) not in _ATOMIC:
                    self.push(key, index, _RAW, f".<key {_key_text(key)}>", True)
        if type(obj) is not dict:
            self.visit_object(obj, index, hidden)

    def visit_sequence(self, obj: Any, index: int, hidden: bool) -> None:
        if len(obj) >= _MANY and _plain(obj):
            pass  # a vocabulary, merges: nothing to find
        elif isinstance(obj, (list, tuple, deque)):
            self.push_all(enumerate(obj), index, _ITEM, hidden)
        else:
            self.push_all(((".<item>", value) for value in obj), index, _RAW, hidden)
        if type(obj) not in (list, tuple, set, frozenset):
            self.visit_object(obj, index, hidden)

    def visit_weak_container(self, obj: Any, index: int, hidden: bool) -> None:
        # Its referents are named, not walked (they are not part of the result by this edge).
        if isinstance(obj, weakref.WeakValueDictionary):
            for key, value in list(obj.items()):
                self.weak.append((self.record(index, f"[{_key_text(key)}]"), id(value)))
                self.push(key, index, _RAW, f".<key {_key_text(key)}>", True)
        elif isinstance(obj, weakref.WeakKeyDictionary):
            for key, value in list(obj.items()):
                self.weak.append((self.record(index, f".<key {_key_text(key)}>"), id(key)))
                self.push(value, index, _ITEM, key, True)
        else:
            for value in list(obj):
                self.weak.append((self.record(index, f".<item {type(value).__name__}>"),
                                  id(value)))

    def record(self, parent: int, step: str) -> int:
        """A path to a weak referent."""
        self.records.append((parent, _RAW, step))
        return len(self.records) - 1

    def visit_weakref(self, obj: Any, index: int, hidden: bool) -> None:
        target = weakref.ref.__call__(obj)  # the referent itself (a WeakMethod's: its instance)
        if target is not None and not _by_name(target):
            self.weak.append((index, id(target)))
        self.visit_object(obj, index, hidden)  # a subclass's (``KeyedRef.key``, WeakMethod's)

    def visit_proxy(self, obj: Any, index: int, hidden: bool) -> None:
        # A proxy gives no way to its referent but its repr, which names its address (id); a dead
        # one's is None's.
        match = _PROXY_TARGET.search(repr(obj))
        if match is None:
            raise self.found(index, "is a weak proxy (weakref.proxy): a rebuild would copy its "
                                    "referent, or lose it")
        target = int(match.group(1), 16)
        if target != id(None):
            self.weak.append((index, target))

    def visit_finalize(self, obj: Any, index: int, hidden: bool) -> None:
        if obj.alive:
            raise self.found(index, "is a live weakref.finalize: a rebuilt one would not be "
                                    "registered, and would never run")

    def visit_function(self, obj: types.FunctionType, index: int, hidden: bool) -> None:
        if _by_name(obj):
            return  # comes back as itself: what it closes over is not carried
        if getattr(obj, "_torchdynamo_orig_callable", None) is not None:
            raise self.found(index, "is a function wrapped by torch.compile: a rebuild would not "
                                    "carry its compiled state")
        code = obj.__code__
        for name, cell in zip(code.co_freevars, obj.__closure__ or (), strict=False):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            self.push(value, index, _RAW, f".<locals>.{name}", True)
        for i, value in enumerate(obj.__defaults__ or ()):
            self.push(value, index, _RAW, f".__defaults__[{i}]", True)
        for name, value in (obj.__kwdefaults__ or {}).items():
            self.push(value, index, _RAW, f".__kwdefaults__[{name!r}]", True)
        self.visit_object(obj, index, hidden)

    def visit_method(self, obj: Any, index: int, hidden: bool) -> None:
        owner = getattr(obj, "__self__", None)
        if not isinstance(owner, (type, types.ModuleType)):
            self.push(owner, index, _ATTR, "__self__", True)
        func = getattr(obj, "__func__", None)
        if func is not None:
            self.push(func, index, _ATTR, "__func__", True)

    def visit_partial(self, obj: functools.partial[Any], index: int, hidden: bool) -> None:
        self.push(obj.func, index, _ATTR, "func", True)
        for i, value in enumerate(obj.args):
            self.push(value, index, _RAW, f".args[{i}]", True)
        for name, value in obj.keywords.items():
            self.push(value, index, _RAW, f".keywords[{name!r}]", True)
        self.visit_object(obj, index, hidden)

    def visit_handle(self, obj: Any, index: int, hidden: bool) -> None:
        if hidden:
            self.hidden_handles.append((index, id(obj)))
        self.visit_object(obj, index, hidden)

    def visit_module(self, obj: Any, index: int, hidden: bool) -> None:
        cls = type(obj)
        if cls.__name__ == "OptimizedModule" and cls.__module__.startswith("torch._dynamo"):
            raise self.found(index, "is a torch.compile wrapper (OptimizedModule): a rebuild "
                                    "would not carry its compiled state")
        state = obj.__dict__
        if state.get("_compiled_call_impl") is not None:
            raise self.found(index, "was compiled (nn.Module.compile): a rebuild would drop its "
                                    "compiled forward")
        seen = self.seen
        rest = []
        for name, value in state.items():
            if name in _NAMED_TABLES and type(value) is dict and id(value) not in seen:
                # Submodules, parameters, buffers: named as attributes (``unet.conv_in.weight``)
                seen[id(value)] = index
                self.push_all(value.items(), index, _ATTR, hidden)
            elif name in _HOOK_TABLES and type(value) is OrderedDict:
                if not value:
                    seen.setdefault(id(value), index)  # most of a model's objects: not recorded
                elif id(value) not in seen:
                    # A hook by its name, not its id (which a warning's text would carry: one
                    # warning per load instead of one in all)
                    seen[id(value)] = len(self.records)
                    self.records.append((index, _ATTR, name))
                    self.push_all(((f"[{_hook_name(hook)}]", hook) for hook in value.values()),
                                  len(self.records) - 1, _RAW, hidden)
            else:
                rest.append((name, value))
        self.push_all(rest, index, _ATTR, hidden)
        for name in slot_names(cls):
            try:
                value = object.__getattribute__(obj, name)
            except AttributeError:
                continue  # unset
            self.push(value, index, _ATTR, name, True)

    def visit_tensor(self, t: Any, index: int, hidden: bool) -> None:
        if t._backward_hooks:
            raise self.found(index, "has a backward hook (Tensor.register_hook): a rebuilt "
                                    "tensor would not have it")
        if getattr(t, "_post_accumulate_grad_hooks", None):
            raise self.found(index, "has a post-accumulate-grad hook "
                                    "(Tensor.register_post_accumulate_grad_hook): a rebuilt "
                                    "tensor would not have it")
        if t.is_inference():
            raise self.found(index, "is an inference tensor (made under torch.inference_mode): "
                                    "a rebuilt one would be a normal tensor")
        self.tensors.append((t, index))  # their memory is looked at only if an array is found
        self.visit_object(t, index, hidden)

    def visit_array(self, a: Any, index: int, hidden: bool) -> None:
        bounds = array_bounds(a)
        if bounds is not None:
            self.arrays.append((*bounds, index))
        if a.base is not None:
            self.push(a.base, index, _ATTR, "base", hidden)
        self.visit_object(a, index, hidden)

    # -- judgements that need the whole walk ----------------------------------------------
    def judge_weak(self) -> None:
        for index, target in self.weak:
            if target not in self.seen:
                raise self.found(index, "is a weak reference to an object outside the result: "
                                        "a rebuild would copy that object, and the reference "
                                        "would die")

    def judge_handles(self) -> None:
        if not self.hidden_handles:
            return
        # First reached through a closure (say), it may also be reached where renumbering looks.
        reached = _renumbered_handles(self.root)
        for index, handle in self.hidden_handles:
            if handle not in reached:
                raise self.found(index, "is a hook handle (RemovableHandle) held in a closure or "
                                        "the like, where a rebuild does not renumber it: its "
                                        "remove() would no longer remove its hook")

    def judge_globals(self) -> None:
        for name, module in _user_modules():
            for attr, value in list(vars(module).items()):
                if attr.startswith("__") or type(value) in _ATOMIC:
                    continue
                index = self.seen.get(id(value))
                if (index is not None and id(value) not in self.by_reference
                        and self.mutable(value)):
                    raise self.found(index, f"is the global {name}.{attr} "
                                            f"({type(value).__name__}): a rebuild would make a "
                                            "copy, no longer that object")
                if self.tensors and self.numpy is not None and isinstance(value,
                                                                          self.numpy.ndarray):
                    bounds = array_bounds(value)
                    hit = None if bounds is None else self.overlapping(*bounds)
                    if hit is not None:
                        raise self.found(hit, f"shares memory with the numpy array {name}.{attr} "
                                              "(torch.from_numpy): a rebuilt tensor would have "
                                              "its own copy")

    def mutable(self, value: Any) -> bool:
        """Whether a rebuilt copy of ``value`` could be told from it (identity, in-place change)."""
        cls = type(value)
        if issubclass(cls, (dict, list, set, bytearray, deque)):
            return True
        kind = self.kinds.get(cls)
        if kind == "object":  # an instance of a user class (a library's may be a singleton)
            return _is_user_module(cls.__module__, sys.modules.get(cls.__module__))
        return kind in ("tensor", "module", "array", "weak_container")

    def overlapping(self, start: int, end: int) -> int | None:
        """The record of a CPU tensor whose storage meets the bytes ``[start, end)``."""
        if self.spans is None:
            self.spans = sorted(span for t, index in self.tensors
                                if (span := self.span(t, index)) is not None)
            self.reach, top = [], 0
            for _start, stop, _index in self.spans:  # the largest end so far, for each
                top = max(top, stop)
                self.reach.append(top)
        spans, reach = self.spans, self.reach
        first = None  # the earliest found (the shortest path), of all that meet it
        i = bisect_left(spans, (end,)) - 1
        while i >= 0 and reach[i] > start:
            if spans[i][1] > start and (first is None or spans[i][2] < first):
                first = spans[i][2]
            i -= 1
        return first

    def span(self, t: Any, index: int) -> tuple[int, int, int] | None:
        """The bytes of ``t``'s storage (start, end, record), ``None`` where it has none."""
        if t.layout is not self.torch.strided or t.device.type != "cpu":
            return None
        try:
            storage = t.untyped_storage()
            start, nbytes = int(storage.data_ptr()), int(storage.nbytes())
        except Exception:  # noqa: BLE001 - a subclass without a storage: no memory to share
            return None
        return (start, start + nbytes, index) if nbytes else None

    def judge_sharing(self) -> None:
        if not self.arrays or not self.tensors:
            return
        for start, end, index in self.arrays:
            hit = self.overlapping(start, end)
            if hit is not None:
                raise self.found(hit, f"shares memory with the numpy array at {self.path(index)} "
                                      "(torch.from_numpy, Tensor.numpy): a rebuild would give "
                                      "each its own copy")


#: module name -> (module, whether it is the user's): regularity does not change in a process
_verdicts: dict[str, tuple[Any, bool]] = {}


def _user_modules() -> list[tuple[str, types.ModuleType]]:
    """The modules of the user's code (Note [Regular code] in ``user_code``), ``__main__`` too."""
    out = []
    for name, module in list(sys.modules.items()):
        known = _verdicts.get(name)
        if known is None or known[0] is not module:
            known = _verdicts[name] = (module, _is_user_module(name, module))
        if known[1]:
            out.append((name, module))
    return out


def _is_user_module(name: str, module: types.ModuleType | None) -> bool:
    top = name.partition(".")[0]
    if module is None or top == "overmind_lab":
        return False
    if name == "__main__":
        return True
    file = _module_file(module)
    if file is None and top != name:  # no file, in a package: a library's (``torch._C._nn``)
        return _module_file(sys.modules.get(top)) is not False
    return file is not False


def _renumbered_handles(root: Any) -> set[int]:
    """The ids of the hook handles ``pickling.renumber_hooks`` reaches from ``root``."""
    return {id(h) for h in hook_owners(root)[1]}


def _by_name(obj: Any) -> bool:
    """Whether pickle stores ``obj`` by name (a class, module, or function found where it says it
    was defined): it comes back as itself."""
    if isinstance(obj, (type, types.ModuleType, types.BuiltinFunctionType)):
        return True
    if not isinstance(obj, types.FunctionType) or "<locals>" in obj.__qualname__:
        return False
    found: Any = sys.modules.get(obj.__module__)
    for part in obj.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is obj


def _plain(values: Collection[Any]) -> bool:
    """Whether every value is atomic or a tuple of atomics (a tokenizer's 49,000 merges): nothing
    to find in them (a tuple is neither weakly referenced nor a mutable global). In C, mostly."""
    kinds = set(map(type, values))
    if kinds <= _ATOMIC:
        return True
    if kinds - _ATOMIC != {tuple}:
        return False
    tuples = values if kinds == {tuple} else [v for v in values if type(v) is tuple]
    return _ATOMIC.issuperset(map(type, chain.from_iterable(tuples)))


def _hook_name(hook: Any) -> str:
    name = getattr(hook, "__name__", None)
    return name if isinstance(name, str) else f"<{type(hook).__name__}>"


def _key_text(key: Any) -> str:
    if isinstance(key, (str, int, float, bool, bytes)) or key is None:
        return repr(key)
    return f"<{type(key).__name__}>"
