"""Cases for the differential fuzzer (``tests/test_fuzz.py``): generated specs, one loader.

A *spec* is a JSON text that says what to build: a module tree (``kind: module``), a
tokenizer (``kind: tokenizer``) or a config (``kind: config``). :func:`build` makes the
object from it, deterministically: every number comes from a local ``torch.Generator``
seeded from the spec, never from a global generator (a load that moves one is not cached,
by design), so two calls of ``build(spec)``, in any process, give equal objects. The one
exception is a module tree's ``rng``: it draws from the global generator inside
``torch.random.fork_rng`` (seeded there, so still deterministic), which puts the state back;
such a load must come back uncached (:func:`must_be_uncached`). The spec text is the load's
argument, hence part of the cache key: each example has its own entry.

Some shapes are what a pickle rebuild cannot carry (Note [What pickling cannot carry] in
``overmind_lab/_loading/faithful.py``): tensor hooks, compiled submodules, references to this
module's globals (``REGISTRY``...), tensors over numpy arrays. Loaded through the cache they
come back uncached with a warning, equal to plain; the fingerprint names what a rebuild
would lose (Note [Sharing with the outside] in ``overmind_lab/_common/fingerprint.py``).

:func:`specs` is the hypothesis strategy of specs; :func:`forward` is what the fuzzer runs
on each result besides the fingerprint (a forward pass on a fixed input for module trees,
encodings of generated texts for tokenizers); :data:`NAMED` are the hand-written specs of
the differences the fuzzer found (run by a plain parametrized test).

Everything a spec can name that pickle must find by name (hooks, parametrizations,
classes with ``__slots__``, custom ``__getstate__``/``__reduce__``) is defined here, at
module level.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import hashlib
import json
from typing import Any

import numpy
import torch
from hypothesis import strategies as st
from torch import nn

# -- what specs can name -----------------------------------------------------------------

#: Every dtype torch has (those it can make on the CPU).
DTYPES = ("float16", "float32", "float64", "bfloat16", "float8_e4m3fn", "float8_e5m2",
          "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2",
          "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool",
          "complex32", "complex64", "complex128")
FLOATS = ("float16", "float32", "float64", "bfloat16", "complex64", "complex128")
LAYER_DTYPES = ("float32", "float32", "float64", "bfloat16", "float16")
SPARSE_DTYPES = ("float32", "float64", "int64", "complex64")
QDTYPES = ("quint8", "qint8", "qint32")
#: Module-level functions hooks and parametrizations are made of.
#: ("generator", a torch.Generator attribute, is left out of the draws: its rebuild fails,
#: see the named case "torch.Generator attribute, hooks".)
MISC = ("dtype", "device", "partial", "lambda", "sets", "ordered", "namedtuple",
        "dataclass", "memoryview_dtype")
HOOKS = ("double_out", "shift_in", "kw_out", "kw_pre", "noop_out", "noop_pre", "half_out")


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)  # type: ignore[no-any-return]


def _grad_ok(name: str) -> bool:
    return name in FLOATS or name == "complex32"


def double_out(module: nn.Module, args: Any, out: Any) -> Any:
    return out * 2


def half_out(module: nn.Module, args: Any, out: Any) -> Any:
    return out / 2


def noop_out(module: nn.Module, args: Any, out: Any) -> None:
    return None


def shift_in(module: nn.Module, args: Any) -> Any:
    return (args[0] + 1, *args[1:])


def noop_pre(module: nn.Module, args: Any) -> None:
    return None


def kw_out(module: nn.Module, args: Any, kwargs: Any, out: Any) -> Any:
    return out - 0.25


def kw_pre(module: nn.Module, args: Any, kwargs: Any) -> Any:
    return (args[0] * 0.5, *args[1:]), kwargs


def scale_out(factor: float, module: nn.Module, args: Any, out: Any) -> Any:
    return out * factor


def grad_hook(grad: torch.Tensor) -> torch.Tensor:
    """A tensor hook (``register_hook``)."""
    return grad * 2


def accumulated(param: torch.Tensor) -> None:
    """A post-accumulate-grad hook."""


#: State outside every result: a built object may refer to it (``where: outside``), and is then
#: not cached (a rebuild would be a copy). Never changed.
REGISTRY: dict[str, Any] = {"scale": 2.0, "names": ["a", "b"]}
HISTORY: list[int] = [1, 2, 3]
TABLE = torch.arange(4.0)
ARRAY = numpy.arange(6.0)
OUTSIDE = {"dict": "REGISTRY", "list": "HISTORY", "tensor": "TABLE", "array": "ARRAY"}
#: Read by ``ReadsGlobal.forward`` (the result holds only the key). Never changed.
GAINS: dict[str, float] = {"a": 0.5, "b": 1.5, "c": -1.0}
OFFSET = 0.25


class ReadsGlobal(nn.Module):
    """A module whose forward reads module-level globals (``bake``: its gain read at build)."""

    def __init__(self, key: str, bake: bool) -> None:
        super().__init__()
        self.key = key
        self.gain = GAINS[key] if bake else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (GAINS[self.key] if self.gain is None else self.gain) + OFFSET


class Scale(nn.Module):
    """A parametrization: the weight seen is twice the one stored."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class Chain(nn.Module):
    """Applies a ``ModuleList`` in order."""

    def __init__(self, items: list[nn.Module]) -> None:
        super().__init__()
        self.items = nn.ModuleList(items)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for item in self.items:
            x = _apply(item, x)
        return x


class Branch(nn.Module):
    """Sums the outputs of a ``ModuleDict``'s entries (in float32)."""

    def __init__(self, items: dict[str, nn.Module]) -> None:
        super().__init__()
        self.items = nn.ModuleDict(items)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        for item in self.items.values():
            out = out + _apply(item, x).float()
        return out


