"""The per-user cache daemon: an asyncio server on a Unix socket.

It holds the segments (``store``), an index of entries saved beside them (``persist``),
statistics and single-flight leases (``leases``); it never imports torch or user code and never
unpickles anything. Each request (a JSON frame, ``_common.protocol``; typed in
``_common.messages``) is run by its ``op``'s entry in ``OPERATIONS``; a refused one is answered
``{ok: false, kind, error}`` (``kind``: an ``ErrorKind``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import resource
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol, TypeVar, cast

from overmind_lab import __version__
from overmind_lab._common.messages import (
    EntryJson,
    ErrorReply,
    HitReply,
    KeyRequest,
    LeaseReply,
    LinkRequest,
    LookupRequest,
    OpRequest,
    Reply,
    ReportRequest,
    ReserveRequest,
    SegmentSpec,
    SourceGone,
    Status,
    StatusRequest,
    StoreRequest,
    WaitReply,
    WireEntry,
)
from overmind_lab._common.naming import BUDGET_ENV
from overmind_lab._common.protocol import AsyncChannel, Frame, peer_credentials
from overmind_lab._common.sizes import available_memory, env_seconds, parse_size, total_memory
from overmind_lab._daemon.holders import HolderScanner
from overmind_lab._daemon.index import Entry, Index, Segment, TooLarge
from overmind_lab._daemon.leases import Leases
from overmind_lab._daemon.persist import restore, snapshot, source_changed
from overmind_lab._daemon.refold import RETRY_SECONDS
from overmind_lab._daemon.store import (
    Corrupt,
    Store,
    cache_dir_wait,
    file_bytes,
    footprint,
    new_segment_id,
    resident_bytes,
)
from overmind_lab._errors import ErrorKind

if TYPE_CHECKING:
    from overmind_lab._daemon.refresh import Refresher

__all__ = ["Daemon", "Watch", "default_budget"]

log = logging.getLogger("overmind_lab.daemon")

#: Fraction of system RAM the cache may hold by default.
DEFAULT_BUDGET_FRACTION = 0.5
KEEPALIVE_SECONDS = 5.0
IDLE_TIMEOUT = 600.0
SEND_TIMEOUT = 30.0
#: Coalesce index writes that follow each other closely (hits, stores, evictions).
SAVE_DELAY = 0.2
#: After a restart, wait this long before reading saved segments' checksums.
SCRUB_DELAY = 2.0


#: Note [Sources let go]: how often held source files are compared with their paths
#: (seconds; ``$OVERMIND_LAB_DAEMON_SOURCE_CHECK``), and how many of the entries let go
#: ``status`` names.
SOURCE_CHECK_SECONDS = 1.0
SOURCE_CHECK_ENV = "OVERMIND_LAB_DAEMON_SOURCE_CHECK"
SOURCE_GONE_HISTORY = 5


class Watch(Protocol):
    """Something ``Daemon.serve`` checks every ``period`` s besides its entries (``process``:
    the socket path, the package): ``check`` returns a new listening socket to accept on,
    why the daemon must stop (it stops as ``stop`` does), or ``None``; in a thread when
    ``blocking`` (then it returns no socket)."""

    period: float
    blocking: bool

    def check(self) -> socket.socket | str | None: ...


def default_budget() -> int:
    env = os.environ.get(BUDGET_ENV)
    if env:
        return parse_size(env)
    return int(total_memory() * DEFAULT_BUDGET_FRACTION)


#: Descriptors the daemon keeps free of segments (Note [Descriptor budget] in ``index``):
#: connections, writers of segments being stored, the listening socket, logs, the index.
FD_RESERVE = 256


def max_segments() -> int:
    """How many segments the daemon may hold open (``RLIMIT_NOFILE`` less the reserve)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max(16, soft - FD_RESERVE)


#: Note [Refolding a held source] (``refold``): ``0`` leaves the page cache of the user's files
#: alone and serves a copy of a file in small folios instead (Note [A copy to serve]).
REFOLD_ENV = "OVERMIND_LAB_REFOLD"
#: How long (s) the daemon waits after a client left before it refolds (others may follow).
REFOLD_SETTLE = 0.25

#: The nice value of the threads that copy sources (Note [Background work yields]).
BACKGROUND_NICE = 19


# Note [Background work yields]: after a first load is stored, the daemon reads and writes
# gigabytes nobody waits for: the copy of a source in small folios (Note [A copy to serve] in
# ``store``, 1.9 GB for SD 1.5). On 2 cores that ran beside the user's next restart and cell at
# the same priority. So copies run in threads of their own at nice 19 (Linux gives a thread its
# own nice value): they take what the user's processes leave. A thread cannot raise its
# priority back unprivileged, hence the separate pool. Not among them: checksums (a hit may
# wait for one: Note [Checks before a hit]), and finishes (``Store.finish``): between its stamp
# check and its trailer write a write to the file would be sealed into the entry, and a thread
# at nice 19 can be preempted there for long; CI once served such a damaged segment warm
# (``test_a_segment_damaged_right_after_its_store_is_dropped``) with finishes in this pool.
def _lower_priority() -> None:
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)


