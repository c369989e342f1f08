"""What a load registers in the libraries' registries, which a hit must repeat.

Note [Registrations a load makes]: ``AutoModel...from_pretrained(..., trust_remote_code=True)``
registers the model's own classes: the config class under its ``model_type`` and the model class
under the config class in the Auto class's mapping (``_extra_content`` of transformers'
``_LazyConfigMapping`` and ``_LazyAutoMapping``), and sets ``_auto_class`` on both classes
(``register_for_auto_class``). A hit skips the load, so later ``AutoModel.from_config(m.config)``
would prompt for ``trust_remote_code`` and ``save_pretrained`` would leave out the model's code.
So :class:`Watch` compares every registry of the Auto modules before and after the cold load, and
:func:`replay` writes the same entries on each hit (and ``_auto_class`` on the classes whose value
the stored result names). A registration whose key or value is not a class, a function or a plain
value cannot be named across processes: the load is not cached.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from overmind_lab._errors import NotCacheable
from overmind_lab._loading import user_code

__all__ = ["Watch", "replay"]

_REGISTRY_MODULES = "transformers.models.auto."


#: Auto module name -> (the module, the globals of it that are registries): each module looked
#: into once, so a cold load's two snapshots allocate next to nothing (a large process's full
#: garbage collection, set off by allocations, cost a pipeline load 200 ms in one of two).
_known: dict[str, tuple[Any, tuple[str, ...]]] = {}


def _registries() -> dict[tuple[str, str], dict[Any, Any]]:
    """Every ``_extra_content`` dict of the Auto modules imported now: (module, global) -> it."""
    out: dict[tuple[str, str], dict[Any, Any]] = {}
    for name in [n for n in sys.modules if n.startswith(_REGISTRY_MODULES)]:
        module = sys.modules.get(name)
        if module is None:
            continue
        known = _known.get(name)
        if known is None or known[0] is not module:
            known = _known[name] = (module, tuple(
                attr for attr, value in list(vars(module).items())
                if isinstance(_extra_content(value), dict)))
        for attr in known[1]:
            extra = _extra_content(getattr(module, attr, None))
            if isinstance(extra, dict):
                out[(name, attr)] = extra
    return out


def _extra_content(value: Any) -> Any:
    state = getattr(value, "__dict__", None)
    return state.get("_extra_content") if isinstance(state, dict) else None


class Watch:
    """Records the registrations made while it is entered (``registered``, JSON-able)."""

    __slots__ = ("_before", "registered")

    def __init__(self) -> None:
        self._before: dict[tuple[str, str], dict[Any, Any]] = {}
        self.registered: list[list[Any]] = []

    def __enter__(self) -> Watch:
        self._before = {k: dict(v) for k, v in _registries().items()}
        return self

    def __exit__(self, *exc: object) -> None:
        made: list[list[Any]] = []
        for (module, attr), extra in _registries().items():
            old = self._before.get((module, attr), {})
            for key, value in list(extra.items()):
                if key in old and old[key] is value:
                    continue
                try:
                    made.append([module, attr, _encode(key), _encode(value)])
                except NotCacheable as exc_:
                    made.append([module, attr, None, str(exc_)])  # reported by ``record``
        self._before = {}
        self.registered = made

    def record(self, classes: Iterable[Any]) -> dict[str, list[list[Any]]]:
        """The effects to store: the registrations, and ``_auto_class`` of the result's classes.
        Raises :class:`NotCacheable` for a registration a hit cannot repeat."""
        for module, attr, key, value in self.registered:
            if key is None:
                raise NotCacheable(f"the load registers in {module}.{attr} what a hit cannot "
                                   f"register again: {value}")
        auto = [[user_code._name(c), vars(c)["_auto_class"]] for c in classes
                if isinstance(c, type) and isinstance(vars(c).get("_auto_class"), str)]
        out = {"registered": self.registered, "auto_class": auto}
        return {k: v for k, v in out.items() if v}


def _encode(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return {"seq": type(value).__name__, "items": [_encode(v) for v in value]}
    if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
        name = user_code._name(value)
        if "<locals>" not in name:
            return {"ref": name}
    raise NotCacheable(f"{value!r} is not a class, a function or a plain value")


def _decode(value: Any) -> Any:
    if isinstance(value, dict) and "ref" in value:
        found = user_code._resolve(value["ref"])
        if found is None:
            raise LookupError(f"{value['ref']} cannot be imported")
        return found
    if isinstance(value, dict) and "items" in value:
        items = [_decode(v) for v in value["items"]]
        return tuple(items) if value.get("seq") == "tuple" else items
    return value


def replay(stored: Any) -> None:
    """Make the registrations the cold load made (``Meta.effects``); raises if one cannot be made
    (the hit is then rebuilt as a plain load: Note [Never worse than plain] in ``load``)."""
    if not stored:
        return
    for module, attr, key, value in stored.get("registered", ()):
        if module not in sys.modules:
            __import__(module)
        extra = vars(getattr(sys.modules[module], attr))["_extra_content"]
        extra[_decode(key)] = _decode(value)
    for name, auto_class in stored.get("auto_class", ()):
        cls = user_code._resolve(name)
        if cls is None:
            raise LookupError(f"{name} cannot be imported")
        if vars(cls).get("_auto_class") != auto_class:
            cls._auto_class = auto_class
