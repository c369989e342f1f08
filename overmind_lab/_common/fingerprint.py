"""What "equal to a plain load" means: one fingerprint of everything a user can observe.

``fingerprint(obj)`` walks a result as pickle sees it and records a short text per path
(classes, aliases, attributes in order, hooks, tensors' layout, sharing, bytes and flags,
tokenizers, closures), and what the result shares with the world outside it (Note [Sharing with
the outside]). It never raises and depends on no address, id or hash salt (Note [What differs
between two plain loads]); ``difference(a, b)`` names the first differing path. Standard library
only (torch and numpy from ``sys.modules``).
"""

from __future__ import annotations

import ast
import collections
import enum
import functools
import hashlib
import re
import sys
import types
import weakref
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Any

from overmind_lab._common.outside import array_bounds, is_user_module, user_globals

__all__ = ["fingerprint", "difference", "differences", "compare", "PROBES", "INTENDED"]

Fingerprint = dict[str, str]

#: Strings every tokenizer encodes in a fingerprint: chat markers (added tokens outside the base
#: vocabulary), unknown words, whitespace runs, non-ASCII text.
PROBES = (
    "Hello world!", "<|im_start|>user\nhi<|im_end|>", "<s>[INST] hi [/INST]</s>",
    "  leading and   inner  spaces ", "unbelievably_rare-wordpiece", "naïve café 東京 🙂",
    "a photo of an astronaut riding a horse", "", "\n\n\t",
)
_MAX_DEPTH = 200
_MAX_TEXT = 160
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
#: Lists whose order comes from iterating a set, so from the string-hash salt.
_UNORDERED_LISTS = ("_use_default_values",)


def fingerprint(obj: Any) -> Fingerprint:
    """Path -> description of everything observable in ``obj`` (see the module doc)."""
    walker = _Walker()
    walker.visit(obj, "", 0)
    walker.finish()
    return walker.out


#: Facts recorded but passed over by default (``ignore``): Note [Facts that plain loads vary in].
RESIZABLE = "resizable"
ALIGNED64 = "data_ptr%64"

# Note [Facts that plain loads vary in]: ``resizable`` and ``data_ptr%64`` are shown but count
# only if asked (``ignore``): plain loads already differ in them. More in docs/notes.md.
INTENDED = frozenset({RESIZABLE, ALIGNED64})


def difference(a: Fingerprint, b: Fingerprint, *, names: tuple[str, str] = ("warm", "plain"),
               ignore: frozenset[str] = INTENDED) -> str | None:
    """The first difference between two fingerprints, described; ``None`` when equal. Facts named in
    ``ignore`` (by default the ``INTENDED`` ones) do not count."""
    return next(differences(a, b, names=names, ignore=ignore), None)


def differences(a: Fingerprint, b: Fingerprint, *, names: tuple[str, str] = ("warm", "plain"),
                ignore: frozenset[str] = INTENDED) -> Iterator[str]:
    """Every difference, in the order of ``a``'s paths, then paths only ``b`` has."""
    for path, value in a.items():
        other = b.get(path)
        if other is not None and path.rpartition(" ")[2] in ignore:
            continue
        if other is None:
            yield f"{_shown(path)}: only in the {names[0]} result ({value})"
        elif other != value:
            yield f"{_shown(path)}: {_contrast(value, other, names)}"
    for path, value in b.items():
        if path not in a:
            yield f"{_shown(path)}: only in the {names[1]} result ({value})"


def _shown(path: str) -> str:
    """A path as a difference names it: the root is "the result"."""
    return "the result" + path if not path or path[0] == " " else path


def compare(a: Any, b: Any) -> str | None:
    """``difference(fingerprint(a), fingerprint(b))``."""
    return difference(fingerprint(a), fingerprint(b))


def _contrast(a: str, b: str, names: tuple[str, str]) -> str:
    """``a vs b``, a common ``name value`` prefix said once; for attribute lists, what only one side
    has, or that the order differs."""
    if a.startswith("[") and b.startswith("["):
        try:
            la, lb = ast.literal_eval(a), ast.literal_eval(b)
        except (ValueError, SyntaxError):
            la = lb = None
        if isinstance(la, list) and isinstance(lb, list):
            only_a = [x for x in la if x not in lb]
            only_b = [x for x in lb if x not in la]
            if not only_a and not only_b:
                return f"the same names in another order: {la} vs {lb}"
            return f"{only_a} only in the {names[0]} result, {only_b} only in the {names[1]}"
    wa, wb = a.split(" "), b.split(" ")
    if len(wa) == len(wb) and len(wa) > 1:
        diff = [i for i, (x, y) in enumerate(zip(wa, wb, strict=True)) if x != y]
        if len(diff) == 1 and diff[0] > 0:
            i = diff[0]
            return f"{' '.join(wa[:i])} {wa[i]} vs {wb[i]}"
    return f"{a} vs {b}"