class SlotGain(nn.Module):
    """A module with a ``__slots__`` field (``Module.__getstate__`` knows only __dict__)."""

    __slots__ = ("gain",)

    def __init__(self, gain: float) -> None:
        super().__init__()
        self.gain = gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class CachedSum(nn.Module):
    """Custom ``__getstate__``/``__setstate__``: a derived tensor is dropped and remade."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("table", table)
        self.total = table.float().sum()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["total"] = None  # remade by __setstate__ (in its place: the order is kept)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.total = self.table.float().sum()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.total


class Slotted:
    """A plain object with ``__slots__`` (some may be left unset)."""

    __slots__ = ("a", "b", "__weakref__")


class WithState:
    """Custom ``__getstate__``/``__setstate__`` that renames what it saves."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.note = "made"

    def __getstate__(self) -> dict[str, Any]:
        return {"saved": self.value, "note": self.note}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.value = state["saved"]
        self.note = state["note"]


class WithReduce:
    """A custom ``__reduce__`` through a module-level function."""

    def __init__(self, value: Any, label: str) -> None:
        self.value = value
        self.label = label

    def __reduce__(self) -> Any:
        return (_make_with_reduce, (self.value, self.label))


def _make_with_reduce(value: Any, label: str) -> WithReduce:
    return WithReduce(value, label)


class FuzzNet(nn.Module):
    """The root of a module tree: ``body`` runs on the input, the rest is carried."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _apply(self.body, x)


def _apply(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``, with ``x`` cast to the dtype of the module's first parameter."""
    for p in module.parameters():
        if p.dtype.is_floating_point:
            x = x.to(p.dtype)
        break
    return module(x)  # type: ignore[no-any-return]


# -- build ---------------------------------------------------------------------------------

def build(spec: str) -> Any:
    """The object ``spec`` describes (deterministic; leaves the global generators as they were:
    only a module tree's ``rng`` draws from one, inside ``fork_rng``)."""
    data = json.loads(spec)
    gen = torch.Generator().manual_seed(int(data.get("seed", 0)))
    return _build(data, gen)


def _build(data: dict[str, Any], gen: torch.Generator) -> Any:
    kind = data["kind"]
    if kind == "bundle":  # several results in one container, maybe sharing tensors
        parts = [_build(part, gen) for part in data["parts"]]
        if data.get("share") and len(parts) > 1 and isinstance(parts[0], nn.Module):
            tensors = [*parts[0].parameters(), *parts[0].buffers()]
            if tensors:
                parts.append(tensors[0])
        if data.get("container") == "tuple":
            return tuple(parts)
        if data.get("container") == "list":
            return parts
        return {f"part{i}": part for i, part in enumerate(parts)}
    if kind == "module":
        return _module_tree(data, gen)
    if kind == "tokenizer":
        return _tokenizer(data)
    if kind == "config":
        return _config(data)
    raise ValueError(f"unknown kind {kind!r}")


def _values(shape: list[int], dtype: str, fill: str, gen: torch.Generator) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    dt = _dtype(dtype)
    if dtype == "bool":
        t = torch.randint(0, 2, (n,), generator=gen, dtype=torch.uint8).bool()
    elif fill == "bytes" or not (dt.is_floating_point or dt.is_complex) or dtype in (
            "float8_e8m0fnu", "float4_e2m1fn_x2", "complex32"):
        size = torch.empty(0, dtype=dt).element_size()
        raw = torch.randint(0, 256, (n * size,), generator=gen, dtype=torch.uint8)
        t = raw.view(dt) if n else torch.empty(0, dtype=dt)
    elif fill == "zeros":
        t = torch.zeros(n, dtype=dt)
    else:
        t = torch.randn(n, generator=gen, dtype=torch.float64)
        if fill == "special" and n:
            t[0] = float("nan")
            t[-1] = float("-inf")
        t = t.to(dt) if not dt.is_complex else torch.complex(t, t.flip(0)).to(dt)
    return t.reshape(shape)


def _tensor(ts: dict[str, Any], gen: torch.Generator, made: list[torch.Tensor]) -> torch.Tensor:
    shape = list(ts["shape"])
    layout = ts.get("layout", "dense")
    if ts.get("share") is not None and made:
        src = made[ts["share"] % len(made)]
        if src.layout is torch.strided and not src.is_quantized:
            return _shared(src, ts)
    if layout == "coo":
        dense = _values(shape, ts["dtype"], "randn", gen)
        dense = dense * (torch.rand(shape, generator=gen) > 0.5).to(dense.dtype)
        t = dense.to_sparse()
        if ts.get("uncoalesced"):
            idx, vals = t._indices(), t._values()
            t = torch.sparse_coo_tensor(torch.cat([idx, idx], 1), torch.cat([vals, vals]),
                                        shape)
        return t
    if layout == "csr":
        dense = _values(shape, ts["dtype"], "randn", gen)
        dense = dense * (torch.rand(shape, generator=gen) > 0.5).to(dense.dtype)
        return dense.to_sparse_csr()
    if layout in ("qt", "qc"):
        x = torch.randn(shape, generator=gen)
        qdtype = getattr(torch, ts["qdtype"])
        if layout == "qt":
            return torch.quantize_per_tensor(x, ts.get("scale", 0.1), ts.get("zero", 0), qdtype)
        axis = ts.get("axis", 0) % len(shape)
        scales = torch.rand(shape[axis], generator=gen, dtype=torch.float64) + 0.01
        zeros = torch.zeros(shape[axis], dtype=torch.int64)
        return torch.quantize_per_channel(x, scales, zeros, axis, qdtype)
    view = ts.get("view")
    fill = ts.get("fill", "randn")
    if view == "offset":
        k = ts.get("k", 3)
        n = 1
        for s in shape:
            n *= s
        base = _values([n + k + 2], ts["dtype"], fill, gen)
        t = base[k:k + n].view(shape)
    elif view == "expand" and shape:
        t = _values([1, *shape[1:]], ts["dtype"], fill, gen).expand(shape)
    elif view == "channels_last" and len(shape) == 4:
        t = _values(shape, ts["dtype"], fill, gen).contiguous(
            memory_format=torch.channels_last)
    elif view == "transpose" and len(shape) >= 2:
        t = _values(shape, ts["dtype"], fill, gen).transpose(0, 1)
    elif view == "conj" and ts["dtype"] in ("complex64", "complex128"):
        t = _values(shape, ts["dtype"], fill, gen).conj()
    elif view == "neg" and ts["dtype"] in ("complex64", "complex128"):
        t = torch._neg_view(_values(shape, ts["dtype"], fill, gen))
    else:
        t = _values(shape, ts["dtype"], fill, gen)
    return t


