"""Pickling with tensor bytes out of band: ``reduce_*`` on the way in, ``rebuild_*`` out.

:class:`StoragePickler`'s ``reducer_override`` turns every torch storage into a reference
(``_storage(segment, offset, nbytes, dtype, device, typed)``), every plain CPU tensor into one call
(Note [One call per tensor]), every ``nn.Module`` without hooks into the object plus its non-default
fields (Note [Modules in one call]); large ``PickleBuffer`` objects leave the stream too, so it is
metadata only. A :class:`WritePlan` puts every byte in the new segment, or nowhere for a storage
already unchanged in a cached segment (Note [Provenance] in ``segments.py``). Unpickling rebuilds
storages over the private mapping without a copy. Nothing is registered on a global pickler;
``dill`` is the fallback for what pickle refuses (lambdas, nested functions).
"""

from __future__ import annotations

import copyreg
import ctypes
import functools
import gc
import importlib
import io
import json
import os
import pickle
import sys
import threading
import types
import warnings
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from overmind_lab._errors import NotCacheable
from overmind_lab._loading.segments import Mapping, find_mapping

if TYPE_CHECKING:  # a store's only (a warm hit does not import it: first-call cost)
    from overmind_lab._loading.sources import SourceFile, SourceMap

__all__ = ["WritePlan", "dump", "load_stream", "ALIGN"]

#: Storages keep their address modulo this (Note [Addresses modulo 64]).
ALIGN = 64

# Note [Addresses modulo 64]: a storage copied into a segment starts at an offset that is, modulo
# 64, its address in the loader's result; segments are mapped at page boundaries, so a warm tensor's
# ``data_ptr() % 64`` is the plain load's. torch's CPU kernels pick vectorised or scalar paths, and
# split reductions, by alignment: the same bytes elsewhere give outputs that differ in the last bits
# (a small UNet's by up to 5e-7). Storages in a source file keep its offsets.
#: PickleBuffers smaller than this stay in the stream.
MIN_OUT_OF_BAND = 64 * 1024


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class WritePlan:
    """Where each storage goes. Segment 0 is the new one; 1.. are references: cached segments, or
    source files whose unchanged regions storages are (``sources.py``)."""

    # A plain class, not a ``@dataclass``: this module is on a warm hit's import path, and a
    # dataclass costs ~0.4 ms to define (Note [A first call's imports] in ``load.py``).
    def __init__(self, sources: SourceMap | None = None,
                 exclude: frozenset[str] = frozenset()) -> None:
        self.size = 0
        self.items: list[tuple[int, Any]] = []
        self.keep_alive: list[Any] = []
        self.refs: list[Mapping | SourceFile] = []
        self.sources = sources
        #: source files not to reference (the daemon could not link them): copy instead
        self.exclude = exclude
        self.source_bytes = 0
        self.seen: dict[tuple[int, int, str], tuple[int, int]] = {}
        self.buffers: list[tuple[int, int, int]] = []
        self.tensors = 0
        self.shared_bytes = 0
        #: a module with hooks, or a hook handle, is in the stream (Note [Hook ids])
        self.hooks = False
        #: the classes and functions the stream names (for ``user_code.graph_code``)
        self.classes: list[Any] = []

    def place(self, data: Any, nbytes: int, phase: int = 0) -> int:
        """Put ``nbytes`` of ``data`` at the next offset that is ``phase`` modulo ``ALIGN``."""
        offset = _align(self.size) + phase
        self.items.append((offset, data))
        self.size = offset + nbytes
        return offset

    @property
    def files(self) -> list[SourceFile]:
        from overmind_lab._loading.sources import SourceFile

        return [r for r in self.refs if isinstance(r, SourceFile)]

    def ref_index(self, mapping: Mapping | SourceFile) -> int:
        for i, m in enumerate(self.refs):
            if m is mapping:
                return i + 1
        self.refs.append(mapping)
        return len(self.refs)

    # -- reduce_* -----------------------------------------------------------------------
    def reduce_storage(self, untyped: Any) -> tuple[int, int]:
        """Place one storage; returns (segment index, offset)."""
        nbytes = int(untyped.nbytes())
        device = str(untyped.device)
        ptr = int(untyped.data_ptr())
        # An empty storage has no address: by identity, each at its own offset.
        memo = (ptr, nbytes, device) if nbytes else (-int(untyped._cdata), 0, device)
        if memo in self.seen:
            return self.seen[memo]
        self.tensors += 1
        if untyped.device.type != "cpu":
            untyped = untyped.cpu()  # cached on host, moved back on load
            ptr = int(untyped.data_ptr())
            self.keep_alive.append(untyped)
        # Note [Borrowed storage views]: ``buf`` views the storage's memory without a reference to
        # it; valid because ``load`` holds ``result`` (every CPU storage) until the segment is
        # written, and ``keep_alive`` holds a storage copied off a device.
        buf = (ctypes.c_char * nbytes).from_address(ptr) if nbytes else b""
        where = find_mapping(ptr, nbytes) if nbytes and device == "cpu" else None
        source = (self.sources.find(ptr, nbytes) if where is None and nbytes
                  and self.sources is not None and device == "cpu" else None)
        if where is not None and where[0].pristine_equal(where[1], nbytes, buf):
            placed = (self.ref_index(where[0]), where[1])
            self.shared_bytes += nbytes
        elif source is not None and source[0].path not in self.exclude:
            placed = (self.ref_index(source[0]), source[1])
            self.source_bytes += nbytes
        else:
            placed = (0, self.place(buf, nbytes, ptr % ALIGN))
            self.size += not nbytes
        self.seen[memo] = placed
        return placed

    def reduce_buffer(self, buf: pickle.PickleBuffer) -> bool:
        raw = buf.raw()
        if raw.nbytes < MIN_OUT_OF_BAND:
            return True  # in band
        offset = self.place(raw, raw.nbytes)
        self.buffers.append((0, offset, raw.nbytes))
        return False