def _short(text: str) -> str:
    text = _ADDRESS.sub("", text)
    return text if len(text) <= _MAX_TEXT else text[:_MAX_TEXT - 1] + "…"


def _qual(cls: type) -> str:
    return f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', cls.__name__)}"


def _digest(data: Any) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _unreadable(exc: BaseException) -> str:
    return f"<unreadable: {type(exc).__name__}: {_short(str(exc))}>"


# Note [What differs between two plain loads]: a model loaded plainly in two processes must
# fingerprint equal. Object identity is recorded as "alias of" the first path (tied weights and
# cycles still count); lists built from sets of strings are sorted (``_use_default_values``); salted
# string hashes (``_original_object_hash``) as whether current. Addresses in reprs dropped.
class _Walker:
    def __init__(self) -> None:
        self.out: Fingerprint = {}
        self.seen: dict[int, str] = {}
        self.keep: list[Any] = []  # objects made while walking stay alive: ids stay unique
        self.storages: dict[Any, str] = {}
        self.torch = sys.modules.get("torch")
        self.numpy = sys.modules.get("numpy")
        hooks = sys.modules.get("torch.utils.hooks")
        self.handle_type: Any = hooks.RemovableHandle if hooks is not None else None
        #: what is judged once the whole result is walked (Note [Sharing with the outside]):
        #: CPU storages' and arrays' bytes (start, end, path), hook handles (path, handle)
        self.spans: list[tuple[int, int, str]] = []
        self.arrays: list[tuple[int, int, str]] = []
        self.handles: list[tuple[str, Any]] = []
        #: class -> how its instances are walked, where not as the rest are (``special_for``)
        self.special: dict[type, Callable[[Any, str, int], None] | None] = {}

    def put(self, path: str, text: str) -> None:
        self.out[path] = text

    def visit(self, obj: Any, path: str, depth: int) -> None:
        try:
            self._visit(obj, path, depth)
        except RecursionError:
            self.put(path, "<too deep>")
        except Exception as exc:  # noqa: BLE001 - a fingerprint never raises
            self.put(path + " !", _unreadable(exc))

    def _visit(self, obj: Any, path: str, depth: int) -> None:
        cls = type(obj)
        if obj is None or cls in (bool, int, str, bytes):
            text = repr(obj) if cls is not bytes or len(obj) <= 64 else (
                f"bytes[{len(obj)}] {_digest(obj)}")
            self.put(path, f"{cls.__name__} {_short(text)}")
            return
        if cls is float:
            self.put(path, f"float {obj!r}")
            return
        ident = id(obj)
        if ident in self.seen:
            self.put(path, f"alias of {self.seen[ident] or 'the result'}")
            return
        self.seen[ident] = path
        self.keep.append(obj)
        if depth > _MAX_DEPTH:
            self.put(path, f"{_qual(cls)} <deeper than {_MAX_DEPTH}>")
            return
        torch = self.torch
        if torch is not None:
            if isinstance(obj, torch.Tensor):
                self.tensor(obj, path, depth)
                return
            if isinstance(obj, torch.nn.Module):
                self.module(obj, path, depth)
                return
            if isinstance(obj, (torch.dtype, torch.device, torch.layout, torch.memory_format,
                                torch.qscheme)):
                self.put(path, f"{_qual(cls)} {obj}")
                return
            if isinstance(obj, (torch.UntypedStorage, torch.storage.TypedStorage)):
                self.put(path, f"{_qual(cls)} {self.storage(obj, path)}")
                return
            if isinstance(obj, torch.Generator):
                self.put(path, f"{_qual(cls)} {obj.device} state "
                               f"{_digest(obj.get_state().numpy().tobytes())}")
                return
        if self.numpy is not None and isinstance(obj, self.numpy.ndarray):
            self.ndarray(obj, path, depth)
            return
        if isinstance(obj, type):
            self.put(path, f"class {_qual(obj)}")
            return
        if cls not in self.special:
            self.special[cls] = self.special_for(cls)
        special = self.special[cls]
        if special is not None:
            special(obj, path, depth)
            return
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "__dict__"):
            items = list(obj)
            if path.rsplit(".", 1)[-1].rstrip("]'\"").endswith(_UNORDERED_LISTS):
                items = sorted(items, key=repr)
            self.put(path, f"{_qual(cls)} of {len(items)}")
            for i, item in enumerate(items):
                self.visit(item, f"{path}[{i}]", depth + 1)
            return
        if isinstance(obj, (set, frozenset)):
            texts = sorted(_short(repr(x)) for x in obj)
            self.put(path, f"{_qual(cls)} {_digest(repr(texts).encode())} of {len(texts)}")
            return
        if isinstance(obj, dict):  # OrderedDict, FrozenDict, configs that are dicts
            self.mapping(obj, path, depth)
            return
        if _is_tokenizer(obj):
            self.tokenizer(obj, path, depth)
        self.instance(obj, path, depth)

    def mapping(self, obj: Any, path: str, depth: int) -> None:
        keys = list(obj.keys())
        self.put(path, f"{_qual(type(obj))} keys {_ADDRESS.sub('', repr(keys))}")
        for key in keys:
            self.visit(obj[key], f"{path}[{key!r}]", depth + 1)
        state = getattr(obj, "__dict__", None)
        if isinstance(state, dict) and state:
            self.attributes(obj, state, path, depth)

    def instance(self, obj: Any, path: str, depth: int) -> None:
        cls = type(obj)
        state = getattr(obj, "__dict__", None)
        if isinstance(state, dict) and _deferred(state):  # the attributes a plain load has
            _deferred(state).complete(obj)
        slots = _slots(cls)
        if not isinstance(state, dict) and (not slots or _custom_reduce(cls)):
            # what pickle saves: e.g. a path by its text, not its lazily filled caches
            self.opaque(obj, path, depth)
            return
        if path not in self.out:
            self.put(path, _qual(cls))
        if isinstance(state, dict):
            self.attributes(obj, state, path, depth)
        self.slots(obj, slots, path, depth)

    def slots(self, obj: Any, names: list[str], path: str, depth: int) -> None:
        for name in names:
            try:
                value = object.__getattribute__(obj, name)
            except AttributeError:
                self.put(_attr(path, name), "<unset slot>")
                continue
            self.visit(value, _attr(path, name), depth + 1)

    def facts(self, prefix: str, probes: list[tuple[str, Callable[[], Any]]]) -> None:
        """``<prefix> <name>``: what each probe reads, or why it could not."""
        for name, probe in probes:
            try:
                value = probe()
            except Exception as exc:  # noqa: BLE001 - recorded, never raised
                value = _unreadable(exc)
            self.put(f"{prefix} {name}", str(value))

    def attributes(self, obj: Any, state: dict[str, Any], path: str, depth: int) -> None:
        self.put(f"{path} attrs", repr(list(state)))
        for name, value in state.items():
            if name == "_original_object_hash":  # Note [What differs between two plain loads]
                self.put(_attr(path, name), f"current {value == _safe_hash(obj)}")
                continue
            self.visit(value, _attr(path, name), depth + 1)

    def opaque(self, obj: Any, path: str, depth: int) -> None:
        """A function or class by its name, anything else by its ``__reduce_ex__``."""
        cls = type(obj)
        name = getattr(obj, "__qualname__", None)
        if callable(obj) and isinstance(name, str):
            self.put(path, f"{_qual(cls)} {getattr(obj, '__module__', '?')}.{name}")
            owner = getattr(obj, "__self__", None)
            if owner is not None and not isinstance(owner, type(sys)):
                self.visit(owner, _attr(path, "__self__"), depth + 1)
            return
        try:
            reduced = obj.__reduce_ex__(5)
        except Exception as exc:  # noqa: BLE001 - recorded, never raised
            self.put(path, f"{_qual(cls)} {_short(repr(obj))} (not picklable: "
                           f"{type(exc).__name__})")
            return
        if isinstance(reduced, str):
            self.put(path, f"{_qual(cls)} global {reduced}")
            return
        parts = [*reduced, None, None, None, None, None][:6]
        func = parts[0]
        self.put(path, f"{_qual(cls)} reduced by "
                       f"{getattr(func, '__qualname__', None) or _short(repr(func))}")
        self.visit(parts[1], _attr(path, "<args>"), depth + 1)
        if parts[2] is not None:
            self.visit(parts[2], _attr(path, "<state>"), depth + 1)
        for label, index in (("<items>", 3), ("<dictitems>", 4)):
            if parts[index] is not None:
                self.visit(list(parts[index]), _attr(path, label), depth + 1)

    def special_for(self, cls: type) -> Callable[[Any, str, int], None] | None:
        if issubclass(cls, types.FunctionType):
            return self.function
        if issubclass(cls, types.MethodType):
            return self.method
        if issubclass(cls, functools.partial):
            return self.partial
        if self.handle_type is not None and issubclass(cls, self.handle_type):
            return self.handle
        return None

    def handle(self, obj: Any, path: str, depth: int) -> None:
        self.handles.append((path, obj))  # what it removes: once the walk is done
        self.instance(obj, path, depth)

    def function(self, fn: types.FunctionType, path: str, depth: int) -> None:
        """A function by its name; one pickled by value (a lambda, a nested function) also by what
        it closes over and its defaults, which a rebuild copies."""
        self.put(path, f"{_qual(type(fn))} {fn.__module__}.{fn.__qualname__}")
        if not _by_name(fn):
            for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=False):
                try:
                    value = cell.cell_contents
                except ValueError:
                    self.put(f"{path}.<locals>.{name}", "<empty cell>")
                    continue
                self.visit(value, f"{path}.<locals>.{name}", depth + 1)
            if fn.__defaults__:
                self.visit(fn.__defaults__, _attr(path, "__defaults__"), depth + 1)
            if fn.__kwdefaults__:
                self.visit(fn.__kwdefaults__, _attr(path, "__kwdefaults__"), depth + 1)
        self.attributes(fn, fn.__dict__, path, depth)

    def method(self, bound: types.MethodType, path: str, depth: int) -> None:
        func: Any = bound.__func__
        self.put(path, f"{_qual(type(bound))} {getattr(func, '__module__', '?')}."
                       f"{getattr(func, '__qualname__', '?')}")
        self.visit(bound.__self__, _attr(path, "__self__"), depth + 1)
        if not _by_name(func):
            self.visit(func, _attr(path, "__func__"), depth + 1)

    def partial(self, part: functools.partial[Any], path: str, depth: int) -> None:
        self.put(path, _qual(type(part)))
        self.visit(part.func, _attr(path, "func"), depth + 1)
        self.visit(part.args, _attr(path, "args"), depth + 1)
        self.visit(part.keywords, _attr(path, "keywords"), depth + 1)
        state = getattr(part, "__dict__", None)
        if isinstance(state, dict) and state:
            self.attributes(part, state, path, depth)

    def module(self, obj: Any, path: str, depth: int) -> None:
        # ``_compiled_call_impl = None`` reads as the class attribute; __getstate__ drops it.
        state = {k: v for k, v in obj.__dict__.items()
                 if k != "_compiled_call_impl" or v is not None}
        self.put(path, f"{_qual(type(obj))} training {state.get('training')}")
        self.put(f"{path} attrs", repr(list(state)))
        for name, value in state.items():
            if name in ("_parameters", "_buffers", "_modules"):
                self.put(f"{path} {name}", repr(list(value)))
                for child, item in value.items():
                    self.visit(item, _child(path, child), depth + 1)
            elif name == "_compiled_call_impl":
                self.put(_attr(path, name), "set" if value is not None else "None")
            elif name != "training":
                self.visit(value, _attr(path, name), depth + 1)
        self.slots(obj, _slots(type(obj)), path, depth)  # a module class may have slots

    def storage(self, storage: Any, path: str) -> str:
        """``storage <first path>`` (and, the first time, its size, bytes and flags)."""
        torch = self.torch
        untyped = storage.untyped_storage() if hasattr(storage, "untyped_storage") else (
            storage._untyped_storage if hasattr(storage, "_untyped_storage") else storage)
        key = (untyped._cdata, str(untyped.device))
        first = self.storages.get(key)
        if first is not None:
            return f"storage of {first or 'the result'}"
        self.storages[key] = path
        self.keep.append(untyped)
        nbytes = untyped.nbytes()
        self.put(f"{path} {RESIZABLE}", str(untyped.resizable()))
        text = f"storage {nbytes} bytes"
        if untyped.device.type == "meta":
            return text + " meta"
        assert torch is not None
        self.put(f"{path} storage data_ptr%16", str(untyped.data_ptr() % 16))
        self.put(f"{path} storage {ALIGNED64}", str(untyped.data_ptr() % 64))
        if untyped.device.type == "cpu" and nbytes:
            self.spans.append((untyped.data_ptr(), untyped.data_ptr() + nbytes, path))
        host = untyped if untyped.device.type == "cpu" else untyped.cpu()
        raw = torch.empty(0, dtype=torch.uint8).set_(host)
        return text + f" bytes {_digest(raw.numpy().tobytes())}"

    def tensor(self, t: Any, path: str, depth: int) -> None:
        torch = self.torch
        assert torch is not None
        cls = type(t)
        head = f"{_qual(cls)} {t.dtype} {t.device} {t.layout}"
        facts: list[tuple[str, Callable[[], Any]]] = [
                 ("shape", lambda: list(t.shape)),
                 ("requires_grad", lambda: t.requires_grad),
                 ("is_leaf", lambda: t.is_leaf),
                 ("grad_fn", lambda: type(t.grad_fn).__name__ if t.grad_fn is not None else None),
                 ("inference", lambda: t.is_inference()),
                 ("conj", lambda: t.is_conj()), ("neg", lambda: t.is_neg())]
        if t.layout is torch.strided and not t.is_nested:
            facts += [("stride", lambda: list(t.stride())),
                      ("offset", lambda: t.storage_offset()),
                      ("data_ptr%16", lambda: t.data_ptr() % 16 if t.device.type != "meta"
                       else None),
                      (ALIGNED64, lambda: t.data_ptr() % 64 if t.device.type != "meta"
                       else None)]
        self.put(path, head)
        self.facts(path, facts)
        if t.is_quantized:
            self.quantized(t, path)
        elif t.is_nested:
            self.visit(list(t.unbind()), _attr(path, "<components>"), depth + 1)
        elif t.layout is torch.sparse_coo:
            self.visit(t._indices(), _attr(path, "<indices>"), depth + 1)
            self.visit(t._values(), _attr(path, "<values>"), depth + 1)
            self.put(f"{path} coalesced", str(t.is_coalesced()))
        elif t.layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
            compressed = t.crow_indices() if t.layout in (torch.sparse_csr, torch.sparse_bsr) \
                else t.ccol_indices()
            plain = t.col_indices() if t.layout in (torch.sparse_csr, torch.sparse_bsr) \
                else t.row_indices()
            self.visit(compressed, _attr(path, "<compressed>"), depth + 1)
            self.visit(plain, _attr(path, "<plain>"), depth + 1)
            self.visit(t.values(), _attr(path, "<values>"), depth + 1)
        elif t.layout is torch.strided:
            try:
                self.put(f"{path} storage", self.storage(t.untyped_storage(), path))
            except Exception as exc:  # noqa: BLE001 - e.g. a subclass without storage
                self.put(f"{path} storage", _unreadable(exc))
        grad = getattr(t, "grad", None) if t.is_leaf else None
        if grad is not None:
            self.visit(grad, _attr(path, "grad"), depth + 1)
        for name in ("_backward_hooks", "_post_accumulate_grad_hooks"):  # register_hook...
            hooks = getattr(t, name, None)
            if hooks:
                self.visit(hooks, _attr(path, name), depth + 1)
        state = getattr(t, "__dict__", None)
        if isinstance(state, dict) and state:
            self.attributes(t, state, path, depth)

    def quantized(self, t: Any, path: str) -> None:
        torch = self.torch
        assert torch is not None
        scheme = t.qscheme()
        self.put(f"{path} qscheme", str(scheme))
        if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            self.put(f"{path} q", f"scale {t.q_scale()!r} zero_point {t.q_zero_point()}")
        else:
            scales = t.q_per_channel_scales().contiguous()
            zeros = t.q_per_channel_zero_points().contiguous()
            self.put(f"{path} q", f"axis {t.q_per_channel_axis()} scales "
                                  f"{_digest(scales.numpy().tobytes())} zero_points "
                                  f"{_digest(zeros.numpy().tobytes())}")
        ints = t.int_repr().contiguous()
        self.put(f"{path} ints", _digest(ints.numpy().tobytes()))

    def ndarray(self, a: Any, path: str, depth: int) -> None:
        numpy: Any = self.numpy
        bounds = array_bounds(a)
        if bounds is not None:
            self.arrays.append((*bounds, path))
        data = numpy.ascontiguousarray(a)
        self.put(path, f"{_qual(type(a))} {a.dtype} shape {list(a.shape)} strides "
                       f"{list(a.strides)} bytes {_digest(data.tobytes())}")

    def tokenizer(self, tok: Any, path: str, depth: int) -> None:
        self.put(path, _qual(type(tok)))
        probes: list[tuple[str, Callable[[], Any]]] = [
            ("vocab", lambda: _digest(repr(sorted(tok.get_vocab().items())).encode())),
            ("size", lambda: len(tok)),
        ]
        added = getattr(tok, "added_tokens_decoder", None)
        if added is not None:
            probes.append(("added", lambda: _short(repr(sorted(
                (i, str(t)) for i, t in tok.added_tokens_decoder.items())))))
        if callable(getattr(tok, "encode", None)):
            probes += [(f"probe {i}", functools.partial(_encoded, tok, text))
                       for i, text in enumerate(PROBES)]
        backend: Any = getattr(tok, "backend_tokenizer", None) or getattr(tok, "_tokenizer", None)
        if callable(getattr(backend, "to_str", None)):
            probes.append(("backend", lambda: _digest(backend.to_str().encode())))
        self.facts(f"{path} tokenizer", probes)

    # -- what the result shares with the world outside it ---------------------------------
    def finish(self) -> None:
        """The facts that need the whole walk (Note [Sharing with the outside])."""
        try:
            globals_ = user_globals()
            self.user_globals(globals_)
            self.sharing(globals_)
            for path, handle in self.handles:
                self.put(f"{path} removes", self.removes(handle))
        except Exception as exc:  # noqa: BLE001 - recorded, never raised
            self.put("<outside> !", _unreadable(exc))

    def user_globals(self, found: list[tuple[str, Any]]) -> None:
        """``<path> global``: the object at ``path`` is a module-level global of the user's code."""
        for name, value in found:
            path = self.seen.get(id(value))
            if path and f"{path} global" not in self.out and self.mutable(value):
                self.put(f"{path} global", name)

    def mutable(self, value: Any) -> bool:
        """Whether a copy of ``value`` could be told from it (identity, a change in place): what
        ``_loading/faithful.py`` refuses to cache when it is a global of the user's."""
        cls = type(value)
        if issubclass(cls, (dict, list, set, bytearray, collections.deque, weakref.WeakSet,
                            weakref.WeakKeyDictionary, weakref.WeakValueDictionary)):
            return True
        torch, numpy = self.torch, self.numpy
        if torch is not None and issubclass(cls, (torch.Tensor, torch.nn.Module)):
            return True
        if numpy is not None and issubclass(cls, numpy.ndarray):
            return True
        if issubclass(cls, (type, enum.Enum, tuple, frozenset, functools.partial,
                            types.FunctionType, types.MethodType, types.BuiltinFunctionType,
                            types.ModuleType)):
            return False  # by name, or immutable
        module = getattr(cls, "__module__", None)  # an instance of a user class
        return isinstance(module, str) and is_user_module(module, sys.modules.get(module))

    def sharing(self, found: list[tuple[str, Any]]) -> None:
        """``<path> shares memory``: a tensor's storage and a numpy array over the same bytes (an
        array in the result, or a global of the user's)."""
        numpy = self.numpy
        arrays = list(self.arrays)
        if numpy is not None and self.spans:
            arrays += [(*bounds, f"global {name}") for name, value in found
                       if isinstance(value, numpy.ndarray) and id(value) not in self.seen
                       and (bounds := array_bounds(value)) is not None]
        if not arrays or not self.spans:
            return
        spans = sorted(self.spans)
        starts = [start for start, _, _ in spans]
        reach, top = [], 0  # the largest end up to each span
        for _, end, _ in spans:
            top = max(top, end)
            reach.append(top)
        shared: dict[str, list[str]] = {}
        for start, end, array in arrays:
            i = bisect_left(starts, end) - 1
            while i >= 0 and reach[i] > start:
                if spans[i][1] > start:
                    tensor = spans[i][2]
                    shared.setdefault(tensor, []).append(f"the numpy array {_shown(array)}")
                    if not array.startswith("global "):
                        shared.setdefault(array, []).append(f"the storage of {_shown(tensor)}")
                i -= 1
        if not shared:
            return
        order = {path: i for i, path in enumerate(self.out)}  # where each was first recorded
        for path in sorted(shared, key=lambda p: order.get(p, len(order))):
            self.put(f"{path} shares memory", "with " + ", ".join(sorted(shared[path])))

    def removes(self, handle: Any) -> str:
        """What ``handle.remove()`` removes: entries of hook tables in the result (by path), of
        tables outside it, or nothing."""
        key, entries, main = handle.id, [], None
        for ref in (handle.hooks_dict_ref, *getattr(handle, "extra_dict_ref", ())):
            table = ref()
            where = None if table is None else self.seen.get(id(table))
            place = ("a table gone" if table is None else _shown(where) if where is not None
                     else "a table outside the result")
            main = main or place
            if table is not None and key in table:
                entries.append(f"{place}[{key!r}]")
        return ", ".join(entries) if entries else f"nothing (id {key!r} not in {main})"