class Color(enum.Enum):
    RED = 1
    BLUE = 2


Pair = collections.namedtuple("Pair", ["left", "right"])


@dataclasses.dataclass
class Settings:
    scale: float
    tensor: Any = None
    names: list[str] = dataclasses.field(default_factory=list)


#: A lambda at module level: pickle cannot find it by name (dill takes it by value).
TWICE = lambda x: x * 2  # noqa: E731


def _misc(kind: str, t: torch.Tensor, gen: torch.Generator) -> Any:
    if kind == "dtype":
        return t.dtype
    if kind == "device":
        return torch.device("cpu")
    if kind == "generator":
        return torch.Generator().manual_seed(int(torch.randint(0, 99, (1,), generator=gen)))
    if kind == "partial":
        return functools.partial(scale_out, 0.25)
    if kind == "lambda":
        return TWICE
    if kind == "sets":
        return ({"b", "a"}, frozenset({3, 1}), b"\x00raw", bytearray(b"ab"))
    if kind == "ordered":
        return collections.OrderedDict([("z", t), ("a", 1)])
    if kind == "namedtuple":
        return Pair(t, Color.BLUE)
    if kind == "dataclass":
        return Settings(0.5, t, ["x"])
    if kind == "memoryview_dtype":
        return [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8]
    raise ValueError(f"unknown misc {kind!r}")


def _bytes_of(t: torch.Tensor) -> bytes:
    if t.layout is not torch.strided or t.is_quantized or not t.numel():
        return b"\x01\x02\x03"
    flat = t.detach().resolve_conj().resolve_neg().contiguous().view(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def _shared(src: torch.Tensor, ts: dict[str, Any]) -> torch.Tensor:
    """A new tensor over ``src``'s storage: at an offset, or its bytes as uint8."""
    storage = src.untyped_storage()
    if ts.get("reinterpret") or src.dtype in (torch.float4_e2m1fn_x2,):
        return torch.empty(0, dtype=torch.uint8).set_(storage)
    elems = storage.nbytes() // src.element_size()
    offset = min(ts.get("k", 1), elems)
    return torch.empty(0, dtype=src.dtype).set_(storage, offset, (elems - offset,), (1,))


def _with_flags(t: torch.Tensor, ts: dict[str, Any]) -> torch.Tensor:
    if ts.get("rg") and _grad_ok(str(t.dtype).removeprefix("torch.")) and not t.is_quantized:
        t = t.detach().requires_grad_(True)
    if ts.get("attr"):
        t.tag = ts["attr"]  # type: ignore[attr-defined]
    return t


def _param(t: torch.Tensor, ts: dict[str, Any], gen: torch.Generator) -> nn.Parameter:
    rg = bool(ts.get("rg")) and _grad_ok(str(t.dtype).removeprefix("torch.")) \
        and not t.is_quantized
    p = nn.Parameter(t.detach(), requires_grad=rg)
    if ts.get("grad") and rg and t.layout is torch.strided:
        p.grad = _values(list(t.shape), str(t.dtype).removeprefix("torch."), "randn", gen)
    if ts.get("attr"):
        p.tag = ts["attr"]  # type: ignore[attr-defined]
    return p


def _layer(ls: dict[str, Any], dim: int, gen: torch.Generator) -> nn.Module:
    t = ls["t"]
    module: nn.Module
    if t == "linear":
        dtype = _dtype(ls.get("dtype", "float32"))
        lin = nn.utils.skip_init(nn.Linear, dim, dim, bias=ls.get("bias", True), dtype=dtype)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(dim, dim, generator=gen) / dim ** 0.5)
            if lin.bias is not None:
                lin.bias.copy_(torch.randn(dim, generator=gen))
        pz = ls.get("pz")
        if pz == "weight_norm":
            nn.utils.parametrizations.weight_norm(lin)
        elif pz == "orthogonal":
            nn.utils.parametrizations.orthogonal(lin)
        elif pz == "scale":
            nn.utils.parametrize.register_parametrization(lin, "weight", Scale())
        elif pz == "old_weight_norm":  # the deprecated kind: a pre-hook object, no class
            nn.utils.weight_norm(lin)
        if ls.get("frozen"):
            lin.requires_grad_(False)
        module = lin
    elif t == "act":
        module = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU, "sigmoid": nn.Sigmoid,
                  "identity": nn.Identity}[ls.get("fn", "relu")]()
    elif t == "norm":
        module = nn.LayerNorm(dim, elementwise_affine=ls.get("affine", True))
        if ls.get("affine", True):
            with torch.no_grad():
                module.weight.copy_(torch.rand(dim, generator=gen) + 0.5)
    elif t == "seq":
        module = nn.Sequential(*[_layer(x, dim, gen) for x in ls["items"]])
    elif t == "chain":
        module = Chain([_layer(x, dim, gen) for x in ls["items"]])
    elif t == "branch":
        module = Branch({f"b{i}": _layer(x, dim, gen) for i, x in enumerate(ls["items"])})
    elif t == "slots":
        module = SlotGain(ls.get("gain", 1.5))
    elif t == "cached":
        module = CachedSum(torch.randn(dim, generator=gen))
    elif t == "gread":
        module = ReadsGlobal(ls.get("key", "a"), bool(ls.get("bake")))
    else:
        raise ValueError(f"unknown layer {t!r}")
    handles = []
    for hs in ls.get("hooks", []):
        handles.append(_hook(module, hs))
    for i, h in enumerate(handles):
        if ls.get("remove") == i:
            h.remove()
        elif ls.get("keep_handle") == i:
            module.handle = h  # type: ignore[assignment]
    thook = ls.get("thook")
    first = next(module.parameters(recurse=False), None)
    if thook and first is not None and first.requires_grad:
        if thook == "grad":
            first.register_hook(grad_hook)
        else:
            first.register_post_accumulate_grad_hook(accumulated)
    if ls.get("eval"):
        module.eval()
    if ls.get("compile"):
        module.compile(backend="eager")
    return module


