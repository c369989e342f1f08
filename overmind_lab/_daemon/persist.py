"""The index across daemon restarts: entries as records, and what a new daemon keeps.

Only entries whose segments are all finished files are saved. :func:`restore` keeps an entry
only if its segment files pass their trailer check, its source files still have the recorded
signature (Note [File signatures] in ``_loading/keys.py``) and, on the same interpreter, its
libraries their versions; the rest is dropped with its reason logged, unused files deleted. A
corrupt index is discarded with a warning: the cache starts cold.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from typing import Any

from overmind_lab._common.saved import source_changed, versions_changed
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