# Note [Sharing with the outside]: what a pickle rebuild cannot carry, the fingerprint records, so
# verify mode, the corpus and the fuzzer name it (``_loading/faithful.py`` refuses to cache it):
# ``<path> global`` (the object is a mutable module-level global of the user's code or
# ``__main__``: a rebuild is a copy; not the result itself, which a script's or a notebook's
# assignment makes one), ``<path> shares memory`` (a tensor's storage and a numpy array
# over the same bytes: an array in the result, or a global of the user's; a rebuild gives each its
# own), ``<path> removes`` (what a hook handle's ``remove()`` removes: an entry of a table in the
# result, by path, of one outside it, or nothing). A function pickled by value (a lambda, a nested
# function) is walked into its closure cells and defaults, a partial into its function and
# arguments, a bound method into its ``__self__``. User code is what no standard library or site
# folder holds (Note [Regular code] in ``_loading/user_code.py``, without its editable-install
# roots, which lie outside those folders anyway); ``_common`` imports nothing of ``_loading``.
def _by_name(fn: Any) -> bool:
    """Whether pickle stores function ``fn`` by name: found where its name says it was defined."""
    name = getattr(fn, "__qualname__", None)
    if not isinstance(name, str) or "<locals>" in name:
        return False
    found: Any = sys.modules.get(getattr(fn, "__module__", None) or "")
    for part in name.split("."):
        found = getattr(found, part, None)
    return found is fn