def reduce_tensor(t: Any, is_param: bool, plan: WritePlan) -> Any:
    """A lean reduction for plain CPU tensors and parameters (torch's costs ~10x more to rebuild);
    anything else (layouts, devices, autograd history, conjugate views, subclasses) goes through
    torch's reduction. The storage is placed in the same call (Note [One call per tensor])."""
    import torch

    if t.grad_fn is not None:
        # It would come back a leaf without its ``grad_fn`` (old ``weight_norm``, a view).
        raise NotCacheable(f"it holds a tensor with autograd history "
                           f"({type(t.grad_fn).__name__}), which a rebuild would make a leaf")
    if (t.layout is not torch.strided or t.device.type != "cpu" or t.is_quantized
            or t.is_conj() or t.is_neg() or t.grad_fn is not None
            or getattr(t, "_backward_hooks", None) or t.is_nested):
        if (t.layout is not torch.strided and t.requires_grad and t.grad_fn is None
                and not is_param):
            # torch's reduction of a sparse tensor drops requires_grad (a Parameter's keeps it).
            return (_requiring_grad, (t.detach(), dict(t.__dict__) or None))
        if t.grad is not None:  # torch's own reduction drops ``.grad``: set it after
            reduced = t.__reduce_ex__(5)
            if isinstance(reduced, tuple) and len(reduced) == 2:
                return (_with_grad, (reduced[0], reduced[1], t.grad))
        return NotImplemented
    untyped = t.untyped_storage()
    seg, offset = plan.reduce_storage(untyped)
    nbytes = int(untyped.nbytes())
    state = dict(t.__dict__) or None
    if t.grad is not None:  # torch's own reduction drops it; a plain load keeps it
        state = {**(state or {}), _GRAD: t.grad}
    size = tuple(t.size())
    if (nbytes and t.storage_offset() == 0 and t.stride() == _row_major(size)
            and t.numel() * t.element_size() == nbytes):
        return (rebuild_whole, (seg, offset, nbytes, size, t.dtype, t.requires_grad,
                                is_param, state))
    return (rebuild_tensor, (seg, offset, nbytes, t.storage_offset(), size, t.stride(),
                             t.dtype, t.requires_grad, is_param, state))


def _with_grad(rebuild: Any, args: tuple[Any, ...], grad: Any) -> Any:
    t = rebuild(*args)
    t.grad = grad
    return t


def _requiring_grad(t: Any, state: dict[str, Any] | None) -> Any:
    t.requires_grad_(True)
    if state:
        t.__dict__.update(state)
    return t


