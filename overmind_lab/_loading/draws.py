"""Random draws of a load, seen where they happen: a load that drew is not cached (Note [Loads
that draw random numbers] in ``load``; Note [Draws seen where they happen]).

:class:`Draws` sees them in every generator's state, before each set of it (a draw ``fork_rng``
puts back) and at the end; ``ops=True`` also in every torch op (a dispatch mode, also in the
load's thread pools). :func:`snapshot`, :func:`changed` and :func:`restore` are the generators'
state (verify mode loads plainly from the state the hit started from).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any

from overmind_lab._loading.wrapping import wrappers as _hooks

__all__ = ["Draws", "snapshot", "changed", "restore"]


def snapshot() -> dict[str, Any]:
    """The state of every generator a loader may draw from: ``random``, numpy's global one if
    imported, torch's CPU generator and every CUDA one where CUDA is initialised."""
    state: dict[str, Any] = {"random": random.getstate()}
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = np.random.get_state()
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch"] = torch.get_rng_state()
        if torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "shape") and hasattr(a, "dtype"):  # numpy arrays, torch tensors
        return a.shape == b.shape and _bytes(a) == _bytes(b)
    return bool(a == b)


def _bytes(array: Any) -> bytes:
    """The bytes of a CPU tensor or array, read without a torch op (a user's dispatch mode around
    the load sees only the load's ops)."""
    if hasattr(array, "data_ptr"):  # a generator's state: a contiguous CPU byte tensor
        import ctypes

        return ctypes.string_at(array.data_ptr(), array.nbytes) if array.nbytes else b""
    return bytes(array.tobytes())