class Daemon:
    def __init__(self, path: Path, budget: int, cache_dir: Path | None = None) -> None:
        self.path = path
        # raises CacheDirRefused: refuse to start; Note [A successor waits for the cache
        # directory]
        self.store = Store(cache_dir, lock_wait=cache_dir_wait())
        self.index = Index(budget, on_drop=self._drop, max_segments=max_segments())
        self.holders = HolderScanner(self.store.dir if self.store.persistent else None)
        self.leases = Leases(on_release=self._discard_reserved)
        self.pending: dict[str, Segment] = {}  # key -> segment reserved, being written
        self.pending_links: dict[str, list[Segment]] = {}  # key -> linked, not stored yet
        self.finishing: dict[str, Segment] = {}  # id -> segment being finished
        self.copying: dict[str, asyncio.Future[None]] = {}  # Note [A copy to serve]
        #: Note [Refolding a held source] (``refold``): passes running, and a client gone
        self.refolding: dict[str, asyncio.Future[None]] = {}
        self._client_left = asyncio.Event()
        self._stopping = threading.Event()  # ends the copies
        #: Note [Background work yields]: copies
        self._background = ThreadPoolExecutor(2, "overmind-lab-background", _lower_priority)
        self.summing: dict[str, asyncio.Future[None]] = {}  # checksums being read
        self._dirty = False
        self._saver: asyncio.Task[None] | None = None
        if self.store.persistent:
            restore(self.store, self.index)
        self.started = time.time()
        self.stopping = asyncio.Event()
        self.refresher: Refresher | None = None  # set by refresh.attach
        #: Note [Sources let go]: how many entries, and the last few
        self.source_gone_entries = 0
        self.source_gone: deque[SourceGone] = deque(maxlen=SOURCE_GONE_HISTORY)
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Future[None] | None = None
        self._clients: set[asyncio.Future[None]] = set()  # referenced until done

    async def serve(self, sock: socket.socket, watches: Sequence[Watch] = ()) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        sock.setblocking(False)
        log.info("serving on %s (pid %d, budget %d bytes)", self.path, os.getpid(),
                 self.index.budget)
        self._listener = sock
        self._accepting = asyncio.ensure_future(self._accept_loop(sock))
        background = [asyncio.ensure_future(self._scrub_all()),
                      asyncio.ensure_future(self._refold_pending()),
                      asyncio.ensure_future(self._watch_sources(
                          env_seconds(SOURCE_CHECK_ENV, SOURCE_CHECK_SECONDS))),
                      *(asyncio.ensure_future(self._watch(w)) for w in watches)]
        await self.stopping.wait()
        self._accepting.cancel()
        for task in background:
            task.cancel()
        if self.refresher is not None:
            self.refresher.close()  # Note [Workers outlive no daemon]
        await self._shutdown()
        log.info("stopped")

    async def _shutdown(self) -> None:
        """Finish the files being written, save the index, let go of the segments."""
        self._stopping.set()
        if self.finishing or self.copying or self.refolding:
            await asyncio.wait([*(asyncio.ensure_future(self._finished(sid))
                                  for sid in list(self.finishing)),
                                *self.copying.values(), *self.refolding.values()], timeout=60)
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
        self._background.shutdown(wait=False)

    async def _finished(self, sid: str) -> None:
        while sid in self.finishing:
            await asyncio.sleep(0.02)

    async def _watch(self, watch: Watch) -> None:
        """Check ``watch`` every ``watch.period`` s (Note [A socket path that moved], Note [A
        daemon whose package is gone] in ``process``)."""
        while not self.stopping.is_set():
            await asyncio.sleep(watch.period)
            try:
                verdict = (await asyncio.to_thread(watch.check) if watch.blocking
                           else watch.check())
            except Exception:  # a check that fails must not end the daemon
                log.exception("a periodic check of the daemon failed")
                continue
            if isinstance(verdict, socket.socket):
                await self._listen(verdict)
            elif verdict is not None and not self.stopping.is_set():
                log.warning("%s: stopping", verdict)
                self.stopping.set()

    async def _listen(self, sock: socket.socket) -> None:
        """Accept on ``sock`` from now on (Note [A socket path that moved]); connections
        queued on the old listener are served, then it is closed."""
        old, accepting = self._listener, self._accepting
        sock.setblocking(False)
        self._listener = sock
        self._accepting = asyncio.ensure_future(self._accept_loop(sock))
        if accepting is not None:
            accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await accepting  # its reader is off the old descriptor before it closes
        if old is None:
            return
        while True:
            try:
                conn, _ = old.accept()
            except OSError:  # BlockingIOError: none left
                break
            self._serve_soon(conn)
        old.close()

    def _serve_soon(self, conn: socket.socket) -> None:
        task = asyncio.ensure_future(self._serve_client(conn))
        self._clients.add(task)
        task.add_done_callback(self._clients.discard)

    async def _accept_loop(self, listener: socket.socket) -> None:
        """Note [Accept never dies]: an ``accept`` error is logged and retried (EMFILE and
        ENFILE evict the oldest entry first), since a daemon that holds its socket and
        answers nobody stalls every load; any other exception stops the daemon, so the next
        load starts one. More in docs/notes.md."""
        loop = asyncio.get_running_loop()
        failing = False  # log the first failure of a run of them, and the recovery
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as exc:
                freed = (self.index.evict_oldest()
                         if exc.errno in (errno.EMFILE, errno.ENFILE) else None)
                if freed:
                    log.warning("accept failed (%s): evicted %s to free descriptors", exc,
                                freed[:12])
                    self.holders.invalidate()
                    self.save_soon()
                elif not failing:
                    log.warning("accept failed (%s); retrying", exc)
                failing = True
                await asyncio.sleep(0.05)
                continue
            except Exception:
                log.exception("the accept loop failed; stopping (the next load starts "
                              "a new daemon)")
                self.stopping.set()
                raise
            if failing:
                log.info("accepting connections again")
                failing = False
            self._serve_soon(conn)

    async def _serve_client(self, sock: socket.socket) -> None:
        conn = Connection(AsyncChannel(sock))
        try:
            pid, uid, _ = peer_credentials(sock)
            if uid != os.getuid():
                log.warning("refused a connection from uid %d (pid %d)", uid, pid)
                await conn.chan.send(_refusal(_RequestError(
                    ErrorKind.PERMISSION, f"the overmind-lab daemon of uid {os.getuid()} "
                                          f"does not serve uid {uid}")))
                return
            self.holders.saw(pid)
            await self._conversation(conn)
        except (ConnectionError, asyncio.TimeoutError) as exc:
            log.info("connection from a client ended: %r", exc)
        except Exception:  # a bad request must never take the daemon down
            log.exception("error while serving a client")
        finally:
            self.leases.release_all(conn)  # Note [Single flight and takeover]
            conn.chan.close()
            self._client_left.set()  # Note [Refolding a held source]

    async def _conversation(self, conn: Connection) -> None:
        while True:
            timeout = None if self.leases.held_by(conn) else IDLE_TIMEOUT
            frame = await asyncio.wait_for(conn.chan.recv(), timeout)
            if frame is None:
                return
            msg, fds = frame
            for fd in fds:  # no request carries descriptors to the daemon any more
                os.close(fd)
            name = msg.get("op")
            operation = OPERATIONS.get(name) if isinstance(name, str) else None
            try:
                if operation is None:
                    raise _RequestError(ErrorKind.BAD_REQUEST, f"unknown operation {name!r}")
                answer = await operation.run(self, conn, msg)
            except _RequestError as exc:
                answer = Answer(_refusal(exc))
            if answer is None:  # it answered for itself (lookup), or needs no answer
                continue
            try:
                await asyncio.wait_for(conn.chan.send(answer.reply, answer.give),
                                       SEND_TIMEOUT)
            finally:
                for fd in answer.give:
                    os.close(fd)
            if operation is not None and operation.last:
                self.stopping.set()
                return

    def _status_op(self, conn: Connection, msg: StatusRequest) -> Answer:
        return Answer({"ok": True, **self.status()})

    def _list_op(self, conn: Connection, msg: OpRequest) -> Answer:
        return Answer({"ok": True, "entries": self.list_entries()})

    def _abandon(self, conn: Connection, msg: KeyRequest) -> Answer:
        key = str(msg.get("key"))
        if self.leases.holds(conn, key):
            self.leases.release(key)
        self.index.unreserve(key)
        return Answer({"ok": True})

    def _evict(self, conn: Connection, msg: KeyRequest) -> Answer:
        keys = self._resolve(str(msg.get("key", "")))
        for key in keys:
            self.index.evict(key)
        self.holders.invalidate()
        self.save_soon()
        return Answer({"ok": True, "evicted": keys})

    def _evict_all(self, conn: Connection, msg: OpRequest) -> Answer:
        keys = list(self.index.entries)
        for key in keys:
            self.index.evict(key)
        self.save_soon()
        return Answer({"ok": True, "evicted": keys})

    def _refresh(self, conn: Connection, msg: KeyRequest) -> Answer:
        keys = self._resolve(str(msg.get("key", "")))
        if self.refresher is None:
            raise _RequestError(ErrorKind.UNSUPPORTED, "this daemon cannot refresh entries")
        entry = self.refresher.start(self.index.entries[keys[0]])
        return Answer({"ok": True, "entry": entry})

    def _stop(self, conn: Connection, msg: OpRequest) -> Answer:
        return Answer({"ok": True, "pid": os.getpid()})

    def _resolve(self, key: str) -> list[str]:
        keys = self.index.resolve(key) if key else []
        if not keys:
            gone = next((g for g in self.source_gone if key and g["key"].startswith(key)), None)
            if gone is not None:  # listed a moment ago: say where it went
                ago = time.time() - gone["at"]
                raise _RequestError(
                    ErrorKind.UNKNOWN_ENTRY,
                    f"entry {key!r} was let go {ago:.0f} s ago ({gone['why']}: "
                    f"{gone['detail']}); the next load caches the model afresh")
            raise _RequestError(ErrorKind.UNKNOWN_ENTRY, f"no cache entry matches {key!r}")
        if len(keys) > 1:
            raise _RequestError(ErrorKind.UNKNOWN_ENTRY,
                                f"{key!r} matches {len(keys)} entries; give more of the key")
        return keys

    async def _lookup(self, conn: Connection, msg: LookupRequest) -> None:
        """Answers for itself: a hit, a lease, or waits then one of those
        (Note [Single flight and takeover])."""
        chan = conn.chan
        key = str(msg["key"])
        refresh = bool(msg.get("refresh"))
        announced = False
        self._check_place()
        while True:
            entry = self.index.get(key)
            if entry is not None and not refresh and not await self._intact(entry):
                continue  # it was corrupt and is gone: look again (a miss now)
            if entry is not None and not refresh:
                self.index.touch(key, hit=not msg.get("own"))
                self.save_soon()
                fds = [self.index.segments[s].serve_fd for s in entry.segments]
                hit: HitReply = {"ok": True, "hit": True, "entry": self._wire_entry(entry)}
                await asyncio.wait_for(chan.send(hit, fds), SEND_TIMEOUT)
                return
            busy = self.leases.acquire(key, conn)
            if busy is None:
                lease: LeaseReply = {"ok": True, "lease": True}
                if self.store.note:
                    lease["note"] = self.store.note
                await asyncio.wait_for(chan.send(lease), SEND_TIMEOUT)
                return
            wait: WaitReply = {"ok": True, "wait": True}
            if not announced:
                await asyncio.wait_for(chan.send(wait), SEND_TIMEOUT)
                announced = True
            if await busy.released(KEEPALIVE_SECONDS):
                refresh = False  # whoever held the lease has just loaded it fresh
            else:
                await asyncio.wait_for(chan.send(wait), SEND_TIMEOUT)

    def _discard_reserved(self, key: str) -> None:
        """A lease went: nothing the key reserved but did not store stays."""
        self.index.unreserve(key)
        seg = self.pending.pop(key, None)
        if seg is not None:  # reserved but never stored: nothing half-written stays
            self.store.discard(seg)
        for link in self.pending_links.pop(key, []):
            self.store.discard(link)

    def _check_place(self) -> None:
        """Refuse and stop once the cache dir's path names another directory (``store``)."""
        why = self.store.displaced()
        if why is None:
            return
        if not self.stopping.is_set():
            log.error("%s: this daemon stops rather than follow it; the next one checks the "
                      "new path (and refuses it unless it is a private directory of yours)",
                      why)
            self.stopping.set()
        raise _RequestError(ErrorKind.STORE_FAILED,
                            f"{why}; the overmind-lab daemon stopped, loads run plainly")

    def _leased(self, conn: Connection, msg: ReserveRequest | LinkRequest | StoreRequest,
                op: str) -> str:
        key = str(msg["key"])
        if not self.leases.holds(conn, key):
            raise _RequestError(ErrorKind.NO_LEASE, f"{op} needs the lease from lookup")
        return key

    def _reserve(self, conn: Connection, msg: ReserveRequest) -> Answer:
        key = self._leased(conn, msg, "reserve")
        self._check_place()
        refs = set(msg.get("refs", []))
        protect = {k for k, e in self.index.entries.items() if refs & set(e.segments)}
        missing = refs - set(self.index.segments) - {
            s.id for s in self.pending_links.get(key, [])}
        if missing:
            raise _RequestError(ErrorKind.STALE_REFERENCE,
                                f"referenced segments were evicted: {sorted(missing)}")
        nbytes = int(msg["nbytes"])
        # Note [What an entry costs]: the source files it holds cost descriptors, not budget.
        try:
            evicted = self.index.reserve(key, file_bytes(nbytes), protect,
                                         segments=1 + len(self.pending_links.get(key, [])))
        except TooLarge as exc:
            raise _RequestError(ErrorKind.TOO_LARGE, f"not cached: {exc}") from None
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
            raise _RequestError(ErrorKind.STORE_FAILED,
                                f"cannot create a segment: {exc}") from None
        self.pending[key] = seg
        return Answer({"ok": True, "evicted": evicted,
                       "segment": {"id": seg.id, "size": seg.size, "tier": seg.tier}},
                      give=(writer,))

    def _link(self, conn: Connection, msg: LinkRequest) -> Answer:
        key = self._leased(conn, msg, "link")
        self._check_place()
        links: list[SegmentSpec | None] = []
        for record in msg.get("files", []):
            seg, why = self.store.link(new_segment_id(), dict(record))
            if seg is None:
                log.info("copying, not referencing, %s: %s", record.get("path"), why)
                links.append(None)
                continue
            self.pending_links.setdefault(key, []).append(seg)
            links.append({"id": seg.id, "size": seg.size})
        return Answer({"ok": True, "links": links})

    def _store(self, conn: Connection, msg: StoreRequest) -> Answer:
        key = self._leased(conn, msg, "store")
        seg = self.pending.get(key)
        specs = msg.get("segments", [])
        if seg is None or specs != [{"id": seg.id, "size": seg.size}]:
            raise _RequestError(ErrorKind.BAD_REQUEST,
                                f"store names segments {specs!r}, reserve "
                                f"made {seg.record() if seg else 'none'}")
        try:
            self.store.commit(seg)
        except (Corrupt, OSError) as exc:
            raise _RequestError(ErrorKind.BAD_REQUEST, str(exc)) from None
        del self.pending[key]
        linked = {s.id: s for s in self.pending_links.pop(key, [])}
        refs = [str(s) for s in msg.get("refs", [])]
        # Note [What an entry costs]: the source files this store holds are its own.
        own = [seg.id, *(s for s in refs if s in linked)]
        shared = [s for s in refs if s not in linked]
        new = [seg, *(linked[s] for s in own[1:])]
        for unused in set(linked) - set(refs):
            self.store.discard(linked[unused])
        missing = [s for s in shared if s not in self.index.segments]
        validate = msg.get("validate")
        changed = source_changed((validate or {}).get("source"))
        if missing or changed:
            for dead in new:
                self.store.discard(dead)
            if changed:  # Note [File signatures] (client keys): read while it changed
                self.index.unreserve(key)
                raise _RequestError(ErrorKind.STORE_FAILED,
                                    f"not cached: the source changed during the load: "
                                    f"{changed}")
            raise _RequestError(ErrorKind.STALE_REFERENCE,
                                f"referenced segments were evicted meanwhile: {missing}")
        entry = Entry(
            key=key, name=str(msg.get("name", key)), cls=str(msg.get("class", "")),
            callable=str(msg.get("callable", "")), source=msg.get("source"),
            own=own, shared=shared, meta=dict(msg.get("meta", {})),
            tensors=int(msg.get("tensors", 0)),
            cold_seconds=float(msg.get("cold_seconds", 0.0)),
            store_seconds=float(msg.get("store_seconds", 0.0)), call=msg.get("call"),
            validate=validate, order=[seg.id, *refs] if own != [seg.id] else None,
        )
        replaced = self.index.get(key)
        if replaced is not None:  # a refresh in progress goes on showing on the new entry
            entry.refresh = replaced.refresh.copy()
        self.index.unreserve(key)
        self.index.add(entry, new)
        self.leases.release(key)  # after index.add: Note [Single flight and takeover]
        self.holders.invalidate()
        log.info("stored %s (%s, %d bytes, %s)", key[:12], entry.name, seg.size, seg.tier)
        if seg.tier == "file":
            self.finishing[seg.id] = seg
            asyncio.ensure_future(self._finish(seg))
        for held in new[1:]:
            if held.small_folios:  # Note [Refolding a held source] (``refold``)
                self._refold_soon(held)
        # Note [What a store promises]: "cached in this daemon" (these bytes or a miss, for
        # every later asker), not yet on disk: a crash keeps the entry whole or not at all
        # (``unsaved == 0`` once kept). More in docs/notes.md.
        return Answer({"ok": True, "key": key})

    def _refold_soon(self, seg: Segment) -> None:
        if seg.id in self.refolding or seg.id in self.copying:
            return
        if os.environ.get(REFOLD_ENV, "1") == "0":  # the user's page cache left alone: a copy
            seg.small_folios = False
            self.copying[seg.id] = asyncio.ensure_future(self._copy(seg))
            return
        self.refolding[seg.id] = asyncio.ensure_future(self._refold(seg))

    async def _refold(self, seg: Segment) -> None:
        """Note [Refolding a held source] (``refold``): in a background thread, from a duplicate
        of the held descriptor (an eviction meanwhile cannot close it under the pass). Done:
        served as it is; busy: again later (``_refold_pending``); where the file system keeps
        no large folios: the copy (Note [A copy to serve])."""
        path = (seg.source or {}).get("path")
        try:
            src = os.dup(seg.fd)
        except OSError:
            del self.refolding[seg.id]
            return
        try:
            done, why = await asyncio.get_running_loop().run_in_executor(
                self._background, self.store.refold_source, seg, src, self._stopping)
        except OSError as exc:
            done, why = None, str(exc)
        finally:
            os.close(src)
            del self.refolding[seg.id]
        if seg.id not in self.index.segments or self._stopping.is_set():
            return
        if done is None:  # the copy, which says for itself where it cannot be made either
            log.info("not refolding %s: %s", path, why)
            seg.small_folios = False
            self.copying[seg.id] = asyncio.ensure_future(self._copy(seg))
        elif done.done:
            seg.small_folios = False
            log.info("refolded %s: %d MiB in large folios (%.2f s)", path, seg.size >> 20,
                     done.seconds)
        elif done.unable:
            log.info("%s stays in small folios (its file system keeps no large ones): a "
                     "copy serves it", path)
            seg.small_folios = False  # not refolded again
            self.copying[seg.id] = asyncio.ensure_future(self._copy(seg))
        elif done.busy:
            log.debug("refolding %s: %d of %d windows mapped by a process, later",
                      path, done.busy, done.windows)

    async def _refold_pending(self) -> None:
        """Refold the held files still in small folios once a client went away (the process
        that mapped one may be gone) or every ``RETRY_SECONDS`` (Note [Refolding a held
        source])."""
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._client_left.wait(), RETRY_SECONDS)
            await asyncio.sleep(REFOLD_SETTLE)  # one pass for clients that leave together
            self._client_left.clear()
            for seg in list(self.index.segments.values()):
                if seg.tier == "link" and seg.small_folios and seg.fd >= 0:
                    self._refold_soon(seg)

    async def _copy(self, seg: Segment) -> None:
        """Note [A copy to serve] (``store``): made in a thread from a duplicate of the held
        descriptor, served once the source is still what the entry holds."""
        path = (seg.source or {}).get("path")
        try:
            fd, why = await self._make_copy(seg)
        finally:
            del self.copying[seg.id]
        if fd < 0:
            log.info("serving %s as it is: no copy (%s)", path, why)
            return
        seg.serve_copy(fd)
        if seg.id not in self.index.segments or seg.fd < 0 or seg.changed() is not None:
            self.store.drop_copy(seg)  # evicted or changed meanwhile
            return
        log.info("serving %s from a copy in large folios (%d bytes)", path, seg.size)

    async def _make_copy(self, seg: Segment) -> tuple[int, str]:
        """``Store.copy_source``'s answer, or why no copy is tried."""
        # Note [What an entry costs]: a copy is the cache's own bytes; those made count already
        making = sum(self.index.segments[s].size for s in self.copying
                     if s != seg.id and s in self.index.segments)
        if self.index.cached_bytes + making + seg.size > self.index.budget:
            return -1, "it does not fit in the budget"
        try:
            src = os.dup(seg.fd)
        except OSError as exc:
            return -1, str(exc)
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._background, self.store.copy_source, seg, src, self._stopping)
        finally:
            os.close(src)

    async def _finish(self, seg: Segment) -> None:
        try:
            await asyncio.to_thread(self.store.finish, seg)
        except OSError as exc:  # the entry stays, served from its .tmp file until evicted
            log.warning("could not finish segment %s on disk (%s): it will not survive a "
                        "restart", seg.id, exc)
        except Corrupt as exc:
            self._reject(seg, str(exc))
        finally:
            del self.finishing[seg.id]
        if seg.id not in self.index.segments:  # evicted while it was being finished
            self.store.discard(seg)
        self.save_soon()

    def _drop(self, seg: Segment) -> None:
        """The index let go of ``seg``: delete it (after it is finished, if it is)."""
        if seg.id in self.finishing:
            return  # _finish discards it
        fut = self.summing.get(seg.id)
        if fut is not None:
            fut.add_done_callback(lambda _f: self.store.discard(seg))
        else:
            self.store.discard(seg)

    async def _intact(self, entry: Entry) -> bool:
        """Whether every segment passes Note [Checks before a hit] (``store``); if not, the
        entry is evicted (logged once) and the caller answers a miss."""
        for sid in entry.segments:
            seg = self.index.segments.get(sid)
            if seg is None:
                continue
            why = seg.check()
            if why is None and seg.copy_moved():  # Note [A copy to serve]: the source again
                log.warning("the copy of %s changed on disk: serving the file itself",
                            (seg.source or {}).get("path"))
                self.store.drop_copy(seg)
            if why is None and not seg.sum_ok:
                try:
                    await self._check_sum(seg)
                except (Corrupt, OSError, ValueError) as exc:
                    why = str(exc)
            if why is not None:
                self._reject(seg, why)
                return False
        return True

    def _reject(self, seg: Segment, why: str) -> None:
        """``seg`` failed a check: every entry that uses it goes, with one log line."""
        for key in [k for k, e in self.index.entries.items() if seg.id in e.segments]:
            entry = self.index.evict(key)
            log.warning("dropped entry %s (%s), it loads cold: %s", key[:12], entry.name,
                        why)
        self.holders.invalidate()
        self.save_soon()

    async def _watch_sources(self, period: float) -> None:
        """Note [Sources let go]: every ``period`` s, let go of the entries whose held source
        file went away.

        A held source file (Note [Source files are held, not linked] in ``store``) is the
        user's own. Deleted (``rm -rf`` of a model folder, a hub cache cleaned) or replaced
        (a download renamed over its path), it stays alive through the daemon's descriptor and
        the copy it serves (Note [A copy to serve]): the disk space never comes back and the
        mount stays busy until an eviction or ``stop``, though no hit may use it any more (the
        check before a hit refuses it). So each held file is compared with its path
        (``Segment.source_gone``: an ``fstat`` and a ``stat``) and every entry using one that
        went is evicted as eviction does: descriptors, copy (one being made stops at its next
        window), segment files; processes that mapped it keep their mappings (Note [Eviction
        and mappings]). The stats run in a thread, so a hung network mount stalls this task
        and never a request; a verdict is acted on back in the event loop only for a segment
        the index still holds (the same object): nothing closed its descriptor meanwhile, only
        a drop from the index does. An error that tells nothing (EACCES, EIO) leaves the entry
        to the check before a hit. ``status`` counts the entries let go
        (``source_gone_entries``) and names the last few (``source_gone_recent``; an evict or
        a refresh of one of those says it was let go, and why). An entry being refreshed is
        left alone: the user re-saved the model and clicked refresh, whose result replaces the
        entry, so a sidebar sees the old entry's progress, then the new entry, never neither
        in between (a failed refresh leaves it to the next check). The cache directory itself
        is checked too (one ``lstat``): removed (``rm -rf ~/.cache``) or replaced, the daemon
        stops as ``stop`` does, so its files go with it; the next load starts a daemon on a
        fresh directory."""
        while True:
            await asyncio.sleep(period)
            why = self.store.displaced()  # the whole cache directory removed or replaced
            if why is not None:
                log.error("%s: this daemon stops and lets its files go; the next load starts "
                          "one on that path", why)
                self.stopping.set()
                return
            held = [s for s in self.index.segments.values() if s.tier == "link"]
            if not held:
                continue
            gone = await asyncio.to_thread(_sources_gone, held)
            for seg, (what, why) in gone:
                if self.index.segments.get(seg.id) is seg and not self._refreshing(seg):
                    self._let_go(seg, what, why)

    def _refreshing(self, seg: Segment) -> bool:
        """Whether an entry that uses ``seg`` is being refreshed (Note [Sources let go]):
        the refresh replaces it when done, and a failed one leaves it to the next check."""
        tasks = self.refresher.tasks if self.refresher is not None else {}
        return any(seg.id in self.index.entries[key].segments
                   for key in tasks if key in self.index.entries)

    def _let_go(self, seg: Segment, what: str, why: str) -> None:
        """Evict every entry that uses ``seg``, whose source went away (Note [Sources let
        go])."""
        path = str((seg.source or {}).get("path", ""))
        for key in [k for k, e in self.index.entries.items() if seg.id in e.segments]:
            entry = self.index.evict(key)
            self.source_gone_entries += 1
            self.source_gone.appendleft({"key": key, "name": entry.name, "path": path,
                                         "why": what, "detail": why, "at": time.time()})
            log.warning("let go of entry %s (%s): %s: %s", key[:12], entry.name, what, why)
        self.holders.invalidate()
        self.save_soon()

    def _check_sum(self, seg: Segment) -> asyncio.Future[None]:
        fut = self.summing.get(seg.id)
        if fut is None:
            fut = asyncio.ensure_future(asyncio.to_thread(self.store.check_sum, seg))
            self.summing[seg.id] = fut
            fut.add_done_callback(lambda _f: self.summing.pop(seg.id, None))
        return fut

    async def _scrub_all(self) -> None:
        """After a restart, checksum every saved segment once, most recently used first,
        after a pause that leaves the first loads the disk (Note [Checks before a hit])."""
        for seg in self.index.segments.values():
            if seg.tier == "link":
                with contextlib.suppress(OSError):
                    os.posix_fadvise(seg.fd, 0, 0, os.POSIX_FADV_WILLNEED)
        if not any(not s.scrubbed for s in self.index.segments.values()):
            return
        await asyncio.sleep(SCRUB_DELAY)
        for entry in reversed(list(self.index.entries.values())):
            for sid in entry.segments:
                saved = self.index.segments.get(sid)
                if saved is None or saved.scrubbed or saved.tier != "file":
                    continue
                try:
                    await self._check_sum(saved)
                except (Corrupt, OSError, ValueError) as exc:
                    if saved.id in self.index.segments:
                        self._reject(saved, str(exc))

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

    async def _report(self, conn: Connection, msg: ReportRequest) -> None:
        """A warm load's time, for statistics; no answer."""
        entry = self.index.get(str(msg.get("key")))
        if entry is not None and isinstance(msg.get("seconds"), (int, float)):
            entry.warm_seconds.append(float(msg["seconds"]))
        if entry is not None and msg.get("verified") is True:
            entry.verified += 1

    def _wire_entry(self, entry: Entry) -> WireEntry:
        return {
            "key": entry.key, "name": entry.name, "meta": entry.meta,
            "segments": [{"id": s, "size": self.index.segments[s].size}
                         for s in entry.segments],
            "cold_seconds": entry.cold_seconds,
        }

    def status(self) -> Status:
        mapped = self.holders.scan()
        for sid in [s for s in self.index.evicted if s not in mapped]:
            del self.index.evicted[sid]
        disk, memory, resident = self._footprint()
        return {
            "running": True, "pid": os.getpid(), "socket": str(self.path),
            "version": __version__, "started": self.started,
            "uptime_seconds": time.time() - self.started,
            "budget_bytes": self.index.budget, "cached_bytes": self.index.cached_bytes,
            "held_bytes": self.index.held_bytes, "held_files": sum(
                1 for s in self.index.segments.values() if s.tier == "link"),
            "tier": self.store.tier, "tier_reason": self.store.reason,
            "cache_dir": str(self.store.dir) if self.store.dir else None,
            "disk_bytes": disk, "memfd_bytes": memory, "resident_bytes": resident,
            "copying": len(self.copying),
            "refolding": sum(1 for s in self.index.segments.values()
                             if s.tier == "link" and s.small_folios),
            "refold_passes": len(self.refolding),
            "unsaved": len(self.finishing) + len(self.summing)
            + int(self._dirty or (self._saver is not None and not self._saver.done())),
            "evicted_mapped_bytes": sum(self.index.evicted.values()),
            "entries": len(self.index.entries),
            "source_gone_entries": self.source_gone_entries,
            "source_gone_recent": [g.copy() for g in self.source_gone],
            "memory_total_bytes": total_memory(),
            "memory_available_bytes": available_memory(),
        }

    def _footprint(self) -> tuple[int, int, int]:
        """Bytes of segments on disk, in memfds, and resident in memory now."""
        disk = memory = resident = 0
        for seg in self.index.segments.values():
            if seg.tier in ("file", "link"):  # a held file's: its copy's (the file is yours)
                disk += footprint(seg)
            else:
                memory += footprint(seg)
            resident += resident_bytes(seg.serve_fd, seg.size) or 0
        return disk, memory, resident

    def list_entries(self) -> list[EntryJson]:
        mapped = self.holders.scan()
        out: list[EntryJson] = []
        for entry in reversed(self.index.entries.values()):  # most recently used first
            own, shared = self.index.entry_bytes(entry)
            holders: set[int] = set()
            for sid in entry.own or entry.shared:
                holders |= mapped.get(sid, set())
            out.append({
                "key": entry.key, "name": entry.name, "class": entry.cls,
                "callable": entry.callable, "source": entry.source, "bytes": own,
                "shared_bytes": shared, "held_bytes": self.index.entry_held(entry),
                "tensors": entry.tensors, "created": entry.created,
                "last_used": entry.last_used, "hits": entry.hits,
                "verified": entry.verified,
                "cold_seconds": entry.cold_seconds, "store_seconds": entry.store_seconds,
                "warm_seconds": list(entry.warm_seconds),
                "warm_median_seconds": entry.warm_median, "holders": sorted(holders),
                "replayable": entry.call is not None, "refresh": entry.refresh.copy(),
                "resident_bytes": sum(resident_bytes(self.index.segments[s].serve_fd,
                                                     self.index.segments[s].size) or 0
                                      for s in entry.own if s in self.index.segments),
                "tier": sorted({self.index.segments[s].tier for s in entry.own
                                if s in self.index.segments}),
            })
        return out


