"""``load()``: a cached call, warm from shared memory when any process loaded it before.

The cold load runs here; its result is pickled with tensor bytes out of band into a segment the
daemon created (or left in the source file the entry links to), and the caller gets the loader's own
object (Note [Never worse than plain]); a large result is stored by a forked copy
(Note [Storing in a forked process]). A hit must be indistinguishable from the plain load: the key
covers every input (Note [What a warm hit skips] in ``keys``), loads that draw random numbers are
not cached, warnings and log records are replayed, the loader's exceptions carry none of ours
(Note [Clean exceptions]); verify mode checks every hit against a plain load.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, cast

from overmind_lab._common.trust import Untrusted
from overmind_lab._errors import (
    DaemonUnavailable,
    ErrorKind,
    NotAnswering,
    NotCacheable,
    OvermindError,
    OvermindWarning,
    VerifyMismatch,
)
from overmind_lab._loading import draws, effects, from_disk, manifest, observe, user_code
from overmind_lab._loading import keys as _keys
from overmind_lab._loading.client import Client, Session
from overmind_lab._loading.pickling import (
    WritePlan,
    dump,
    hook_counter,
    load_stream,
    set_hook_counter,
)
from overmind_lab._loading.segments import map_segment, prefault_behind, write_segment

if TYPE_CHECKING:
    from typing import TypedDict

    from typing_extensions import NotRequired

    from overmind_lab._common.messages import WireEntry
    from overmind_lab._loading import background

__all__ = ["load", "bypass", "refreshing", "verifying", "set_verify", "record_loads",
           "LoadEvent", "key_of", "loader_traceback"]

VERIFY_ENV = "OVERMIND_LAB_VERIFY"

T = TypeVar("T")
key_of = _keys.key_of


if TYPE_CHECKING:
    class Meta(TypedDict):
        """An entry's ``meta``: how to rebuild the result; the daemon never looks into it."""

        stream: list[int]  # segment index, offset and length of the pickle stream
        pickler: str  # "pickle" or "dill"
        buffers: list[tuple[int, int, int]]  # out-of-band buffers (lists once through JSON)
        observed: dict[str, Any]  # warnings and log records to replay (observe.Observed)
        #: the user's code in the result: "module:qualname" -> digest (``user_code.graph_code``)
        code: NotRequired[dict[str, str]]
        #: torch's hook counter before and after the load, if hooks (Note [Hook ids] in pickling)
        hooks: NotRequired[list[int]]
        #: what the load read and ran (Note [What a load depends on] in ``manifest``)
        deps: NotRequired[dict[str, list[list[Any]]]]
        #: registrations to repeat (Note [Registrations a load makes] in ``effects``)
        effects: NotRequired[dict[str, list[list[Any]]]]
else:
    # A ``TypedDict`` costs ~0.5 ms to define (``typing`` compiles every field's annotation into a
    # ``ForwardRef``), on a fresh process's first hit: Note [A first call's imports].
    Meta = dict


