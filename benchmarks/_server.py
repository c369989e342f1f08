"""A real ``jupyter server`` for the benchmark, and a kernel driven through it.

:class:`JupyterServer` runs ``python -m jupyter_server`` in its own process group on a
free port with a random token (``rest-entries``, ``warm-kernel``); :meth:`~JupyterServer.stop`
ends the group whatever happens. :class:`WsKernel` is what JupyterLab does with a kernel:
REST to start, restart and delete it, and the server's websocket
(``api/kernels/<id>/channels``, the JSON wire format) for ``kernel_info`` and ``execute``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

__all__ = ["JupyterServer", "WsKernel", "free_port"]

SERVER_START_TIMEOUT = 60.0
REQUEST_TIMEOUT = 30.0
#: Deleting a kernel at cleanup waits no longer (the server's stop kills what is left).
CLOSE_TIMEOUT = 30.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class JupyterServer:
    """A ``jupyter server`` in its own process group, stopped by :meth:`stop`."""

    def __init__(self, env: dict[str, str], log_path: Path, base_url: str = "/",
                 extra_args: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.token = secrets.token_hex(24)
        self.base_url = base_url
        self.root = f"http://127.0.0.1:{self.port}{base_url}"
        self.log_path = log_path
        self.env = env
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None
        # localhost requests must never go through a proxy from the environment
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self, timeout: float = SERVER_START_TIMEOUT) -> float:
        """Start the server and wait until it answers; returns the seconds that took."""
        cmd = [sys.executable, "-m", "jupyter_server", "--no-browser", "--allow-root",
               f"--port={self.port}", "--ip=127.0.0.1", f"--ServerApp.token={self.token}",
               f"--ServerApp.base_url={self.base_url}", "--ServerApp.port_retries=0",
               *self.extra_args]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         env=self.env, close_fds=True, start_new_session=True)
        deadline = time.monotonic() + timeout
        url = f"{self.root}api/status?token={self.token}"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter server exited with {self.proc.returncode} "
                                   f"before answering; see {self.log_path}")
            with contextlib.suppress(OSError, urllib.error.URLError):
                with self.opener.open(url, timeout=2.0) as resp:
                    if resp.status == 200:
                        return time.perf_counter() - t0
            time.sleep(0.2)
        raise RuntimeError(f"jupyter server did not answer {self.base_url}api/status within "
                           f"{timeout:.0f} s; see {self.log_path}")

    def request(self, method: str, path: str, body: Any = None,
                timeout: float = REQUEST_TIMEOUT) -> tuple[float, bytes]:
        """A request to a path under the base URL; returns (seconds, body)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.root + path, data=data, method=method,
                                     headers={"Authorization": f"token {self.token}",
                                              "Content-Type": "application/json"})
        t0 = time.perf_counter()
        with self.opener.open(req, timeout=timeout) as resp:
            answer = resp.read()
        return time.perf_counter() - t0, answer

    def get(self, path: str) -> tuple[float, bytes]:
        """``GET`` a path under the base URL; returns (seconds, body)."""
        return self.request("GET", path)

    def stop(self) -> None:
        """Terminate the server's process group (SIGTERM, then SIGKILL after 10 s)."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            if self.proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait)
        # anything the server left in its group (it was started in a new session)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)


class WsKernel:
    """A kernel of a :class:`JupyterServer`, as JupyterLab drives one: REST for its
    lifecycle, the server's websocket for messages."""

    def __init__(self, server: JupyterServer, kernel_name: str, timeout: float,
                 mark: Callable[[str], None] | None = None) -> None:
        self.server = server
        #: Called with a step's name (``client.*``) as it happens (the restart timeline).
        self.mark = mark or (lambda event: None)
        self.timeout = timeout
        self.session = uuid.uuid4().hex
        _, body = server.request("POST", "api/kernels", {"name": kernel_name}, timeout=timeout)
        self.id = str(json.loads(body)["id"])
        self.ws: Any = None
        self.connect()
        self.kernel_info()

    def connect(self) -> None:
        import websocket  # websocket-client, a dependency of jupyter_server

        if self.ws is not None:
            with contextlib.suppress(Exception):
                self.ws.close()
        url = (f"ws://127.0.0.1:{self.server.port}{self.server.base_url}api/kernels/{self.id}"
               f"/channels?session_id={self.session}")
        self.ws = websocket.create_connection(
            url, header=[f"Authorization: token {self.server.token}"], timeout=self.timeout,
            http_proxy_host=None, http_no_proxy=["127.0.0.1"])

    def _send(self, msg_type: str, content: dict[str, Any]) -> str:
        msg_id = uuid.uuid4().hex
        self.ws.send(json.dumps({
            "header": {"msg_id": msg_id, "msg_type": msg_type, "session": self.session,
                       "username": "bench", "version": "5.3",
                       "date": datetime.now(timezone.utc).isoformat()},
            "parent_header": {}, "metadata": {}, "content": content, "channel": "shell",
            "buffers": []}))
        return msg_id

    def _replies(self, msg_id: str) -> Any:
        """Messages of this websocket that answer ``msg_id``, until the deadline."""
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"kernel {self.id}: no answer in {self.timeout:.0f} s")
            self.ws.settimeout(left)
            raw = self.ws.recv()
            if not isinstance(raw, str):
                continue  # the JSON wire format only; binary frames are not ours
            msg = json.loads(raw)
            if msg.get("parent_header", {}).get("msg_id") == msg_id:
                yield msg

    def kernel_info(self) -> float:
        """Seconds from the request to the ``kernel_info_reply``."""
        t0 = time.perf_counter()
        msg_id = self._send("kernel_info_request", {})
        for msg in self._replies(msg_id):
            if msg["msg_type"] == "kernel_info_reply":
                return time.perf_counter() - t0
        raise AssertionError("unreachable")

    def restart(self) -> float:
        """JupyterLab's restart: ``POST .../restart`` (the server answers once the new
        kernel replied to its own ``kernel_info``), a new websocket, ``kernel_info``.
        Seconds from the request to the first ``kernel_info_reply`` on the websocket."""
        t0 = time.perf_counter()
        self.mark("client.restart_request")
        self.server.request("POST", f"api/kernels/{self.id}/restart", {}, timeout=self.timeout)
        self.mark("client.restart_reply")
        self.connect()
        self.mark("client.ws_connected")
        self.kernel_info()
        self.mark("client.kernel_info_reply")
        return time.perf_counter() - t0

    def execute(self, code: str) -> tuple[float, str]:
        """Run a cell; (seconds until its reply and idle status, its stdout). Raises on
        an error in the cell."""
        t0 = time.perf_counter()
        self.mark("client.execute_request")
        msg_id = self._send("execute_request", {
            "code": code, "silent": False, "store_history": True, "user_expressions": {},
            "allow_stdin": False, "stop_on_error": True})
        out: list[str] = []
        reply: dict[str, Any] | None = None
        idle = False
        for msg in self._replies(msg_id):
            kind, content = msg["msg_type"], msg.get("content", {})
            if kind == "stream" and content.get("name") == "stdout":
                out.append(content.get("text", ""))
            elif kind == "execute_reply":
                reply = content
                self.mark("client.execute_reply")
            elif kind == "status" and content.get("execution_state") == "idle":
                idle = True
            if reply is not None and idle:
                break
        seconds = time.perf_counter() - t0
        assert reply is not None
        if reply.get("status") != "ok":
            raise RuntimeError(f"cell failed in kernel {self.id}: {reply.get('ename')}: "
                               f"{reply.get('evalue')}")
        return seconds, "".join(out)

    def close(self) -> None:
        """Close the websocket and delete the kernel (errors ignored: cleanup)."""
        if self.ws is not None:
            with contextlib.suppress(Exception):
                self.ws.close()
            self.ws = None
        with contextlib.suppress(Exception):
            self.server.request("DELETE", f"api/kernels/{self.id}", timeout=CLOSE_TIMEOUT)
