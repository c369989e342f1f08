"""A hostile cache directory: planted symlinks, FIFOs and devices, an unsafe parent, a
directory swapped while the daemon runs.

Note [The cache directory is used through its descriptor] (daemon store). In each case
the daemon neither follows, hangs nor serves: it refuses with a clear message, and loads
go plain (or cold, then warm, where only a planted file was refused). Real daemons, real
files; devices need root.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from overmind_lab import Client, DaemonUnavailable
from tests.conftest import wait_for_exit
from tests.test_disk_cache import cache_dir, log_text, segment_files, sized_child, wait_saved

pytestmark = pytest.mark.slow  # minutes in all: `make test`, not `make test-fast`

NBYTES = 64 * 1024
PLAIN_LOAD = """
import json, sys, warnings
sys.path.insert(0, {here!r})
import overmind_lab
from tests.loaders import sized_load
warnings.simplefilter("always")
with overmind_lab.record_loads() as ev:
    t = overmind_lab.load(sized_load, 4096, "p")
print(json.dumps(ev[-1].outcome))
"""


def plant_fifo(path: Path) -> None:
    os.mkfifo(path, 0o600)


def plant_device(path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to make a device node")
    os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero: reads never end


def plant_symlink_to(target: Path) -> Callable[[Path], None]:
    def plant(path: Path) -> None:
        path.symlink_to(target)
    return plant


def stored_then_stopped(client: Client) -> float:
    first = sized_child(NBYTES, "h")
    assert first["outcome"] == "cold"
    wait_saved(client)
    client.stop()
    return float(first["sum"])  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["fifo", "device", "symlink"])
def test_a_planted_index_is_neither_followed_nor_waited_on(
        daemon: Client, tmp_path: Path, kind: str) -> None:
    total = stored_then_stopped(daemon)
    index = cache_dir() / "index"
    decoy = tmp_path / "decoy"
    decoy.write_bytes(index.read_bytes())  # a valid index, elsewhere
    index.unlink()
    {"fifo": plant_fifo, "device": plant_device,
     "symlink": plant_symlink_to(decoy)}[kind](index)
    status = daemon.start()  # returns: nothing blocks on a FIFO or reads /dev/zero
    assert status["running"] and status["entries"] == 0
    assert "discarded the saved index" in log_text(daemon.path)
    assert sized_child(NBYTES, "h") == {"outcome": "cold", "sum": total}
    wait_saved(daemon)
    assert stat.S_ISREG(index.lstat().st_mode)  # replaced by a real index, not written through
    assert decoy.read_bytes()[:6] == b"OVLIDX"


@pytest.mark.parametrize("kind", ["fifo", "device", "symlink"])
def test_a_planted_segment_is_refused(daemon: Client, tmp_path: Path, kind: str) -> None:
    total = stored_then_stopped(daemon)
    [seg] = segment_files()
    copy = tmp_path / "copy.seg"
    copy.write_bytes(seg.read_bytes())  # the very bytes: following it would still be wrong
    seg.chmod(0o600)
    seg.unlink()
    {"fifo": plant_fifo, "device": plant_device,
     "symlink": plant_symlink_to(copy)}[kind](seg)
    status = daemon.start()
    assert status["running"] and status["entries"] == 0
    text = log_text(daemon.path)
    assert "dropped a saved entry" in text
    assert ("cannot be opened" in text) if kind == "symlink" else ("not a regular file" in text)
    assert not os.path.lexists(seg)  # collected: unlinked, never followed
    assert copy.exists()
    assert sized_child(NBYTES, "h") == {"outcome": "cold", "sum": total}


def test_a_planted_index_tmp_is_not_written_through(daemon: Client, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    daemon.start()
    (cache_dir() / "index.tmp").symlink_to(victim)
    assert sized_child(NBYTES, "t")["outcome"] == "cold"
    wait_saved(daemon)
    assert victim.read_text() == "precious"
    assert stat.S_ISREG((cache_dir() / "index").lstat().st_mode)


@pytest.mark.parametrize("mode", [0o777, 0o770])
def test_a_parent_others_can_write_is_refused(sock_path: Path, mode: int,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    with tempfile.TemporaryDirectory(prefix="olt-parent-", dir="/tmp") as d:
        parent = Path(d)
        parent.chmod(mode)
        if mode & 0o070:  # group-writable: only unsafe when the group has another user
            os.chown(parent, -1, _a_shared_group())
        monkeypatch.setenv("OVERMIND_LAB_CACHE_DIR", str(parent / "cache"))
        proc = subprocess.run([sys.executable, "-m", "overmind_lab", "serve"],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and f"lies in {parent}, which" in proc.stderr, proc.stderr
        with pytest.raises(DaemonUnavailable, match="could swap it"):
            Client().start()
        # ...and a load runs plainly, with one warning.
        code = PLAIN_LOAD.format(here=str(Path(__file__).parent.parent))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120)
        assert out.stdout.strip().splitlines()[-1] == '"fallback"', out.stderr
        assert "could swap it" in out.stderr
        assert not (parent / "cache").exists()
        parent.chmod(0o1777)  # the sticky bit makes it safe: /tmp is like that
        status = Client().start()
        assert status["tier"] == "file"
        Client().stop()


def _a_shared_group() -> int:
    """A group with a member other than us (skip when there is none)."""
    import grp
    import pwd

    me = pwd.getpwuid(os.getuid()).pw_name
    for group in grp.getgrall():
        if set(group.gr_mem) - {me} and group.gr_gid != os.getgid():
            return group.gr_gid
    for user in pwd.getpwall():
        if user.pw_uid != os.getuid() and user.pw_gid != os.getgid():
            return user.pw_gid
    pytest.skip("no group with another member on this machine")


def test_a_directory_swapped_while_the_daemon_runs_is_not_followed(
        daemon: Client, tmp_path: Path) -> None:
    first = sized_child(NBYTES, "s")
    wait_saved(daemon)
    pid = int(daemon.status()["pid"])
    elsewhere = tmp_path / "theirs"
    elsewhere.mkdir(mode=0o700)
    moved = cache_dir().with_name("cache.old")
    cache_dir().rename(moved)
    cache_dir().symlink_to(elsewhere)
    again = sized_child(NBYTES, "s2")  # a new key: it would store
    assert again["outcome"] == "fallback"
    assert list(elsewhere.iterdir()) == []  # nothing written, nothing read there
    assert "replaced by a symbolic link while the daemon ran" in log_text(daemon.path)
    wait_for_exit(pid, what=f"daemon {pid}")  # it stopped by itself
    # The next daemon checks the path and refuses it; loads stay plain.
    assert sized_child(NBYTES, "s")["outcome"] == "fallback"
    assert list(elsewhere.iterdir()) == []
    assert first["outcome"] == "cold"


