"""The client side of trust (Note [Trust no neighbour]) and a daemon that does not answer (Note [A
daemon that does not answer]): real second-uid servers, real stopped daemons, fresh processes.

- A server of another uid on the daemon's or the zygote's socket name receives not one byte from
  a load, the CLI, ``status`` or a zygote request; the load goes plain with one warning naming it.
- A socket folder others can write is refused before anything is created in it.
- A stopped daemon costs one process one short deadline; every later load, in any process, goes
  plain without connecting; ``status`` says "not answering" with the pid; ``stop --force`` ends it
  and the next load starts a new daemon.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from overmind_lab import Client
from overmind_lab._common import learned, zygote_client
from overmind_lab._common.trust import Untrusted, check_folder
from tests.conftest import last_json, run_py
from tests.nobody import NOBODY, python_for_nobody

HERE = str(Path(__file__).resolve().parents[1])

# A server as uid 65534: it logs how many bytes each connection sent it, and answers with a
# forged status frame (which a believing client would print).
HOSTILE = textwrap.dedent("""
    import json, os, socket, struct, sys
    folder = sys.argv[1]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(os.path.join(folder, "d.sock"))
    s.listen(64)
    print("ready", flush=True)
    forged = json.dumps({"ok": True, "running": True, "pid": 1, "forged": True}).encode()
    while True:
        c, _ = s.accept()
        try:
            c.sendall(struct.pack(">I", len(forged)) + forged)
        except OSError:
            pass
        got = 0
        while True:
            try:
                data = c.recv(65536)
            except OSError:
                break
            if not data:
                break
            got += len(data)
        c.close()
        with open(os.path.join(folder, "log"), "a") as f:
            f.write(f"{got}\\n")
