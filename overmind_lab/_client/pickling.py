"""Pickling with tensor bytes out of band: ``reduce_*`` on the way in, ``rebuild_*`` out.

:class:`StoragePickler` is a protocol-5 pickler whose ``reducer_override`` turns every
torch storage into a small reference, a call ``_storage(segment, offset, nbytes, dtype,
device, typed)``, and whose ``buffer_callback`` takes large ``PickleBuffer`` objects
(numpy arrays) out of the stream too. The stream itself is metadata only (~100 KB for a UNet). A
:class:`WritePlan` decides where every byte goes: into the new segment, or, for a storage
that already lives unchanged in a cached segment, nowhere (Note [Provenance] in
``_segments``).

Unpickling rebuilds storages with ``torch.frombuffer`` over the private mapping: no byte
is copied, the tensor keeps the mapping alive.

Nothing here is registered on a global pickler. ``dill`` is the fallback for objects
plain pickle refuses (lambdas, nested functions).
"""

from __future__ import annotations

import ctypes
import importlib
import io
import json
import os
import pickle
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

from overmind_lab._client.segments import Mapping, find_mapping
from overmind_lab._client.sources import SourceFile, SourceMap
from overmind_lab._errors import NotCacheable

__all__ = ["WritePlan", "dump", "load_stream", "ALIGN"]

#: Storages start at multiples of this (SIMD kernels like aligned data).
ALIGN = 64
#: PickleBuffers smaller than this stay in the stream.
MIN_OUT_OF_BAND = 64 * 1024


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class WritePlan:
    """Where each storage goes. Segment index 0 is the new segment; 1.. are references:
    cached segments, or source files whose unchanged regions storages are (``_sources``).
    """

    size: int = 0
    items: list[tuple[int, Any]] = field(default_factory=list)
    keep_alive: list[Any] = field(default_factory=list)
    refs: list[Mapping | SourceFile] = field(default_factory=list)
    sources: SourceMap | None = None
    #: source files not to reference (the daemon could not link them): copy instead
    exclude: frozenset[str] = frozenset()
    source_bytes: int = 0
    seen: dict[tuple[int, int, str], tuple[int, int]] = field(default_factory=dict)
    buffers: list[tuple[int, int, int]] = field(default_factory=list)
    tensors: int = 0
    shared_bytes: int = 0

    def place(self, data: Any, nbytes: int) -> int:
        offset = _align(self.size)
        self.items.append((offset, data))
        self.size = offset + nbytes
        return offset

    @property
    def files(self) -> list[SourceFile]:
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
        memo = (ptr, nbytes, device)
        if memo in self.seen and nbytes:
            return self.seen[memo]
        self.tensors += 1
        if untyped.device.type != "cpu":
            untyped = untyped.cpu()  # cached on host, moved back on load
            ptr = int(untyped.data_ptr())
            self.keep_alive.append(untyped)
        # Note [Borrowed storage views]: ``buf`` is a raw view of the storage's memory with
        # no reference to the storage. It stays valid for the whole store only because the
        # caller (``load``) still holds ``result``, which holds every CPU storage, until the
        # segment is written; a storage copied off a device is held by ``keep_alive``.
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
            placed = (0, self.place(buf, nbytes))
        self.seen[memo] = placed
        return placed

    def reduce_buffer(self, buf: pickle.PickleBuffer) -> bool:
        raw = buf.raw()
        if raw.nbytes < MIN_OUT_OF_BAND:
            return True  # in band
        offset = self.place(raw, raw.nbytes)
        self.buffers.append((0, offset, raw.nbytes))
        return False


def reduce_tensor(t: Any, is_param: bool) -> Any:
    """A lean reduction for plain CPU tensors and parameters (see ``rebuild_tensor``).

    torch's own reduction costs ~10x more to rebuild (fake-mode detection, hook dicts);
    everything it handles that this does not (other layouts, devices, autograd history,
    conjugate views, subclasses) goes through torch's reduction unchanged.
    """
    import torch

    if (t.layout is not torch.strided or t.device.type != "cpu" or t.is_quantized
            or t.is_conj() or t.is_neg() or t.grad_fn is not None
            or getattr(t, "_backward_hooks", None) or t.is_nested):
        return NotImplemented
    state = dict(t.__dict__) or None
    return (rebuild_tensor, (t.untyped_storage(), t.storage_offset(), tuple(t.size()),
                             t.stride(), t.dtype, t.requires_grad, is_param, state))


def rebuild_tensor(storage: Any, offset: int, size: tuple[int, ...], stride: tuple[int, ...],
                   dtype: Any, requires_grad: bool, is_param: bool,
                   state: dict[str, Any] | None) -> Any:
    import torch

    t = torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)
    if is_param:
        t = torch.nn.Parameter(t, requires_grad=requires_grad)
    elif requires_grad:
        t.requires_grad_(True)
    if state:
        t.__dict__.update(state)
    return t


