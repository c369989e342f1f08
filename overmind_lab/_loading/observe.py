"""What a load says, which a hit must say again (random draws are ``draws``').

- Warnings and log records: :class:`Capture` records them at their source, whatever the filters
  and levels in force at the cold load, while the user sees exactly what a plain load shows;
  :func:`replay` emits them on every hit through the filters, once-registries and levels in force
  then (Note [Warnings replayed where they were raised], Note [Records below the level]).
"""

from __future__ import annotations

import importlib
import itertools
import logging
import os
import sys
import warnings
from types import FrameType, TracebackType
from typing import Any

from overmind_lab._loading.wrapping import wrappers as _hooks

__all__ = ["Capture", "Observed", "replay"]

#: Library root loggers that do not propagate to the root logger (diffusers and transformers set
#: ``propagate = False``): records are taken from loggers that reach these or root. Below their
#: level too: Note [Records below the level].
_LIBRARY_LOGGERS = ("diffusers", "transformers", "huggingface_hub", "accelerate")


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


# Note [Warnings replayed where they were raised]: ``warnings.warn`` keeps "once per location"
# in the ``__warningregistry__`` of the module it attributes the warning to (the frame at
# ``stacklevel``), and matches filters against that module's name. ``catch_warnings`` is no way
# to record: entering and leaving it invalidates every once-registry of the process (the filters'
# version), and it sees only what passes the filters and registries at the cold load. So while a
# ``Capture`` is open, ``warnings.warn`` and ``warn_explicit`` are wrapped: the wrapper finds the
# frame as ``warn`` does, records the warning with its module, and calls ``warn_explicit`` with
# the same module and registry ``warn`` would use: the user sees what a plain load shows, the
# registries stay those of plain Python. ``replay`` gives ``warn_explicit`` that module's registry
# (or, where it is not imported, one of our own per module) and name. Not recorded: what the load
# silences itself (a filter of its own that ignores or raises, a ``catch_warnings(record=True)``
# of its own). Warnings raised by C code (torch's ``TORCH_WARN``) or by ``from warnings import
# warn`` reach no wrapper: they are recorded when shown (``_showwarnmsg``), so only if the filters
# and registries let them through at the cold load.
#
# Note [Records below the level]: a record below its logger's effective level is never made
# (``Logger.isEnabledFor``): a cold load under ``transformers.logging.set_verbosity_error()``
# would record none of the warnings a plain load at the default level shows. While a ``Capture``
# is open, ``isEnabledFor`` says yes for the library loggers (``_LIBRARY_LOGGERS``) when
# ``Logger.warning`` and its kind ask (a library asking itself gets the true answer:
# transformers puts more in its load report at INFO), and ``Logger.handle`` records every record
# of a logger that reaches root or a library root, then passes it on only if the level in force
# let it through: the user's handlers see what a plain load shows. ``replay`` asks
# ``isEnabledFor`` at the hit before ``handle``. transformers' ``warning_once`` and ``info_once``
# (an ``lru_cache`` per logger and message) replay through themselves, so a hit and a plain load
# in one process say it once between them. Other loggers are recorded from their level up, as
# before: below it, every library's debug records would fill the entry.
_ONCE = ("warning_once", "info_once")