""")


@contextlib.contextmanager
def hostile_server(target: Path) -> Iterator[Path]:
    """A server run by uid 65534 whose socket file is then moved to ``target`` (the name a
    client will use); yields its log (one line per connection: the bytes it received)."""
    python = python_for_nobody()
    if python is None:
        pytest.skip("no interpreter that uid 65534 can run")
    with tempfile.TemporaryDirectory(prefix="olt-hostile-", dir="/tmp") as folder:
        os.chown(folder, 65534, 65534)
        proc = subprocess.Popen([*NOBODY, python, "-c", HOSTILE, folder],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            os.rename(Path(folder) / "d.sock", target)
            yield Path(folder) / "log"
        finally:
            proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
            with contextlib.suppress(FileNotFoundError):
                target.unlink()


def connections(log: Path) -> list[int]:
    return [int(n) for n in log.read_text().split()] if log.exists() else []


def wait_for_connections(log: Path, count: int) -> list[int]:
    """The log once it holds ``count`` connections (each is logged when the client hangs up)."""
    import time

    deadline = time.monotonic() + 60
    while len(connections(log)) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    return connections(log)


def test_a_server_of_another_uid_gets_not_one_byte(sock_path: Path) -> None:
    with hostile_server(sock_path) as log:
        status = Client(sock_path).status()
        assert status["running"] is False and "forged" not in status
        assert "uid 65534" in status["error"] and "Nothing was sent" in status["error"]
        cli = subprocess.run([sys.executable, "-m", "overmind_lab", "status"],
                             capture_output=True, text=True, timeout=120)
        assert cli.returncode != 0 and "uid 65534" in cli.stdout + cli.stderr, cli
        proc = run_py(f"""
            import json, sys, warnings, overmind_lab
            sys.path.insert(0, {HERE!r})
            from tests.loaders import sized_load
            with warnings.catch_warnings(record=True) as caught, \\
                    overmind_lab.record_loads() as events:
                warnings.simplefilter("always")
                a = overmind_lab.load(sized_load, 4096, "a")
                b = overmind_lab.load(sized_load, 4096, "b")
            print(json.dumps({{"outcomes": [e.outcome for e in events],
                              "warnings": [str(w.message) for w in caught]}}))
        """)
        out = last_json(proc)
        assert out["outcomes"] == ["fallback", "fallback"]
        [warning] = out["warnings"]  # one, naming the server and what to do
        assert "uid 65534" in warning and "OVERMIND_LAB_SOCKET" in warning
        assert wait_for_connections(log, 4) == [0, 0, 0, 0]
        assert not sock_path.with_name("d.sock.lock").exists()  # no daemon was started


def test_a_zygote_socket_of_another_uid_gets_not_one_byte(sock_path: Path) -> None:
    env = {"OVERMIND_LAB_SOCKET": str(sock_path), "SECRET_TOKEN": "x"}
    target = zygote_client.ZygotePaths.for_launch(sys.executable, env).socket
    assert target.parent == sock_path.parent
    with hostile_server(target) as log:
        with pytest.raises(Untrusted, match="uid 65534"):
            zygote_client.ask(target, {"op": "status"})
        r, w = os.pipe()
        try:  # a fork request would carry these descriptors and the whole environment
            with pytest.raises(zygote_client.WarmUnavailable, match="uid 65534"):
                zygote_client.request_fork(
                    [sys.executable, "-m", "ipykernel_launcher", "-f", "x.json"],
                    env, "/", [r, w, w], watch_parent=False)
        finally:
            os.close(r)
            os.close(w)
        assert wait_for_connections(log, 2) == [0, 0]


def test_a_socket_folder_others_can_write_is_refused(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # sticky does not help: a name can still be taken first
    sock = shared / "d.sock"
    monkeypatch.setenv("OVERMIND_LAB_SOCKET", str(sock))
    monkeypatch.setenv("OVERMIND_LAB_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(Untrusted, match="written by every user"):
        check_folder(shared)
    status = Client().status()
    assert status["running"] is False and "written by every user" in status["error"]
    proc = run_py(f"""
        import json, sys, warnings, overmind_lab
        sys.path.insert(0, {HERE!r})
        from tests.loaders import sized_load
        with warnings.catch_warnings(record=True) as caught, overmind_lab.record_loads() as ev:
            warnings.simplefilter("always")
            overmind_lab.load(sized_load, 4096, "a")
        print(json.dumps({{"outcome": ev[-1].outcome,
                          "warnings": [str(w.message) for w in caught]}}))
    """)
    out = last_json(proc)
    assert out["outcome"] == "fallback"
    assert "written by every user" in out["warnings"][0]
    assert sorted(p.name for p in shared.iterdir()) == []  # nothing created there
    os.chmod(shared, 0o700)
    check_folder(shared)


def test_files_beside_the_socket_must_be_ours(tmp_path: Path) -> None:
    path = tmp_path / "zygote-x.learned.json"
    path.write_text(json.dumps({"modules": ["json"]}))
    os.chmod(path, 0o600)
    assert learned.read_learned(path) == ["json"]
    os.chown(path, 65534, 65534)  # planted by another user
    assert learned.read_learned(path) == []
    os.chown(path, os.getuid(), os.getgid())
    os.chmod(path, 0o666)  # or writable by them
    assert learned.read_learned(path) == []
    os.chmod(path, 0o600)
    link = tmp_path / "link.learned.json"
    link.symlink_to(path)
    assert learned.read_learned(link) == []


LOAD_TWICE = f"""
    import json, socket, sys, warnings, overmind_lab
    sys.path.insert(0, {HERE!r})
    from tests.loaders import sized_load
    daemon_path = overmind_lab.Client().path
    calls = []
    real_connect = socket.socket.connect
    def connect(self, address):
        if address == str(daemon_path):
            calls.append(address)
        return real_connect(self, address)
    socket.socket.connect = connect
    with warnings.catch_warnings(record=True) as caught, overmind_lab.record_loads() as ev:
        warnings.simplefilter("always")
        a = overmind_lab.load(sized_load, 4096, "a")
        b = overmind_lab.load(sized_load, 4096, "b")
    print(json.dumps({{"outcomes": [e.outcome for e in ev], "connects": len(calls),
                      "warnings": [str(w.message) for w in caught],
                      "sums": [float(a.sum()), float(b.sum())]}}))
