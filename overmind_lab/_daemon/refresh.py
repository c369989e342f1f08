"""Refresh: put the current version of a model on disk into the cache.

The daemon re-runs the recorded call (``Note [Replay]`` in ``_loading/keys.py``) inside
``refreshing()`` in a worker (``python -m overmind_lab._loading.refresh_worker``) started with
the interpreter that stored the entry, and drops the old entry if the key changed; an entry
that cannot be replayed is evicted. This side imports only the standard library.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from overmind_lab._common.messages import EntryJson, RefreshJob, RefreshResult
from overmind_lab._common.naming import SOCKET_ENV

if TYPE_CHECKING:  # process.py calls this module's attach; only the types point back
    from overmind_lab._daemon.index import Entry
    from overmind_lab._daemon.server import Daemon

__all__ = ["attach", "Refresher"]

log = logging.getLogger("overmind_lab.refresh")
REFRESH_TIMEOUT = 3600.0


def attach(daemon: Daemon) -> None:
    daemon.refresher = Refresher(daemon)


class Refresher:
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.workers: set[asyncio.subprocess.Process] = set()

    def close(self) -> None:
        """Kill the running workers: the daemon is stopping.

        Note [Workers outlive no daemon]: a worker's client would start a new daemon on the
        socket once this one is gone, a daemon nobody asked for."""
        for proc in self.workers:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        self.workers.clear()

    def start(self, entry: Entry) -> EntryJson:
        """Start refreshing ``entry``; returns the entry as listed."""
        if entry.call is None:
            entry.refresh = {"state": "failed", "started": None,
                             "message": "this load cannot be replayed (its arguments are not "
                                        "plain values); the entry was evicted"}
            view = self._find(entry.key)
            self.daemon.index.evict(entry.key)
            return view
        if entry.key not in self.tasks:
            entry.refresh = {"state": "running", "message": "reloading from source",
                             "started": time.time()}
            task = asyncio.ensure_future(self._run(entry))
            self.tasks[entry.key] = task
            task.add_done_callback(self._done(entry.key))
        return self._find(entry.key)

    def _done(self, key: str) -> Callable[[asyncio.Task[None]], None]:
        def forget(_task: asyncio.Task[None]) -> None:
            self.tasks.pop(key, None)

        return forget

    def _find(self, key: str) -> EntryJson:
        return next(e for e in self.daemon.list_entries() if e["key"] == key)

    async def _run(self, entry: Entry) -> None:
        call = entry.call
        assert call is not None  # start() runs only replayable entries
        env = dict(os.environ)
        env[SOCKET_ENV] = str(self.daemon.path)
        env["PYTHONPATH"] = os.pathsep.join(call.get("sys_path", []))
        job: RefreshJob = {"key": entry.key, "call": call}
        started = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                call.get("python") or sys.executable, "-m", "overmind_lab._loading.refresh_worker",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, cwd=call.get("cwd") or "/", env=env)
            self.workers.add(proc)
            try:
                out, err = await asyncio.wait_for(
                    proc.communicate(json.dumps(job).encode()),
                    REFRESH_TIMEOUT)
            finally:
                self.workers.discard(proc)
        except (OSError, asyncio.TimeoutError) as exc:
            entry.refresh.update({"state": "failed",
                                  "message": f"could not run the refresh: {exc}"})
            return
        seconds = time.monotonic() - started
        result = _last_json(out)
        if proc.returncode != 0 or not result.get("ok"):
            detail = result.get("error") or err.decode(errors="replace").strip()[-500:]
            entry.refresh.update({"state": "failed", "message": f"refresh failed: {detail}"})
            log.warning("refresh of %s failed: %s", entry.key[:12], detail)
            return
        new_key = str(result.get("key"))
        index = self.daemon.index
        if new_key != entry.key and entry.key in index.entries:
            index.evict(entry.key)
        fresh = index.entries.get(new_key)
        message = f"refreshed in {seconds:.1f} s" + (
            " (the source changed: new entry)" if new_key != entry.key else "")
        for target in (entry, fresh):
            if target is not None:
                target.refresh = {"state": "done", "message": message,
                                  "started": entry.refresh.get("started"),
                                  "previous": entry.key}
        log.info("refreshed %s -> %s in %.1f s", entry.key[:12], new_key[:12], seconds)


def _last_json(out: bytes) -> RefreshResult:
    """The worker's result: the last line of its output that is a JSON object."""
    for line in reversed(out.decode(errors="replace").splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return cast(RefreshResult, value)  # what refresh_worker prints, by its word
    return {}