def _row_major(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(size):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


# Note [One call per tensor]: a warm SD UNet rebuilds 686 tensors within ~15 ms in all, so a plain
# CPU tensor is one call that makes its storage and the tensor over it (one REDUCE and one Python
# call fewer than tensor-of-storage). A row-major tensor over its whole storage is a numpy array
# over the mapped bytes, in its shape, and the tensor over it (``rebuild_whole``, ~4 µs against ~10
# µs); dtypes numpy lacks (bfloat16, float8) and other layouts use ``rebuild_tensor`` (``set_``).
# Storages are memoized by location (segment, offset, size), as in ``_storage``, so shared storages
# stay shared. Torch functions are bound once per stream (``_Frame``).
def rebuild_whole(seg: int, offset: int, nbytes: int, size: tuple[int, ...], dtype: Any,
                  requires_grad: bool, is_param: bool, state: dict[str, Any] | None) -> Any:
    frame = _frame()
    key = (seg, offset, nbytes)
    np_dtype = frame.numpy_dtypes.get(dtype)
    if np_dtype is None or key in frame.memo or offset % dtype.itemsize:
        return rebuild_tensor(seg, offset, nbytes, 0, size, _row_major(size), dtype,
                              requires_grad, is_param, state)
    t = frame.from_numpy(frame.ndarray(size, np_dtype, frame.buffers[seg], offset))
    frame.memo[key] = t.untyped_storage()
    return _finish(frame, t, requires_grad, is_param, state)


def rebuild_tensor(seg: int, offset: int, nbytes: int, storage_offset: int,
                   size: tuple[int, ...], stride: tuple[int, ...], dtype: Any,
                   requires_grad: bool, is_param: bool, state: dict[str, Any] | None) -> Any:
    frame = _frame()
    key = (seg, offset, nbytes)
    untyped = frame.memo.get(key)
    if untyped is None and nbytes and nbytes % dtype.itemsize == 0:
        # The storage's first tensor is made over the bytes in its dtype; set_ gives the layout.
        t = frame.frombuffer(frame.views[seg][offset:offset + nbytes], dtype=dtype)
        untyped = frame.memo[key] = t.untyped_storage()
    else:
        t = frame.empty(0, dtype=dtype)
        if untyped is None:
            untyped = frame.storage(seg, offset, nbytes, "cpu")
    t.set_(untyped, storage_offset, size, stride)
    return _finish(frame, t, requires_grad, is_param, state)


#: The key of a tensor's ``.grad`` in the state ``reduce_tensor`` passes (no attribute name).
_GRAD = "\x00grad"


def _finish(frame: _Frame, t: Any, requires_grad: bool, is_param: bool,
            state: dict[str, Any] | None) -> Any:
    if is_param:
        t = frame.make_subclass(frame.parameter, t, requires_grad)
    elif requires_grad:
        t.requires_grad_(True)
    if state:
        if _GRAD in state:
            state = dict(state)
            t.grad = state.pop(_GRAD)
        t.__dict__.update(state)
    return t


# Note [Modules in one call]: pickled the default way, every ``nn.Module`` carries the eleven empty
# hook tables ``Module.__init__`` makes, each a global, a call and a memo entry (an SD UNet: 165 KB,
# 9,200 calls). A module whose hook tables are all empty is pickled as the object (``__newobj__``:
# in the memo before its state, so back references resolve) plus the six other standard fields and
# its own attributes (95 KB, 1,600 calls); ``_set_module_state`` makes fresh tables and passes
# ``__setstate__`` the dict, in the key order, the default would. Only for classes that do not
# customise pickling, while ``Module.__init__`` makes exactly the fields below (checked at run
# time); ``_compiled_call_impl`` is dropped as ``Module.__getstate__`` drops it. Anything else (a
# hook, a non-empty table, an unknown layout) is pickled the default way.
_MODULE_FIELDS = (
    "training", "_parameters", "_buffers", "_non_persistent_buffers_set",
    "_backward_pre_hooks", "_backward_hooks", "_is_full_backward_hook", "_forward_hooks",
    "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs", "_state_dict_hooks", "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_modules")
_HOOK_TABLES = tuple(f for f in _MODULE_FIELDS if "hooks" in f)  # all eleven
#: pickle writes a reduction by this function as NEWOBJ (``cls.__new__(cls)``)
_NEWOBJ: Any = copyreg.__newobj__  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=1)
def _module_layout_known() -> bool:
    import torch

    fresh = torch.nn.Module().__dict__
    return tuple(fresh) == _MODULE_FIELDS and all(
        type(fresh[f]) is OrderedDict and not fresh[f] for f in _HOOK_TABLES)


def _default_module_pickling(cls: type) -> bool:
    import torch

    return (issubclass(cls, torch.nn.Module)
            and cls.__reduce_ex__ is object.__reduce_ex__
            and cls.__reduce__ is object.__reduce__
            and cls.__getstate__ is torch.nn.Module.__getstate__
            and not hasattr(cls, "__getnewargs_ex__") and not hasattr(cls, "__getnewargs__")
            and cls not in copyreg.dispatch_table)


def reduce_module(module: Any) -> Any:
    state = module.__dict__
    names = tuple(state)
    if names[:len(_MODULE_FIELDS)] != _MODULE_FIELDS:
        return NotImplemented
    for table in _HOOK_TABLES:
        value = state[table]
        if type(value) is not OrderedDict or value:
            return NotImplemented
    rest = {k: state[k] for k in names[len(_MODULE_FIELDS):] if k != "_compiled_call_impl"}
    return (_NEWOBJ, (type(module),),
            (state["training"], state["_parameters"], state["_buffers"],
             state["_non_persistent_buffers_set"], state["_is_full_backward_hook"],
             state["_modules"], rest or None),
            None, None, _set_module_state)


def _set_module_state(module: Any, compact: tuple[Any, ...]) -> None:
    training, parameters, buffers, non_persistent, full_backward, modules, rest = compact
    od = OrderedDict
    state = {  # _MODULE_FIELDS, in order
        "training": training, "_parameters": parameters, "_buffers": buffers,
        "_non_persistent_buffers_set": non_persistent, "_backward_pre_hooks": od(),
        "_backward_hooks": od(), "_is_full_backward_hook": full_backward,
        "_forward_hooks": od(), "_forward_hooks_with_kwargs": od(),
        "_forward_hooks_always_called": od(), "_forward_pre_hooks": od(),
        "_forward_pre_hooks_with_kwargs": od(), "_state_dict_hooks": od(),
        "_state_dict_pre_hooks": od(), "_load_state_dict_pre_hooks": od(),
        "_load_state_dict_post_hooks": od(), "_modules": modules,
    }
    if rest:
        state.update(rest)
    if type(module).__setstate__ is _module_setstate() and not module.__dict__:
        # What Module.__setstate__ would do to an empty __dict__, without copying the dict.
        object.__setattr__(module, "__dict__", state)
    else:
        module.__setstate__(state)