def _hook(module: nn.Module, hs: dict[str, Any]) -> Any:
    name = hs["fn"]
    if name in ("kw_out", "kw_pre"):
        fn = globals()[name]
        if name == "kw_out":
            return module.register_forward_hook(fn, with_kwargs=True,
                                                 prepend=hs.get("prepend", False),
                                                 always_call=hs.get("always", False))
        return module.register_forward_pre_hook(fn, with_kwargs=True,
                                                prepend=hs.get("prepend", False))
    if name in ("shift_in", "noop_pre"):
        return module.register_forward_pre_hook(globals()[name],
                                                prepend=hs.get("prepend", False))
    fn = globals()[name] if name != "half_out" or not hs.get("partial") else \
        functools.partial(scale_out, 0.5)
    return module.register_forward_hook(fn, prepend=hs.get("prepend", False),
                                        always_call=hs.get("always", False))


def _module_tree(data: dict[str, Any], gen: torch.Generator) -> nn.Module:
    dim = int(data.get("dim", 4))
    net = FuzzNet()
    for i, ls in enumerate(data.get("body", [])):
        net.body.add_module(str(i), _layer(ls, dim, gen))
    made: list[torch.Tensor] = []
    holders: dict[str, Any] = {}
    for i, item in enumerate(data.get("extras", [])):
        ts = item["tensor"]
        where = item["where"]
        name = f"x{i}"
        if item.get("tie") is not None and made:
            t = made[item["tie"] % len(made)]
            if where in ("plist", "pdict") and not isinstance(t, nn.Parameter):
                t = nn.Parameter(t.detach(), requires_grad=False)  # over the same storage
        else:
            t = _tensor(ts, gen, made)
            t = _param(t, ts, gen) if where in ("param", "plist", "pdict") else \
                _with_flags(t, ts)
        made.append(t)
        if where == "param":
            if isinstance(t, nn.Parameter):
                net.register_parameter(name, t)
            else:
                setattr(net, name, t)
        elif where == "buffer":
            net.register_buffer(name, t, persistent=item.get("persistent", True))
        elif where in ("plist", "pdict"):
            if where not in holders:
                holders[where] = nn.ParameterList() if where == "plist" else nn.ParameterDict()
                setattr(net, f"p_{where}", holders[where])
            if where == "plist":
                holders[where].append(t)
            else:
                holders[where][name] = t
        elif where == "attr":
            setattr(net, name, t)
        elif where == "list":
            holders.setdefault("list", [])
            if not hasattr(net, "things"):
                net.things = holders["list"]  # type: ignore[assignment]
            holders["list"].append(t)
        elif where == "slotted":
            obj = Slotted()
            obj.a = t
            if item.get("both"):
                obj.b = (t, i)
            setattr(net, name, obj)
        elif where == "state":
            setattr(net, name, WithState(t))
        elif where == "reduce":
            setattr(net, name, WithReduce(t, name))
        elif where == "sub":
            sub = nn.Module()
            sub.register_buffer("value", t, persistent=item.get("persistent", True))
            net.add_module(name, sub)
        elif where == "misc":  # other things a module carries
            setattr(net, name, _misc(item["misc"], t, gen))
        elif where == "twin":  # one submodule at two places
            if len(net.body):
                net.add_module(name, net.body[len(net.body) - 1])
        elif where == "cycle":  # a reference back to the root, not registered
            object.__setattr__(net, name, net)
        elif where == "outside":  # a global of this module, maybe in a list
            value = globals()[OUTSIDE[item.get("ref", "dict")]]
            setattr(net, name, [value] if item.get("nested") else value)
        elif where == "from_numpy":  # a tensor and a numpy array over the same memory
            made[-1] = _over_numpy(net, name, item, gen)
        elif where == "numpy":  # an array of the tensor's bytes (large ones out of band)
            reps = int(item.get("repeat", 1))
            raw = numpy.frombuffer(_bytes_of(t) * reps, dtype=numpy.uint8)
            setattr(net, name, raw if not item.get("strided") else raw[::2])
        else:
            raise ValueError(f"unknown place {where!r}")
    if data.get("rng"):
        with torch.random.fork_rng(devices=[]):  # the global generator, put back after
            if data["rng"] == "seeded":
                torch.manual_seed(int(data.get("seed", 0)))
                net.register_buffer("drawn", torch.randn(dim))
            else:
                torch.rand(1)  # drawn, unused, and put back
    if not data.get("training", True):
        net.eval()
    return net


def _over_numpy(net: nn.Module, name: str, item: dict[str, Any],
                gen: torch.Generator) -> torch.Tensor:
    """``torch.from_numpy`` of a new array, or ``Tensor.numpy()`` of a new tensor; the array kept
    beside the tensor (whole or a view) or not."""
    shape = list(item.get("shape", item["tensor"]["shape"]))
    if item.get("mode") == "to_numpy":
        t = _values(shape, "float32", "randn", gen)
        array = t.numpy()
    else:
        array = _values(shape, "float32", "randn", gen).numpy().copy()
        t = torch.from_numpy(array)
    if item.get("buffer"):
        net.register_buffer(name, t)
    else:
        setattr(net, name, t)
    keep = item.get("keep")
    if keep:
        setattr(net, f"{name}_array", array if keep == "whole" or not array.size
                else array.reshape(-1)[1:])
    return t


def must_be_uncached(spec: str) -> str | None:
    """Why the cache must refuse ``spec``'s load where the fingerprint cannot tell (a draw from
    the global generator that ``fork_rng`` puts back: the result is deterministic), or None."""
    data = json.loads(spec)
    parts = data.get("parts", [data])
    if any(part.get("rng") for part in parts):
        return "it draws from the global generator (inside fork_rng)"
    return None


def shapes(spec: str) -> set[str]:
    """The shapes a pickle rebuild cannot carry that ``spec`` has, for the fuzzer's counts."""
    found = set()
    for key, name in (('"thook"', "tensor hook"), ('"compile"', "compiled"),
                      ('"outside"', "outside"), ('"from_numpy"', "over numpy"),
                      ('"rng"', "fork_rng"), ('"gread"', "reads globals")):
        if key in spec:
            found.add(name)
    return found


