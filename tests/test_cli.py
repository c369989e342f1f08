"""The ``overmind-lab`` command line as a shell runs it: pipes that close, ``serve --detach``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from overmind_lab import Client


def _cli_into_closed_pipe(*args: str) -> subprocess.CompletedProcess[bytes]:
    """Run the CLI with stdout a pipe whose reader is already gone (as ``| head -3`` is
    once it has read its lines): every write fails with EPIPE, deterministically."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, "-m", "overmind_lab", *args], stdout=write_end,
                              stderr=subprocess.PIPE, timeout=120)
    finally:
        os.close(write_end)


def test_a_reader_that_stops_reading_gets_no_traceback(daemon: Client) -> None:
    for args in (["status"], ["status", "--json"], ["ls"], ["kernel", "status"]):
        proc = _cli_into_closed_pipe(*args)
        assert proc.stderr == b"", (args, proc.stderr.decode())
        assert proc.returncode == 141, args  # as a shell reports a command SIGPIPE ended


def test_serve_detach_says_what_it_started(sock_path: Path) -> None:
    def serve() -> str:
        return subprocess.run([sys.executable, "-m", "overmind_lab", "serve", "--detach",
                               "--socket", str(sock_path)], capture_output=True, text=True,
                              timeout=120, check=True).stdout.strip()

    first = serve()
    pid = Client(sock_path).status()["pid"]
    assert first == f"daemon started: pid {pid}, socket {sock_path}, log {sock_path}.log"
    assert serve() == f"daemon already running: pid {pid}, socket {sock_path}, " \
                      f"log {sock_path}.log"
    status = json.loads(subprocess.run(
        [sys.executable, "-m", "overmind_lab", "status", "--json"], capture_output=True,
        text=True, timeout=120, check=True).stdout)
    assert status["pid"] == pid and re.fullmatch(r"\d+\.\d+\.\d+.*", status["version"])
