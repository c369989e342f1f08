"""REST handlers of the Jupyter server extension, under ``<base_url>/overmind-lab/api/v1/``,
behind Jupyter's authentication. JSON in and out; an error is ``{"message": ..., "kind": ...}``.
The sidebar's ``GET`` polls are not user activity (``_track_activity = False``), so an open
sidebar keeps no idle server from being culled; daemon calls run on the extension's own thread
pool, never the event loop.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web
from tornado.ioloop import IOLoop
from traitlets import Int, Unicode
from traitlets.config import Configurable

from overmind_lab._common.lookup import match_keys
from overmind_lab._common.messages import EntryJson, Status
from overmind_lab._common.sizes import available_memory, total_memory
from overmind_lab._errors import DaemonUnavailable, OvermindError, UnknownEntry

if TYPE_CHECKING:
    from overmind_lab._loading.client import Client

__all__ = ["API_PREFIX", "OvermindLab", "setup_handlers"]

#: Path of the REST API below the server's ``base_url``.
API_PREFIX = "overmind-lab/api/v1"

T = TypeVar("T")


class OvermindLab(Configurable):
    """Settings of the overmind-lab server extension (``c.OvermindLab.<name>``)."""
    socket_path = Unicode(
        None,
        allow_none=True,
        config=True,
        help="""Daemon socket the sidebar talks to. Default: the client's own choice
        ($OVERMIND_LAB_SOCKET when set, else the per-user socket), i.e. the same daemon
        that kernels started by this server use.""",
    )

    threads = Int(
        4,
        config=True,
        help="""Threads that make the (short, blocking) daemon calls for the REST
        handlers. They are separate from the server's default executor, so a slow daemon
        cannot hold up contents or kernel requests.""",
    )

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.executor = ThreadPoolExecutor(
            max_workers=max(1, self.threads), thread_name_prefix="overmind-lab"
        )
        self.api_root = ""

    def client(self) -> Client:
        # A client per call: it reads OVERMIND_LAB_SOCKET when built and holds no connection.
        from overmind_lab._loading.client import Client

        return Client(socket_path=self.socket_path)

    async def call(self, fn: Callable[[Client], T]) -> T:
        """Run ``fn(client)`` on the extension's thread pool."""
        return await IOLoop.current().run_in_executor(self.executor, lambda: fn(self.client()))


def _with_memory(status: Status) -> Status:
        # The daemon reports system memory; when it is down, read here for the sidebar's bar.
    if status.get("memory_total_bytes") is None:
        status["memory_total_bytes"] = total_memory()
    if status.get("memory_available_bytes") is None:
        status["memory_available_bytes"] = available_memory()
    return status


def _status(client: Client) -> Status:
    try:
        status = client.status()
    except OvermindError as exc:
        # A daemon that answers garbage is reported, not turned into a 500.
        status = {"running": False, "socket": str(client.path), "error": str(exc)}
    return _with_memory(status)


class _Handler(APIHandler):
    """Base: JSON in and out, daemon errors translated to HTTP statuses."""

    @property
    def overmind(self) -> OvermindLab:
        return self.settings["overmind_lab"]  # type: ignore[no-any-return]

    def reply(self, data: object, status: int = 200) -> None:
        self.set_status(status)
        self.finish(json.dumps(data))

    def fail(self, status: int, kind: str, message: str) -> None:
        # Written by hand: HTTPError would %-format messages that quote keys from the URL.
        self.set_status(status)
        self.finish(json.dumps({"message": message, "kind": kind}))

    async def daemon(self, fn: Callable[[Client], T]) -> tuple[bool, T | None]:
        """Call the daemon; on a daemon error write the JSON error and return False."""
        try:
            return True, await self.overmind.call(fn)
        except UnknownEntry as exc:
            self.fail(404, "unknown_entry", str(exc))
        except DaemonUnavailable as exc:
            self.fail(
                503,
                "daemon_unavailable",
                f"{exc} (start it from the sidebar, POST daemon/start, or run "
                "`overmind-lab serve`)",
            )
        except OvermindError as exc:
            self.fail(502, "daemon_error", str(exc))
        return False, None