def _sources_gone(held: list[Segment]) -> list[tuple[Segment, tuple[str, str]]]:
    """The held source files no longer at their paths (in a thread: Note [Sources let go])."""
    return [(seg, gone) for seg in held if (gone := seg.source_gone()) is not None]


class _RequestError(Exception):
    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _refusal(exc: _RequestError) -> ErrorReply:
    return {"ok": False, "kind": exc.kind.value, "error": str(exc)}


class Connection:
    """One client's connection: its channel, and the owner of the leases it takes."""
    def __init__(self, chan: AsyncChannel) -> None:
        self.chan = chan


class Answer(NamedTuple):
    """A reply to send, with descriptors handed over with it (closed once sent)."""
    reply: Reply
    give: tuple[int, ...] = ()


R = TypeVar("R")  # the request type of one operation


@dataclass(frozen=True)
class Operation:
    """How the daemon runs a request: ``run`` returns the answer, or ``None`` when the
    operation answers itself (``lookup``) or not at all (``report``); ``last``: the
    connection and the daemon end after the answer (``stop``)."""
    run: Callable[[Daemon, Connection, Frame], Awaitable[Answer | None]]
    last: bool = False


def _answers(handler: Callable[[Daemon, Connection, R], Answer], *,
             last: bool = False) -> Operation:
    """An operation answered with the one reply ``handler`` returns."""

    async def run(daemon: Daemon, conn: Connection, frame: Frame) -> Answer:
        return handler(daemon, conn, cast(R, frame))

    return Operation(run, last)


def _answers_itself(handler: Callable[[Daemon, Connection, R], Awaitable[None]]
                    ) -> Operation:
    """An operation that sends its own replies, or none."""

    async def run(daemon: Daemon, conn: Connection, frame: Frame) -> None:
        await handler(daemon, conn, cast(R, frame))

    return Operation(run)


#: The operations, by the ``op`` of a request (``_common.messages``).
OPERATIONS: dict[str, Operation] = {
    "hello": _answers(Daemon._status_op),
    "status": _answers(Daemon._status_op),
    "lookup": _answers_itself(Daemon._lookup),
    "reserve": _answers(Daemon._reserve),
    "link": _answers(Daemon._link),
    "store": _answers(Daemon._store),
    "abandon": _answers(Daemon._abandon),
    "report": _answers_itself(Daemon._report),
    "list": _answers(Daemon._list_op),
    "evict": _answers(Daemon._evict),
    "evict_all": _answers(Daemon._evict_all),
    "refresh": _answers(Daemon._refresh),
    "stop": _answers(Daemon._stop, last=True),
}
