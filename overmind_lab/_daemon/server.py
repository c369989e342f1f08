"""The per-user cache daemon: an asyncio server on a Unix socket.

It holds segments (that *is* the cache: read-only files in the cache directory, or sealed
memfds, see ``store``), an index of entries saved beside them (``persist``), statistics
and single-flight leases. It never imports torch or user code and never unpickles anything;
it cannot be crashed by a model. Start it with ``overmind-lab serve`` or let the first
client start it (``process``: lifetime lock, ``--detach``).

Requests (JSON frames, see ``_protocol``), one connection may send several:

``status``                  -> status object
``lookup {key, refresh?}``  -> ``{hit: true, entry}`` + segment fds, or ``{lease: true}``
                               (you load it), after ``{wait: true}`` and keep-alives while
                               another process loads the same key (single flight)
``reserve {key, nbytes, refs}`` -> make room (LRU eviction) and a new segment: its id,
                               tier and a writable fd; or ``kind: too_large``
``link {key, files}``       -> hard-link source files whose regions the result's storages
                               are into the cache: ``{links: [{id, size} | null]}``
``store {key, segments, ...}`` -> the written segment is committed (read-only from now),
                               the entry is cached, the lease released
``abandon {key}``           -> release the lease without storing
``report {key, seconds}``   -> a warm load's time, for statistics (no reply)
``list``                    -> ``{entries: [...]}``
``evict {key}`` / ``evict_all`` / ``refresh {key}`` / ``stop``
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import struct
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from overmind_lab import __version__
from overmind_lab._common.naming import BUDGET_ENV
from overmind_lab._common.protocol import AsyncChannel
from overmind_lab._common.sizes import available_memory, parse_size, total_memory
from overmind_lab._daemon.holders import HolderScanner
from overmind_lab._daemon.index import Entry, Index, Segment, TooLarge
from overmind_lab._daemon.persist import restore, snapshot
from overmind_lab._daemon.store import (
    Corrupt,
    Store,
    file_bytes,
    footprint,
    new_segment_id,
    resident_bytes,
)

if TYPE_CHECKING:
    from overmind_lab._daemon.refresh import Refresher

__all__ = ["Daemon", "default_budget", "peer_credentials"]

log = logging.getLogger("overmind_lab.daemon")

#: Fraction of system RAM the cache may hold by default.
DEFAULT_BUDGET_FRACTION = 0.5
KEEPALIVE_SECONDS = 5.0
IDLE_TIMEOUT = 600.0
SEND_TIMEOUT = 30.0
#: Coalesce index writes that follow each other closely (hits, stores, evictions).
SAVE_DELAY = 0.2


def default_budget() -> int:
    env = os.environ.get(BUDGET_ENV)
    if env:
        return parse_size(env)
    return int(total_memory() * DEFAULT_BUDGET_FRACTION)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


class _Lease:
    def __init__(self, owner: object) -> None:
        self.owner = owner
        self.released = asyncio.Event()


class Daemon:
    def __init__(self, path: Path, budget: int, cache_dir: Path | None = None) -> None:
        self.path = path
        self.store = Store(cache_dir)  # raises CacheDirRefused: refuse to start
        self.index = Index(budget, on_drop=self._drop)
        self.holders = HolderScanner(self.store.dir if self.store.persistent else None)
        self.leases: dict[str, _Lease] = {}
        self.pending: dict[str, Segment] = {}  # key -> segment reserved, being written
        self.pending_links: dict[str, list[Segment]] = {}  # key -> linked, not stored yet
        self.finishing: dict[str, Segment] = {}  # id -> segment being finished
        self.verifying: dict[str, asyncio.Future[None]] = {}
        self._dirty = False
        self._saver: asyncio.Task[None] | None = None
        if self.store.persistent:
            restore(self.store, self.index)
        self.started = time.time()
        self.stopping = asyncio.Event()
        self.refresher: Refresher | None = None  # set by refresh.attach

    # -- lifecycle --------------------------------------------------------------------
    async def serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        sock.setblocking(False)
        log.info("serving on %s (pid %d, budget %d bytes)", self.path, os.getpid(),
                 self.index.budget)
        accepting = asyncio.ensure_future(self._accept_loop(sock))
        verifier = asyncio.ensure_future(self._verify_all())
        await self.stopping.wait()
        accepting.cancel()
        verifier.cancel()
        if self.refresher is not None:
            self.refresher.close()  # Note [Workers outlive no daemon]
        await self._shutdown()
        log.info("stopped")

    async def _shutdown(self) -> None:
        """Finish the files being written, save the index, let go of the segments."""
        if self.finishing:
            await asyncio.wait([asyncio.ensure_future(self._finished(sid))
                                for sid in list(self.finishing)], timeout=60)
        for seg in [*self.pending.values(), *(s for v in self.pending_links.values()
                                               for s in v)]:
            self.store.discard(seg)
        self.pending.clear()
        self.pending_links.clear()
        if self.store.persistent:
            try:
                self.store.save_index(snapshot(self.index))
            except OSError as exc:
                log.warning("could not save the index: %s", exc)
        self.index.close(self.store.release)
        self.store.close()

    async def _finished(self, sid: str) -> None:
        while sid in self.finishing:
            await asyncio.sleep(0.02)

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task[None]] = set()
        while True:
            conn, _ = await loop.sock_accept(listener)
            task = asyncio.ensure_future(self._serve_client(conn))
            tasks.add(task)  # keep a reference until done
            task.add_done_callback(tasks.discard)

    async def _serve_client(self, sock: socket.socket) -> None:
        chan = AsyncChannel(sock)
        held: set[str] = set()
        try:
            pid, uid, _ = peer_credentials(sock)
            if uid != os.getuid():
                log.warning("refused a connection from uid %d (pid %d)", uid, pid)
                await chan.send({"ok": False, "kind": "permission",
                                 "error": f"the overmind-lab daemon of uid {os.getuid()} "
                                          f"does not serve uid {uid}"})
                return
            self.holders.saw(pid)
            await self._conversation(chan, pid, held)
        except (ConnectionError, asyncio.TimeoutError) as exc:
            log.info("connection from a client ended: %r", exc)
        except Exception:  # a bad request must never take the daemon down
            log.exception("error while serving a client")
        finally:
            for key in held:
                self._release(key)
            chan.close()

    async def _conversation(self, chan: AsyncChannel, pid: int, held: set[str]) -> None:
        while True:
            timeout = None if held else IDLE_TIMEOUT
            frame = await asyncio.wait_for(chan.recv(), timeout)
            if frame is None:
                return
            msg, fds = frame
            op = msg.get("op")
            give: list[int] = []  # descriptors to close once sent
            try:
                for fd in fds:  # no request carries descriptors to the daemon any more
                    os.close(fd)
                if op == "store":
                    reply, out_fds = self._store(msg, held), list[int]()
                elif op == "reserve":
                    reply, give = self._reserve(msg, held)
                    out_fds = give
                else:
                    if op == "lookup":
                        await self._lookup(chan, msg, held)
                        continue
                    if op == "report":
                        self._report(msg)
                        continue
                    reply, out_fds = self._simple(op, msg, held, pid)
            except _RequestError as exc:
                reply, out_fds = {"ok": False, "kind": exc.kind, "error": str(exc)}, []
            try:
                await asyncio.wait_for(chan.send(reply, out_fds), SEND_TIMEOUT)
            finally:
                for fd in give:
                    os.close(fd)
            if op == "stop":
                self.stopping.set()
                return

    # -- requests ---------------------------------------------------------------------
    def _simple(self, op: Any, msg: dict[str, Any], held: set[str],
                pid: int) -> tuple[dict[str, Any], list[int]]:
        if op in ("status", "hello"):
            return {"ok": True, **self.status()}, []
        if op == "list":
            return {"ok": True, "entries": self.list_entries()}, []
        if op == "link":
            return self._link(msg, held), []
        if op == "abandon":
            key = str(msg.get("key"))
            if key in held:
                held.discard(key)
                self._release(key)
            self.index.unreserve(key)
            return {"ok": True}, []
        if op == "evict":
            keys = self._resolve(str(msg.get("key", "")))
            for key in keys:
                self.index.evict(key)
            self.holders.invalidate()
            self.save_soon()
            return {"ok": True, "evicted": keys}, []
        if op == "evict_all":
            keys = list(self.index.entries)
            for key in keys:
                self.index.evict(key)
            self.save_soon()
            return {"ok": True, "evicted": keys}, []
        if op == "refresh":
            keys = self._resolve(str(msg.get("key", "")))
            if self.refresher is None:
                raise _RequestError("unsupported", "this daemon cannot refresh entries")
            entry = self.refresher.start(self.index.entries[keys[0]])
            return {"ok": True, "entry": entry}, []
        if op == "stop":
            return {"ok": True, "pid": os.getpid()}, []
        raise _RequestError("bad_request", f"unknown operation {op!r}")

    def _resolve(self, key: str) -> list[str]:
        keys = self.index.resolve(key) if key else []
        if not keys:
            raise _RequestError("unknown_entry", f"no cache entry matches {key!r}")
        if len(keys) > 1:
            raise _RequestError("unknown_entry",
                                f"{key!r} matches {len(keys)} entries; give more of the key")
        return keys

    async def _lookup(self, chan: AsyncChannel, msg: dict[str, Any], held: set[str]) -> None:
        key = str(msg["key"])
        refresh = bool(msg.get("refresh"))
        announced = False
        while True:
            entry = self.index.get(key)
            if entry is not None and not refresh and not await self._verified(entry):
                continue  # it was corrupt and is gone: look again (a miss now)
            if entry is not None and not refresh:
                self.index.touch(key, hit=not msg.get("own"))
                self.save_soon()
                fds = [self.index.segments[s].fd for s in entry.segments]
                await asyncio.wait_for(chan.send({"ok": True, "hit": True,
                                                  "entry": self._wire_entry(entry)}, fds),
                                       SEND_TIMEOUT)
                return
            lease = self.leases.get(key)
            if lease is None:
                self.leases[key] = _Lease(chan)
                held.add(key)
                await asyncio.wait_for(chan.send({"ok": True, "lease": True}), SEND_TIMEOUT)
                return
            if not announced:
                await asyncio.wait_for(chan.send({"ok": True, "wait": True}), SEND_TIMEOUT)
                announced = True
            try:
                await asyncio.wait_for(lease.released.wait(), KEEPALIVE_SECONDS)
                refresh = False  # whoever held the lease has just loaded it fresh
            except asyncio.TimeoutError:
                await asyncio.wait_for(chan.send({"ok": True, "wait": True}), SEND_TIMEOUT)

    def _release(self, key: str) -> None:
        lease = self.leases.pop(key, None)
        self.index.unreserve(key)
        seg = self.pending.pop(key, None)
        if seg is not None:  # reserved but never stored: nothing half-written stays
            self.store.discard(seg)
        for link in self.pending_links.pop(key, []):
            self.store.discard(link)
        if lease is not None:
            lease.released.set()

    def _reserve(self, msg: dict[str, Any], held: set[str]) -> tuple[dict[str, Any], list[int]]:
        key = str(msg["key"])
        if key not in held:
            raise _RequestError("no_lease", "reserve needs the lease from lookup")
        refs = set(msg.get("refs", []))
        protect = {k for k, e in self.index.entries.items() if refs & set(e.segments)}
        missing = refs - set(self.index.segments) - {
            s.id for s in self.pending_links.get(key, [])}
        if missing:
            raise _RequestError("stale_reference",
                                f"referenced segments were evicted: {sorted(missing)}")
        nbytes = int(msg["nbytes"])
        try:
            evicted = self.index.reserve(key, file_bytes(nbytes), protect)
        except TooLarge as exc:
            raise _RequestError("too_large", f"not cached: {exc}") from None
        if evicted:
            log.info("evicted %d entries to make room: %s", len(evicted), evicted)
            self.save_soon()
        old = self.pending.pop(key, None)
        if old is not None:
            self.store.discard(old)
        try:
            seg, writer = self.store.create(new_segment_id(), nbytes)
        except OSError as exc:
            self.index.unreserve(key)
            raise _RequestError("store_failed", f"cannot create a segment: {exc}") from None
        self.pending[key] = seg
        return {"ok": True, "evicted": evicted,
                "segment": {"id": seg.id, "size": seg.size, "tier": seg.tier}}, [writer]

    def _link(self, msg: dict[str, Any], held: set[str]) -> dict[str, Any]:
        key = str(msg["key"])
        if key not in held:
            raise _RequestError("no_lease", "link needs the lease from lookup")
        links: list[dict[str, Any] | None] = []
        for record in msg.get("files", []):
            seg, why = self.store.link(new_segment_id(), dict(record))
            if seg is None:
                log.info("copying, not referencing, %s: %s", record.get("path"), why)
                links.append(None)
                continue
            self.pending_links.setdefault(key, []).append(seg)
            links.append({"id": seg.id, "size": seg.size})
        return {"ok": True, "links": links}

    def _store(self, msg: dict[str, Any], held: set[str]) -> dict[str, Any]:
        key = str(msg["key"])
        if key not in held:
            raise _RequestError("no_lease", "store needs the lease from lookup")
        seg = self.pending.get(key)
        specs = msg.get("segments", [])
        if seg is None or specs != [{"id": seg.id, "size": seg.size}]:
            raise _RequestError("bad_request", f"store names segments {specs!r}, reserve "
                                               f"made {seg.record() if seg else 'none'}")
        try:
            self.store.commit(seg)
        except (Corrupt, OSError) as exc:
            raise _RequestError("bad_request", str(exc)) from None
        del self.pending[key]
        linked = {s.id: s for s in self.pending_links.pop(key, [])}
        shared = [str(s) for s in msg.get("refs", [])]
        new = [seg, *(linked[s] for s in shared if s in linked)]
        for unused in set(linked) - set(shared):
            self.store.discard(linked[unused])
        missing = [s for s in shared if s not in self.index.segments and s not in linked]
        if missing:
            for dead in new:
                self.store.discard(dead)
            raise _RequestError("stale_reference",
                                f"referenced segments were evicted meanwhile: {missing}")
        entry = Entry(
            key=key, name=str(msg.get("name", key)), cls=str(msg.get("class", "")),
            callable=str(msg.get("callable", "")), source=msg.get("source"),
            own=[seg.id], shared=shared, meta=dict(msg.get("meta", {})),
            tensors=int(msg.get("tensors", 0)),
            cold_seconds=float(msg.get("cold_seconds", 0.0)),
            store_seconds=float(msg.get("store_seconds", 0.0)), call=msg.get("call"),
            validate=msg.get("validate"),
        )
        replaced = self.index.get(key)
        if replaced is not None:  # a refresh in progress goes on showing on the new entry
            entry.refresh = dict(replaced.refresh)
        self.index.unreserve(key)
        self.index.add(entry, new)
        held.discard(key)
        self._release(key)
        self.holders.invalidate()
        log.info("stored %s (%s, %d bytes, %s)", key[:12], entry.name, seg.size, seg.tier)
        if seg.tier == "file":
            self.finishing[seg.id] = seg
            asyncio.ensure_future(self._finish(seg))
        return {"ok": True, "key": key}

    # -- the files: finishing, verifying, saving the index ------------------------------
    async def _finish(self, seg: Segment) -> None:
        try:
            await asyncio.to_thread(self.store.finish, seg)
        except OSError as exc:  # the entry stays, served from its .tmp file until evicted
            log.warning("could not finish segment %s on disk (%s): it will not survive a "
                        "restart", seg.id, exc)
        finally:
            del self.finishing[seg.id]
        if seg.id not in self.index.segments:  # evicted while it was being finished
            self.store.discard(seg)
        self.save_soon()

    def _drop(self, seg: Segment) -> None:
        """The index let go of ``seg``: delete it (after it is finished, if it is)."""
        if seg.id in self.finishing:
            return  # _finish discards it
        fut = self.verifying.get(seg.id)
        if fut is not None:
            fut.add_done_callback(lambda _f: self.store.discard(seg))
        else:
            self.store.discard(seg)

    async def _verified(self, entry: Entry) -> bool:
        """Check the data of segments written by an earlier daemon; evict a corrupt entry."""
        for sid in entry.segments:
            seg = self.index.segments.get(sid)
            stale = seg.changed() if seg is not None else None
            if stale is not None:  # Note [Referenced source files] (client sources module)
                log.warning("entry %s (%s) is stale, it loads cold: %s", entry.key[:12],
                            entry.name, stale)
                if entry.key in self.index.entries:
                    self.index.evict(entry.key)
                    self.save_soon()
                return False
            if seg is None or seg.verified:
                continue
            try:
                await self._verify(seg)
            except (Corrupt, OSError, ValueError) as exc:
                log.warning("rejected a saved entry %s (%s), it loads cold: %s",
                            entry.key[:12], entry.name, exc)
                if entry.key in self.index.entries:
                    self.index.evict(entry.key)
                    self.save_soon()
                return False
        return True

    def _verify(self, seg: Segment) -> asyncio.Future[None]:
        fut = self.verifying.get(seg.id)
        if fut is None:
            fut = asyncio.ensure_future(asyncio.to_thread(self.store.verify, seg))
            self.verifying[seg.id] = fut
            fut.add_done_callback(lambda _f: self.verifying.pop(seg.id, None))
        return fut

    async def _verify_all(self) -> None:
        """After a restart, check saved segments most recently used first (this also
        reads them into the page cache after a reboot; linked source files, which are not
        checksummed, are read ahead by the kernel)."""
        for seg in self.index.segments.values():
            if seg.tier == "link":
                with contextlib.suppress(OSError):
                    os.posix_fadvise(seg.fd, 0, 0, os.POSIX_FADV_WILLNEED)
        for entry in reversed(list(self.index.entries.values())):
            if entry.key in self.index.entries:
                await self._verified(entry)

    def save_soon(self) -> None:
        """Save the index shortly (coalescing changes), in a thread."""
        if not self.store.persistent:
            return
        self._dirty = True
        if self._saver is None or self._saver.done():
            self._saver = asyncio.ensure_future(self._save())

    async def _save(self) -> None:
        while self._dirty:
            await asyncio.sleep(SAVE_DELAY)
            self._dirty = False
            try:
                await asyncio.to_thread(self.store.save_index, snapshot(self.index))
            except OSError as exc:
                log.warning("could not save the index: %s", exc)

    def _report(self, msg: dict[str, Any]) -> None:
        entry = self.index.get(str(msg.get("key")))
        if entry is not None and isinstance(msg.get("seconds"), (int, float)):
            entry.warm_seconds.append(float(msg["seconds"]))
        if entry is not None and msg.get("verified") is True:
            entry.verified += 1

    # -- views ------------------------------------------------------------------------
    def _wire_entry(self, entry: Entry) -> dict[str, Any]:
        return {
            "key": entry.key, "name": entry.name, "meta": entry.meta,
            "segments": [{"id": s, "size": self.index.segments[s].size}
                         for s in entry.segments],
            "cold_seconds": entry.cold_seconds,
        }

    def status(self) -> dict[str, Any]:
        mapped = self.holders.scan()
        for sid in [s for s in self.index.evicted if s not in mapped]:
            del self.index.evicted[sid]
        return {
            "running": True, "pid": os.getpid(), "socket": str(self.path),
            "version": __version__, "started": self.started,
            "uptime_seconds": time.time() - self.started,
            "budget_bytes": self.index.budget, "cached_bytes": self.index.cached_bytes,
            "tier": self.store.tier, "tier_reason": self.store.reason,
            "cache_dir": str(self.store.dir) if self.store.dir else None,
            **self._footprint(),
            "unsaved": len(self.finishing) + len(self.verifying)
            + int(self._dirty or (self._saver is not None and not self._saver.done())),
            "evicted_mapped_bytes": sum(self.index.evicted.values()),
            "entries": len(self.index.entries),
            "memory_total_bytes": total_memory(),
            "memory_available_bytes": available_memory(),
        }

    def _footprint(self) -> dict[str, int]:
        disk = memory = resident = 0
        for seg in self.index.segments.values():
            if seg.tier in ("file", "link"):
                disk += footprint(seg)
            else:
                memory += footprint(seg)
            resident += resident_bytes(seg.fd, seg.size) or 0
        return {"disk_bytes": disk, "memfd_bytes": memory, "resident_bytes": resident}

    def list_entries(self) -> list[dict[str, Any]]:
        mapped = self.holders.scan()
        out = []
        for entry in reversed(self.index.entries.values()):  # most recently used first
            own, shared = self.index.entry_bytes(entry)
            holders: set[int] = set()
            for sid in entry.own or entry.shared:
                holders |= mapped.get(sid, set())
            out.append({
                "key": entry.key, "name": entry.name, "class": entry.cls,
                "callable": entry.callable, "source": entry.source, "bytes": own,
                "shared_bytes": shared, "tensors": entry.tensors, "created": entry.created,
                "last_used": entry.last_used, "hits": entry.hits,
                "verified": entry.verified,
                "cold_seconds": entry.cold_seconds, "store_seconds": entry.store_seconds,
                "warm_seconds": list(entry.warm_seconds), "holders": sorted(holders),
                "replayable": entry.call is not None, "refresh": dict(entry.refresh),
                "resident_bytes": sum(resident_bytes(self.index.segments[s].fd,
                                                     self.index.segments[s].size) or 0
                                      for s in entry.own if s in self.index.segments),
                "tier": sorted({self.index.segments[s].tier for s in entry.own
                                if s in self.index.segments}),
            })
        return out


class _RequestError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
