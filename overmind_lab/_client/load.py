"""``load()``: a cached call, warm from shared memory when any process loaded it before.

The cold load runs in this process (its libraries are already imported); the result is
pickled with tensor bytes out of band, the bytes go into a sealed memfd handed to the
daemon, and the caller gets the object rebuilt from that segment, exactly as any later
process will. The cache never makes a load fail: whatever goes wrong on the cache's side,
the caller gets the original function's result and one warning.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from overmind_lab._client import keys as _keys
from overmind_lab._client.client import Client, Session
from overmind_lab._client.pickling import dump, load_stream
from overmind_lab._client.segments import map_segment, new_segment_id, write_segment
from overmind_lab._errors import NotCacheable, OvermindError, OvermindWarning

__all__ = ["load", "bypass", "refreshing", "record_loads", "LoadEvent", "key_of"]

T = TypeVar("T")
key_of = _keys.key_of


@dataclass
class LoadEvent:
    """What one ``load()`` did. ``outcome`` is warm, cold, bypass, uncached or fallback."""

    key: str | None
    name: str
    outcome: str
    seconds: float
    cold_seconds: float | None = None
    reason: str | None = None


class _State(threading.local):
    def __init__(self) -> None:
        self.depth = 0
        self.bypass = 0
        self.refresh = 0
        self.recorders: list[list[LoadEvent]] = []


_state = _State()
_warned: set[str] = set()


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
def record_loads() -> Iterator[list[LoadEvent]]:
    """Collect a :class:`LoadEvent` for every ``load()`` inside (this thread)."""
    events: list[LoadEvent] = []
    _state.recorders.append(events)
    try:
        yield events
    finally:
        _state.recorders.remove(events)


def _emit(event: LoadEvent) -> None:
    for events in _state.recorders:
        events.append(event)


def _plain(fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
    _state.depth += 1
    try:
        return fn(*args, **kwargs)
    finally:
        _state.depth -= 1


def load(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Call ``fn(*args, **kwargs)`` through the cache.

    The first call (in any process of this user) runs ``fn`` and parks the result in
    shared memory; later calls rebuild it from there without copying tensor bytes.
    In-place changes stay private to the process that makes them.

    >>> unet = overmind_lab.load(UNet2DConditionModel.from_pretrained,   # doctest: +SKIP
    ...                          "/models/unet", dtype=torch.float16)
    """
    if _state.depth:  # nested inside a cached load: part of the outer result
        return fn(*args, **kwargs)
    start = time.perf_counter()
    if _state.bypass:
        result = _plain(fn, args, kwargs)
        _emit(LoadEvent(None, _keys.describe(fn, args, kwargs), "bypass",
                        time.perf_counter() - start))
        return result
    try:
        info = _keys.make_key(fn, args, kwargs)
    except NotCacheable as exc:
        _warn_once(f"key:{exc}", f"loading without the cache: {exc}")
        result = _plain(fn, args, kwargs)
        _emit(LoadEvent(None, _keys.describe(fn, args, kwargs), "uncached",
                        time.perf_counter() - start, reason=str(exc)))
        return result
    client = Client()
    try:
        session = client.session()
    except (OvermindError, OSError) as exc:
        return _fallback(fn, args, kwargs, info, start, exc)
    if client.replaced_dead_daemon:
        _warn_once(f"restart:{client.path}:{time.time()}",
                   f"the cache daemon on {client.path} had died; a new one was started "
                   "and the cache starts empty")
    with session:
        return _load_with(session, fn, args, kwargs, info, start)


def _fallback(fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any],
              info: _keys.KeyInfo, start: float, exc: BaseException) -> T:
    _warn_once(f"daemon:{exc}", f"the cache is unavailable, loading {info.name} "
                                f"without it: {exc}")
    result = _plain(fn, args, kwargs)
    _emit(LoadEvent(info.key, info.name, "fallback", time.perf_counter() - start,
                    reason=str(exc)))
    return result