# Note [A first call's imports]: a fresh process's first ``load`` imports this module and what it
# imports (``import overmind_lab`` imports none of it), so their definitions are part of that call's
# cost: 6.5 ms of a 18.5 ms first warm UNet hit, against 8 ms for the same call repeated. The hit
# path therefore defines no ``@dataclass`` (~0.4 ms each: the decorator compiles its methods with
# ``exec``) and no ``TypedDict`` (its fields' annotations are compiled); its record classes are
# written out. What only a store needs (``sources``, ``background``) is imported where a store
# starts.
# ``test_a_first_warm_hit_imports_only_the_hit_path`` keeps both true.
class LoadEvent:
    """What one ``load()`` did. ``outcome`` is warm, cold, bypass, uncached or fallback."""

    # Written out, not a ``@dataclass``: Note [A first call's imports]. Same constructor,
    # equality and repr as the dataclass it was.
    __slots__ = __match_args__ = ("key", "name", "outcome", "seconds", "cold_seconds", "reason",
                                  "verified", "daemon_seconds")

    def __init__(self, key: str | None, name: str, outcome: str, seconds: float,
                 cold_seconds: float | None = None, reason: str | None = None,
                 verified: bool | None = None, daemon_seconds: float | None = None) -> None:
        self.key = key
        self.name = name
        self.outcome = outcome
        #: the load's own time (Note [What a load's times say]); ``daemon_seconds`` not included
        self.seconds = seconds
        #: the cold load's time as recorded with the entry: the loader, without storing
        self.cold_seconds = cold_seconds
        self.reason = reason
        self.verified = verified  # verify mode: the hit equalled a plain load (or not)
        #: starting the cache daemon, when this load had to (none was running)
        self.daemon_seconds = daemon_seconds

    def _fields(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f) for f in self.__slots__)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._fields() == other._fields()

    __hash__ = None  # type: ignore[assignment]  # mutable, as a dataclass's

    def __repr__(self) -> str:
        inner = ", ".join(f"{f}={getattr(self, f)!r}" for f in self.__slots__)
        return f"LoadEvent({inner})"

    def summary(self) -> str:
        """One human line, e.g. ``warm 0.05 s (cold load was 2.91 s, 58x)``."""
        if self.outcome == "warm":
            from overmind_lab._common.display import describe_load

            return describe_load(self, name=False)
        text = f"{self.outcome} {self.seconds:.2f} s"
        if self.reason:
            text += f" ({self.reason})"
        return text


class _State(threading.local):
    def __init__(self) -> None:
        self.depth = 0
        self.bypass = 0
        self.refresh = 0
        self.verify = 0
        self.recorders: list[list[LoadEvent]] = []
        self.daemon_seconds: float | None = None  # this load started the daemon: how long


_state = _State()
_warned: set[str] = set()
_verify_all = False


def set_verify(on: bool) -> None:
    """Verify every hit in this process (``patch_all(verify=True)`` calls this)."""
    global _verify_all
    _verify_all = on


def _verify_on() -> bool:
    env = os.environ.get(VERIFY_ENV, "").strip().lower()
    return bool(_state.verify or _verify_all or env not in ("", "0", "false", "no", "off"))


def _warn_once(tag: str, message: str) -> None:
    if tag not in _warned:
        _warned.add(tag)
        warnings.warn(f"overmind-lab: {message}", OvermindWarning, stacklevel=4)


@contextlib.contextmanager
def bypass() -> Iterator[None]:
    """Run loads inside uncached (for cold-vs-warm comparisons).

    >>> with overmind_lab.bypass():                      # doctest: +SKIP
    ...     unet = UNet2DConditionModel.from_pretrained(path)
    """
    _state.bypass += 1
    try:
        yield
    finally:
        _state.bypass -= 1


@contextlib.contextmanager
def refreshing() -> Iterator[None]:
    """Loads inside read the source again and replace their cache entries."""
    _state.refresh += 1
    try:
        yield
    finally:
        _state.refresh -= 1


@contextlib.contextmanager
def verifying() -> Iterator[None]:
    """Every hit inside is also loaded plainly and compared (see :func:`load`)."""
    _state.verify += 1
    try:
        yield
    finally:
        _state.verify -= 1


@contextlib.contextmanager
def record_loads() -> Iterator[list[LoadEvent]]:
    """Collect a :class:`LoadEvent` for every ``load()`` inside (this thread)."""
    events: list[LoadEvent] = []
    _state.recorders.append(events)
    try:
        yield events
    finally:
        # By identity: two recorders that are equal (both empty, say) are still two.
        _state.recorders[:] = [r for r in _state.recorders if r is not events]


def _emit(event: LoadEvent) -> None:
    if event.daemon_seconds is None:
        event.daemon_seconds = _state.daemon_seconds
    for events in _state.recorders:
        events.append(event)