# Note [Modules with slots]: ``Module.__getstate__`` returns ``__dict__``, so torch's pickling loses
# slot values (a warm hit would raise AttributeError). Such a module, unless its class customises
# ``__reduce__``, is pickled as the object, its ``__getstate__`` and its set slots.
_SLOTS: dict[type, tuple[str, ...]] = {}


def slot_names(cls: type) -> tuple[str, ...]:
    """The slot names of ``cls`` and its bases (mangled), but ``__dict__`` and ``__weakref__``."""
    known = _SLOTS.get(cls)
    if known is not None:
        return known
    names: list[str] = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{klass.__name__.lstrip('_')}{name}"
            if name not in names:
                names.append(name)
    known = _SLOTS[cls] = tuple(names)
    return known


def _slotted_module(cls: type) -> bool:
    import torch

    return (issubclass(cls, torch.nn.Module) and bool(slot_names(cls))
            and cls.__reduce_ex__ is object.__reduce_ex__
            and cls.__reduce__ is object.__reduce__)


def reduce_slotted_module(module: Any) -> Any:
    slots = {}
    for name in slot_names(type(module)):
        try:
            slots[name] = object.__getattribute__(module, name)
        except AttributeError:
            continue  # unset: stays unset
    return (_NEWOBJ, (type(module),), (module.__getstate__(), slots), None, None,
            _set_slotted_module_state)


# Note [Strided arrays]: numpy pickles a non-contiguous array (a ``[::2]`` view) as a contiguous
# copy; it goes as the bytes it spans instead, rebuilt as a view with its own strides. An empty
# array (numpy gives it zero strides, its pickle dense ones) goes as its shape and strides.
def reduce_strided_array(a: Any) -> Any:
    import numpy

    if a.dtype.hasobject or a.strides in _dense_strides(a.shape, a.itemsize):
        return NotImplemented  # numpy's own pickling keeps it as it is
    if not a.size:  # numpy gives empty arrays zero strides; its pickle, dense ones
        return (rebuild_empty_array, (a.shape, a.strides, a.dtype, bool(a.flags.writeable)))
    try:
        from numpy.lib.array_utils import byte_bounds
    except ImportError:  # numpy < 2
        byte_bounds = numpy.byte_bounds  # type: ignore[attr-defined,unused-ignore]
    low, high = byte_bounds(a)
    raw: Any = (ctypes.c_char * (high - low)).from_address(low)
    span = numpy.frombuffer(raw, dtype=numpy.uint8).copy()
    offset = a.__array_interface__["data"][0] - low
    return (rebuild_strided_array, (span, offset, a.shape, a.strides, a.dtype,
                                    bool(a.flags.writeable)))


def _dense_strides(shape: tuple[int, ...], itemsize: int) -> tuple[tuple[int, ...], ...]:
    c = tuple(itemsize * s for s in _row_major(shape))
    f = tuple(itemsize * s for s in reversed(_row_major(tuple(reversed(shape)))))
    return c, f


def rebuild_strided_array(span: Any, offset: int, shape: tuple[int, ...],
                          strides: tuple[int, ...], dtype: Any, writeable: bool) -> Any:
    import numpy

    if writeable and not span.flags.writeable:
        span = span.copy()
    out = numpy.ndarray(shape, dtype, buffer=span, offset=offset, strides=strides)
    if not writeable:
        out.flags.writeable = False
    return out


def rebuild_empty_array(shape: tuple[int, ...], strides: tuple[int, ...], dtype: Any,
                        writeable: bool) -> Any:
    import numpy

    out = numpy.ndarray(shape, dtype, buffer=bytearray(0), strides=strides)
    if not writeable:
        out.flags.writeable = False
    return out


def _set_slotted_module_state(module: Any, state: tuple[Any, dict[str, Any]]) -> None:
    module.__setstate__(state[0])
    for name, value in state[1].items():
        object.__setattr__(module, name, value)


@functools.lru_cache(maxsize=1)
def _module_setstate() -> Any:
    import torch

    return torch.nn.Module.__setstate__


# Note [Attributes in their order]: ``OrderedDict.__reduce__`` calls the class, then sets the saved
# attributes; a subclass whose ``__init__`` sets its own (diffusers' ``FrozenDict`` sets
# ``__frozen`` last) then comes back in another ``vars()`` order. Such objects (OrderedDict
# subclasses with a ``__dict__`` and the default reduction) are made by ``__new__``, get their
# items, then exactly the saved attribute dict.
def _ordered_with_attributes(cls: type) -> bool:
    return (issubclass(cls, OrderedDict) and cls is not OrderedDict
            and cls.__reduce__ is OrderedDict.__reduce__ and cls.__dictoffset__ != 0
            and getattr(cls, "__setstate__", None) is None
            and cls not in copyreg.dispatch_table)


def reduce_ordered(obj: Any) -> Any:
    return (_NEWOBJ, (type(obj),), dict(obj.__dict__), None, iter(obj.items()), _set_attribute_dict)


def _set_attribute_dict(obj: Any, state: dict[str, Any]) -> None:
    object.__setattr__(obj, "__dict__", state)


def _has_hooks(module: Any) -> bool:
    state = getattr(module, "__dict__", {})
    return any(state.get(table) for table in _HOOK_TABLES)