def _load_with(session: Session, fn: Callable[..., T], args: tuple[Any, ...],
               kwargs: dict[str, Any], info: _keys.KeyInfo, start: float) -> T:
    try:
        reply, fds = session.lookup(info.key, refresh=bool(_state.refresh))
    except (OvermindError, OSError) as exc:
        return _fallback(fn, args, kwargs, info, start, exc)
    components = _components(args, kwargs)
    if reply.get("hit"):
        try:
            obj = _rebuild(reply["entry"], fds, components)
        except Exception as exc:  # noqa: BLE001 - any rebuild failure means: load it
            _warn_once(f"rebuild:{info.key}", f"could not rebuild {info.name} from the "
                                              f"cache ({exc!r}); loading it from source")
            result = _plain(fn, args, kwargs)
            _emit(LoadEvent(info.key, info.name, "uncached", time.perf_counter() - start,
                            reason=f"rebuild failed: {exc}"))
            return result
        seconds = time.perf_counter() - start
        session.report(info.key, seconds)
        _emit(LoadEvent(info.key, info.name, "warm", seconds,
                        cold_seconds=reply["entry"].get("cold_seconds")))
        return obj  # type: ignore[no-any-return]
    # We hold the lease: load it here, then park it. An exception from fn propagates
    # unchanged; closing the session releases the lease for the next waiter.
    result = _plain(fn, args, kwargs)
    cold = time.perf_counter() - start
    try:
        obj = _store(session, info, result, cold, components)
    except NotCacheable as exc:
        _warn_once(f"store:{info.key}:{exc}", f"{info.name} was loaded but not cached: {exc}")
        _emit(LoadEvent(info.key, info.name, "uncached", time.perf_counter() - start,
                        reason=str(exc)))
        return result
    except (OvermindError, OSError) as exc:
        _warn_once(f"store:{exc}", f"{info.name} was loaded but could not be cached: {exc}")
        _emit(LoadEvent(info.key, info.name, "uncached", time.perf_counter() - start,
                        reason=str(exc)))
        return result
    _emit(LoadEvent(info.key, info.name, "cold", time.perf_counter() - start,
                    cold_seconds=cold))
    if obj is not result:
        del result
        _trim_heap()  # the loader's own copy is gone: give its pages back now
    return obj  # type: ignore[no-any-return]


def _store(session: Session, info: _keys.KeyInfo, result: Any, cold: float,
           components: dict[str, Any]) -> Any:
    """Park ``result`` in a new segment; return the object rebuilt from the cache.

    A result that only ``dill`` could pickle (a class defined inside a function, say) is
    returned as is: rebuilt, its class would be a copy, and ``isinstance`` would fail in
    this process.
    """
    from overmind_lab._errors import ProtocolError

    t0 = time.perf_counter()
    stream, plan, kind = dump(result, {id(v): k for k, v in components.items()})
    stream_offset = plan.place(stream, len(stream))
    refs = [m.segment_id for m in plan.refs]
    try:
        session.request({"op": "reserve", "key": info.key, "nbytes": plan.size,
                         "refs": refs})
    except ProtocolError as exc:
        session.request({"op": "abandon", "key": info.key})
        if exc.kind in ("too_large", "stale_reference"):
            raise NotCacheable(str(exc)) from exc
        raise
    seg_id = new_segment_id()
    fd = write_segment(seg_id, plan.size, plan.items)
    plan.items.clear()
    try:
        meta = {"stream": [0, stream_offset, len(stream)], "pickler": kind,
                "buffers": plan.buffers}
        session.request({
            "op": "store", "key": info.key, "name": info.name,
            "class": f"{type(result).__module__}.{type(result).__qualname__}",
            "callable": info.callable, "source": info.source, "meta": meta,
            "segments": [{"id": seg_id, "size": plan.size}], "refs": refs,
            "tensors": plan.tensors, "cold_seconds": cold,
            "store_seconds": time.perf_counter() - t0, "call": info.call,
        }, [fd])
    finally:
        os.close(fd)
    # Rebuild from the segment, as every later process will: the loader's own copy can
    # be freed, and the result carries its provenance (Note [Provenance]).
    if kind == "dill":
        _keys.remember(result, info.key)
        return result
    reply, fds = session.lookup(info.key, own=True)
    if not reply.get("hit"):
        raise OvermindError("the entry vanished right after it was stored")
    return _rebuild(reply["entry"], fds, components)


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


def _trim_heap() -> None:
    """Return freed heap pages to the system (glibc keeps them for reuse otherwise)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _rebuild(entry: dict[str, Any], fds: list[int], components: dict[str, Any]) -> Any:
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
    meta = entry["meta"]
    seg, offset, length = meta["stream"]
    stream = mappings[seg].view(offset, length)
    try:
        obj = load_stream(stream, meta["pickler"], mappings,
                          [tuple(b) for b in meta.get("buffers", [])], components)
    finally:
        stream.release()
    _keys.remember(obj, entry["key"])
    return obj
