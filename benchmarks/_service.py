"""The daemon the benchmark talks to: a private one by default, or the user's.

By default the benchmark starts ``overmind-lab serve`` in the foreground of a child
process, on a socket in a fresh 0700 temporary directory, points every measuring process
at it (``OVERMIND_LAB_SOCKET``) and stops it at the end: the user's own cache is never
touched. Its cache directory is private too, beside the user's (``~/.cache``, a real file
system where the user's is), so that segment files and links to the models behave as
they do for the user. With ``--socket`` it uses that daemon (starting it if needed) and
leaves it running.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from overmind_lab._common.naming import SOCKET_ENV

__all__ = ["PrivateDaemon"]


class PrivateDaemon:
    """A handle on the daemon used by one benchmark run."""

    def __init__(self, socket: str | None, log_path: Path, budget: str | None = None) -> None:
        self.private = socket is None
        self._tmpdir: str | None = None
        if socket is None:
            self._tmpdir = tempfile.mkdtemp(prefix="overmind-bench-")
            os.chmod(self._tmpdir, 0o700)
            socket = os.path.join(self._tmpdir, "daemon.sock")
            from overmind_lab._common.naming import default_cache_dir

            parent = default_cache_dir().parent
            parent.mkdir(parents=True, exist_ok=True)
            self.cache_dir: str | None = tempfile.mkdtemp(prefix="overmind-lab-bench-cache-",
                                                          dir=parent)
        else:
            self.cache_dir = None
        self.socket = os.path.abspath(os.path.expanduser(socket))
        self.log_path = log_path
        self.budget = budget
        self.proc: subprocess.Popen[bytes] | None = None

    def client(self) -> Any:
        from overmind_lab import Client

        return Client(self.socket)

    def start(self, timeout: float = 30.0) -> dict[str, Any]:
        """Start (private) or reach (``--socket``) the daemon; returns its status."""
        if not self.private:
            return dict(self.client().start())
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "overmind_lab", "serve", "--socket", self.socket]
        if self.cache_dir:
            cmd += ["--cache-dir", self.cache_dir]
        if self.budget:
            cmd += ["--budget", self.budget]
        env = dict(os.environ)
        env[SOCKET_ENV] = self.socket
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         env=env, close_fds=True, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.client().status()
            if status.get("running"):
                return dict(status)
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        tail = ""
        with contextlib.suppress(OSError):
            tail = self.log_path.read_text(errors="replace")[-2000:]
        self.stop()
        raise RuntimeError(f"the private overmind-lab daemon did not start ({self.socket}):\n{tail}")

    def wait_quiet(self, timeout: float = 60) -> None:
        """Until the daemon's background work is done: segments finished on disk and the index
        saved (``unsaved``), copies of held files made (``copying``: Note [A copy to serve]),
        held files refolded (``refolding``: Note [Refolding a held source])."""
        self.client().wait_settled(timeout, also=("refolding",))

    def kill_and_restart(self, before_start: Callable[[], object] | None = None
                         ) -> dict[str, Any]:
        """``kill -9`` the private daemon and start a new one on the same cache directory,
        once its saved index is complete (``before_start`` runs in between)."""
        assert self.private and self.proc is not None
        self.wait_quiet()
        self.proc.kill()
        self.proc.wait(timeout=10)
        if before_start is not None:
            before_start()
        return self.start()

    def pid(self) -> int | None:
        status = self.client().status()
        return int(status["pid"]) if status.get("running") and status.get("pid") else None

    def evict_all(self) -> list[str]:
        return list(self.client().evict_all())

    def stop(self) -> None:
        """Stop a private daemon (never the user's) and remove its directory."""
        if not self.private:
            return
        with contextlib.suppress(Exception):
            self.client().stop(timeout=10.0)
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=10)
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
        if self.cache_dir is not None:
            shutil.rmtree(self.cache_dir, ignore_errors=True)
            self.cache_dir = None

    def __enter__(self) -> PrivateDaemon:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