class Capture:
    """Record the warnings and log records of a call at their source (Note [Warnings replayed
    where they were raised], Note [Records below the level]). The user sees what a plain call
    shows, as it happens; ``emit=False`` only records (verify mode's plain load: the hit already
    spoke)."""

    def __init__(self, *, emit: bool = True) -> None:
        self.emit = emit
        self.observed = Observed()
        self._order = itertools.count()
        self._filters: list[Any] = []
        self._display: tuple[Any, Any] = (None, None)
        self._last = -1  # the order of the last item recorded

    def __enter__(self) -> Capture:
        self._filters = list(warnings.filters)
        self._display = _display()
        _hooks.add("capture", self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        _hooks.remove("capture", self)

    def silenced_by_the_load(self, text: str, category: type[Warning], module: str | None,
                             lineno: int) -> bool:
        """Whether the load itself hides this warning (Note [Warnings replayed where they were
        raised]): it displays elsewhere, or its own filter ignores or raises it."""
        if _display() != self._display:
            return True
        now = warnings.filters
        if module is None or now == self._filters:
            return False
        action = _action(now, text, category, module, lineno)
        return action in ("ignore", "error") and action != _action(
            self._filters, text, category, module, lineno)

    def note_warning(self, message: Any, category: type[Warning], filename: str, lineno: int,
                     module: str | None, *, registered: bool = True) -> None:
        text = str(message)
        if self.silenced_by_the_load(text, category, module, lineno):
            return
        item: dict[str, Any] = {
            "category": f"{category.__module__}.{category.__qualname__}", "message": text,
            "filename": filename, "lineno": lineno, "module": module}
        if not registered:  # ``warn_explicit`` without a registry: shown every time
            item["registry"] = False
        found = self.observed.warnings
        last = found[-1] if found else None
        if (last is not None and last["order"] == self._last
                and all(last[k] == v for k, v in item.items())):
            last["count"] = last.get("count", 1) + 1  # a warning in a loop: one item
            return
        self._last = item["order"] = next(self._order)
        found.append(item)

    def note_record(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken log call is the library's to report
            msg = str(record.msg)
        self._last = next(self._order)
        item = {"name": record.name, "levelno": record.levelno, "levelname": record.levelname,
                "msg": msg, "pathname": record.pathname, "lineno": record.lineno,
                "funcName": record.funcName, "order": self._last}
        if record.funcName in _ONCE and not record.args and isinstance(record.msg, str):
            item["once"] = record.funcName
        self.observed.logs.append(item)


def _display() -> tuple[Any, Any]:
    return (warnings.showwarning, getattr(warnings, "_showwarnmsg_impl", None))


def _action(filters: Any, text: str, category: type[Warning], module: str,
            lineno: int) -> str | None:
    """The action ``filters`` give a warning, as ``warn_explicit`` picks it."""
    try:
        for action, msg, cat, mod, line in filters:
            if ((msg is None or msg.match(text)) and issubclass(category, cat)
                    and (mod is None or mod.match(module)) and (line == 0 or lineno == line)):
                return str(action)
        return str(getattr(warnings, "defaultaction", "default"))
    except Exception:  # noqa: BLE001 - filters someone broke: warn_explicit will say so
        return None


def _is_internal(frame: FrameType) -> bool:
    filename = frame.f_code.co_filename
    return "importlib" in filename and "_bootstrap" in filename


def _next_external(frame: FrameType, skip: tuple[str, ...]) -> FrameType | None:
    found = frame.f_back
    while found is not None and (_is_internal(found)
                                 or (skip and found.f_code.co_filename.startswith(skip))):
        found = found.f_back
    return found


def _patches(captures: tuple[Capture, ...]) -> list[tuple[Any, str, Any]]:
    """The wrappers open ``Capture``s need (Note [Wrapped while watched] in ``wrapping``)."""
    return [(warnings, "warn", _warn), (warnings, "warn_explicit", _warn_explicit),
            (warnings, "_showwarnmsg", _showwarnmsg),
            (logging.Logger, "isEnabledFor", _is_enabled_for), (logging.Logger, "handle", _handle)]


_LOG_CODE = logging.Logger._log.__code__
#: ``Logger``'s own methods that ask ``isEnabledFor`` before making a record: asked by any other
#: caller (a library deciding what to compute), it answers as without a capture.
_LOGGING_CALLS = frozenset(getattr(logging.Logger, name).__code__ for name in (
    "debug", "info", "warning", "warn", "error", "exception", "critical", "fatal", "log")
    if hasattr(getattr(logging.Logger, name, None), "__code__"))


def _warn(message: Any, category: type[Warning] | None = None, stacklevel: int = 1,
          source: Any = None, *, skip_file_prefixes: tuple[str, ...] = ()) -> None:
    """``warnings.warn`` while a ``Capture`` is open: Note [Warnings replayed where they were
    raised]. Finds the frame as CPython's ``warn`` does (``Lib/warnings.py``)."""
    original = _hooks.original(warnings, "warn")
    if isinstance(message, Warning):
        category = message.__class__
    if category is None:
        category = UserWarning
    if (not (isinstance(category, type) and issubclass(category, Warning))
            or not isinstance(skip_file_prefixes, tuple)
            or (skip_file_prefixes and sys.version_info < (3, 12))):
        extra = {"skip_file_prefixes": skip_file_prefixes} if skip_file_prefixes else {}
        original(message, category, stacklevel, source, **extra)  # raises its TypeError
        return
    if skip_file_prefixes:
        stacklevel = max(2, stacklevel)
    frame: FrameType | None
    try:
        if stacklevel <= 1 or _is_internal(sys._getframe(1)):
            frame = sys._getframe(stacklevel)
        else:
            frame = sys._getframe(1)
            for _ in range(stacklevel - 1):
                frame = _next_external(frame, skip_file_prefixes)
                if frame is None:
                    raise ValueError
    except ValueError:
        globals_ = sys.__dict__
        filename, lineno = ("sys", 1) if sys.version_info < (3, 12) else ("<sys>", 0)
    else:
        globals_ = frame.f_globals
        filename, lineno = frame.f_code.co_filename, frame.f_lineno
    module = str(globals_.get("__name__", "<string>"))
    registry = globals_.setdefault("__warningregistry__", {})
    return _warn_explicit(message, category, filename, lineno, module, registry, None, source)


def _warn_explicit(message: Any, category: type[Warning], filename: str, lineno: int,
                   *args: Any, **kwargs: Any) -> None:
    """``warnings.warn_explicit`` while a ``Capture`` is open: records, then calls through
    (unless a capture only records) with the arguments as given (an explicit ``module=None``
    is not the default: CPython then shows nothing)."""
    captures = _hooks.open("capture")
    try:
        module = args[0] if args else kwargs.get("module")
        if module is None and not args and "module" not in kwargs:
            module = filename or "<unknown>"
            if module[-3:].lower() == ".py":
                module = module[:-3]
        registry = args[1] if len(args) > 1 else kwargs.get("registry")
        if module is not None:  # an explicit None shows nothing: nothing to record
            for capture in captures:
                capture.note_warning(message, category if not isinstance(message, Warning)
                                     else message.__class__, filename, int(lineno), str(module),
                                     registered=registry is not None)
    except Exception:  # noqa: BLE001 - recording is ours; the warning is the library's
        pass
    if any(not c.emit for c in captures):
        return
    original = _hooks.original(warnings, "warn_explicit")
    _hooks.local.warning = getattr(_hooks.local, "warning", 0) + 1
    try:
        original(message, category, filename, lineno, *args, **kwargs)
    finally:
        _hooks.local.warning -= 1


def _showwarnmsg(msg: warnings.WarningMessage) -> None:
    """``warnings._showwarnmsg`` while a ``Capture`` is open: records the warnings shown that
    came by no wrapper (C code, ``from warnings import warn``)."""
    captures = _hooks.open("capture")
    if not getattr(_hooks.local, "warning", 0):
        module = None
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:  # the frame the warning names: its module, as warn used
            if frame.f_code.co_filename == msg.filename and frame.f_lineno == msg.lineno:
                module = str(frame.f_globals.get("__name__", "<string>"))
                break
            frame = frame.f_back
        for capture in captures:
            capture.note_warning(msg.message, msg.category, msg.filename, msg.lineno, module)
        if any(not c.emit for c in captures):
            return
    _hooks.original(warnings, "_showwarnmsg")(msg)


def _in_library(name: str) -> bool:
    return any(name == lib or name.startswith(lib + ".") for lib in _LIBRARY_LOGGERS)


def _is_enabled_for(self: logging.Logger, level: int) -> bool:
    """``Logger.isEnabledFor`` while a ``Capture`` is open: Note [Records below the level]."""
    if (_hooks.open("capture") and sys._getframe(1).f_code in _LOGGING_CALLS
            and _in_library(self.name)):
        return True
    return _enabled(self, level)


def _enabled(logger: logging.Logger, level: int) -> bool:
    """``isEnabledFor`` as it is without a capture."""
    method = type(logger).isEnabledFor
    if method is _is_enabled_for:
        method = _hooks.original(logging.Logger, "isEnabledFor")
    return bool(method(logger, level))


def _reaches_watched(logger: logging.Logger) -> bool:
    current: Any = logger
    while current is not None:
        if current.name in _LIBRARY_LOGGERS or current.parent is None:
            return True
        if not current.propagate:
            return False
        current = current.parent
    return False


def _handle(self: logging.Logger, record: logging.LogRecord) -> None:
    """``Logger.handle`` while a ``Capture`` is open: Note [Records below the level]."""
    captures = _hooks.open("capture")
    original = _hooks.original(logging.Logger, "handle")
    if not captures:
        return original(self, record)  # type: ignore[no-any-return]
    if _reaches_watched(self):
        for capture in captures:
            capture.note_record(record)
        if any(not c.emit for c in captures):
            return None
    if (sys._getframe(1).f_code is _LOG_CODE
            and not _enabled(self, record.levelno)):
        return None  # made only for the capture: a plain load would not have made it
    return original(self, record)  # type: ignore[no-any-return]


# -- replay -----------------------------------------------------------------------------
def _category(name: str) -> type[Warning]:
    module, _, qual = name.rpartition(".")
    try:
        obj: Any = importlib.import_module(module) if module else None
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return UserWarning
    return obj if isinstance(obj, type) and issubclass(obj, Warning) else UserWarning


#: Once-per-location registries for warnings whose module is not imported at the hit (and for
#: entries recorded without their module), per module name or file.
_registries: dict[str, dict[Any, Any]] = {}


def _replay_warning(w: dict[str, Any]) -> None:
    filename = str(w.get("filename", ""))
    module = w.get("module")
    namespace = getattr(sys.modules.get(module), "__dict__", None) if module else None
    registry: dict[Any, Any] | None
    if w.get("registry") is False:
        registry = None
    elif isinstance(namespace, dict):  # the one ``warn`` would use: Note [Warnings replayed...]
        registry = namespace.setdefault("__warningregistry__", {})
    else:
        registry = _registries.setdefault(str(module or filename), {})
    # The unwrapped one: a capture open in another thread records its own load, not this hit.
    warn_explicit = _hooks.original(warnings, "warn_explicit")
    category = _category(str(w["category"]))
    where = {"module": module} if module is not None else {}  # None would silence it
    for _ in range(max(1, int(w.get("count", 1)))):
        warn_explicit(str(w["message"]), category, filename, int(w.get("lineno", 0)),
                      registry=registry, **where)


def _replay_record(r: dict[str, Any]) -> None:
    logger = logging.getLogger(str(r["name"]))
    levelno = int(r["levelno"])
    once = r.get("once")
    if once in _ONCE and callable(getattr(logger, once, None)):
        getattr(logger, once)(str(r["msg"]))  # its lru_cache: once per process, as plain
        return
    if not _enabled(logger, levelno):
        return
    pathname = str(r.get("pathname", ""))
    filename = os.path.basename(pathname)
    fields = {k: v for k, v in r.items() if k not in ("once", "order")}
    record = logging.makeLogRecord({**fields, "args": None, "filename": filename,
                                    "module": os.path.splitext(filename)[0]})
    handle = type(logger).handle
    if handle is _handle:  # the unwrapped one: a capture open in another thread is not ours
        handle = _hooks.original(logging.Logger, "handle")
    handle(logger, record)


def replay(observed: Observed) -> None:
    """Emit what the cold load emitted, in its order, through the filters, once-registries and
    levels in force now."""
    items: list[tuple[float, int, dict[str, Any]]] = []
    for kind, found in ((0, observed.warnings), (1, observed.logs)):
        for i, item in enumerate(found):  # entries recorded without "order": warnings first
            items.append((float(item.get("order", kind * 1e9 + i)), kind, item))
    for _, kind, item in sorted(items, key=lambda t: (t[0], t[1])):
        if kind == 0:
            _replay_warning(item)
        else:
            _replay_record(item)


_hooks.provide("capture", _patches)