def changed(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Names of the generators whose state differs (``["torch"]``); empty if none."""
    names = sorted(set(before) | set(after))
    return [n for n in names if n not in before or n not in after or not _same(before[n], after[n])]


def restore(state: dict[str, Any]) -> None:
    """Put every generator back into ``state`` (from :func:`snapshot`)."""
    random.setstate(state["random"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])
    torch = sys.modules.get("torch")
    if torch is not None and "torch" in state:
        torch.set_rng_state(state["torch"])
        if "cuda" in state:
            torch.cuda.set_rng_state_all(state["cuda"])


# Note [Draws seen where they happen]: a generator's state before and after a load misses a draw
# whose state was put back (``torch.random.fork_rng``: the weights follow the caller's seed, the
# stream does not move). Two ways to see it, both in ``Draws``:
# - Every state set while it is open (``torch.set_rng_state``, ``manual_seed``, ``seed``, their
#   ``torch.cuda`` forms, ``random.setstate``/``seed``, numpy's ``set_state``/``seed``; module
#   attributes, wrapped in every thread) first compares the generator with the state it had at the
#   start or after the previous set: a difference is a draw about to be hidden. Free where nothing
#   is set. Missed: a state put back by ``Generator.set_state`` on the default generator itself
#   (a C method: nothing to wrap), and a generator of the load's own seeded from the caller's seed.
# - ``ops=True``: a dispatch mode (every aten op of this thread, below autograd) notes each op
#   tagged ``nondeterministic_seeded`` or taking a ``Generator``, unless it drew nothing: a meta
#   tensor (diffusers' and transformers' modules are built on the meta device, their
#   ``kaiming_uniform_`` draws nothing), ``train=False``, ``dropout_p=0``. It also sees what the
#   setters miss. A dispatch mode is per thread: jobs submitted to any ``ThreadPoolExecutor``
#   while it is open (transformers 5 materialises tensors in one) run inside one too. It costs
#   ~4 us per op, every op, ~12 ops per tensor: +40% on a tiny UNet's cold load, +50-60% on an
#   SD 1.5 UNet's (8450 ops; its cold load maps the file: ~0.2 s), against a budget of 10%. So
#   it is off by default: for verify mode, tests, and loads one suspects.
# A function mode was measured too: 2.6x as many calls (properties, Python-level methods), a
# little cheaper in all, blind to C++-internal draws, no tags.
class Draws:
    """Random draws of the code run inside, seen where they happen (Note [Draws seen where they
    happen]): in the state of every generator at the end and before each set of it; with
    ``ops=True`` also in every torch op (slower).

    ``drawn`` (after exit) names the generators drawn from or reseeded, sorted: ``"torch"``
    (the CPU default generator), ``"cuda"`` (or another device type), ``"torch.Generator"`` (one
    passed explicitly), ``"random"``, ``"numpy"``; empty if none. Never raises of itself.

    >>> with Draws() as draws:                       # doctest: +SKIP
    ...     with torch.random.fork_rng():
    ...         torch.randn(3)
    >>> draws.drawn
    ['torch']
    """

    def __init__(self, *, ops: bool = False) -> None:
        self.ops = ops
        self.drawn: list[str] = []
        self.open = False
        self.seen: set[str] = set()  # filled by the dispatch modes and the setters, any thread
        self._before: dict[str, Any] = {}
        self._expected: dict[str, Any] = {}  # each generator's state at the start or last set
        self._mode: Any = None

    def __enter__(self) -> Draws:
        self._before = snapshot()
        self._expected = dict(self._before)
        self.open = True
        if self.ops and sys.modules.get("torch") is not None:
            import concurrent.futures.thread  # noqa: F401 - torch has: its pools get watched

            self._mode = _push((self,))
        _hooks.add("draws", self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.open = False
        _hooks.remove("draws", self)
        if self._mode is not None:
            _leave(self._mode)
            self._mode = None
        try:
            after = snapshot()
            for then in (self._before, self._expected):  # reseeded, or drawn since the last set
                self.seen |= {n for n in changed(then, after) if n in then and n in after}
        except Exception:  # noqa: BLE001 - a state that cannot be read: say so, not cached
            self.seen.add("random generators (unreadable state)")
        self.drawn = sorted(self.seen)

    def before_set(self, name: str, now: Any) -> None:
        expected = self._expected.get(name)
        if expected is not None and (now is None or not _same(expected, now)):
            self.seen.add(name)  # drawn since the start or the last set: about to be hidden

    def after_set(self, name: str, now: Any) -> None:
        if name in self._expected and now is not None:
            self._expected[name] = now


def _state_of(name: str) -> Any:
    """One generator's state, as :func:`snapshot` reads it; ``None`` if it cannot be read."""
    try:
        if name == "cuda":
            cuda = sys.modules["torch"].cuda
            return cuda.get_rng_state_all() if cuda.is_initialized() else None
        return snapshot().get(name)
    except Exception:  # noqa: BLE001 - unreadable: the caller counts it as moved
        return None


#: The functions that set a generator's state, by module: (module, attribute, generator).
_SETTERS = tuple(
    [(m, a, "random") for m in ("random",) for a in ("seed", "setstate")]
    + [("numpy.random", a, "numpy") for a in ("seed", "set_state")]
    + [(m, a, "torch") for m in ("torch", "torch.random")
       for a in ("manual_seed", "seed", "set_rng_state")]
    + [(m, a, "cuda") for m in ("torch.cuda", "torch.cuda.random")
       for a in ("manual_seed", "manual_seed_all", "seed", "seed_all", "set_rng_state",
                 "set_rng_state_all")])
_setter_wrappers: dict[tuple[str, str], Callable[..., Any]] = {}


def _setter(module: str, attribute: str, name: str) -> Callable[..., Any]:
    """The wrapper of one state setter (made once: ``_Hooks`` knows its own by identity)."""
    key = (module, attribute)
    wrapper = _setter_wrappers.get(key)
    if wrapper is None:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            draws = _hooks.open("draws")
            if draws:
                now = _state_of(name)
                for d in draws:
                    d.before_set(name, now)
            result = _hooks.original(sys.modules[module], attribute)(*args, **kwargs)
            if draws:
                now = _state_of(name)
                for d in draws:
                    d.after_set(name, now)
            return result

        _setter_wrappers[key] = wrapper
    return wrapper


class _Op:
    """How to tell whether one call of a random op drew: where its telling arguments are, and
    their defaults (a call leaves out what it does not change)."""

    __slots__ = ("generator", "dropout_p", "train")

    def __init__(self, arguments: list[Any]) -> None:
        def where(name: str) -> tuple[int, str, Any] | None:
            for index, argument in enumerate(arguments):
                if argument.name == name:
                    default = (argument.default_value if argument.has_default_value()
                               else None)
                    return index, name, default
            return None

        self.generator = where("generator")
        self.dropout_p = where("dropout_p")
        self.train = where("train")


_NOT_RANDOM = object()
_OPS: dict[Any, Any] = {}  # op -> _Op, or _NOT_RANDOM
_mode_type: Any = None


def _classify(func: Any) -> Any:
    torch = sys.modules["torch"]
    schema = getattr(func, "_schema", None)
    kind: Any = _NOT_RANDOM
    if schema is not None:
        arguments = list(schema.arguments)
        seeded = torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
        if seeded or any("Generator" in str(a.type) for a in arguments):
            kind = _Op(arguments)
    _OPS[func] = kind
    return kind


def _value(where: tuple[int, str, Any] | None, args: tuple[Any, ...],
           kwargs: dict[str, Any]) -> Any:
    if where is None:
        return None
    index, name, default = where
    return args[index] if index < len(args) else kwargs.get(name, default)


def _first_tensor(values: Any, torch: Any) -> Any:
    for value in values if isinstance(values, (tuple, list)) else (values,):
        if isinstance(value, torch.Tensor):
            return value
    return None


def _drawn_from(op: _Op, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> str | None:
    """The generator one call of a random op drew from; ``None`` if it drew nothing."""
    torch = sys.modules["torch"]
    if _value(op.train, args, kwargs) is False or _value(op.dropout_p, args, kwargs) == 0:
        return None
    tensor = _first_tensor(out, torch)
    if tensor is None:
        tensor = _first_tensor(args, torch)
    device = tensor.device.type if tensor is not None else "cpu"
    if device == "meta":
        return None
    generator = _value(op.generator, args, kwargs)
    if generator is not None and not _is_default(generator, torch):
        return "torch.Generator"
    return "torch" if device == "cpu" else device


def _is_default(generator: Any, torch: Any) -> bool:
    """Whether ``generator`` is its device's default one. The dispatcher hands over a new
    wrapper: told by the state (right after a draw, another generator's differs)."""
    device = generator.device
    if device.type == "cpu":
        default = torch.default_generator
    elif device.type == "cuda":
        default = torch.cuda.default_generators[device.index or 0]
    else:
        return True
    return _bytes(generator.get_state()) == _bytes(default.get_state())


def _mode_class() -> Any:
    """The dispatch mode's class, made on first use (this module does not import torch)."""
    global _mode_type
    if _mode_type is not None:
        return _mode_type
    from torch.utils._python_dispatch import TorchDispatchMode

    class DrawMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
        # Higher-order operators (``torch.cond``, checkpointing...) pass through: a mode without
        # this raises on them. Their bodies run below the mode: the generators' states see them.
        supports_higher_order_operators = True

        def __init__(self, owners: tuple[Draws, ...]) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self.owners = owners
            self.live = True

        @classmethod
        def ignore_compile_internals(cls) -> bool:  # torch.compile inside a load works as plain
            return True

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                               kwargs: dict[str, Any] | None = None) -> Any:
            out = func(*args, **kwargs) if kwargs else func(*args)
            if self.live:
                kind = _OPS.get(func)
                if kind is None:
                    kind = _classify(func)
                if kind is not _NOT_RANDOM:
                    self.note(kind, args, kwargs or {}, out)
            return out

        def note(self, op: _Op, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
            try:
                name = _drawn_from(op, args, kwargs, out)
            except Exception:  # noqa: BLE001 - cannot tell: count it (not cached is safe)
                name = "torch"
            if name is not None:
                for owner in self.owners:
                    owner.seen.add(name)

    _mode_type = DrawMode
    return DrawMode


def _push(owners: tuple[Draws, ...]) -> Any:
    """A dispatch mode reporting to ``owners``, pushed on this thread's stack; ``None`` if it
    cannot be. Pushed without the mode's ``__enter__``: that one also saves and restores torch's
    process-wide "in a mode" flags, which two threads leaving in another order than they came
    leave set for good (our mode tells ``torch.compile`` to ignore it anyway)."""
    try:
        from torch.utils._python_dispatch import _push_mode

        mode = _mode_class()(owners)
        _push_mode(mode)
    except Exception:  # noqa: BLE001 - no mode: the generators' states still see most
        return None
    return mode


def _leave(mode: Any) -> None:
    """Take ``mode`` off this thread's stack. Modes the code inside pushed over it and left
    there are lifted off and put back, in order; where that cannot be done (a mode of torch's
    own kind, keyed), ``mode`` stays, passing every op through."""
    mode.live = False
    try:
        from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode, _push_mode

        above: list[Any] = []
        top: Any = _get_current_dispatch_mode()
        while top is not None and top is not mode and not _keyed(top):
            above.append(_pop_mode())
            top = _get_current_dispatch_mode()
        try:
            if top is mode:
                _pop_mode()
        finally:
            for lifted in reversed(above):
                _push_mode(lifted)
    except Exception:  # noqa: BLE001 - an inert mode left behind costs time, nothing else
        pass


def _keyed(mode: Any) -> bool:
    return "_dispatch_key" in mode.__dict__ or "_mode_key" in mode.__dict__


def _watched_job(fn: Callable[..., Any], owners: tuple[Draws, ...]) -> Callable[..., Any]:
    """``fn`` run inside a dispatch mode that reports to ``owners`` while one is open."""

    def job(*args: Any, **kwargs: Any) -> Any:
        mode = _push(owners) if any(owner.open for owner in owners) else None
        try:
            return fn(*args, **kwargs)
        finally:
            if mode is not None:
                _leave(mode)

    return job


def _submit(self: Any, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``ThreadPoolExecutor.submit`` while a ``Draws`` is open: Note [Draws seen where they
    happen]."""
    draws = tuple(d for d in _hooks.open("draws") if d.ops)
    original = _hooks.original(sys.modules["concurrent.futures.thread"].ThreadPoolExecutor,
                               "submit")
    return original(self, _watched_job(fn, draws) if draws else fn, *args, **kwargs)


def _patches(draws: tuple[Draws, ...]) -> list[tuple[Any, str, Any]]:
    """The wrappers open ``Draws`` need (Note [Wrapped while watched] in ``wrapping``)."""
    patches: list[tuple[Any, str, Any]] = []
    pool = sys.modules.get("concurrent.futures.thread")
    if any(d.ops for d in draws) and pool is not None:
        patches.append((pool.ThreadPoolExecutor, "submit", _submit))
    for module, attribute, name in _SETTERS:
        owner = sys.modules.get(module)
        if owner is not None and callable(owner.__dict__.get(attribute)):
            patches.append((owner, attribute, _setter(module, attribute, name)))
    return patches


_hooks.provide("draws", _patches)