# Note [The collector's schedule]: a fresh process whose first statement is ``import overmind_lab``
# (``%load_ext``) ran torch's and diffusers' imports (410 k objects the collector tracks) with a
# few thousand objects of ours more, and the collector's full collections fell elsewhere: one
# landed in the first load, in the model's ``__init__`` (230 ms against 50: ``gc.callbacks``
# showed 170 ms in one full collection of the imported modules' objects, which a plain process
# had paid during its imports). Whatever the order, a cold load is where a full collection of a
# large heap costs the user most. So the loader runs with the objects that were there before it
# frozen (``gc.freeze``: lists spliced, nothing walked): a collection during the load walks the
# load's own objects only; after it, ``gc.unfreeze`` gives the old ones back to the oldest
# generation, so the garbage among them is collected as it would have been (later, not never).
# A process that froze its own heap (a warm kernel: the zygote's ``gc.freeze``, or the user's)
# is left as it is: its frozen objects must stay out of every collection (copy-on-write), and
# the walk is short there anyway. ``tests/test_load.py`` checks both.
@contextlib.contextmanager
def _young_only() -> Iterator[None]:
    import gc

    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _plain(fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
    _state.depth += 1
    try:
        return fn(*args, **kwargs)
    finally:
        _state.depth -= 1


# Note [Tracebacks that show the user's code]: an exception of the loader (a typo'd path, a
# missing file, a wrong argument) reaches the user with the same type, message, attributes,
# ``__cause__`` and ``__context__`` as a plain call (Note [Clean exceptions]), and with the same
# frames: the user's line, then one frame of ours (the entry point they called: ``load`` or a
# patched ``from_pretrained``), then every frame of the loader. Without this, a typo'd path showed
# 7 of our frames above diffusers' own error. Each entry point catches what leaves it and asks
# ``loader_traceback``:
# - the exception came out of the loader if its traceback passes through ``_plain`` (the one place
#   a load calls the loader) or through an entry point that already cut it (its local
#   ``loader_frames`` is the rest of the traceback: a patched method calling ``load``); anything
#   else is an error of ours (a daemon we cannot start, ``MissingDependency``, a bug) and is
#   re-raised whole with a bare ``raise``: an internal error of the cache never reaches the user
#   from the loader's call anyway (Note [Never worse than plain]), and one that surfaces keeps
#   every frame;
# - the entry point re-raises it with the traceback below the loader call (``with_traceback``),
#   so Python adds back only the entry point's own frame. Frames between the two that are not
#   ours (a user's wrapper around ``overmind_lab.load``) are kept;
# - inside the loader's frames, ours that the exception only passed through are dropped (a nested
#   patched ``from_pretrained``: a pipeline loading its components; a wrapped ``Logger.handle``:
#   Note [Wrapped while watched] in ``wrapping``); one it was raised in stays (a bug of ours, or
#   a C function behind one of our wrappers, which look alike).
# The traceback objects are new (``types.TracebackType``) over the same frames; the exception
# object is the loader's own. The magic cuts its own frames the same way (``magics.py``).
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _ours(frame: FrameType) -> bool:
    return frame.f_code.co_filename.startswith(_PACKAGE)


def loader_traceback(tb: TracebackType | None) -> tuple[bool, TracebackType | None]:
    """``(True, frames)`` when the exception whose traceback is ``tb`` (starting at the frame that
    caught it) came out of the loader: the frames a re-raise should carry, the catching frame's and
    ours left out (Note [Tracebacks that show the user's code]); ``(False, tb)`` when it did not."""
    above: list[TracebackType] = []  # entries between the catching frame and the loader call
    entry = tb.tb_next if tb is not None else None
    while entry is not None:
        frame = entry.tb_frame
        if frame.f_code is _plain.__code__:
            below = entry.tb_next
            break
        if _ours(frame) and frame.f_locals.get("loader_frames", False) is entry.tb_next:
            below = entry.tb_next  # cut by an entry point already
            break
        above.append(entry)
        entry = entry.tb_next
    else:
        return False, tb
    kept = [e for e in above if not _ours(e.tb_frame)]
    while below is not None:
        if not (_ours(below.tb_frame) and below.tb_next is not None):
            kept.append(below)
        below = below.tb_next
    rebuilt: TracebackType | None = None
    for e in reversed(kept):
        rebuilt = TracebackType(rebuilt, e.tb_frame, e.tb_lasti, e.tb_lineno)
    return True, rebuilt


def load(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Call ``fn(*args, **kwargs)`` through the cache: the first call (in any process of this user)
    parks the result in shared memory, later ones rebuild it without copying tensor bytes. In-place
    changes stay private to the process that makes them.

    >>> unet = overmind_lab.load(UNet2DConditionModel.from_pretrained,   # doctest: +SKIP
    ...                          "/models/unet", dtype=torch.float16)
    """
    if _state.depth:  # nested inside a cached load: part of the outer result
        return fn(*args, **kwargs)
    try:
        # Without torch no load can be cached: one error naming the extra, before any daemon.
        from overmind_lab._extras import require

        require("torch", "overmind_lab.load()")
        _state.daemon_seconds = None
        start = time.perf_counter()
        if _state.bypass:
            result = _plain(fn, args, kwargs)
            _emit(LoadEvent(None, _keys.describe(fn, args, kwargs), "bypass",
                            time.perf_counter() - start))
            return result
        # Note [Clean exceptions]: the loader is never called inside one of our ``except`` blocks,
        # or its exception would carry ours as __context__ in the user's traceback.
        key_error: str | None = None
        try:
            info = _keys.make_key(fn, args, kwargs)
        except NotCacheable as exc:
            key_error = str(exc)
        if key_error is not None:
            _warn_once(f"key:{key_error}", f"loading without the cache: {key_error}")
            result = _plain(fn, args, kwargs)
            _emit(LoadEvent(None, _keys.describe(fn, args, kwargs), "uncached",
                            time.perf_counter() - start, reason=key_error))
            return result
        unavailable: BaseException | None = None
        from_disk: Session | None = None
        try:
            client = Client()
            absent = not client.path.exists()
            connecting = time.perf_counter()
            try:
                session = Session(client.connect())
            except DaemonUnavailable as exc:
                if isinstance(exc, NotAnswering) or isinstance(exc.__cause__, Untrusted):
                    raise  # one runs, or one not to trust: start none (as ``connect`` does)
                # none listening: the entry on disk while one starts, or wait for one
                from_disk = None if _state.refresh else _session_from_disk(client, info.key, exc)
                session = from_disk or client.session()
        except (OvermindError, OSError) as exc:
            unavailable = exc
        if unavailable is not None:
            return _fallback(fn, args, kwargs, info, start, unavailable)
        if from_disk is None and (absent or client.replaced_dead_daemon):
            _state.daemon_seconds = time.perf_counter() - connecting  # Note [What a load's
            start += _state.daemon_seconds                             # times say]
        if client.replaced_dead_daemon or (from_disk is not None and not absent):
            _warn_once(f"restart:{client.path}:{time.time()}",
                       f"the cache daemon on {client.path} had died; a new one was started "
                       "(entries it had saved on disk are kept, the others load cold)")
        with session:
            return _load_with(session, fn, args, kwargs, info, start)
    except BaseException as error:
        found, loader_frames = loader_traceback(error.__traceback__)
        if not found:
            raise  # ours: whole (Note [Tracebacks that show the user's code])
        error.with_traceback(loader_frames)
        raise error  # the loader's own exception, with its frames below (none of ours)


def _session_from_disk(client: Client, key: str, exc: DaemonUnavailable) -> Session | None:
    """Where no daemon listens (``exc``: no socket, or a dead one's), a session whose lookup is
    the entry saved on disk under ``key`` while a daemon starts (Note [A hit from the disk]); else
    ``None`` (not answering, not to be trusted, or the entry not there as saved: as before)."""
    if not isinstance(exc.__cause__, (FileNotFoundError, ConnectionRefusedError)):
        return None

    found = from_disk.saved_hit(key)
    return None if found is None else from_disk.DiskSession(client, *found)


# Note [What a load's times say]: a load's ``seconds`` is its own time: the key, the lookup and the
# hit, or the loader and the store; a daemon this load had to start (none was running: stopped, or
# dead and replaced) takes ``daemon_seconds`` apart, so that a warm hit right after a restart of the
# daemon is not shown as slower than its cold load, and the recorded ``cold_seconds`` (what every
# view compares warm loads with: the loader's time up to its return, not the store) and the warm
# times reported to the daemon count no daemon start. The magic's line shows both
# (``display.describe_load``).
def _fallback(fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any],
              info: _keys.KeyInfo, start: float, exc: BaseException) -> T:
    _warn_once(f"daemon:{exc}", f"the cache is unavailable, loading {info.name} "
                                f"without it: {exc}")
    result = _plain(fn, args, kwargs)
    _emit(LoadEvent(info.key, info.name, "fallback", time.perf_counter() - start, reason=str(exc)))
    return result


def _load_with(session: Session, fn: Callable[..., T], args: tuple[Any, ...],
               kwargs: dict[str, Any], info: _keys.KeyInfo, start: float) -> T:
    unavailable: BaseException | None = None
    stale: str | None = None  # why an entry was there but built by other code
    changed_again: str | None = None
    try:
        entry, fds, stale = _lookup(session, info)
    except _CodeChanged as exc:
        changed_again = str(exc)
    except (OvermindError, OSError) as exc:
        unavailable = exc
    if unavailable is not None:
        return _fallback(fn, args, kwargs, info, start, unavailable)
    if changed_again is not None:
        result = _plain(fn, args, kwargs)
        _emit(LoadEvent(info.key, info.name, "uncached", time.perf_counter() - start,
                        reason=changed_again))
        return result
    components = _components(args, kwargs)
    if entry is not None:
        return _hit(session, fn, args, kwargs, info, start, entry, fds, components)
    if session.note:  # the memory tier where files were expected: a read-only home
        _warn_once(f"note:{session.note}", session.note)
    # We hold the lease: load here, then park it. fn's exception propagates unchanged; closing the
    # session releases the lease.
    counter_before = hook_counter()
    # Capture and Draws innermost: they see the loader, not what the recorders do at their exit.
    with manifest.Recorder() as watched, effects.Watch() as done, \
            observe.Capture() as capture, draws.Draws() as drew, _young_only():
        result = _plain(fn, args, kwargs)
    cold = time.perf_counter() - start
    taken = (counter_before, hook_counter())  # Note [Hook ids] in ``pickling``
    drawn = drew.drawn
    if drawn:
        # Note [Loads that draw random numbers]: a load that drew from a random generator (a new
        # head initialised at random), even one that put its state back (``fork_rng``), depends on
        # the seed or moves the stream; a hit would give seed 1 seed 0's weights. Such loads are
        # not cached (keying on the generators' state would miss in every fresh process, seeded
        # from entropy).
        reason = (f"it draws random numbers ({', '.join(drawn)}) while loading, "
                  "e.g. to initialise weights missing from the checkpoint; it is not "
                  "cached, so that seeds keep working")
        _warn_once(f"random:{info.key}", f"{info.name} was loaded but not cached: {reason}")
        _emit(LoadEvent(info.key, info.name, "uncached", time.perf_counter() - start,
                        reason=reason))
        return result
    from overmind_lab._loading import background  # cold loads only: not on a hit's path

    if background.wanted(result):
        def store() -> None:
            _store(session, info, result, cold, components, capture.observed, taken,
                   (watched, fn, done))

        if background.start(store, info.key, info.name, _report_background,
                            keep_fds=[session.chan.sock.fileno()]):
            # The child has the session now; this process closes its copy when ``load`` leaves
            # ``with session``. The caller's object is the loader's own (memory, or the source
            # file's mapping), so this process is no holder of the entry, and a later store that
            # includes its tensors copies them instead of referencing the segment.
            _keys.remember(result, info.key)
            _emit(LoadEvent(info.key, info.name, "cold", time.perf_counter() - start,
                            cold_seconds=cold, reason=background.REASON))
            return result
    failure: BaseException | None = None
    try:
        _store(session, info, result, cold, components, capture.observed, taken,
               (watched, fn, done))
    except Exception as exc:  # noqa: BLE001 - Note [Never worse than plain]
        failure = exc
    if failure is not None:
        reason = _failure_text(failure)
        _warn_not_stored(info.key, info.name, reason,
                         isinstance(failure, NotCacheable) or not isinstance(
                             failure, (OvermindError, OSError)))
        _emit(LoadEvent(info.key, info.name, "uncached", time.perf_counter() - start,
                        reason=reason))
        return result
    _keys.remember(result, info.key)
    _emit(LoadEvent(info.key, info.name, "cold", time.perf_counter() - start,
                    cold_seconds=cold, reason=stale))
    return result


class _CodeChanged(Exception):
    """An entry built by other code than this process's, twice (see ``_lookup``)."""


# Note [Code that changed under an entry]: the key holds the loader's code, not the code of the
# result's classes (known only after the load): the entry records their digests
# (``user_code.graph_code``, ``Meta.code``) and what the load read and ran (``Meta.deps``: Note
# [What a load depends on] in ``manifest``), and a hit compares both with this process first.
# If they differ, the key is looked up again with ``refresh`` (as ``refreshing()``), which takes the
# lease although an entry exists; the load's store replaces the entry. If another process refreshed
# it meanwhile with code that differs too (two processes running different code under one key), this
# load runs uncached rather than take turns.
def _lookup(session: Session,
            info: _keys.KeyInfo) -> tuple[WireEntry | None, list[int], str | None]:
    """A hit built by this process's code, ``(entry, fds, None)``; or the lease, ``(None, [],
    why)``. Raises ``_CodeChanged`` when a second entry in a row was built by other code."""
    entry, fds = session.lookup(info.key, refresh=bool(_state.refresh))
    stale: str | None = None
    for again in (False, True):
        meta = cast(Meta, entry["meta"]) if entry is not None else None
        why = None if meta is None else (user_code.changed(meta.get("code"))
                                         or manifest.changed(meta.get("deps")))
        if why is None:
            return entry, fds, stale
        stale = why
        for fd in fds:
            os.close(fd)
        if again:
            raise _CodeChanged(why)
        entry, fds = session.lookup(info.key, refresh=True)
    raise AssertionError("unreachable")


# Note [Never worse than plain]: the cache may make a load faster, never different, never
# failing:
# - a first load returns the loader's own object, stored or not: it *is* the plain load (a
#   rebuilt copy would let the original be collected, its finalisers run, its storages move);
#   later loads are rebuilt from the entry (``_hit``), proven equal by the fingerprint;
# - any exception while pickling (far more than ``PicklingError``), reserving, writing or
#   storing makes the load uncached with one warning; the daemon drops the reservation;
# - any exception while rebuilding a hit evicts the entry and loads plainly, with one warning;
# - the loader's own exceptions reach the caller unchanged (Note [Clean exceptions]).
def _failure_text(exc: BaseException) -> str:
    if isinstance(exc, (OvermindError, OSError)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _warn_not_stored(key: str, name: str, error: str, not_cacheable: bool) -> None:
    verb = "not cached" if not_cacheable else "could not be cached"
    _warn_once(f"store:{key}:{error}", f"{name} was loaded but {verb}: {error}")


def _report_background(outcome: background.StoreOutcome) -> None:
    """A background store ended (called from the thread that reaped the child)."""
    if outcome.error is not None:
        _warn_not_stored(outcome.key, outcome.name, outcome.error, outcome.not_cacheable)


def _hit(session: Session, fn: Callable[..., T], args: tuple[Any, ...],
         kwargs: dict[str, Any], info: _keys.KeyInfo, start: float, entry: WireEntry,
         fds: list[int], components: dict[str, Any]) -> T:
    rng_before = draws.snapshot() if _verify_on() else None
    hooks_before = hook_counter()
    rebuild_error: BaseException | None = None
    try:
        obj = _rebuild(entry, fds, components)
        effects.replay(entry["meta"].get("effects"))
    except Exception as exc:  # noqa: BLE001 - any rebuild failure means: load it
        rebuild_error = exc
    if rebuild_error is not None:  # Note [Never worse than plain]
        _warn_once(f"rebuild:{info.key}", f"could not rebuild {info.name} from the "
                                          f"cache ({rebuild_error!r}); loading it from source")
        with contextlib.suppress(OvermindError, OSError):
            session.evict(info.key)
        set_hook_counter(hooks_before)  # hook ids a partial rebuild took: the plain load's
        result = _plain(fn, args, kwargs)
        _emit(LoadEvent(info.key, info.name, "uncached", time.perf_counter() - start,
                        reason=f"rebuild failed: {rebuild_error}"))
        return result
    observed = observe.Observed.from_json(entry["meta"].get("observed"))
    observe.replay(observed)
    seconds = time.perf_counter() - start
    verified: bool | None = None
    if rng_before is not None:
        plain, mismatch = _verify(fn, args, kwargs, obj, observed, rng_before, hooks_before)
        verified = mismatch is None
        if mismatch is not None:
            warnings.warn(f"overmind-lab: warm hit of {info.name} differs from plain load "
                          f"in {mismatch}; returning the plain result and dropping the "
                          "entry", VerifyMismatch, stacklevel=4)
            with contextlib.suppress(OvermindError, OSError):
                session.evict(info.key)
            _emit(LoadEvent(info.key, info.name, "uncached", time.perf_counter() - start,
                            reason=f"verify: differs in {mismatch}", verified=False))
            return plain  # type: ignore[no-any-return]
    session.report(info.key, seconds, verified=verified)
    _emit(LoadEvent(info.key, info.name, "warm", seconds,
                    cold_seconds=entry.get("cold_seconds"), verified=verified))
    return obj  # type: ignore[no-any-return]


def _verify(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
            warm: Any, observed: observe.Observed,
            rng_before: dict[str, Any], hooks_before: int) -> tuple[Any, str | None]:
    """Load plainly from the same generator state and compare with the hit: the plain result and the
    first difference (``None`` if equal); generators left as the plain load leaves them.
    """
    from overmind_lab._common.fingerprint import compare

    rng_warm = draws.snapshot()
    hooks_warm = hook_counter()
    draws.restore(rng_before)
    set_hook_counter(hooks_before)  # the plain load takes the ids the hit took
    with observe.Capture(emit=False) as capture, draws.Draws(ops=True) as drew:
        plain = _plain(fn, args, kwargs)
    rng_plain = draws.snapshot()
    found = compare(warm, plain)
    if found is None:
        drawn = draws.changed(rng_warm, rng_plain)
        if drawn:
            found = f"the random generators' state after the load ({', '.join(drawn)})"
        elif drew.drawn:
            found = f"random draws in the plain load ({', '.join(drew.drawn)})"
        elif hook_counter() != hooks_warm:
            found = (f"torch's hook id counter after the load: {hooks_warm} vs "
                     f"{hook_counter()}")
    # What the plain load said must be among what the hit replayed, not the reverse (a once-only
    # message shown before in this process stays silent in the plain load).
    unsaid = [m for m in capture.observed.messages() if m not in observed.messages()]
    if found is None and unsaid:
        found = f"the warnings and log records emitted: the plain load also said {unsaid!r}"
    return plain, found


def _store(session: Session, info: _keys.KeyInfo, result: Any, cold: float,
           components: dict[str, Any], observed: observe.Observed,
           hooks_taken: tuple[int, int],
           watched: tuple[manifest.Recorder, Callable[..., Any], effects.Watch]) -> None:
    """Park ``result`` in a new segment (Note [Never worse than plain]); ``watched``: the cold
    load's recorder, loader and registrations (Note [What a load depends on] in ``manifest``,
    Note [Registrations a load makes] in ``effects``)."""
    from overmind_lab._errors import ProtocolError
    from overmind_lab._loading import faithful  # stores only
    from overmind_lab._loading.sources import SourceFile, SourceMap

    t0 = time.perf_counter()
    by_id = {id(v): k for k, v in components.items()}
    faithful.check(result, by_id)  # Note [What pickling cannot carry]
    stream, plan, kind = dump(result, by_id, sources=SourceMap())
    code = user_code.graph_code(plan.classes)  # Note [Code that changed under an entry]
    deps = manifest.build(watched[0], plan.classes, watched[1], info.source)
    made = watched[2].record(plan.classes)
    try:
        linked = _link_sources(session, info.key, plan)
        if len(linked) < len(plan.files):  # some cannot be linked: copy their storages
            refused = frozenset(f.path for f in plan.files if f.path not in linked)
            stream, plan, kind = dump(result, by_id, sources=SourceMap(), exclude=refused)
    except ProtocolError:
        session.abandon(info.key)
        raise
    stream_offset = plan.place(stream, len(stream))
    refs = [linked[r.path] if isinstance(r, SourceFile) else r.segment_id for r in plan.refs]
    try:
        reserved, fds = session.reserve(info.key, plan.size, refs)
    except ProtocolError as exc:
        session.abandon(info.key)
        if exc.kind in (ErrorKind.TOO_LARGE, ErrorKind.STALE_REFERENCE):
            raise NotCacheable(str(exc)) from exc
        raise
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise OvermindError(f"reserve sent {len(fds)} descriptors, 1 expected")
    # A failure to write (a full disk) closes the session: the daemon deletes the segment.
    try:
        write_segment(fds[0], plan.size, plan.items)
    finally:
        os.close(fds[0])
    plan.items.clear()
    meta: Meta = {"stream": [0, stream_offset, len(stream)], "pickler": kind,
                  "buffers": plan.buffers, "observed": observed.to_json()}
    if code:
        meta["code"] = code
    if deps:
        meta["deps"] = deps
    if made:
        meta["effects"] = made
    if plan.hooks:
        meta["hooks"] = list(hooks_taken)
    session.store({
        "op": "store", "key": info.key, "name": info.name,
        "class": f"{type(result).__module__}.{type(result).__qualname__}",
        "callable": info.callable, "source": info.source, "meta": dict(meta),
        "segments": [{"id": reserved["segment"]["id"], "size": plan.size}], "refs": refs,
        "tensors": plan.tensors, "cold_seconds": cold,
        "store_seconds": time.perf_counter() - t0, "call": info.call,
        "validate": info.validate,
    })


def _link_sources(session: Session, key: str, plan: WritePlan) -> dict[str, str]:
    """Ask the daemon to link the plan's source files: path -> segment id (refused ones missing:
    the memfd tier, changed meanwhile, a file of the cache)."""
    from overmind_lab._loading.sources import in_small_folios

    files = plan.files
    if not files:
        return {}
    records = [f.record() for f in files]
    for record in records:  # Note [Sources in small folios]
        if in_small_folios(record["path"]):
            record["small_folios"] = True
    reply = session.link(key, records)
    return {f.path: str(seg["id"]) for f, seg in zip(files, reply["links"], strict=True)
            if seg is not None}


def _components(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Arguments (also inside lists, tuples, dicts) that came from the cache, by key."""
    found: dict[str, Any] = {}
    stack: list[Any] = [*args, *kwargs.values()]
    while stack:
        value = stack.pop()
        if isinstance(value, (list, tuple)):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
        else:
            key = _keys.key_of(value)
            if key is not None:
                found[key] = value
    return found


def _pair(value: Any) -> tuple[int, int] | None:
    return (int(value[0]), int(value[1])) if isinstance(value, list) and len(value) == 2 \
        else None


def _rebuild(entry: WireEntry, fds: list[int], components: dict[str, Any]) -> Any:
    segments = entry["segments"]
    if len(segments) != len(fds):
        for fd in fds:
            os.close(fd)
        raise OvermindError(f"{len(segments)} segments but {len(fds)} descriptors")
    mappings = []
    pinned = []  # the mmaps stay alive while the tensors over them are built
    for i, (spec, fd) in enumerate(zip(segments, fds, strict=True)):
        try:
            mapping, mm = map_segment(spec["id"], int(spec["size"]), fd)
            mappings.append(mapping)
            pinned.append(mm)
        except BaseException:
            for rest in fds[i + 1:]:
                os.close(rest)
            raise
    meta = cast(Meta, entry["meta"])  # our own record, as _store wrote it
    seg, offset, length = meta["stream"]
    stream = mappings[seg].view(offset, length)
    try:
        obj = load_stream(stream, meta["pickler"], mappings,
                          [(a, b, c) for a, b, c in meta.get("buffers", [])], components,
                          hooks=_pair(meta.get("hooks")))
    finally:
        stream.release()
    # after the unpickling: Note [Pages mapped behind the load]
    prefault_behind(list(zip(mappings, pinned, strict=True)))
    _keys.remember(obj, entry["key"])
    return obj
