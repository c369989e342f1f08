"""Fresh measuring processes (:mod:`benchmarks._child`), driven with timeouts.

Every measurement runs in a new ``python -m benchmarks._child`` process. Imports
take several seconds and are not what is measured (they are reported separately), so
:func:`run_sequence` lets a small batch of processes import at the same time and then
tells them, one at a time, to run their timed load: a timed load never overlaps with
anything else the benchmark does, and the next process starts only after the previous one
has exited.

No call here can hang: every wait has a deadline, after which the process group is
killed and the failure recorded.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from overmind_lab._common.naming import SOCKET_ENV

__all__ = ["Child", "ChildError", "Timeouts", "child_env", "run_sequence"]


class ChildError(RuntimeError):
    """A measuring process failed, timed out or broke the protocol."""


@dataclass
class Timeouts:
    ready: float = 300.0  # imports
    load: float = 900.0  # the load (and check) after "go"
    exit: float = 60.0


def child_env(socket: str | None) -> dict[str, str]:
    """Environment of a measuring process: quiet libraries, offline, this daemon socket."""
    env = dict(os.environ)
    env.update({
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "DIFFUSERS_VERBOSITY": "error",
        "TRANSFORMERS_VERBOSITY": "error",
        "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    })
    if socket:
        env[SOCKET_ENV] = socket
    return env


@dataclass
class Child:
    """One measuring process and its JSON-lines protocol."""

    job: dict[str, Any]
    env: dict[str, str]
    log_path: Path
    timeouts: Timeouts = field(default_factory=Timeouts)
    proc: subprocess.Popen[bytes] | None = None
    _buf: bytes = b""
    events: list[dict[str, Any]] = field(default_factory=list)

    def start(self) -> Child:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "benchmarks._child", json.dumps(self.job)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                env=self.env, close_fds=True, start_new_session=True,
            )
        finally:
            log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def _tail(self, n: int = 2000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-n:].decode(errors="replace")

    def expect(self, event: str, timeout: float) -> dict[str, Any]:
        """Wait for the next message *event*; raise :class:`ChildError` on error/exit/timeout."""
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                while b"\n" in self._buf:
                    line, self._buf = self._buf.split(b"\n", 1)
                    try:
                        msg = json.loads(line)
                    except ValueError:
                        continue
                    self.events.append(msg)
                    if msg.get("event") == "error":
                        self.kill()
                        raise ChildError(f"{msg.get('error')}\n{msg.get('traceback', '')}".strip())
                    if msg.get("event") == event:
                        return dict(msg)
                left = deadline - time.monotonic()
                if left <= 0:
                    self.kill()
                    raise ChildError(f"timed out after {timeout:.0f} s waiting for {event!r}; "
                                     f"log tail:\n{self._tail()}")
                if not sel.select(min(left, 1.0)):
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    code = self.proc.wait(timeout=5)
                    raise ChildError(f"exited with status {code} before {event!r}; "
                                     f"log tail:\n{self._tail()}")
                self._buf += chunk

    def send(self, word: str) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(word.encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise ChildError(f"cannot talk to the process: {exc}; log tail:\n{self._tail()}") from exc

    def finish(self) -> int | None:
        """Wait for the process to exit (killing it after the exit timeout)."""
        if self.proc is None:
            return None
        with contextlib.suppress(OSError):
            if self.proc.stdin:
                self.proc.stdin.close()
        try:
            code = self.proc.wait(timeout=self.timeouts.exit)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.proc.wait(timeout=10)
        if self.proc.stdout:
            self.proc.stdout.close()
        return code

    def kill(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


def run_sequence(
    jobs: list[dict[str, Any]],
    *,
    env: dict[str, str],
    log_dir: Path,
    label: str,
    timeouts: Timeouts,
    batch: int = 2,
    before_go: Callable[[int], None] | None = None,
    on_result: Callable[[int, dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run each job in a fresh process; returns one record per job, in order.

    Up to *batch* processes import concurrently; their timed loads then run one at a
    time (``before_go(i)`` first, e.g. to evict the cache), each process exiting before
    the next load starts. A failed job gives ``{"error": ...}`` and the others still run.
    """
    records: list[dict[str, Any]] = [{} for _ in jobs]
    i = 0
    while i < len(jobs):
        group = list(range(i, min(i + max(1, batch), len(jobs))))
        children: dict[int, Child] = {}
        try:
            _run_group(jobs, group, children, records, env, log_dir, label, timeouts,
                       before_go, on_result)
        except BaseException:  # interrupted: no child outlives the benchmark
            for child in children.values():
                child.kill()
            raise
        i = group[-1] + 1
    return records


def _run_group(jobs: list[dict[str, Any]], group: list[int], children: dict[int, Child],
               records: list[dict[str, Any]], env: dict[str, str], log_dir: Path, label: str,
               timeouts: Timeouts, before_go: Callable[[int], None] | None,
               on_result: Callable[[int, dict[str, Any]], None] | None) -> None:
    """Start the processes of one group, then let each load in turn (``run_sequence``)."""
    for j in group:
        children[j] = Child(jobs[j], env, log_dir / f"{label}-{j + 1}.log", timeouts).start()
    ready: dict[int, dict[str, Any]] = {}
    for j in group:
        try:
            ready[j] = children[j].expect("ready", timeouts.ready)
        except ChildError as exc:
            records[j] = {"error": f"import: {exc}"}
            children[j].kill()
    for j in group:
        child = children[j]
        if j not in ready:
            child.finish()
            if on_result:
                on_result(j, records[j])
            continue
        try:
            if before_go is not None:
                before_go(j)
            child.send("go")
            result = child.expect("result", timeouts.load)
            records[j] = {**ready[j], **result}
        except Exception as exc:  # noqa: BLE001 - recorded; the benchmark goes on
            records[j] = {**ready[j], "error": f"{type(exc).__name__}: {exc}"}
            child.kill()
        records[j]["exit_code"] = child.finish()
        if on_result:
            on_result(j, records[j])
