"""The ``overmind-lab`` command line as a shell runs it: pipes that close, ``serve --detach``,
exit statuses a ``set -e`` script can live with (Note [Nothing to do is no error] in
``overmind_lab/cli.py``), and bad input answered with the command's usage."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

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


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "overmind_lab", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def test_nothing_to_stop_list_or_evict_is_no_error(sock_path: Path) -> None:
    stop = cli("stop")
    assert (stop.returncode, stop.stdout, stop.stderr) == (
        0, f"no daemon running on {sock_path}\n", "")
    ls = cli("ls")
    assert (ls.returncode, ls.stdout, ls.stderr) == (
        0, f"nothing cached: no daemon running on {sock_path}\n", "")
    ls_json = cli("ls", "--json")
    assert ls_json.returncode == 0 and json.loads(ls_json.stdout) == []
    evict = cli("evict", "--all")
    assert (evict.returncode, evict.stdout) == (
        0, f"evicted 0 entries: no daemon running on {sock_path}\n")
    assert json.loads(cli("evict", "--all", "--json").stdout) == {"evicted": []}
    assert not sock_path.exists()  # none of them started a daemon


def test_a_key_with_no_daemon_and_status_say_none_runs(sock_path: Path) -> None:
    evict = cli("evict", "0123abcd")
    assert (evict.returncode, evict.stdout) == (3, "")
    assert evict.stderr == (f"overmind-lab: no daemon running on {sock_path}: nothing is "
                            "cached, so no entry matches '0123abcd'\n")
    refresh = cli("refresh", "0123abcd")
    assert refresh.returncode == 3
    assert refresh.stderr == (f"overmind-lab: no daemon running on {sock_path}: nothing is "
                              "cached, so no entry matches '0123abcd' to refresh (a load "
                              "caches it, and starts the daemon)\n")
    status = cli("status")
    assert (status.returncode, status.stdout) == (
        3, f"not running (socket {sock_path}); a load starts it, as does "
           "`overmind-lab serve --detach`\n")
    assert not sock_path.exists()


def test_the_stale_socket_of_a_dead_daemon_is_no_daemon(sock_path: Path) -> None:
    with socket.socket(socket.AF_UNIX) as sock:  # bound, never listening: connect is refused
        sock.bind(str(sock_path))
    for args, out in ((["stop"], f"no daemon running on {sock_path}\n"),
                      (["ls"], f"nothing cached: no daemon running on {sock_path}\n")):
        proc = cli(*args)
        assert (proc.returncode, proc.stdout, proc.stderr) == (0, out, ""), args


def test_a_socket_folder_not_to_trust_fails_stop_and_ls(tmp_path: Path) -> None:
    folder = tmp_path / "everyone"
    folder.mkdir()
    folder.chmod(0o777)  # anyone may bind the socket's name first
    sock = folder / "d.sock"
    for args in (["stop"], ["ls"], ["ls", "--json"], ["evict", "--all"], ["evict", "k"],
                 ["refresh", "k"]):
        proc = cli(*args, "--socket", str(sock))
        assert proc.returncode == 3 and proc.stdout == "", (args, proc)
        assert proc.stderr.startswith(f"overmind-lab: refusing the socket folder {folder}: "), \
            (args, proc.stderr)
        assert "set OVERMIND_LAB_SOCKET to a path in a folder only you can write" in proc.stderr
    status = cli("status", "--socket", str(sock))
    assert status.returncode == 3 and status.stdout.startswith(
        f"unavailable (socket {sock})\n  refusing the socket folder {folder}: "), status
    for args in (["kernel", "status"], ["kernel", "restart-zygote"]):  # the zygotes' folder
        proc = cli(*args, "--socket", str(sock))
        assert proc.returncode == 3 and proc.stderr.startswith(
            f"overmind-lab: refusing the zygote socket folder {folder}: "), (args, proc)
    assert not sock.exists()


def test_a_daemon_that_does_not_answer_is_an_error_for_stop_and_ls(daemon: Client) -> None:
    pid = daemon.status()["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        for args in (["stop"], ["ls"]):
            proc = cli(*args, env={"OVERMIND_LAB_ANSWER_TIMEOUT": "0.5"})
            assert proc.returncode == 3 and proc.stdout == "", (args, proc)
            assert f"pid {pid}" in proc.stderr and "does not answer" in proc.stderr, proc.stderr
            assert "overmind-lab stop --force" in proc.stderr, proc.stderr
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert daemon.status()["pid"] == pid  # still there: nothing was stopped


def test_stop_says_what_it_stopped(daemon: Client) -> None:
    proc = cli("stop")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "stopped\n", "")
    assert not daemon.status()["running"]


@pytest.mark.parametrize(("args", "command", "error"), [
    ([], "", "the following arguments are required: COMMAND"),
    (["bogus"], "", "argument COMMAND: invalid choice: 'bogus'"),
    (["refresh"], " refresh", "the following arguments are required: key"),
    (["evict", "a", "b"], " evict", "unrecognized arguments: b"),
    (["ls", "--all"], " ls", "unrecognized arguments: --all"),
    (["stop", "--json"], " stop", "unrecognized arguments: --json"),
    (["kernel", "install", "--bogus"], " kernel", "unrecognized arguments: --bogus"),
    (["serve", "--budget", "lots"], " serve", "invalid size 'lots'"),
])
def test_a_usage_error_shows_the_commands_usage_and_exits_2(
        args: list[str], command: str, error: str, sock_path: Path) -> None:
    proc = cli(*args)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert f"overmind-lab{command}: " in proc.stderr and error in proc.stderr, proc.stderr
    if args[:1] != ["serve"]:
        assert proc.stderr.startswith(f"usage: overmind-lab{command} "), proc.stderr
    assert not sock_path.exists()


def test_evict_needs_a_key_or_all_but_not_both(sock_path: Path) -> None:
    for args in (["evict"], ["evict", "k", "--all"]):
        proc = cli(*args)
        assert (proc.returncode, proc.stderr) == (
            2, "overmind-lab evict: give a KEY or --all (not both)\n"), args


def test_the_help_lists_the_exit_statuses() -> None:
    proc = cli("--help")
    assert proc.returncode == 0
    statuses = proc.stdout.partition("exit status:\n")[2]
    assert [line.split()[0] for line in statuses.splitlines() if line[:3].strip()] == \
        ["0", "1", "2", "3", "130", "141"]
    assert "stop, ls and evict --all when no daemon runs" in statuses