def _deferred(state: dict[str, Any]) -> Any:
    """The ``_loading.deferred.Deferred`` among an object's attributes, still to build, or ``None``
    (not imported: this module runs in processes that never load)."""
    value = state.get("_tokenizer")  # ``deferred.NAMES``
    kind = type(value)
    return value if kind.__name__ == "Deferred" and kind.__module__.endswith("._loading.deferred") \
        else None


def _child(path: str, name: str) -> str:
    """A submodule's, parameter's or buffer's path as a user writes it."""
    return f"{path}[{name}]" if name.isdigit() else _attr(path, name)


def _attr(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _slots(cls: type) -> list[str]:
    names: list[str] = []
    for klass in reversed(cls.__mro__):
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and name not in names:
                names.append(f"_{klass.__name__.lstrip('_')}{name}"
                             if name.startswith("__") and not name.endswith("__") else name)
    return names


def _custom_reduce(cls: type) -> bool:
    return (getattr(cls, "__reduce_ex__", None) is not object.__reduce_ex__
            or getattr(cls, "__reduce__", None) is not object.__reduce__)


def _is_tokenizer(obj: Any) -> bool:
    cls = type(obj)
    if cls.__module__ == "tokenizers" and cls.__name__ == "Tokenizer":
        return True
    return callable(getattr(obj, "get_vocab", None)) and callable(getattr(obj, "encode", None))


def _encoded(tok: Any, text: str) -> str:
    ids = tok.encode(text)
    ids = getattr(ids, "ids", ids)  # tokenizers.Encoding
    return repr(list(ids))


def _safe_hash(obj: Any) -> int | None:
    try:
        return hash(obj)
    except Exception:  # noqa: BLE001 - unhashable
        return None