# Note [Hook ids]: a hook's id is its handle's number from torch's process-wide counter
# (``RemovableHandle.next_id``) and its key in its module's tables. A plain load numbers hooks from
# this process's counter; a rebuilt one would keep the storing process's numbers, and the user's
# next ``register_forward_hook`` could get an id already used (it replaces that hook, and removing
# it removes both). So the counter is read before and after the original load (``taken``, in the
# entry) and a rebuilt stream with hooks is renumbered: ``before + i`` becomes ``start + i`` in
# every table (in place: handles hold weak references to them) and handle, and the counter ends
# where a plain load would leave it; other keys stay. Streams without hooks skip the walk
# (``WritePlan.hooks``); verify mode sets the counter back before its plain load.
def hook_counter() -> int:
    """torch's hook id counter now (0 before torch is imported: nothing took an id)."""
    hooks = sys.modules.get("torch.utils.hooks")
    return int(hooks.RemovableHandle.next_id) if hooks is not None else 0


def set_hook_counter(value: int) -> None:
    """Set torch's hook id counter (verify mode: the plain load takes the hit's ids)."""
    hooks = sys.modules.get("torch.utils.hooks")
    if hooks is not None:
        hooks.RemovableHandle.next_id = value


def hook_owners(obj: Any) -> tuple[list[Any], list[Any]]:
    """The modules and the hook handles reached from ``obj`` (dict values, list, tuple and set
    items, ``__dict__`` values): what ``renumber_hooks`` renumbers."""
    import torch
    from torch.utils.hooks import RemovableHandle

    modules: list[Any] = []
    handles: list[Any] = []
    seen: set[int] = set()
    stack = [obj]
    while stack:
        item = stack.pop()
        if id(item) in seen or item is None or isinstance(item, (str, bytes, int, float,
                                                                 torch.Tensor, type)):
            continue
        seen.add(id(item))
        if isinstance(item, torch.nn.Module):
            modules.append(item)
        elif isinstance(item, RemovableHandle):
            handles.append(item)
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        state = getattr(item, "__dict__", None)
        if isinstance(state, dict):
            stack.extend(state.values())
    return modules, handles


def renumber_hooks(obj: Any, start: int, taken: tuple[int, int]) -> None:
    """Give a rebuilt object's hooks the ids a plain load here would (Note [Hook ids]): ``start`` is
    this process's counter before unpickling, ``taken`` the storing process's before and after its
    load."""
    from torch.utils.hooks import RemovableHandle

    modules, handles = hook_owners(obj)
    tables = [t for m in modules for t in (m.__dict__.get(n) for n in _HOOK_TABLES)
              if isinstance(t, dict) and t]
    before, after = taken
    new = {k: start + k - before
           for k in {k for t in tables for k in t if isinstance(k, int)}
           | {h.id for h in handles if isinstance(getattr(h, "id", None), int)}
           if before <= k < after}
    end = start + after - before
    for table in tables:
        items = list(table.items())
        table.clear()
        table.update((new.get(k, k), v) for k, v in items)
    for handle in handles:
        handle.id = new.get(handle.id, handle.id)
    RemovableHandle.next_id = end


_BPE_OPTIONS = ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix",
                "fuse_unk", "byte_fallback", "ignore_merges")


def reduce_tokenizer(tok: Any) -> Any:
    """A BPE ``tokenizers.Tokenizer`` as its pipeline JSON plus vocab and merges: the library's
    pickling parses one big JSON (0.2 s for CLIP); this takes a third. Other models keep it."""
    state = json.loads(tok.to_str())
    model = state.get("model", {})
    if model.get("type") != "BPE" or not set(model) <= {"type", "vocab", "merges", *_BPE_OPTIONS}:
        return NotImplemented
    vocab = model["vocab"]
    # Added tokens get the next id after the *stub's* vocabulary, so the stub holds every added
    # token (chat markers are outside the base vocabulary) and the unknown token at its id.
    added = {t["content"]: t["id"] for t in state.get("added_tokens", [])}
    unk = model.get("unk_token")
    stub_vocab = {**({unk: vocab[unk]} if unk in vocab else {}), **added}
    if len(set(stub_vocab.values())) != len(stub_vocab):
        return NotImplemented  # two names for one id: leave it to the library
    stub = dict(state, model=dict(model, vocab=stub_vocab, merges=[]))
    # A merge's parts are vocabulary tokens: made the same string objects, pickle's memo writes each
    # once and the unpickler makes 49,000 strings for CLIP instead of 150,000 (15 -> 8.5 ms).
    same = {token: token for token in vocab}
    pairs = (m if isinstance(m, list) else m.split(" ", 1) for m in model["merges"])
    merges = [tuple(same.get(part, part) for part in pair) for pair in pairs]
    options = {k: model[k] for k in _BPE_OPTIONS if model.get(k) is not None}
    # Attributes set on the object come back too (CLIPTokenizer wraps ``decode``: dill).
    attributes = dict(getattr(tok, "__dict__", None) or {})
    if not attributes:
        return (rebuild_tokenizer, (json.dumps(stub), vocab, merges, options))
    return (rebuild_tokenizer, (json.dumps(stub), vocab, merges, options), attributes,
            None, None, _update_attributes)


