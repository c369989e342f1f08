"""What "equal to a plain load" means: one fingerprint of everything a user can observe.

``fingerprint(obj)`` walks a result as pickle sees it and records a short text per path
(classes, aliases, attributes in order, hooks, tensors' layout, sharing, bytes and flags,
tokenizers). It never raises and depends on no address, id or hash salt (Note [What differs
between two plain loads]); ``difference(a, b)`` names the first differing path. Standard library
only (torch and numpy from ``sys.modules``).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

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
