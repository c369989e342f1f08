"""The daemon as a process: start, races, stale sockets, peers, budget, CLI."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import overmind_lab
from overmind_lab import Client, OvermindWarning, UnknownEntry
from tests.conftest import last_json, run_py
from tests.loaders import sized_load
from tests.nobody import NOBODY, package_for_nobody, python_for_nobody


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "overmind_lab", *args], capture_output=True,
                          text=True, timeout=60)
    if check and proc.returncode != 0:
        raise AssertionError(proc.stderr)
    return proc


def daemon_pids(path: Path) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"overmind_lab(\\._daemon)? serve --detach --socket {path}"],
                         capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def test_status_when_not_running_is_a_normal_answer(sock_path: Path) -> None:
    status = Client().status()
    assert status["running"] is False and status["socket"] == str(sock_path)
    proc = cli("status", "--json", check=False)
    assert proc.returncode == 3 and json.loads(proc.stdout)["running"] is False


def test_a_spawned_daemon_imports_this_overmind_lab_whatever_the_cwd() -> None:
    from overmind_lab._loading.client import _daemon_env

    first = _daemon_env()["PYTHONPATH"].split(os.pathsep)[0]
    assert (Path(first) / "overmind_lab" / "__init__.py").resolve() == \
        Path(overmind_lab.__file__).resolve()


def test_racing_clients_start_exactly_one_daemon(sock_path: Path) -> None:
    code = "import json, overmind_lab; print(json.dumps(overmind_lab.Client().start()['pid']))"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              text=True) for _ in range(4)]
    pids = {int(p.communicate(timeout=60)[0].strip()) for p in procs}
    assert len(pids) == 1
    assert daemon_pids(sock_path) == list(pids)
    assert stat.S_IMODE(sock_path.parent.stat().st_mode) & 0o077 == 0  # a private folder
    assert sock_path.stat().st_mode & 0o077 == 0  # the socket is private


def test_stale_socket_of_a_dead_daemon_is_replaced(sock_path: Path) -> None:
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(sock_path))
    dead.close()  # the file stays, nobody listens
    client = Client()
    status = client.start()
    assert status["running"] and status["pid"] != os.getpid()
    assert client.replaced_dead_daemon


@pytest.mark.skipif(os.getuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to run a client as another uid")
def test_a_second_uid_cannot_use_the_daemon(daemon: Client, sock_path: Path) -> None:
    python = python_for_nobody()
    if python is None:
        pytest.skip("uid 65534 can run no Python interpreter on this machine")
    # The client needs only the standard library and the package's own Python files; the
    # checkout itself may lie in a folder uid 65534 cannot enter, so it gets a copy.
    with package_for_nobody() as copy:
        code = (f"import sys, json; sys.path.insert(0, {copy!r}); "
                "from overmind_lab import Client; "
                f"print(json.dumps(Client({str(sock_path)!r}).status()))")
        as_nobody = [*NOBODY, python, "-c", code]
        # Our client, as uid 65534, believes no folder of another user's (Note [Trust no
        # neighbour])...
        sock_path.parent.chmod(0o755)
        out = subprocess.run(as_nobody, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "belongs to uid 0" in json.loads(out.stdout)["error"], out.stdout
    # ...and a raw client that asks anyway, through a file system opened up, is refused by the
    # daemon itself (SO_PEERCRED)
    sock_path.chmod(0o777)
    # (it says so at once, unasked: a request sent and left unread would make its close a reset)
    raw = ("import socket\n"
           "s = socket.socket(socket.AF_UNIX)\n"
           f"s.connect({str(sock_path)!r})\n"
           "data = b''\n"
           "while True:\n"
           "    chunk = s.recv(65536)\n"
           "    if not chunk:\n"
           "        break\n"
           "    data += chunk\n"
           "print(data[4:].decode())\n")
    out = subprocess.run([*NOBODY, python, "-c", raw], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert status["ok"] is False
    assert "does not serve uid 65534" in status["error"]
    assert daemon.status()["running"]


def test_budget_evicts_least_recently_used(sock_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OVERMIND_LAB_BUDGET", "1MiB")
    client = Client()
    assert client.start()["budget_bytes"] == 1024 * 1024
    mb = 400 * 1024
    with overmind_lab.record_loads() as events:
        overmind_lab.load(sized_load, mb, "a")
        overmind_lab.load(sized_load, mb, "bb")
        overmind_lab.load(sized_load, mb, "a")  # a is now more recent than bb
        overmind_lab.load(sized_load, mb, "ccc")  # needs room: bb goes
    key_a, key_b, _, key_c = (e.key for e in events)
    assert [e.outcome for e in events] == ["cold", "cold", "warm", "cold"]
    assert [e["key"] for e in client.entries()] == [key_c, key_a]  # most recent first
    assert client.status()["cached_bytes"] <= 1024 * 1024
    with overmind_lab.record_loads() as events:
        overmind_lab.load(sized_load, mb, "bb")
    assert events[-1].outcome == "cold" and events[-1].key == key_b  # it was evicted


def test_entry_larger_than_the_budget_is_not_cached(sock_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OVERMIND_LAB_BUDGET", "100KiB")
    with pytest.warns(OvermindWarning, match="not cached.*exceed the whole budget"):
        value = overmind_lab.load(sized_load, 200 * 1024, "big")
    assert value.numel() == 50 * 1024
    assert Client().entries() == []


def test_cli_lists_and_evicts(daemon: Client) -> None:
    overmind_lab.load(sized_load, 4096, "x")
    entries = json.loads(cli("ls", "--json").stdout)
    assert {"key", "name", "bytes", "hits", "cold_seconds", "warm_seconds",
            "holders"} <= set(entries[0])
    status = json.loads(cli("status", "--json").stdout)
    assert {"running", "pid", "socket", "budget_bytes", "cached_bytes"} <= set(status)
    assert status["cached_bytes"] >= 4096
    assert "sized_load(4096)" in cli("ls").stdout
    bad = cli("evict", "nope", check=False)
    assert bad.returncode == 1 and "no cache entry matches 'nope'" in bad.stderr
    assert "evicted 1 entry" in cli("evict", entries[0]["key"]).stdout
    assert cli("evict", "--all").stdout.strip() == "evicted 0 entries"
    assert cli("stop").stdout.strip() == "stopped"
    assert not daemon.status()["running"]


def test_unknown_entry_raises(daemon: Client) -> None:
    with pytest.raises(UnknownEntry, match="no cache entry matches 'ffff'"):
        daemon.evict("ffff")


def test_daemon_survives_garbage(daemon: Client, sock_path: Path) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(sock_path))
    s.sendall(b"\x00\x00\x00\x05hello")
    s.close()
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(sock_path))
    s.sendall(b"\xff\xff\xff\xff")
    s.close()
    assert daemon.status()["running"]


def test_daemon_never_imports_torch(daemon: Client) -> None:
    pid = daemon.status()["pid"]
    maps = Path(f"/proc/{pid}/maps").read_text()
    assert "libtorch" not in maps and "_native" not in maps
    proc = run_py("import sys, overmind_lab, overmind_lab.cli, overmind_lab._daemon.server; "
                  "import json; print(json.dumps('torch' in sys.modules))")
    assert last_json(proc) is False


def test_a_clean_stop_removes_the_socket_file(sock_path: Path) -> None:
    """Note [Removing our own socket]: after ``stop`` the path is gone, and the next
    start does not take the leftover for the socket of a daemon that died."""
    client = Client()
    first = client.start()
    assert sock_path.exists()
    assert client.stop()
    assert not sock_path.exists()
    again = Client()
    assert again.start()["pid"] != first["pid"]
    assert not again.replaced_dead_daemon