def _update_attributes(obj: Any, attributes: dict[str, Any]) -> None:
    """Set saved attributes (the object's ``__setstate__`` expects something else)."""
    obj.__dict__.update(attributes)


def rebuild_tokenizer(stub: str, vocab: dict[str, int], merges: list[tuple[str, str]],
                      options: dict[str, Any]) -> Any:
    from tokenizers import Tokenizer
    from tokenizers.models import BPE

    tok = Tokenizer.from_str(stub)
    tok.model = BPE(vocab, merges, **options)
    return tok


def _deferred() -> Any:
    from overmind_lab._loading import deferred

    return deferred


def reduce_deferring(obj: Any, base: type, plan: WritePlan) -> Any:
    """A transformers tokenizer with its Rust tokenizer pickled apart, or ``None`` where that could
    change what a hit returns (Note [A tokenizer built on first use] in ``deferred``)."""
    deferred = _deferred()
    deferred.complete(obj)  # itself from a hit, not yet used
    state = obj.__dict__
    root = state.get(deferred.NAMES[0])
    if type(root).__module__ != "tokenizers" or type(root).__name__ != "Tokenizer":
        return None
    nested = WritePlan()
    file = io.BytesIO()
    pickler = _make_pickler(base, file, nested, {})
    _set_up(pickler, base)
    # What the attempt holds would count as other references (``closed``), and a failed one's
    # plan lives on in its pickler class until a collection: let go of both now.
    try:
        pickler.dump({deferred.NAMES[0]: root})
    except BaseException:
        nested.classes.clear()
        raise
    finally:
        pickler.clear_memo()
        del pickler
    if nested.items or nested.refs or nested.buffers or nested.hooks:
        return None  # not self-contained: storages, hooks
    # 1: ``root`` here; the nested plan lists the functions it pickled (for the entry's code)
    if not deferred.closed(root, 1, (nested.classes,)):
        return None
    plan.classes.extend(nested.classes)
    kind = "pickle" if base is pickle.Pickler else "dill"
    held = deferred.Deferred(file.getvalue(), kind, load_nested, rebuild_deferred)
    # The attribute's value: the dictionary keeps a plain load's order (``deferred.complete``)
    rest = {k: (held if k == deferred.NAMES[0] else v) for k, v in state.items()}
    return (copyreg.__newobj__, (type(obj),), rest)  # type: ignore[attr-defined]


def rebuild_deferred(blob: bytes, kind: str) -> Any:
    """A ``Deferred`` from the stream, the class's side installed (``deferred.install``)."""
    deferred = _deferred()
    deferred.install()
    return deferred.Deferred(blob, kind, load_nested, rebuild_deferred)


def load_nested(blob: bytes, kind: str) -> Any:
    """Unpickle what ``reduce_deferring`` pickled apart."""
    base = pickle.Unpickler if kind == "pickle" else _dill().Unpickler
    collecting = gc.isenabled()
    gc.disable()  # Note [No collection while rebuilding]
    try:
        return _make_unpickler(base, io.BytesIO(blob), []).load()
    finally:
        if collecting:
            gc.enable()


# Note [Hashes of strings]: transformers' GenerationConfig records ``hash(self)`` at load and
# compares it later to tell whether the user changed it. String hashes are salted per process, so a
# rebuilt one would look modified: a hash that was current when pickled is recomputed.
def reduce_rehashed(obj: Any, state: dict[str, Any]) -> tuple[Any, ...]:
    current = state.get("_original_object_hash") == _safe_hash(obj)
    return (rebuild_rehashed, (type(obj), dict(state), current))


def _safe_hash(obj: Any) -> int | None:
    try:
        return hash(obj)
    except TypeError:
        return None


def rebuild_rehashed(cls: type[Any], state: dict[str, Any], current: bool) -> Any:
    obj = object.__new__(cls)  # a plain instance, as pickle makes one (copyreg.__newobj__)
    obj.__dict__.update(state)
    if current:
        obj._original_object_hash = _safe_hash(obj)
    return obj