def _tokenizer(data: dict[str, Any]) -> Any:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words: list[str] = data["words"]
    model_kind = data["model"]
    opts = data.get("opts", {})
    if model_kind == "bpe":
        vocab: dict[str, int] = {}
        for piece in ["[UNK]", *sorted({c for w in words for c in w})]:
            vocab.setdefault(piece, len(vocab))
        prefix = opts.get("continuing_subword_prefix") or ""
        merges: list[tuple[str, str]] = []
        for w in words:
            cur = w[0]
            for c in w[1:]:
                vocab.setdefault(prefix + c, len(vocab))
                if cur + c not in vocab:  # (with a prefix, the library panics on others)
                    merges.append((cur, prefix + c))
                    vocab[cur + c] = len(vocab)
                cur = cur + c
        # An option left out is null in the model (the library's own default: the
        # constructor refuses an explicit None for some of them).
        model = models.BPE(vocab, merges, **{k: v for k, v in opts.items() if v is not None})
    elif model_kind == "wordpiece":
        vocab = {"[UNK]": 0}
        for w in words:
            vocab.setdefault(w, len(vocab))
            for c in w:
                vocab.setdefault(c, len(vocab))
                vocab.setdefault("##" + c, len(vocab))
        model = models.WordPiece(vocab, unk_token="[UNK]",
                                 max_input_chars_per_word=opts.get("max_chars", 100))
    else:
        pieces: list[tuple[str, float]] = [("<unk>", 0.0)]
        seen = {"<unk>"}
        for i, piece in enumerate([*words, *sorted({c for w in words for c in w})]):
            if piece not in seen:
                seen.add(piece)
                pieces.append((piece, -1.0 - i * 0.25))
        model = models.Unigram(pieces, unk_id=0 if opts.get("unk", True) else None,
                               byte_fallback=opts.get("byte_fallback", False))
    tok = Tokenizer(model)
    if data.get("pre", "whitespace") == "whitespace":
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
    elif data.get("pre") == "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    for a in data.get("added", []):
        token = AddedToken(a["content"], special=a.get("special", False),
                           single_word=a.get("single_word", False),
                           normalized=a.get("normalized", not a.get("special", False)))
        if a.get("special"):
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
    if data.get("wrap"):
        from transformers import PreTrainedTokenizerFast

        wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, **data.get("wrap_kwargs", {}))
        extra = data.get("extra_special")
        if extra:
            wrapped.add_special_tokens({"additional_special_tokens": extra})
        for name, value in data.get("wrap_attrs", {}).items():
            setattr(wrapped, name, value)
        return wrapped
    return tok


def _config(data: dict[str, Any]) -> Any:
    from transformers import LlamaConfig, PretrainedConfig

    cls = LlamaConfig if data.get("cls") == "llama" else PretrainedConfig
    config = cls(**data.get("fields", {}))
    for name, value in data.get("private", {}).items():
        setattr(config, name, value)
    return config


# -- what the fuzzer runs on a result ---------------------------------------------------

def forward(obj: Any, spec: str) -> str:
    """A text of what the result computes: for a module tree, its output on a fixed
    input (dtype, shape and a digest of the bytes) or the exception's type; for a
    tokenizer, the ids of the spec's texts; for a config, its ``to_dict``."""
    return _forward(obj, json.loads(spec))


def _forward(obj: Any, data: dict[str, Any]) -> str:
    try:
        if data["kind"] == "bundle":
            items = list(obj.values()) if isinstance(obj, dict) else list(obj)
            return json.dumps([_forward(o, d) for o, d in zip(items, data["parts"],
                                                               strict=False)])
        if data["kind"] == "module":
            dim = int(data.get("dim", 4))
            x = torch.linspace(-1, 1, 2 * dim, dtype=torch.float32).reshape(2, dim)
            with torch.no_grad():
                out = obj(x)
            return _tensor_text(out)
        if data["kind"] == "tokenizer":
            ids = []
            for text in data.get("texts", []):
                enc = obj.encode(text)
                ids.append(list(getattr(enc, "ids", enc)))
            return json.dumps(ids)
        return _digest(json.dumps(obj.to_dict(), sort_keys=True, default=repr))
    except Exception as exc:  # noqa: BLE001 - compared by type
        return f"raises {type(exc).__name__}"


def _tensor_text(t: Any) -> str:
    if not isinstance(t, torch.Tensor):
        return f"{type(t).__name__} {t!r}"
    raw = t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes() \
        if t.numel() else b""
    return f"{t.dtype} {list(t.shape)} {_digest(raw)}"


def _digest(data: Any) -> str:
    if isinstance(data, str):
        data = data.encode()
    return hashlib.sha256(data).hexdigest()[:16]


# -- strategies ----------------------------------------------------------------------------

def _shapes(max_dims: int = 4) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, 4), min_size=0, max_size=max_dims)


@st.composite
def tensor_specs(draw: st.DrawFn, param: bool = False) -> dict[str, Any]:
    layout = draw(st.sampled_from(("dense",) * 8 + ("coo", "csr", "qt", "qc")))
    ts: dict[str, Any] = {"layout": layout}
    if layout in ("coo", "csr"):
        ts["dtype"] = draw(st.sampled_from(SPARSE_DTYPES))
        ts["shape"] = [draw(st.integers(1, 4)), draw(st.integers(1, 4))]
        if layout == "coo" and draw(st.booleans()):
            ts["uncoalesced"] = True
    elif layout in ("qt", "qc"):
        ts["dtype"] = "float32"
        ts["qdtype"] = draw(st.sampled_from(QDTYPES if layout == "qt" else QDTYPES[:2]))
        ts["shape"] = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
        if layout == "qt":
            ts["scale"] = draw(st.sampled_from((0.1, 0.05, 1.0)))
            ts["zero"] = draw(st.integers(0, 3)) if ts["qdtype"] != "qint8" else 0
        else:
            ts["axis"] = draw(st.integers(0, 2))
    else:
        ts["dtype"] = draw(st.sampled_from(DTYPES))
        ts["shape"] = draw(_shapes())
        ts["fill"] = draw(st.sampled_from(("randn", "randn", "bytes", "zeros", "special")))
        view = draw(st.sampled_from((None, None, None, "offset", "expand", "channels_last",
                                     "transpose", "conj", "neg")))
        if view == "channels_last" and len(ts["shape"]) != 4:
            ts["shape"] = draw(st.lists(st.integers(1, 3), min_size=4, max_size=4))
        if view is not None:
            ts["view"] = view
        if view == "offset":
            ts["k"] = draw(st.integers(1, 17))
        if draw(st.integers(0, 5)) == 0:
            ts["share"] = draw(st.integers(0, 20))
            ts["k"] = draw(st.integers(0, 9))
            ts["reinterpret"] = draw(st.booleans())
    ts["rg"] = draw(st.booleans())
    if param and draw(st.booleans()):
        ts["grad"] = True
    if draw(st.integers(0, 4)) == 0:
        ts["attr"] = draw(st.sampled_from(("tag", "meta:1")))
    return ts


