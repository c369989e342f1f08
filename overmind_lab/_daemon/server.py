"""The per-user cache daemon: an asyncio server on a Unix socket.

It holds sealed memfd segments (that *is* the cache), an index of entries, statistics and
single-flight leases. It never imports torch or user code and never unpickles anything;
it cannot be crashed by a model. Start it with ``overmind-lab serve`` or let the first
client start it (``_serve``: lifetime lock, ``--detach``).

Requests (JSON frames, see ``_protocol``), one connection may send several:

``status``                  -> status object
``lookup {key, refresh?}``  -> ``{hit: true, entry}`` + segment fds, or ``{lease: true}``
                               (you load it), after ``{wait: true}`` and keep-alives while
                               another process loads the same key (single flight)
``reserve {key, nbytes, refs}`` -> make room (LRU eviction) or ``kind: too_large``
``store {key, ...}`` + fds  -> the entry is cached, the lease released
``abandon {key}``           -> release the lease without storing
``report {key, seconds}``   -> a warm load's time, for statistics (no reply)
``list``                    -> ``{entries: [...]}``
``evict {key}`` / ``evict_all`` / ``refresh {key}`` / ``stop``
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import signal
import socket
import struct
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from overmind_lab import __version__
from overmind_lab._common.naming import BUDGET_ENV, SEGMENT_SEALS
from overmind_lab._common.protocol import AsyncChannel
from overmind_lab._common.sizes import available_memory, parse_size, total_memory
from overmind_lab._daemon.holders import HolderScanner
from overmind_lab._daemon.index import Entry, Index, Segment, TooLarge
from overmind_lab._errors import ErrorKind

if TYPE_CHECKING:
    from overmind_lab._daemon.refresh import Refresher

__all__ = ["Daemon", "default_budget", "peer_credentials"]

log = logging.getLogger("overmind_lab.daemon")

#: Fraction of system RAM the cache may hold by default.
DEFAULT_BUDGET_FRACTION = 0.5
KEEPALIVE_SECONDS = 5.0
IDLE_TIMEOUT = 600.0
SEND_TIMEOUT = 30.0


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
    def __init__(self, path: Path, budget: int) -> None:
        self.path = path
        self.index = Index(budget)
        self.holders = HolderScanner()
        self.leases: dict[str, _Lease] = {}
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
        await self.stopping.wait()
        accepting.cancel()
        if self.refresher is not None:
            self.refresher.close()  # Note [Workers outlive no daemon]
        self.index.close()
        log.info("stopped")

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
                await chan.send({"ok": False, "kind": ErrorKind.PERMISSION.value,
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
            # Note [Single flight and takeover]: the first lookup of a missing key gets its
            # lease (``held``); every other lookup of that key waits on ``lease.released``
            # and sends ``wait`` keepalives meanwhile. The holder stores (or gives up with
            # ``release``). If it dies or hangs up mid-load instead, its connection ends
            # here and this ``finally`` releases each lease it still holds: the waiters
            # wake, find no entry, and the first of them takes the lease and loads itself.
            # So one process loads at a time, and a crashed loader never blocks the rest.
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
            try:
                if op == "store":
                    reply, out_fds = self._store(msg, fds, held), list[int]()
                else:
                    for fd in fds:
                        os.close(fd)
                    if op == "lookup":
                        await self._lookup(chan, msg, held)
                        continue
                    if op == "report":
                        self._report(msg)
                        continue
                    reply, out_fds = self._simple(op, msg, held, pid)
            except _RequestError as exc:
                reply, out_fds = {"ok": False, "kind": exc.kind.value, "error": str(exc)}, []
            await asyncio.wait_for(chan.send(reply, out_fds), SEND_TIMEOUT)
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
        if op == "reserve":
            return self._reserve(msg, held), []
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
            return {"ok": True, "evicted": keys}, []
        if op == "evict_all":
            keys = list(self.index.entries)
            for key in keys:
                self.index.evict(key)
            return {"ok": True, "evicted": keys}, []
        if op == "refresh":
            keys = self._resolve(str(msg.get("key", "")))
            if self.refresher is None:
                raise _RequestError(ErrorKind.UNSUPPORTED, "this daemon cannot refresh entries")
            entry = self.refresher.start(self.index.entries[keys[0]])
            return {"ok": True, "entry": entry}, []
        if op == "stop":
            return {"ok": True, "pid": os.getpid()}, []
        raise _RequestError(ErrorKind.BAD_REQUEST, f"unknown operation {op!r}")

    def _resolve(self, key: str) -> list[str]:
        keys = self.index.resolve(key) if key else []
        if not keys:
            raise _RequestError(ErrorKind.UNKNOWN_ENTRY, f"no cache entry matches {key!r}")
        if len(keys) > 1:
            raise _RequestError(ErrorKind.UNKNOWN_ENTRY,
                                f"{key!r} matches {len(keys)} entries; give more of the key")
        return keys

    async def _lookup(self, chan: AsyncChannel, msg: dict[str, Any], held: set[str]) -> None:
        key = str(msg["key"])
        refresh = bool(msg.get("refresh"))
        announced = False
        while True:
            entry = self.index.get(key)
            if entry is not None and not refresh:
                self.index.touch(key, hit=not msg.get("own"))
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
        if lease is not None:
            lease.released.set()

    def _reserve(self, msg: dict[str, Any], held: set[str]) -> dict[str, Any]:
        key = str(msg["key"])
        if key not in held:
            raise _RequestError(ErrorKind.NO_LEASE, "reserve needs the lease from lookup")
        refs = set(msg.get("refs", []))
        protect = {k for k, e in self.index.entries.items() if refs & set(e.segments)}
        missing = refs - set(self.index.segments)
        if missing:
            raise _RequestError(ErrorKind.STALE_REFERENCE,
                                f"referenced segments were evicted: {sorted(missing)}")
        try:
            evicted = self.index.reserve(key, int(msg["nbytes"]), protect)
        except TooLarge as exc:
            raise _RequestError(ErrorKind.TOO_LARGE, f"not cached: {exc}") from None
        if evicted:
            log.info("evicted %d entries to make room: %s", len(evicted), evicted)
        return {"ok": True, "evicted": evicted}

    def _store(self, msg: dict[str, Any], fds: list[int], held: set[str]) -> dict[str, Any]:
        key = str(msg["key"])
        try:
            if key not in held:
                raise _RequestError(ErrorKind.NO_LEASE, "store needs the lease from lookup")
            specs = msg.get("segments", [])
            if len(specs) != len(fds):
                raise _RequestError(ErrorKind.BAD_REQUEST,
                                    f"{len(specs)} segments announced, {len(fds)} fds sent")
            new = [self._check_segment(spec, fd) for spec, fd in zip(specs, fds, strict=True)]
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        shared = [str(s) for s in msg.get("refs", [])]
        missing = [s for s in shared if s not in self.index.segments]
        if missing:
            for seg in new:
                os.close(seg.fd)
            raise _RequestError(ErrorKind.STALE_REFERENCE,
                                f"referenced segments were evicted meanwhile: {missing}")
        entry = Entry(
            key=key, name=str(msg.get("name", key)), cls=str(msg.get("class", "")),
            callable=str(msg.get("callable", "")), source=msg.get("source"),
            own=[s.id for s in new], shared=shared, meta=dict(msg.get("meta", {})),
            tensors=int(msg.get("tensors", 0)),
            cold_seconds=float(msg.get("cold_seconds", 0.0)),
            store_seconds=float(msg.get("store_seconds", 0.0)), call=msg.get("call"),
        )
        replaced = self.index.get(key)
        if replaced is not None:  # a refresh in progress goes on showing on the new entry
            entry.refresh = dict(replaced.refresh)
        self.index.unreserve(key)
        self.index.add(entry, new)
        held.discard(key)
        self._release(key)
        self.holders.invalidate()
        log.info("stored %s (%s, %d bytes)", key[:12], entry.name, sum(s.size for s in new))
        return {"ok": True, "key": key}

    def _check_segment(self, spec: dict[str, Any], fd: int) -> Segment:
        sid = str(spec.get("id", ""))
        if not sid or sid in self.index.segments:
            raise _RequestError(ErrorKind.BAD_REQUEST, f"segment id {sid!r} is missing or reused")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as exc:
            raise _RequestError(ErrorKind.BAD_REQUEST,
                                f"segment {sid} is not a memfd: {exc}") from None
        if seals & SEGMENT_SEALS != SEGMENT_SEALS:
            raise _RequestError(ErrorKind.BAD_REQUEST, f"segment {sid} is not sealed")
        size = os.fstat(fd).st_size
        if size != int(spec.get("size", -1)):
            raise _RequestError(ErrorKind.BAD_REQUEST, f"segment {sid} has {size} bytes, "
                                               f"{spec.get('size')} announced")
        return Segment(id=sid, fd=fd, size=size)

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
            "evicted_mapped_bytes": sum(self.index.evicted.values()),
            "entries": len(self.index.entries),
            "memory_total_bytes": total_memory(),
            "memory_available_bytes": available_memory(),
        }

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
            })
        return out


class _RequestError(Exception):
    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