def _make_pickler(base: type, file: io.BytesIO, plan: WritePlan, components: dict[int, str]) -> Any:
    import torch
    from torch.utils.hooks import RemovableHandle

    # type -> kind of reduction, looked up once per type (Note [The pickler's hot path])
    kinds: dict[type, str] = {}
    compact_modules = _module_layout_known()

    class StoragePickler(base):  # type: ignore[misc]
        # Note [The pickler's hot path]: ``persistent_id`` would be called for every object (70,000
        # for an SD UNet, against 686 storages); ``reducer_override`` is not called for builtin
        # scalars and exact containers, nor memoized objects: 9,000 calls. So storages and
        # components are reduced here, decided by the object's type.
        def reducer_override(self, obj: Any) -> Any:
            if components:
                key = components.get(id(obj))
                if key is not None:  # Note [Components by reference]
                    return (_component, (key,))
            cls = type(obj)
            if cls is torch.Tensor or cls is torch.nn.Parameter:
                return reduce_tensor(obj, cls is torch.nn.Parameter, plan)
            kind = kinds.get(cls)
            if kind is None:
                kind = kinds[cls] = (
                    "code" if issubclass(cls, type) or cls is types.FunctionType
                    else "typed" if issubclass(cls, torch.storage.TypedStorage)
                    else "untyped" if issubclass(cls, torch.UntypedStorage)
                    else "slotted" if _slotted_module(cls)
                    else "module" if compact_modules and _default_module_pickling(cls)
                    else "hooks" if issubclass(cls, (torch.nn.Module, RemovableHandle))
                    else "ordered" if _ordered_with_attributes(cls)
                    else "ndarray" if cls.__module__ == "numpy" and cls.__name__ == "ndarray"
                    else "deferrable" if _deferred().defers(cls)
                    else "")
            if kind == "slotted":  # Note [Modules with slots]
                plan.hooks = plan.hooks or _has_hooks(obj)
                return reduce_slotted_module(obj)
            if kind == "module":
                reduced = reduce_module(obj)
                if reduced is NotImplemented:
                    plan.hooks = plan.hooks or _has_hooks(obj)
                return reduced
            if kind == "ordered":
                return reduce_ordered(obj)
            if kind == "ndarray":  # Note [Strided arrays]
                return reduce_strided_array(obj)
            if kind == "hooks":  # Note [Hook ids]
                plan.hooks = plan.hooks or not isinstance(obj, torch.nn.Module) or _has_hooks(obj)
                return NotImplemented
            if kind == "deferrable":  # Note [A tokenizer built on first use]
                reduced = reduce_deferring(obj, base, plan)
                if reduced is not None:
                    return reduced
                kind = ""  # pickled as before
            if kind == "code":  # a class or function, once per stream (then memoized)
                plan.classes.append(obj)
                return NotImplemented
            if kind:
                if kind == "typed":
                    untyped, dtype, typed = obj._untyped_storage, obj.dtype, True
                else:
                    untyped, dtype, typed = obj, torch.uint8, False
                seg, offset = plan.reduce_storage(untyped)
                return (_storage, (seg, offset, int(untyped.nbytes()),
                                   str(dtype).removeprefix("torch."), str(untyped.device),
                                   typed))
            if cls.__module__ == "tokenizers" and cls.__name__ == "Tokenizer":
                return reduce_tokenizer(obj)
            state = getattr(obj, "__dict__", None)
            if isinstance(state, dict) and "_original_object_hash" in state:
                return reduce_rehashed(obj, state)
            return NotImplemented

    return StoragePickler(file, protocol=5, buffer_callback=plan.reduce_buffer)