_BPE_OPTIONS = ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix",
                "fuse_unk", "byte_fallback", "ignore_merges")


def reduce_tokenizer(tok: Any) -> Any:
    """A BPE ``tokenizers.Tokenizer`` as its pipeline JSON plus vocab and merges.

    The library's own pickling parses one big JSON document (0.2 s for CLIP, more than
    ``from_pretrained``); building the BPE model from a dict and a list takes a third of
    that. Anything but a plain BPE model keeps the library's reduction.
    """
    state = json.loads(tok.to_str())
    model = state.get("model", {})
    if model.get("type") != "BPE" or not set(model) <= {"type", "vocab", "merges",
                                                         *_BPE_OPTIONS}:
        return NotImplemented
    vocab = model["vocab"]
    # The added tokens must find their ids while the stub loads.
    keep = {t["content"] for t in state.get("added_tokens", [])} | {model.get("unk_token")}
    stub = dict(state, model=dict(model, vocab={k: vocab[k] for k in keep if k in vocab},
                                  merges=[]))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1))
              for m in model["merges"]]
    options = {k: model[k] for k in _BPE_OPTIONS if k in model}
    return (rebuild_tokenizer, (json.dumps(stub), vocab, merges, options))


def rebuild_tokenizer(stub: str, vocab: dict[str, int], merges: list[tuple[str, str]],
                      options: dict[str, Any]) -> Any:
    from tokenizers import Tokenizer
    from tokenizers.models import BPE

    tok = Tokenizer.from_str(stub)
    tok.model = BPE(vocab, merges, **options)
    return tok


# Note [Hashes of strings]: transformers' GenerationConfig records ``hash(self)`` (a hash
# of its JSON text) when it is loaded, and later compares it with ``hash(self)`` to tell
# whether the user changed it (``generate`` then acts differently). String hashes are
# salted per process, so a recorded hash unpickled in another process never matches: a
# warm hit would look modified. An object whose recorded hash was current when it was
# pickled gets it recomputed when it is rebuilt, as a plain load would compute it.
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


def _make_pickler(base: type, file: io.BytesIO, plan: WritePlan,
                  components: dict[int, str]) -> Any:
    import torch

    storage_kinds: dict[type, str] = {}  # type -> "typed", "untyped" or "" (not a storage)

    class StoragePickler(base):  # type: ignore[misc]
        # Note [The pickler's hot path]: a pickler with a ``persistent_id`` method calls
        # it for every object of the graph (70,000 for an SD UNet: every dict key, int
        # and string of every module), against 686 storages. ``reducer_override`` is
        # not called for None, bools, ints, floats, strs, bytes, exact dicts, lists,
        # tuples and sets, nor for an object already in the memo: 9,000 calls. So
        # storages and components are reduced here, to calls of ``_storage`` and
        # ``_component`` that the unpickler resolves (``_Loading``), and everything is
        # decided by the object's type, looked up once per type.
        def reducer_override(self, obj: Any) -> Any:
            if components:
                key = components.get(id(obj))
                if key is not None:  # Note [Components by reference]
                    return (_component, (key,))
            cls = type(obj)
            if cls is torch.Tensor or cls is torch.nn.Parameter:
                return reduce_tensor(obj, cls is torch.nn.Parameter)
            kind = storage_kinds.get(cls)
            if kind is None:
                kind = storage_kinds[cls] = (
                    "typed" if issubclass(cls, torch.storage.TypedStorage)
                    else "untyped" if issubclass(cls, torch.UntypedStorage) else "")
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
# (``vae=vae``) is pickled as a reference to its key, and unpickled as the very object the
# caller passed, so ``pipe.vae is vae`` holds as it does without the cache. A hit always
# has those objects at hand: their keys are part of the call's key.
def dump(obj: Any, components: dict[int, str] | None = None, *,
         sources: SourceMap | None = None,
         exclude: frozenset[str] = frozenset()) -> tuple[bytes, WritePlan, str]:
    """Pickle ``obj``; returns the stream, the plan of its bytes, and the pickler used.

    ``components`` maps ``id()`` of objects to pickle by reference to their cache key;
    ``sources``, when given, lets storages that are unchanged file regions be referenced
    (except files in ``exclude``).
    """
    errors = []
    for kind in ("pickle", "dill"):
        plan = WritePlan(sources=sources, exclude=exclude)
        file = io.BytesIO()
        try:
            base = pickle.Pickler if kind == "pickle" else _dill().Pickler
            pickler = _make_pickler(base, file, plan, components or {})
            if kind == "pickle":
                pickler.dump(obj)
            else:
                # Note [Classes by reference]: dill would pickle a class it cannot find by
                # name (one defined inside a function) by value; a hit would then rebuild
                # a copy of the class and ``isinstance(model, TinyNet)`` would be False.
                # Classes go by reference, as with plain pickle: such a result cannot be
                # pickled, and is returned uncached. Functions and lambdas still go by
                # value, which keeps their behaviour.
                pickler._byref = True
                with warnings.catch_warnings():
                    # dill warns about each class it cannot find by name, then fails on it
                    warnings.simplefilter("ignore", _dill().PicklingWarning)
                    pickler.dump(obj)
            return file.getvalue(), plan, kind
        except (pickle.PicklingError, TypeError, AttributeError, ValueError) as exc:
            errors.append(exc)
        except RecursionError as exc:
            raise NotCacheable(f"the result is nested too deeply to pickle: {exc}") from exc
    raise NotCacheable(f"the result cannot be pickled: {errors[-1]}") from errors[-1]