class StatusHandler(_Handler):
    _track_activity = False  # polled by the sidebar

    @web.authenticated
    async def get(self) -> None:
        ok, status = await self.daemon(_status)
        if ok:
            self.reply(status)


class EntriesHandler(_Handler):
    _track_activity = False  # polled by the sidebar

    @web.authenticated
    async def get(self) -> None:
        ok, entries = await self.daemon(_entries)
        if ok:
            self.reply({"entries": entries})


def _entries(client: Client) -> list[EntryJson]:
    try:
        return client.entries()
    except DaemonUnavailable:
        return []  # no daemon, no entries: a normal state, not an error


class EntryHandler(_Handler):
    _track_activity = False

    @web.authenticated
    async def get(self, key: str) -> None:
        ok, entries = await self.daemon(_entries)
        if not ok:
            return
        listed = entries or []
        keys = match_keys(key, ((str(e.get("key", "")), str(e.get("name", ""))) for e in listed))
        found = [e for e in listed if e.get("key") in keys]
        if len(found) == 1:
            self.reply(found[0])
        elif not found:
            self.fail(404, "unknown_entry", f"no cache entry matches {key!r}")
        else:
            self.fail(
                404,
                "unknown_entry",
                f"{key!r} matches {len(found)} entries; give more of the key",
            )


class EvictHandler(_Handler):
    @web.authenticated
    async def post(self, key: str) -> None:
        ok, evicted = await self.daemon(lambda c: c.evict(key))
        if ok:
            self.reply({"evicted": evicted})


class RefreshHandler(_Handler):
    @web.authenticated
    async def post(self, key: str) -> None:
        ok, entry = await self.daemon(lambda c: c.refresh(key))
        if ok:
            self.reply({"entry": entry}, status=202)


class EvictAllHandler(_Handler):
    @web.authenticated
    async def post(self) -> None:
        ok, evicted = await self.daemon(lambda c: c.evict_all())
        if ok:
            self.reply({"evicted": evicted})


class StartDaemonHandler(_Handler):
    @web.authenticated
    async def post(self) -> None:
        ok, status = await self.daemon(lambda c: _with_memory(c.start()))
        if ok:
            self.reply(status)


class ZygotesHandler(_Handler):
    _track_activity = False  # polled by the sidebar

    @web.authenticated
    async def get(self) -> None:
        from overmind_lab._jupyter_server.kernelspec import zygotes

        found = await self.overmind.call(lambda _client: zygotes())
        self.reply({"zygotes": found})


class RestartZygotesHandler(_Handler):
    @web.authenticated
    async def post(self) -> None:
        from overmind_lab._jupyter_server.kernelspec import restart_zygotes

        pids = await self.overmind.call(lambda _client: restart_zygotes())
        self.reply({"restarted": pids})


_KEY = r"(?P<key>[^/]+)"

ROUTES: list[tuple[str, type[_Handler]]] = [
    ("status", StatusHandler),
    ("entries", EntriesHandler),
    (f"entries/{_KEY}", EntryHandler),
    (f"entries/{_KEY}/evict", EvictHandler),
    (f"entries/{_KEY}/refresh", RefreshHandler),
    ("evict-all", EvictAllHandler),
    ("daemon/start", StartDaemonHandler),
    ("zygotes", ZygotesHandler),
    ("zygotes/restart", RestartZygotesHandler),
]


def setup_handlers(serverapp: Any) -> OvermindLab:
    """Add the REST routes to ``serverapp.web_app``; return the extension's settings."""
    web_app = serverapp.web_app
    overmind = OvermindLab(parent=serverapp)
    base_url = web_app.settings["base_url"]
    overmind.api_root = url_path_join(base_url, API_PREFIX)
    web_app.settings["overmind_lab"] = overmind
    host_pattern = ".*$"
    web_app.add_handlers(
        host_pattern,
        [(url_path_join(overmind.api_root, path) + "/?", handler) for path, handler in ROUTES],
    )
    return overmind