# Note [Components by reference]: a component passed to the call that came from the cache
# (``vae=vae``) is pickled as its key and unpickled as the object the caller passed, so ``pipe.vae
# is vae`` holds; a hit has them at hand, their keys are part of the call's key.
def dump(obj: Any, components: dict[int, str] | None = None, *,
         sources: SourceMap | None = None,
         exclude: frozenset[str] = frozenset()) -> tuple[bytes, WritePlan, str]:
    """Pickle ``obj``: the stream, the plan of its bytes, and the pickler used. ``components``:
    ``id()`` -> cache key, by reference; ``sources``: file regions to reference, bar ``exclude``.
    """
    errors = []
    for kind in ("pickle", "dill"):
        plan = WritePlan(sources=sources, exclude=exclude)
        file = io.BytesIO()
        try:
            base = pickle.Pickler if kind == "pickle" else _dill().Pickler
            pickler = _make_pickler(base, file, plan, components or {})
            _set_up(pickler, base)
            with warnings.catch_warnings():
                if kind == "dill":
                    # dill warns about each class it cannot find by name, then fails on it
                    warnings.simplefilter("ignore", _dill().PicklingWarning)
                pickler.dump(obj)
            return file.getvalue(), plan, kind
        except RecursionError as exc:
            raise NotCacheable(f"the result is nested too deeply to pickle: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - whatever a reducer raises: try dill, then
            errors.append(exc)  # give up (Note [Never worse than plain] in ``load``)
            _let_go(exc)
    first = errors[0]
    raise NotCacheable(f"the result cannot be pickled: {type(first).__name__}: {first}") from first


def _let_go(exc: BaseException | None) -> None:
    """Clear the locals of the frames a failed attempt's traceback keeps: they would hold the
    objects being pickled, and the next attempt counts their references (``deferred.closed``)."""
    import traceback

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def _set_up(pickler: Any, base: type) -> None:
    if base is not pickle.Pickler:
        # Note [Classes by reference]: dill would pickle a class defined in a function by value,
        # and a hit's ``isinstance(model, TinyNet)`` would be False. Classes go by reference as
        # in pickle (such a result is uncached); functions by value.
        pickler._byref = True


def _dill() -> Any:
    import dill

    return dill


# -- rebuild_* --------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _numpy_dtypes() -> dict[Any, Any]:
    """torch dtypes that numpy has too (not bfloat16 nor the float8 types)."""
    import numpy
    import torch

    names = ("float16", "float32", "float64", "complex64", "complex128", "int8", "uint8",
             "int16", "int32", "int64", "bool")
    return {getattr(torch, n): numpy.dtype(n) for n in names}


class _Frame:
    """One stream being unpickled: views of its mapped segments, storages by location, the call's
    components, and bound torch functions (Note [One call per tensor])."""

    def __init__(self, mappings: list[Mapping], components: dict[str, Any]) -> None:
        import torch

        self.views = [memoryview(m.mm) for m in mappings]
        self.components = components
        self.memo: dict[tuple[int, int, int], Any] = {}
        self.buffers = [m.mm for m in mappings]
        self.frombuffer = torch.frombuffer
        self.empty = torch.empty
        self.uint8 = torch.uint8
        self.make_subclass = torch.Tensor._make_subclass
        self.parameter = torch.nn.Parameter
        self.from_numpy = torch.from_numpy
        numpy = sys.modules.get("numpy")  # never imported for this
        self.ndarray: Any = numpy.ndarray if numpy is not None else None
        self.numpy_dtypes = _numpy_dtypes() if numpy is not None else {}

    def storage(self, seg: int, offset: int, nbytes: int, device: str) -> Any:
        """The untyped storage over ``[offset, +nbytes)`` of segment ``seg`` (no copy)."""
        key = (seg, offset, nbytes)
        untyped = self.memo.get(key)
        if untyped is None:
            if nbytes:
                view = self.views[seg][offset:offset + nbytes]
                untyped = self.frombuffer(view, dtype=self.uint8).untyped_storage()
            else:
                import torch

                untyped = torch.UntypedStorage(0)  # type: ignore[no-untyped-call]
            if device != "cpu":
                untyped = _to_device(untyped, device)
            self.memo[key] = untyped
        return untyped

    def release(self) -> None:
        # Storages hold slices of the views, which keep the mappings alive on their own.
        for view in self.views:
            view.release()


class _Loading(threading.local):
    """The streams being unpickled in this thread (a rebuild may run inside another's)."""

    def __init__(self) -> None:
        self.stack: list[_Frame] = []


_loading = _Loading()


def _frame() -> _Frame:
    if not _loading.stack:
        raise pickle.UnpicklingError("a cached object outside of load_stream")
    return _loading.stack[-1]


def _storage(seg: int, offset: int, nbytes: int, dtype_name: str, device: str, typed: bool) -> Any:
    """A storage over ``[offset, +nbytes)`` of mapped segment ``seg`` (no byte copied)."""
    untyped = _frame().storage(seg, offset, nbytes, device)
    if not typed:
        return untyped
    import torch

    dtype = getattr(torch, dtype_name)
    return torch.storage.TypedStorage(  # type: ignore[no-untyped-call]
        wrap_storage=untyped, dtype=dtype, _internal=True)


def _component(key: str) -> Any:
    """The object passed to this call for the cached component ``key``."""
    try:
        return _frame().components[key]
    except KeyError:
        raise pickle.UnpicklingError(f"component {key} was not passed to this call") from None


def _to_device(untyped: Any, device: str) -> Any:
    import torch

    host = torch.empty(0, dtype=torch.uint8).set_(untyped)
    return host.to(torch.device(device)).untyped_storage()


def _make_unpickler(base: type, file: io.BytesIO, buffers: list[memoryview]) -> Any:
    class StorageUnpickler(base):  # type: ignore[misc]
        def find_class(self, module: str, name: str) -> Any:
            import_path_for(module)
            return super().find_class(module, name)

    return StorageUnpickler(file, buffers=buffers)


def load_stream(stream: memoryview, kind: str, mappings: list[Mapping],
                buffer_locations: list[tuple[int, int, int]],
                components: dict[str, Any] | None = None, *,
                hooks: tuple[int, int] | None = None) -> Any:
    """Rebuild an object from its stream and mapped segments (and passed components).

    Note [No collection while rebuilding]: the cyclic collector is off while unpickling. An SD UNet
    makes ~25,000 containers, so the young generation's threshold ran it ~25 times per rebuild over
    live objects (1.5-2 ms of 11-13 ms, or a full collection). Nothing made is cyclic garbage; the
    collector is switched back on, if it was, before returning.
    """
    frame = _Frame(mappings, components or {})
    buffers = [frame.views[s][o:o + n] for s, o, n in buffer_locations]
    base = pickle.Unpickler if kind == "pickle" else _dill().Unpickler
    _loading.stack.append(frame)
    collecting = gc.isenabled()
    counter = hook_counter() if hooks else 0
    gc.disable()
    try:
        obj = _make_unpickler(base, io.BytesIO(stream), buffers).load()
        if hooks:
            renumber_hooks(obj, counter, hooks)
        return obj
    finally:
        if collecting:
            gc.enable()
        _loading.stack.pop()
        frame.release()


# Note [Dynamic modules]: diffusers and transformers import a model's own code (custom pipelines,
# trust_remote_code) as top-level packages in HF_MODULES_CACHE: put it on sys.path.
_DYNAMIC_PACKAGES = {"diffusers_modules", "transformers_modules"}


def import_path_for(module: str) -> None:
    """Make ``module`` importable if it is a model's own code (the Note above)."""
    if module.split(".")[0] in _DYNAMIC_PACKAGES and module not in sys.modules:
        _add_dynamic_module_path()


def _add_dynamic_module_path() -> None:
    home = os.environ.get("HF_HOME", os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "huggingface"))
    path = os.environ.get("HF_MODULES_CACHE", os.path.join(home, "modules"))
    if path not in sys.path:
        sys.path.append(path)
        importlib.invalidate_caches()
