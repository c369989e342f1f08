"""The wire messages, typed: the daemon's (a request and replies per ``Op``; any may be refused
with `ErrorReply`) and the zygote's (Note [The zygote's wire]); a frame is a JSON object
(``_common.protocol``). `JsonObject`: JSON the daemon never looks into. The types describe what
is sent, not a validation: receivers convert each field they read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, TypedDict, get_args

if TYPE_CHECKING:  # typing has it from 3.11; annotations here are strings, never evaluated
    from typing_extensions import NotRequired

__all__ = [
    "Op", "OPS", "JsonObject", "OpRequest", "StatusRequest", "KeyRequest", "LookupRequest",
    "ReserveRequest", "SourceRecord", "LinkRequest", "SegmentSpec", "ReplaySpec", "StoreRequest",
    "ReportRequest", "Request", "OkReply", "ErrorReply", "Status", "StatusReply", "WireSegment",
    "WireEntry", "HitReply", "LeaseReply", "WaitReply", "LookupReply", "NewSegment", "ReserveReply",
    "LinkReply", "StoreReply", "RefreshState", "SourceGone", "EntryJson", "ListReply", "EvictReply",
    "RefreshReply", "StopReply", "Reply", "RefreshJob", "RefreshResult", "ZygoteOp", "ZYGOTE_OPS",
    "ForkRequest", "ZygoteOpRequest", "ZygoteRequest", "ForkReply", "ZygoteRefusal", "ExitReport",
    "ZygoteStatus", "ReplaceReply", "ZygoteReply",
]

#: The daemon's operations, as the ``"op"`` of a request.
Op = Literal["hello", "status", "lookup", "reserve", "link", "store", "abandon", "report",
             "list", "evict", "evict_all", "refresh", "stop"]
OPS: tuple[Op, ...] = get_args(Op)

#: A JSON object the daemon stores and hands back without looking into it.
JsonObject = dict[str, object]


class OpRequest(TypedDict):
    """A request with no fields: ``list``, ``evict_all``, ``stop``."""
    op: Op


class StatusRequest(TypedDict):
    op: Literal["hello", "status"]


class KeyRequest(TypedDict):
    """``abandon``, ``evict``, ``refresh``: a key, a unique prefix or an exact name."""
    op: Literal["abandon", "evict", "refresh"]
    key: str


class LookupRequest(TypedDict):
    op: Literal["lookup"]
    key: str
    refresh: bool  # load it again even if cached (``refreshing()``)
    own: bool  # the loader's read-back right after its store: not counted as a hit


class ReserveRequest(TypedDict):
    op: Literal["reserve"]
    key: str
    nbytes: int
    refs: list[str]  # segment ids the new entry references (protected from eviction)


class SourceRecord(TypedDict):
    """A source file whose unchanged regions are storages of the result."""
    path: str
    dev: int
    ino: int
    size: int
    mtime_ns: int
    #: its page cache is in small folios: the daemon makes a copy to serve (Note [A copy to
    #: serve] in ``_daemon/store.py``)
    small_folios: NotRequired[bool]


class LinkRequest(TypedDict):
    op: Literal["link"]
    key: str
    files: list[SourceRecord]


class SegmentSpec(TypedDict):
    id: str
    size: int


class ReplaySpec(TypedDict):
    """How to re-run a cached call (``Note [Replay]`` in ``_loading.keys``)."""
    callable: str  # ``module:qualname``
    args: list[object]  # JSON-encoded arguments (``_loading.keys.revive`` decodes them)
    kwargs: dict[str, object]
    python: str  # the interpreter that stored the entry
    sys_path: list[str]
    cwd: str


# ``class`` is a keyword: the functional form.
StoreRequest = TypedDict("StoreRequest", {
    "op": Literal["store"],
    "key": str,
    "name": str,  # for people: ``UNet2DConditionModel.from_pretrained('/m/unet')``
    "class": str,  # qualified class of the result
    "callable": str,
    "source": str | None,
    "meta": JsonObject,  # the client's own record of how to rebuild the result
    "segments": list[SegmentSpec],  # the one segment ``reserve`` made, now written
    "refs": list[str],  # segments of other entries or linked files it references
    "tensors": int,
    "cold_seconds": float,
    "store_seconds": float,
    "call": ReplaySpec | None,  # None: the call cannot be replayed
    "validate": JsonObject | None,
})


class _ReportFields(TypedDict):
    op: Literal["report"]
    key: str
    seconds: float  # how long the warm load took


class ReportRequest(_ReportFields, total=False):
    verified: bool  # verify mode compared the hit with a plain load


Request = (OpRequest | StatusRequest | KeyRequest | LookupRequest | ReserveRequest
           | LinkRequest | StoreRequest | ReportRequest)


class OkReply(TypedDict):
    ok: Literal[True]


class ErrorReply(TypedDict):
    ok: Literal[False]
    kind: str  # an ``ErrorKind`` value
    error: str


class _StatusFields(TypedDict):
    running: bool
    socket: str


class SourceGone(TypedDict):
    """An entry the daemon let go because the source file it held went away (Note [Sources let
    go] in ``_daemon/server.py``)."""
    key: str
    name: str
    path: str  # the source file
    why: str  # "source deleted", "source replaced" or "source changed"
    detail: str  # the log's sentence
    at: float  # epoch seconds


class Status(_StatusFields, total=False):
    """The Status JSON (``docs/internals.md``): a running daemon sends all but ``error``; else
    ``running`` (false), ``socket`` and ``error`` (the REST route adds the memory keys)."""
    pid: int
    version: str
    started: float  # epoch seconds
    uptime_seconds: float
    budget_bytes: int
    cached_bytes: int  # what the cache adds, within the budget (Note [What an entry costs])
    held_bytes: int  # the user's own files held open, not in the budget
    held_files: int
    tier: str  # "file" or "memfd"
    tier_reason: str
    cache_dir: str | None
    disk_bytes: int
    memfd_bytes: int
    resident_bytes: int
    copying: int  # held source files being copied to serve (Note [A copy to serve])
    refolding: int  # held source files still in small folios (Note [Refolding a held source])
    refold_passes: int  # refolds running now
    unsaved: int
    evicted_mapped_bytes: int
    entries: int
    #: entries let go since the start because their source file went away, and the last few,
    #: most recent first (Note [Sources let go])
    source_gone_entries: int
    source_gone_recent: list[SourceGone]
    memory_total_bytes: int | None
    memory_available_bytes: int | None
    error: str
    not_answering: bool  # a daemon that accepts but does not reply (pid: its pid, if known)


class StatusReply(Status, OkReply):
    pass


class WireSegment(TypedDict):
    id: str
    size: int


class WireEntry(TypedDict):
    """What a hit needs to rebuild the result (its segments come as fds, in order)."""
    key: str
    name: str
    meta: JsonObject
    segments: list[WireSegment]
    cold_seconds: float


class HitReply(OkReply):
    hit: Literal[True]
    entry: WireEntry


class LeaseReply(OkReply):
    lease: Literal[True]
    #: what the loader should warn about once (the memory tier where files were expected)
    note: NotRequired[str]


class WaitReply(OkReply):
    wait: Literal[True]


LookupReply = HitReply | LeaseReply | WaitReply


class NewSegment(TypedDict):
    id: str
    size: int
    tier: str  # "file" or "memfd"


class ReserveReply(OkReply):
    evicted: list[str]  # keys evicted to make room
    segment: NewSegment


class LinkReply(OkReply):
    links: list[SegmentSpec | None]  # per file: its segment, or None (copy it instead)


class StoreReply(OkReply):
    key: str


class _RefreshFields(TypedDict):
    state: Literal["idle", "running", "done", "failed"]
    message: str
    started: float | None  # epoch seconds


class RefreshState(_RefreshFields, total=False):
    previous: str  # on the entry a refresh stored: the key of the entry it replaced


# The Entry JSON (``docs/internals.md``): one cached result, as ``list`` gives it.
EntryJson = TypedDict("EntryJson", {
    "key": str,
    "name": str,
    "class": str,
    "callable": str,
    "source": str | None,
    "bytes": int,  # own segments
    "shared_bytes": int,  # referenced from other entries
    "held_bytes": int,  # the user's own files it holds open, not in the budget
    "tensors": int,
    "created": float,
    "last_used": float,
    "hits": int,
    "verified": int,  # hits that verify mode found equal to a plain load
    "cold_seconds": float,
    "store_seconds": float,
    "warm_seconds": list[float],  # recent warm loads, newest last
    # median of ``warm_seconds`` (None before a warm load): the speed-up is cold over it
    "warm_median_seconds": float | None,
    "holders": list[int],  # pids that map it now
    "replayable": bool,
    "refresh": RefreshState,
    "resident_bytes": int,
    "tier": list[str],
})


class ListReply(OkReply):
    entries: list[EntryJson]  # most recently used first


class EvictReply(OkReply):
    evicted: list[str]


class RefreshReply(OkReply):
    entry: EntryJson


class StopReply(OkReply):
    pid: int


Reply = (OkReply | ErrorReply | StatusReply | HitReply | LeaseReply | WaitReply | ReserveReply
         | LinkReply | StoreReply | ListReply | EvictReply | RefreshReply | StopReply)


class RefreshJob(TypedDict):
    """What ``_daemon.refresh.Refresher`` sends a refresh worker on its stdin."""
    key: str
    call: ReplaySpec


class RefreshResult(TypedDict, total=False):
    """The worker's last line: ``{"ok": true, "key", "seconds"}`` or ``{"ok": false, "error"}``."""
    ok: bool
    key: str | None
    seconds: float
    error: str


