"""What a load does besides returning its result, which a hit must repeat: random draws (a load that
moved a generator is not cached: Note [Loads that draw random numbers] in ``load``), and warnings
and log records (:class:`Capture` records them in the cold call, :func:`replay` emits them on every
hit).
"""

from __future__ import annotations

import importlib
import logging
import random
import sys
import warnings
from types import TracebackType
from typing import Any

__all__ = ["Capture", "Observed", "snapshot", "changed", "restore", "replay"]

#: Library root loggers that do not propagate to the root logger (diffusers and transformers set
#: ``propagate = False``): records are taken from these and from root.
_LIBRARY_LOGGERS = ("diffusers", "transformers", "huggingface_hub", "accelerate")


# -- random generators ------------------------------------------------------------------
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
        return bool(a.shape == b.shape and (a == b).all())
    return bool(a == b)


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


# -- warnings and log records -----------------------------------------------------------
class Observed:
    """Warnings and log records of one load, JSON-able (stored with the entry)."""

    __slots__ = ("warnings", "logs")

    # Not a ``@dataclass``: Note [A first call's imports] in ``load.py``.
    def __init__(self, warnings: list[dict[str, Any]] | None = None,
                 logs: list[dict[str, Any]] | None = None) -> None:
        self.warnings: list[dict[str, Any]] = [] if warnings is None else warnings
        self.logs: list[dict[str, Any]] = [] if logs is None else logs

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Observed):
            return NotImplemented
        return (self.warnings, self.logs) == (other.warnings, other.logs)

    __hash__ = None  # type: ignore[assignment]  # mutable, as a dataclass's

    def __repr__(self) -> str:
        return f"Observed(warnings={self.warnings!r}, logs={self.logs!r})"

    def to_json(self) -> dict[str, Any]:
        return {"warnings": self.warnings, "logs": self.logs}

    @classmethod
    def from_json(cls, data: Any) -> Observed:
        if not isinstance(data, dict):
            return cls()
        return cls(list(data.get("warnings", [])), list(data.get("logs", [])))

    def messages(self) -> list[str]:
        """What a user saw, for comparisons: category or level, then the text."""
        return ([f"{w['category']}: {w['message']}" for w in self.warnings]
                + [f"{r['levelname']} {r['name']}: {r['msg']}" for r in self.logs])


class _Recorder(logging.Handler):
    """Appends each record once, as JSON, to ``out``.

    Note [Records seen by two loggers]: Attached to the root
    logger and the library roots, it sees a propagated record twice, told apart by identity. An
    ``id()`` is unique only among live objects, and the next record often reuses a freed one's
    address (diffusers' ERROR then WARNING: the second was dropped). ``seen`` keeps every record it
    names alive until the capture ends.
    """

    def __init__(self, out: list[dict[str, Any]]) -> None:
        super().__init__(logging.NOTSET)
        self.out = out
        self.seen: dict[int, logging.LogRecord] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if id(record) in self.seen:  # a record that propagated to a second logger we watch
            return
        self.seen[id(record)] = record  # Note [Records seen by two loggers]
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken log call is the library's to report
            msg = str(record.msg)
        self.out.append({"name": record.name, "levelno": record.levelno,
                         "levelname": record.levelname, "msg": msg,
                         "pathname": record.pathname, "lineno": record.lineno,
                         "funcName": record.funcName})


class Capture:
    """Record the warnings and log records of a call. Log records reach their handlers as usual;
    warnings are held and shown, through the filters in force, when it ends (also on raise).
    ``emit=False`` only records (verify mode's plain load: the hit already spoke)."""

    def __init__(self, *, emit: bool = True) -> None:
        self.emit = emit
        self._saved_handlers: list[list[logging.Handler]] = []
        self.observed = Observed()
        self._warnings: Any = None
        self._caught: list[warnings.WarningMessage] = []
        self._recorder = _Recorder(self.observed.logs)
        self._loggers = [logging.getLogger(), *map(logging.getLogger, _LIBRARY_LOGGERS)]

    def __enter__(self) -> Capture:
        for logger in self._loggers:
            if self.emit:
                logger.addHandler(self._recorder)
            else:
                self._saved_handlers.append(logger.handlers)
                logger.handlers = [self._recorder]
        self._warnings = warnings.catch_warnings(record=True)
        self._caught = self._warnings.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._warnings.__exit__(exc_type, exc, tb)
        for logger in self._loggers:
            if self.emit:
                logger.removeHandler(self._recorder)
        for logger, handlers in zip(self._loggers, self._saved_handlers, strict=False):
            logger.handlers = handlers
        for w in self._caught:
            self.observed.warnings.append({
                "category": f"{w.category.__module__}.{w.category.__qualname__}",
                "message": str(w.message), "filename": w.filename, "lineno": w.lineno})
            if self.emit:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def _category(name: str) -> type[Warning]:
    module, _, qual = name.rpartition(".")
    try:
        obj: Any = importlib.import_module(module) if module else None
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return UserWarning
    return obj if isinstance(obj, type) and issubclass(obj, Warning) else UserWarning


#: Per source file, ``warn_explicit``'s "once per location" registry: a warning replayed by every
#: hit shows as often as by repeated plain loads.
_registries: dict[str, dict[Any, Any]] = {}


def replay(observed: Observed) -> None:
    """Emit what the cold load emitted: its warnings, then its log records."""
    for w in observed.warnings:
        filename = str(w.get("filename", ""))
        warnings.warn_explicit(str(w["message"]), _category(str(w["category"])),
                               filename, int(w.get("lineno", 0)),
                               registry=_registries.setdefault(filename, {}))
    for r in observed.logs:
        record = logging.makeLogRecord({**r, "args": None})
        logging.getLogger(str(r["name"])).handle(record)