def _dill() -> Any:
    import dill

    return dill


# -- rebuild_* --------------------------------------------------------------------------
class _Loading(threading.local):
    """What the stream being unpickled in this thread refers to: its mapped segments, the
    storages rebuilt so far, and the components passed to the call (a stack: one
    unpickling at a time per thread, but a rebuild may run inside another's)."""

    def __init__(self) -> None:
        self.stack: list[tuple[list[Mapping], dict[tuple[int, int, int], Any],
                               dict[str, Any]]] = []


_loading = _Loading()


def _storage(seg: int, offset: int, nbytes: int, dtype_name: str, device: str,
             typed: bool) -> Any:
    """A storage over ``[offset, +nbytes)`` of mapped segment ``seg`` (no byte copied)."""
    import torch

    if not _loading.stack:
        raise pickle.UnpicklingError("a cached storage outside of load_stream")
    mappings, memo, _ = _loading.stack[-1]
    key = (seg, offset, nbytes)
    untyped = memo.get(key)
    if untyped is None:
        if nbytes:
            view = mappings[seg].view(offset, nbytes)
            untyped = torch.frombuffer(view, dtype=torch.uint8).untyped_storage()
        else:
            untyped = torch.UntypedStorage(0)  # type: ignore[no-untyped-call]
        if device != "cpu":
            untyped = _to_device(untyped, torch.device(device))
        memo[key] = untyped
    if not typed:
        return untyped
    dtype = getattr(torch, dtype_name)
    return torch.storage.TypedStorage(  # type: ignore[no-untyped-call]
        wrap_storage=untyped, dtype=dtype, _internal=True)


def _component(key: str) -> Any:
    """The object passed to this call for the cached component ``key``."""
    if not _loading.stack:
        raise pickle.UnpicklingError("a cached component outside of load_stream")
    try:
        return _loading.stack[-1][2][key]
    except KeyError:
        raise pickle.UnpicklingError(f"component {key} was not passed to this call") from None


def _to_device(untyped: Any, device: Any) -> Any:
    import torch

    host = torch.empty(0, dtype=torch.uint8).set_(untyped)
    return host.to(device).untyped_storage()


def _make_unpickler(base: type, file: io.BytesIO, buffers: list[memoryview]) -> Any:
    class StorageUnpickler(base):  # type: ignore[misc]
        def find_class(self, module: str, name: str) -> Any:
            if module.split(".")[0] in _DYNAMIC_PACKAGES and module not in sys.modules:
                _add_dynamic_module_path()
            return super().find_class(module, name)

    return StorageUnpickler(file, buffers=buffers)


def load_stream(stream: memoryview, kind: str, mappings: list[Mapping],
                buffer_locations: list[tuple[int, int, int]],
                components: dict[str, Any] | None = None) -> Any:
    """Rebuild an object from its stream and mapped segments (and passed components)."""
    buffers = [mappings[s].view(o, n) for s, o, n in buffer_locations]
    base = pickle.Unpickler if kind == "pickle" else _dill().Unpickler
    _loading.stack.append((mappings, {}, components or {}))
    try:
        return _make_unpickler(base, io.BytesIO(stream), buffers).load()
    finally:
        _loading.stack.pop()


# Note [Dynamic modules]: diffusers and transformers import code shipped with a model
# (custom pipelines, trust_remote_code) as top-level packages living in HF_MODULES_CACHE.
# A fresh process has not imported them yet: put that directory on sys.path first.
_DYNAMIC_PACKAGES = {"diffusers_modules", "transformers_modules"}


def _add_dynamic_module_path() -> None:
    home = os.environ.get("HF_HOME", os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "huggingface"))
    path = os.environ.get("HF_MODULES_CACHE", os.path.join(home, "modules"))
    if path not in sys.path:
        sys.path.append(path)
        importlib.invalidate_caches()