# Note [The zygote's wire]: the provisioner and the launcher (``_common.zygote_client``) and
# ``overmind-lab kernel status|restart-zygote`` talk to a zygote over its Unix socket, in the frames
# of ``_common.protocol``: ``fork`` `ForkRequest` + stdin, stdout, stderr fds -> `ForkReply` + a
# pidfd, later one `ExitReport` on the same connection once reaped; ``status`` -> `ZygoteStatus`;
# ``replace`` -> `ReplaceReply` (Note [Replacing a zygote]); ``owner`` -> `OkReply` (Note [Owners]);
# ``check`` -> `OkReply` (Note [Checked while the old kernel exits]); ``restart_standby``, from a
# launcher's kernel told to restart -> `OkReply`, then the zygote forks its standby (Note [A
# standby for the launcher's restart] in ``_forked/claim.py``); any may be refused:
# `ZygoteRefusal` (``ok: false``, ``reason``).

#: The zygote's operations, as the ``"op"`` of a request.
ZygoteOp = Literal["fork", "status", "replace", "owner", "check", "restart_standby"]
ZYGOTE_OPS: tuple[ZygoteOp, ...] = get_args(ZygoteOp)


class ForkRequest(TypedDict):
    """Fork a kernel: ``python -m MODULE ARGS`` as ``argv``, in ``cwd`` with ``env``."""
    op: Literal["fork"]
    argv: list[str]
    env: dict[str, str]
    cwd: str
    #: give the kernel a pidfd of the requester and exit with it (Note [Parent death])
    watch_parent: bool
    #: the requester's process attributes (``_common.inherit.observe``); empty: the zygote's
    inherit: JsonObject
    #: ``time.monotonic()`` at the restart request: a staleness check that began then or later
    #: stands for this fork's (Note [Checked while the old kernel exits])
    checked_since: NotRequired[float]
    #: Note [A standby for the restart]: fork now, and let the kernel bind its ports and go on
    #: only once the requester writes ``go`` on the descriptor the reply carries after the pidfd
    standby: NotRequired[bool]
    #: a standby's longest wait for ``go``, in seconds (Note [A standby kept ready])
    standby_wait: NotRequired[float]
    #: ``overmind-lab run``: ``argv`` is ``python SCRIPT ARGS`` or ``python -m MODULE ARGS``, run
    #: as plain Python runs it; the child dies with the requester's connection (Note [A script
    #: dies with its run] in ``_zygote/loop.py``)
    script: NotRequired[bool]
    #: the launcher's (``_launcher/stand_in.py``): the kernel asks for a standby when it is told
    #: to restart, and this request claims one forked for an equal launch (Note [A standby for
    #: the launcher's restart] in ``_forked/claim.py``)
    launcher: NotRequired[bool]


