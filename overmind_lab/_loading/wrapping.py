"""Functions of other modules wrapped while a watcher of a load is open: one registry for
``observe``'s captures and ``draws``' ``Draws``.

Note [Wrapped while watched]: a watcher (a ``Capture``, a ``Draws``) needs some library functions
wrapped while it is open, in every thread (``warnings.warn``, ``Logger.handle``, the generators'
state setters...). Each kind of watcher provides the wrappers it needs for the watchers of its
kind now open (``provide``); they are installed when the first opens and taken off after the last
closes. A function someone else wrapped over ours meanwhile stays as they left it: ours, inert
inside theirs, is never put back over theirs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Wrappers", "wrappers"]

Patch = tuple[Any, str, Any]  # (owner, attribute, wrapper)


class Wrappers:
    """The open watchers by kind, and the functions wrapped for them (Note [Wrapped while
    watched])."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.providers: dict[str, Callable[[tuple[Any, ...]], list[Patch]]] = {}
        self._open: dict[str, tuple[Any, ...]] = {}
        self.saved: dict[tuple[int, str], tuple[Any, str, Any, Any]] = {}
        self.local = threading.local()  # .warning: inside our warn (its display is recorded)

    def provide(self, kind: str, patches: Callable[[tuple[Any, ...]], list[Patch]]) -> None:
        """``patches(open watchers of kind)``: the wrappers they need."""
        self.providers[kind] = patches

    def open(self, kind: str) -> tuple[Any, ...]:
        return self._open.get(kind, ())

    def add(self, kind: str, watcher: Any) -> None:
        with self.lock:
            self._open[kind] = (*self.open(kind), watcher)
            self._install()

    def remove(self, kind: str, watcher: Any) -> None:
        with self.lock:
            self._open[kind] = tuple(w for w in self.open(kind) if w is not watcher)
            self._install()

    def _patches(self) -> list[Patch]:
        return [patch for kind, patches in self.providers.items() if self.open(kind)
                for patch in patches(self.open(kind))]

    def _install(self) -> None:
        wanted = {(id(owner), name): (owner, name, new) for owner, name, new in self._patches()}
        for key in list(self.saved):
            if key not in wanted:
                owner, name, new, old = self.saved.pop(key)
                if owner.__dict__.get(name) is new:  # else someone wrapped ours: leave both
                    setattr(owner, name, old)
        for key, (owner, name, new) in wanted.items():
            if key not in self.saved:
                self.saved[key] = (owner, name, new, owner.__dict__[name])
                setattr(owner, name, new)

    def original(self, owner: Any, name: str) -> Any:
        saved = self.saved.get((id(owner), name))
        return saved[3] if saved is not None else owner.__dict__[name]


wrappers = Wrappers()