@st.composite
def extras(draw: st.DrawFn) -> dict[str, Any]:
    where = draw(st.sampled_from(("param", "buffer", "buffer", "plist", "pdict", "attr",
                                  "list", "slotted", "state", "reduce", "sub", "numpy",
                                  "misc", "misc", "twin", "cycle", "outside", "from_numpy")))
    item: dict[str, Any] = {"where": where,
                            "tensor": draw(tensor_specs(where in ("param", "plist", "pdict")))}
    if where == "misc":
        item["misc"] = draw(st.sampled_from(MISC))
    if where == "numpy":
        item["repeat"] = draw(st.sampled_from((1, 1, 1000, 40000)))
        item["strided"] = draw(st.booleans())
    if where in ("buffer", "sub"):
        item["persistent"] = draw(st.booleans())
    if where == "slotted":
        item["both"] = draw(st.booleans())
    if where == "outside":
        item["ref"] = draw(st.sampled_from(tuple(OUTSIDE)))
        item["nested"] = draw(st.booleans())
    if where == "from_numpy":
        item["mode"] = draw(st.sampled_from(("from_numpy", "to_numpy")))
        item["keep"] = draw(st.sampled_from((None, "whole", "view")))
        item["buffer"] = draw(st.booleans())
        # (no empty arrays: see the named case "empty numpy array")
        item["shape"] = draw(st.lists(st.integers(1, 4), max_size=3))
    if draw(st.integers(0, 6)) == 0:
        item["tie"] = draw(st.integers(0, 20))
    return item


def hook_specs() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {"fn": st.sampled_from(HOOKS)},
        optional={"prepend": st.booleans(), "always": st.booleans(),
                  "partial": st.booleans()})


def layers(depth: int = 0) -> st.SearchStrategy[dict[str, Any]]:
    leaf = st.one_of(
        st.fixed_dictionaries(
            {"t": st.just("linear"), "dtype": st.sampled_from(LAYER_DTYPES),
             "bias": st.booleans()},
            optional={"pz": st.sampled_from(("weight_norm", "orthogonal", "scale",
                                             "old_weight_norm", "old_weight_norm")),
                      "frozen": st.booleans()}),
        st.fixed_dictionaries({"t": st.just("act"), "fn": st.sampled_from(
            ("relu", "tanh", "gelu", "sigmoid", "identity"))}),
        st.fixed_dictionaries({"t": st.just("norm"), "affine": st.booleans()}),
        st.fixed_dictionaries({"t": st.just("slots"), "gain": st.sampled_from((0.5, 1.5))}),
        st.just({"t": "cached"}),
        st.fixed_dictionaries({"t": st.just("gread"), "key": st.sampled_from(tuple(GAINS)),
                               "bake": st.booleans()}),
    )
    if depth >= 2:
        node = leaf
    else:
        inner = st.lists(st.deferred(lambda: layers(depth + 1)), min_size=1, max_size=3)
        node = st.one_of(leaf, leaf, st.fixed_dictionaries(
            {"t": st.sampled_from(("seq", "chain", "branch")), "items": inner}))

    @st.composite
    def decorated(draw: st.DrawFn) -> dict[str, Any]:
        ls = dict(draw(node))
        if draw(st.integers(0, 3)) == 0:
            ls["hooks"] = draw(st.lists(hook_specs(), min_size=1, max_size=3))
            if draw(st.booleans()):
                ls["remove"] = draw(st.integers(0, len(ls["hooks"]) - 1))
            if draw(st.booleans()):
                ls["keep_handle"] = draw(st.integers(0, len(ls["hooks"]) - 1))
        if draw(st.integers(0, 5)) == 0:
            ls["eval"] = True
        # Rare (such results are not cached); a value in the middle: hypothesis draws the
        # bounds far more often than their share.
        if draw(st.integers(0, 11)) == 5 and (
                ls["t"] == "linear" and not ls.get("frozen") or ls["t"] == "norm"
                and ls.get("affine")):
            ls["thook"] = draw(st.sampled_from(("grad", "post")))
        if draw(st.integers(0, 19)) == 7 and _compilable(ls):
            ls["compile"] = True
        return ls

    return decorated()


def _compilable(ls: dict[str, Any]) -> bool:
    """Layers whose forward never raises: a compiled one that raised could raise another type
    once dynamo gives up recompiling new instances and runs it eagerly."""
    return ls["t"] in ("act", "norm", "gread") or (
        ls["t"] == "linear" and ls.get("dtype") in ("float32", "float64"))


@st.composite
def module_specs(draw: st.DrawFn) -> dict[str, Any]:
    spec = {"kind": "module", "seed": draw(st.integers(0, 2 ** 16)),
            "dim": draw(st.integers(1, 6)),
            "body": draw(st.lists(layers(), min_size=0, max_size=4)),
            "extras": draw(st.lists(extras(), min_size=0, max_size=6)),
            "training": draw(st.booleans())}
    # (a value in the middle: hypothesis draws the bounds far more often than 1 in 20)
    if draw(st.integers(0, 19)) == 7:
        spec["rng"] = draw(st.sampled_from(("seeded", "unused")))
    return spec


_LETTERS = "abcdeéz"