class ZygoteOpRequest(TypedDict):
    op: Literal["status", "replace", "owner", "check", "restart_standby"]


ZygoteRequest = ForkRequest | ZygoteOpRequest


class ForkReply(OkReply):
    pid: int
    fork_ms: float  # how long ``os.fork()`` took in the zygote


class ZygoteRefusal(TypedDict):
    ok: Literal[False]
    reason: str


class ExitReport(TypedDict):
    """The forked kernel's exit status (``os.waitstatus_to_exitcode``; -1: unknown)."""
    exit: int


class ZygoteStatus(OkReply):
    pid: int
    identity: str
    socket: str
    python: str
    preloaded: int  # how many modules
    preload_roots: list[str]  # their top-level packages
    failed: list[str]  # preloads that failed, with why
    refusal: str | None  # why it forks nothing (threads, CUDA...), if so
    forks: int
    last_fork_ms: float | None
    kernels: int  # alive now
    standbys: int  # restart standbys of launchers' kernels, waiting now
    standbys_claimed: int  # launches that took such a standby instead of a fork
    owners: list[int]
    uptime_seconds: float
    retiring: str | None
    import_env: list[str]  # variables preloaded modules set at their import
    differences: list[str]  # from a fresh kernel (Note [What a warm kernel does not ...])


class ReplaceReply(OkReply):
    pid: int  # of the retiring zygote


ZygoteReply = ForkReply | ZygoteRefusal | ExitReport | ZygoteStatus | ReplaceReply | OkReply
