"""The index across daemon restarts: entries as records, and what a new daemon keeps.

Only entries whose segments are all finished files are saved. :func:`restore` keeps an entry
only if its segment files pass their trailer check, its source files still have the recorded
signature (Note [File signatures] in ``_loading/keys.py``) and, on the same interpreter, its
libraries their versions; the rest is dropped with its reason logged, unused files deleted. A
corrupt index is discarded with a warning: the cache starts cold.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import platform
import sys
from collections import deque
from pathlib import Path
from typing import Any

from overmind_lab._daemon.index import WARM_HISTORY, Entry, Index
from overmind_lab._daemon.store import Corrupt, Segment, Store

__all__ = ["snapshot", "restore", "source_changed", "versions_changed"]

log = logging.getLogger("overmind_lab.daemon")

_FIELDS = ("key", "name", "cls", "callable", "source", "own", "shared", "meta", "tensors",
           "cold_seconds", "store_seconds", "call", "created", "last_used", "hits",
           "validate", "order")


def snapshot(index: Index) -> dict[str, Any]:
    """The saveable part of ``index``, least recently used first."""
    entries, used = [], set()
    for entry in index.entries.values():
        segs = [index.segments.get(s) for s in entry.segments]
        if not all(s is not None and s.persisted for s in segs):
            continue
        record = {name: getattr(entry, name) for name in _FIELDS}
        record["warm_seconds"] = list(entry.warm_seconds)
        entries.append(record)
        used.update(entry.segments)
    segments = [index.segments[s].record() for s in sorted(used)]
    return {"entries": entries, "segments": segments}


def restore(store: Store, index: Index) -> list[str]:
    """Reload the saved index into ``index``; returns one line per entry dropped."""
    dropped: list[str] = []
    try:
        body = store.load_index()
    except Corrupt as exc:
        log.warning("discarded the saved index, the cache starts cold: %s", exc)
        body = None
        dropped.append(f"index: {exc}")
    opened: dict[str, Segment] = {}
    bad: dict[str, str] = {}
    for record in (body or {}).get("segments", []):
        try:
            seg = store.open_segment(record)
        except (Corrupt, KeyError, TypeError, ValueError) as exc:
            bad[str(record.get("id") if isinstance(record, dict) else record)] = str(exc)
            continue
        opened[seg.id] = seg
    for record in (body or {}).get("entries", []):
        try:
            entry = _entry(record)
        except (KeyError, TypeError, ValueError) as exc:
            dropped.append(f"a malformed entry: {exc!r}")
            continue
        reason = _check(entry, opened, bad)
        if reason is not None:
            dropped.append(f"{entry.key[:12]} ({entry.name}): {reason}")
            continue
        for sid in entry.segments:
            opened[sid].refs += 1
            index.segments[sid] = opened[sid]
        index.entries[entry.key] = entry
    for seg in opened.values():
        if seg.id not in index.segments:
            os.close(seg.fd)
    removed = store.collect(set(index.segments))
    for line in dropped:
        log.warning("dropped a saved entry: %s", line)
    if removed:
        log.info("deleted %d files no entry uses: %s", len(removed), sorted(removed)[:10])
    if index.entries:
        log.info("reopened %d entries (%d bytes) from %s", len(index.entries),
                 index.cached_bytes, store.dir)
    return dropped


def _entry(record: dict[str, Any]) -> Entry:
    values = {name: record[name] for name in _FIELDS if name in record}
    entry = Entry(**{k: values[k] for k in ("key", "name", "cls", "callable", "source",
                                            "own", "shared", "meta", "tensors",
                                            "cold_seconds", "store_seconds")})
    entry.call = values.get("call")
    entry.validate = values.get("validate")
    order = values.get("order")
    if order is not None and sorted(order) != sorted(entry.own + entry.shared):
        raise ValueError(f"its segment order {order!r} names other segments")
    entry.order = order
    entry.created = float(values.get("created", entry.created))
    entry.last_used = float(values.get("last_used", entry.last_used))
    entry.hits = int(values.get("hits", 0))
    entry.warm_seconds = deque((float(s) for s in record.get("warm_seconds", [])),
                               maxlen=WARM_HISTORY)
    return entry


def _check(entry: Entry, opened: dict[str, Segment], bad: dict[str, str]) -> str | None:
    for sid in entry.segments:
        if sid in bad:
            return bad[sid]
        if sid not in opened:
            return f"its segment {sid} is not in the index"
    validate = entry.validate or {}
    return source_changed(validate.get("source")) or versions_changed(validate)


def source_changed(source: Any) -> str | None:
    """Why a recorded source signature (Note [File signatures]) no longer matches the disk,
    or ``None``; one of another shape (an older client's) counts as changed."""
    if not isinstance(source, dict) or "local" not in source:
        return None
    root = Path(str(source["local"]))
    files = source.get("files")
    try:
        if isinstance(files, list) and files and isinstance(files[0], int):
            if len(files) != 5:
                return f"the signature of {root} was recorded without inode and ctime"
            return None if _identity(root.stat()) == files else f"{root} changed"
        if not isinstance(files, list):
            return f"the signature of {root} is malformed"
        for record in files:
            if not isinstance(record, list) or len(record) != 6:
                return f"the signature of {root} was recorded without inode and ctime"
            rel, *then = record
            now = _identity((root / str(rel)).stat())
            if now != then:
                return (f"the source file {root / str(rel)} changed ("
                        f"{_what_changed(then, now)})")
    except FileNotFoundError as exc:
        return f"the source file {exc.filename} is gone"
    except (OSError, TypeError, ValueError) as exc:
        return f"the source {root} cannot be checked: {exc}"
    return None


_IDENTITY = ("device", "inode", "size", "mtime", "ctime")


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _what_changed(then: list[Any], now: list[int]) -> str:
    return ", ".join(name for name, a, b in zip(_IDENTITY, then, now, strict=True) if a != b)


def versions_changed(validate: dict[str, Any]) -> str | None:
    """Which recorded library version differs here, or ``None`` (same interpreter only)."""
    versions = validate.get("versions")
    if validate.get("python") != sys.executable or not isinstance(versions, dict):
        return None
    for lib, recorded in versions.items():
        if lib == "format":
            continue
        if lib == "python":
            now = platform.python_version()
        else:
            try:
                now = importlib.metadata.version(lib)
            except (importlib.metadata.PackageNotFoundError, ValueError):
                continue  # a module that is no distribution: the daemon cannot tell
        if now.split("+")[0] != str(recorded).split("+")[0]:
            return f"{lib} changed from {recorded} to {now}"
    return None