@st.composite
def tokenizer_specs(draw: st.DrawFn) -> dict[str, Any]:
    words = draw(st.lists(st.text(_LETTERS, min_size=1, max_size=5), min_size=1, max_size=8,
                          unique=True))
    model = draw(st.sampled_from(("bpe", "wordpiece", "unigram")))
    opts: dict[str, Any] = {}
    if model == "bpe":
        opts["unk_token"] = draw(st.sampled_from((None, "[UNK]")))
        opts["continuing_subword_prefix"] = draw(st.sampled_from((None, "##")))
        opts["end_of_word_suffix"] = draw(st.sampled_from((None, "</w>")))
        opts["dropout"] = None
        opts["fuse_unk"] = draw(st.booleans())
        opts["byte_fallback"] = draw(st.booleans())
    elif model == "wordpiece":
        opts["max_chars"] = draw(st.sampled_from((100, 3)))
    else:
        opts["unk"] = draw(st.booleans())
        opts["byte_fallback"] = draw(st.booleans())
    added = []
    for content in draw(st.lists(st.sampled_from(
            ("<|im_start|>", "<|im_end|>", "<s>", "</s>", "[INST]", "xyz", "ab", "a",
             *words)), max_size=5, unique=True)):
        added.append({"content": content, "special": draw(st.booleans()),
                      "single_word": draw(st.booleans())})
    texts = draw(st.lists(st.text(_LETTERS + " <|>_mstar", max_size=20), min_size=1,
                          max_size=3))
    spec: dict[str, Any] = {"kind": "tokenizer", "model": model, "words": words, "opts": opts,
                            "added": added, "texts": texts,
                            "pre": draw(st.sampled_from(("whitespace", "bytelevel", "none")))}
    if draw(st.booleans()):
        spec["wrap"] = True
        wrap_kwargs = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            if draw(st.integers(0, 2)) == 0:
                wrap_kwargs[name] = draw(st.sampled_from(("<s>", "</s>", "[UNK]", "<pad>")))
        spec["wrap_kwargs"] = wrap_kwargs
        if draw(st.booleans()):
            spec["extra_special"] = draw(st.lists(st.sampled_from(
                ("<|im_start|>", "<extra_0>", "a", "[INST]")), max_size=2, unique=True))
        attrs: dict[str, Any] = {}
        if draw(st.booleans()):
            attrs["padding_side"] = draw(st.sampled_from(("left", "right")))
        if draw(st.booleans()):
            attrs["model_max_length"] = draw(st.sampled_from((16, 2048)))
        if draw(st.booleans()):
            attrs["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        spec["wrap_attrs"] = attrs
    return spec


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10 ** 6) | st.sampled_from((0.5, -1e-6, 3.0))
    | st.text("abcxyz_", max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.text("abcxyz", min_size=1, max_size=4), inner, max_size=3),
    max_leaves=6)