"""


def test_a_stopped_daemon_costs_one_deadline_then_nothing(daemon: Client) -> None:
    pid = daemon.status()["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        first = last_json(run_py(LOAD_TWICE, env={"OVERMIND_LAB_ANSWER_TIMEOUT": "1"}))
        assert first["outcomes"] == ["fallback", "fallback"]
        assert first["connects"] == 1  # the second load learned it from the first
        [warning] = first["warnings"]
        assert f"pid {pid}" in warning and "stop --force" in warning
        assert first["sums"] == [1024.0, 1024.0]
        # another process learns it from the mark, without connecting at all
        second = last_json(run_py(LOAD_TWICE))
        assert second["outcomes"] == ["fallback", "fallback"] and second["connects"] == 0
        status = Client(daemon.path).status()
        assert status["running"] is False and status["not_answering"] is True
        assert status["pid"] == pid
        cli = subprocess.run([sys.executable, "-m", "overmind_lab", "status"],
                             capture_output=True, text=True, timeout=120)
        assert "not answering" in cli.stdout and str(pid) in cli.stdout, cli
        assert "stop --force" in cli.stdout
        stop = subprocess.run([sys.executable, "-m", "overmind_lab", "stop", "--force"],
                              capture_output=True, text=True, timeout=120)
        assert stop.returncode == 0, stop
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
    third = last_json(run_py(LOAD_TWICE))  # a new daemon, started by the load
    assert third["outcomes"] == ["cold", "cold"] and third["connects"] >= 2
    assert Client(daemon.path).status()["pid"] != pid


def test_a_daemon_resumed_is_asked_again(daemon: Client) -> None:
    pid = daemon.status()["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        first = last_json(run_py(LOAD_TWICE, env={"OVERMIND_LAB_ANSWER_TIMEOUT": "1"}))
        assert first["outcomes"] == ["fallback", "fallback"]
    finally:
        os.kill(pid, signal.SIGCONT)
    again = last_json(run_py(LOAD_TWICE))
    assert again["outcomes"] == ["cold", "cold"] and again["warnings"] == []
    assert not daemon.path.with_name(daemon.path.name + ".silent").exists()
    assert daemon.status()["pid"] == pid


def test_serve_refuses_a_socket_folder_others_can_write(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    proc = subprocess.run([sys.executable, "-m", "overmind_lab", "serve", "--detach",
                           "--socket", str(shared / "d.sock"),
                           "--cache-dir", str(tmp_path / "cache")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "written by every user" in proc.stderr, proc
    assert list(shared.iterdir()) == []


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a folder to another uid")
def test_check_folder_over_generated_owners_and_modes(tmp_path: Path) -> None:
    """Note [Trust no neighbour], rule 1, over every owner and mode a folder can have: it passes
    exactly when it is ours and no other user can write it (a sticky bit changes nothing)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from overmind_lab._common.trust import others_in_group

    folder = tmp_path / "f"
    folder.mkdir()

    @settings(max_examples=200, deadline=None)
    @given(mode=st.integers(0, 0o1777), uid=st.sampled_from([os.getuid(), 65534]),
           gid=st.sampled_from([os.getgid(), 65534]))
    def check(mode: int, uid: int, gid: int) -> None:
        os.chown(folder, uid, gid)
        os.chmod(folder, mode)
        trusted = (uid == os.getuid() and not mode & 0o002
                   and not (mode & 0o020 and others_in_group(gid)))
        try:
            check_folder(folder)
        except Untrusted as exc:
            assert not trusted, exc
            assert str(folder) in str(exc) and "OVERMIND_LAB_SOCKET" in str(exc)
        else:
            assert trusted, (oct(mode), uid, gid)

    try:
        check()
    finally:
        os.chown(folder, os.getuid(), os.getgid())
        os.chmod(folder, 0o700)


def test_a_private_folder_in_a_folder_others_can_rename_is_refused(tmp_path: Path) -> None:
    """The socket's folder is ours and 0700, but it sits in a folder every user can write
    without the sticky bit: another user could rename it away and put theirs in its place."""
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    os.chmod(open_parent, 0o777)
    mine = open_parent / "mine"
    mine.mkdir(mode=0o700)
    with pytest.raises(Untrusted, match=f"lies in {open_parent}"):
        check_folder(mine)
    os.chmod(open_parent, 0o1777)  # sticky: only the owner may rename what it holds
    check_folder(mine)