@st.composite
def config_specs(draw: st.DrawFn) -> dict[str, Any]:
    cls = draw(st.sampled_from(("llama", "pretrained")))
    fields: dict[str, Any] = {}
    if cls == "llama":
        heads = draw(st.sampled_from((1, 2, 4)))
        fields.update(vocab_size=draw(st.integers(8, 300)), hidden_size=heads * 8,
                      num_attention_heads=heads,
                      num_hidden_layers=draw(st.integers(1, 3)),
                      intermediate_size=draw(st.integers(4, 64)))
        if draw(st.booleans()):
            fields["tie_word_embeddings"] = draw(st.booleans())
        if draw(st.booleans()):
            fields["rms_norm_eps"] = draw(st.sampled_from((1e-5, 1e-6)))
        if draw(st.booleans()):
            fields["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    if draw(st.booleans()):
        fields["id2label"] = {str(i): f"L{i}" for i in range(draw(st.integers(1, 3)))}
    if draw(st.booleans()):
        fields["dtype"] = draw(st.sampled_from(("float16", "bfloat16", "float32")))
    if draw(st.booleans()):
        fields["architectures"] = ["LlamaForCausalLM"]
    for name in draw(st.lists(st.text("abcdxyz", min_size=1, max_size=5), max_size=4,
                              unique=True)):
        fields["f_" + name] = draw(_JSON_VALUES)
    private: dict[str, Any] = {}
    if draw(st.booleans()):
        private["_attn_implementation"] = draw(st.sampled_from(("eager", "sdpa")))
    if draw(st.booleans()):
        private["_fuzz_private"] = draw(_JSON_VALUES)
    return {"kind": "config", "cls": cls, "fields": fields, "private": private}


@st.composite
def bundle_specs(draw: st.DrawFn) -> dict[str, Any]:
    parts = [draw(module_specs())] + draw(st.lists(
        st.one_of(module_specs(), tokenizer_specs(), config_specs()), max_size=2))
    return {"kind": "bundle", "parts": parts, "share": draw(st.booleans()),
            "container": draw(st.sampled_from(("dict", "tuple", "list")))}


def specs() -> st.SearchStrategy[str]:
    """JSON texts of module trees (mostly), tokenizers, configs and bundles of them."""
    return st.one_of(module_specs(), module_specs(), module_specs(), tokenizer_specs(),
                     config_specs(), bundle_specs()).map(
        lambda d: json.dumps(d, sort_keys=True))


# -- named cases: the differences the fuzzer found, pinned down -----------------------------

def _spec(**data: Any) -> str:
    return json.dumps(data, sort_keys=True)


#: name -> spec (JSON text). Each is loaded plain, cold and warm by a parametrized test,
#: and all of them warm in one fresh process. Each comment says what differed.
NAMED: dict[str, str] = {
    # The key's source signature called Path.exists() on every text argument: a text of
    # 256+ characters raised OSError (ENAMETOOLONG) from load() where plain works.
    "long text argument": _spec(
        kind="tokenizer", model="bpe", words=["a"], added=[], texts=["", ""],
        pre="whitespace", opts={"byte_fallback": False, "continuing_subword_prefix": None,
                                "dropout": None, "end_of_word_suffix": None,
                                "fuse_unk": False, "unk_token": None}),
    # Module.__getstate__ returns __dict__ only: a module class's __slots__ value was lost
    # (warm: `body[0].gain: <unset slot> vs float 0.5`, and forward raised AttributeError).
    "module with __slots__": _spec(
        kind="module", seed=0, dim=1, body=[{"t": "slots", "gain": 0.5, "eval": True}],
        extras=[], training=False),
    # The background-store size check asked a sparse parameter for its storage:
    # NotImplementedError from load() (cold and warm), where plain works.
    "sparse parameter": _spec(
        kind="module", seed=1627, dim=2, body=[], training=True, extras=[
            {"where": "plist", "tensor": {"dtype": "int64", "layout": "coo", "rg": False,
                                          "shape": [1, 3]}}]),
    # torch's reduction of a sparse tensor drops requires_grad (`x0.value requires_grad:
    # False vs True`); and empty storages at one offset came back as one storage
    # (`x0.value.<values> storage: storage of x0.value.<indices> vs storage 0 bytes`).
    "sparse tensors requiring grad, empty": _spec(
        kind="module", seed=1627, dim=2, body=[], training=True, extras=[
            {"where": "reduce", "tensor": {"attr": "meta:1", "dtype": "float32",
                                           "layout": "coo", "rg": True, "shape": [1, 2]}},
            {"where": "attr", "tensor": {"dtype": "float32", "layout": "csr", "rg": True,
                                         "shape": [3, 2]}},
            {"where": "attr", "tensor": {"dtype": "float64", "layout": "coo", "rg": True,
                                         "shape": [3, 1], "uncoalesced": True}}]),
    # torch.nn.utils.weight_norm (the deprecated one) leaves `weight` a tensor with autograd
    # history; the rebuild made it a leaf (`body[0].weight is_leaf: True vs False`). Such
    # results are not cached now (a warning), and equal plain.
    "old weight_norm: a tensor with grad_fn": _spec(
        kind="module", seed=1230, dim=2, extras=[], training=True,
        body=[{"t": "linear", "dtype": "float16", "bias": False, "pz": "old_weight_norm"}]),
    # numpy pickles a non-contiguous array (a `[::2]` view) as a contiguous copy
    # (`x0: numpy.ndarray uint8 shape [1920000] strides [1] vs [2]`; also a 1-element one,
    # which numpy calls contiguous): pickled now as the bytes it spans and its strides.
    "strided numpy arrays": _spec(
        kind="module", seed=2435, dim=4, training=True, body=[{"t": "cached"}], extras=[
            {"where": "numpy", "repeat": 40000, "strided": True, "tensor": {
                "dtype": "float64", "fill": "randn", "layout": "dense", "rg": False,
                "shape": [1, 3, 4, 1]}},
            {"where": "numpy", "repeat": 1, "strided": True, "tensor": {
                "dtype": "float8_e4m3fn", "fill": "randn", "layout": "dense", "rg": True,
                "shape": [2]}},
            {"where": "numpy", "repeat": 3, "strided": False, "tensor": {
                "dtype": "int16", "fill": "bytes", "layout": "dense", "rg": False,
                "shape": [2, 3]}}]),
    # A parameter's `.grad` was dropped (torch's reductions drop it): first for every
    # parameter (`p_pdict.x0.grad: only in the plain result`), then, once the lean
    # reduction kept it, for conjugate and negative views, which torch's reduction takes.
    "parameters with grad": _spec(
        kind="module", seed=115, dim=3, body=[], training=True, extras=[
            {"where": "pdict", "tensor": {"dtype": "complex128", "fill": "randn",
                                          "grad": True, "layout": "dense", "rg": True,
                                          "shape": [1, 4, 4, 3], "view": "conj"}},
            {"where": "param", "tensor": {"dtype": "complex64", "fill": "randn",
                                          "grad": True, "layout": "dense", "rg": True,
                                          "shape": [2], "view": "neg"}},
            {"where": "plist", "tensor": {"dtype": "bfloat16", "fill": "special",
                                          "grad": True, "layout": "dense", "rg": True,
                                          "shape": [1, 4, 0, 2]}}]),
    # OPEN: a torch.Generator attribute: the rebuild fails (SystemError: "Generator.
    # __setstate__ returned a result with an exception set"), so the hit evicts the entry
    # and loads plainly (uncached, a warning); the partial rebuild had moved the hook
    # counter, so that plain load's hook ids differed (`body[0]._forward_hooks: keys
    # [3390] vs [3388]`): fixed in load.py (the counter is put back). The rebuild failure
    # itself is open (not understood); "generator" is left out of the draws meanwhile.
    "torch.Generator attribute, hooks": _spec(
        kind="module", seed=0, dim=1, training=False, body=[
            {"t": "act", "fn": "relu", "eval": True, "hooks": [{"fn": "double_out"}]},
            {"t": "linear", "dtype": "float32", "bias": False, "eval": True,
             "hooks": [{"fn": "double_out"}], "keep_handle": 0}],
        extras=[{"where": "param", "tensor": {"attr": "tag", "dtype": "float32",
                                              "layout": "coo", "rg": False, "shape": [1, 1]}},
                {"where": "misc", "misc": "generator", "tensor": {
                    "dtype": "float32", "layout": "coo", "rg": False, "shape": [1, 1]}}]),
    # OPEN: numpy gives an empty array zero strides (`numpy.zeros((2, 0, 3)).strides` is
    # (0, 0, 0); `Tensor.numpy()` of an empty tensor too, and `.copy()` keeps them); a rebuild
    # gives it C strides (`x0_array: numpy.ndarray float32 shape [0] strides [4] vs [0]`), as
    # numpy's own pickle does. Empty arrays are left out of the `from_numpy` draws meanwhile.
    "empty numpy array": _spec(
        kind="module", seed=0, dim=1, body=[], training=True, extras=[
            {"where": "from_numpy", "mode": "from_numpy", "keep": "whole", "buffer": False,
             "shape": [0], "tensor": {"dtype": "float32", "layout": "dense", "rg": False,
                                      "shape": [0]}},
            {"where": "from_numpy", "mode": "to_numpy", "keep": "whole", "buffer": True,
             "shape": [2, 0, 3], "tensor": {"dtype": "float32", "layout": "dense", "rg": False,
                                            "shape": [0]}}]),
    # Hook ids come from a process-wide counter: two plain loads differ in them
    # (`_forward_hooks: keys [6, 4] vs [14, 12]`); each load here starts from the plain
    # load's counter (Note [Hook ids in the fuzzer]), and a warm one must have its ids.
    "hooks, kept handle, removed hook": _spec(
        kind="module", seed=20000, dim=6, training=False, extras=[], body=[
            {"t": "cached", "eval": True},
            {"t": "cached", "eval": True, "hooks": [
                {"fn": "double_out"}, {"fn": "kw_pre"}, {"fn": "shift_in", "prepend": True},
                {"fn": "kw_out", "always": True}], "keep_handle": 0, "remove": 1}]),
}
