"""Nothing stale, nothing corrupt: replaced sources, damaged segments, the budget, crashes.

Real daemons on temporary sockets with their own cache directories (``sock_path``), real
child processes that load through the cache, real files changed the way tools change them
(``cp -p``/``rsync -a``: a new inode with the old size and mtime; a rewrite in place
through a second hard link with the mtime set back; a bit flipped in a segment file).
Note [File signatures] (client keys) and Note [Checks before a hit] (daemon store).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from overmind_lab import Client
from tests.conftest import last_json, run_py
from tests.test_disk_cache import (
    HERE,
    cache_dir,
    kill_and_restart,
    log_text,
    segment_files,
    sized_child,
    wait_saved,
)

pytestmark = pytest.mark.slow  # minutes in all: `make test`, not `make test-fast`

# A child that loads a safetensors file through the cache, by path (the key covers the
# file), or by ``$OVERMIND_LAB_TEST_FILE`` (``load_named_file``: only the daemon's check of
# the held file can tell that it changed).
LOAD_FILE = """
import json, sys
sys.path.insert(0, {here!r})
import overmind_lab
from safetensors.torch import load_file
from tests.loaders import load_named_file
with overmind_lab.record_loads() as events:
    if {by_path!r}:
        sd = overmind_lab.load(load_file, {path!r})
    else:
        sd = overmind_lab.load(load_named_file, "weights")
print(json.dumps({{"outcome": events[-1].outcome, **({{"reason": events[-1].reason}} if events[-1].outcome == "uncached" else {{}}),
                  "sums": [float(sd[k].double().sum()) for k in sorted(sd)]}}))
"""


def load_file_child(path: Path, *, by_path: bool, code: str = LOAD_FILE) -> dict[str, object]:
    env = {**os.environ, "OVERMIND_LAB_TEST_FILE": str(path),
           "OVERMIND_LAB_BACKGROUND_STORE": "never"}
    return dict(last_json(run_py(code.format(here=HERE, path=str(path), by_path=by_path),
                                 env=env)))


def save_weights(path: Path, value: float) -> Path:
    """Two 512 KiB tensors of ``value``: same size for every value."""
    import torch
    from safetensors.torch import save_file

    save_file({"a": torch.full((128, 1024), value), "b": torch.full((128, 1024), value)},
              str(path))
    return path


def sums(value: float) -> list[float]:
    return [value * 128 * 1024] * 2


def restore_times(path: Path, st: os.stat_result) -> None:
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def replace_keeping_size_and_mtime(weights: Path, value: float) -> None:
    """What ``cp -p new weights`` or ``rsync -a`` leave: a new inode, same size, old mtime."""
    old = weights.stat()
    fresh = save_weights(weights.with_name("incoming.safetensors"), value)
    restore_times(fresh, old)
    os.rename(fresh, weights)
    now = weights.stat()
    assert (now.st_size, now.st_mtime_ns) == (old.st_size, old.st_mtime_ns)
    assert now.st_ino != old.st_ino


def rewrite_in_place_through_a_second_link(weights: Path, value: float) -> None:
    """Same inode, same size, mtime set back: only the ctime moves."""
    old = weights.stat()
    alias = weights.with_name("alias.safetensors")
    os.link(weights, alias)
    fresh = save_weights(weights.with_name("incoming.safetensors"), value).read_bytes()
    with open(alias, "r+b") as f:
        f.write(fresh)
    alias.unlink()
    restore_times(weights, old)
    now = weights.stat()
    assert (now.st_ino, now.st_size, now.st_mtime_ns) == (old.st_ino, old.st_size,
                                                         old.st_mtime_ns)


@pytest.mark.parametrize("change", [replace_keeping_size_and_mtime,
                                    rewrite_in_place_through_a_second_link])
@pytest.mark.parametrize("by_path", [True, False], ids=["key", "daemon"])
def test_a_source_changed_behind_its_timestamps_loads_fresh(
        daemon: Client, tmp_path: Path, change: object, by_path: bool) -> None:
    weights = save_weights(tmp_path / "w.safetensors", 1.0)
    assert load_file_child(weights, by_path=by_path) == {"outcome": "cold", "sums": sums(1)}
    wait_saved(daemon)
    assert load_file_child(weights, by_path=by_path) == {"outcome": "warm", "sums": sums(1)}
    change(weights, 2.0)  # type: ignore[operator]
    assert load_file_child(weights, by_path=by_path) == {"outcome": "cold", "sums": sums(2)}
    if not by_path:  # the key did not change: the daemon saw it, and says so once, at the
        # check before the hit or first, in its watch of held files (Note [Sources let go])
        log = log_text(daemon.path)
        assert log.count("dropped entry") + log.count("let go of entry") == 1, log


def test_a_source_changed_while_the_daemon_is_down_is_dropped(
        daemon: Client, tmp_path: Path) -> None:
    weights = save_weights(tmp_path / "w.safetensors", 1.0)
    assert load_file_child(weights, by_path=False)["outcome"] == "cold"
    wait_saved(daemon)
    daemon.stop()
    rewrite_in_place_through_a_second_link(weights, 3.0)
    assert daemon.start()["entries"] == 0
    assert "ctime_ns" in log_text(daemon.path)
    assert load_file_child(weights, by_path=False) == {"outcome": "cold", "sums": sums(3)}


# -- damaged segments on the live path ----------------------------------------------------
def damage(path: Path, how: str) -> None:
    path.chmod(0o600)
    if how == "truncate":
        os.truncate(path, path.stat().st_size // 2)
    else:
        with open(path, "r+b") as f:
            f.seek(1000)
            byte = f.read(1)
            f.seek(1000)
            f.write(bytes([byte[0] ^ 0x10]))
    path.chmod(0o400)


@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_a_damaged_segment_of_the_running_daemon_is_dropped(daemon: Client, how: str) -> None:
    nbytes = 256 * 1024
    first = sized_child(nbytes, "d")
    assert first["outcome"] == "cold"
    wait_saved(daemon)
    [seg] = segment_files()
    damage(seg, how)
    again = sized_child(nbytes, "d")
    assert again == {"outcome": "cold", "sum": first["sum"]}  # dropped, loaded plainly
    text = log_text(daemon.path)
    assert text.count("dropped entry") == 1
    assert ("truncated" in text) if how == "truncate" else ("its checksum" in text)
    assert sized_child(nbytes, "d") == {"outcome": "warm", "sum": first["sum"]}  # re-stored


FLIP_AT_ONCE = """
import glob, json, os, sys
sys.path.insert(0, {here!r})
import overmind_lab
from tests.loaders import sized_load
with overmind_lab.record_loads() as events:
    t = overmind_lab.load(sized_load, 256 * 1024, "f")
while True:  # the daemon may be renaming the .tmp to its .seg name right now: look again
    [path] = glob.glob(os.path.join({cache!r}, "*.tmp")) or glob.glob(os.path.join({cache!r}, "*.seg"))
    try:
        os.chmod(path, 0o600)  # no pause: within a timestamp tick of the store, if it can
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        continue
    break
byte = os.pread(fd, 1, 1000)
os.pwrite(fd, bytes([byte[0] ^ 0x10]), 1000)
os.fchmod(fd, 0o400)
os.close(fd)
print(json.dumps({{"outcome": events[-1].outcome, "sum": float(t.sum())}}))
"""


def test_a_segment_damaged_right_after_its_store_is_dropped(daemon: Client) -> None:
    """The stamp taken at ``store`` sees a write made at once (multigrain timestamps,
    Linux 6.13+: a change after a ``stat`` always moves the ctime), whether the file is
    still being finished or already is."""
    env = {**os.environ, "OVERMIND_LAB_BACKGROUND_STORE": "never"}
    first = last_json(run_py(FLIP_AT_ONCE.format(here=HERE, cache=str(cache_dir())), env=env))
    assert first["outcome"] == "cold"
    assert sized_child(256 * 1024, "f") == {"outcome": "cold", "sum": first["sum"]}
    assert log_text(daemon.path).count("dropped entry") == 1


def test_a_segment_damaged_while_the_daemon_is_down_is_checked_before_use(
        daemon: Client) -> None:
    first = sized_child(256 * 1024, "r")
    wait_saved(daemon)
    daemon.stop()
    [seg] = segment_files()
    damage(seg, "flip")
    assert daemon.start()["entries"] == 1  # the trailer is fine: the data is not
    assert sized_child(256 * 1024, "r") == {"outcome": "cold", "sum": first["sum"]}
    assert "its checksum" in log_text(daemon.path)


def test_an_unchecked_segment_stays_unchecked_across_another_restart(daemon: Client) -> None:
    """A daemon that stops before it checked a moved file must not save it as good."""
    first = sized_child(256 * 1024, "q")
    wait_saved(daemon)
    daemon.stop()
    damage(segment_files()[0], "flip")
    daemon.start()
    daemon.stop()  # saves the index again, before any hit or background check
    daemon.start()
    assert sized_child(256 * 1024, "q") == {"outcome": "cold", "sum": first["sum"]}
    assert "its checksum" in log_text(daemon.path)


def test_an_untouched_segment_is_served_after_a_restart_and_checked_behind(
        daemon: Client) -> None:
    first = sized_child(256 * 1024, "u")
    wait_saved(daemon)
    kill_and_restart(daemon)
    assert sized_child(256 * 1024, "u") == {"outcome": "warm", "sum": first["sum"]}
    assert wait_saved(daemon)["entries"] == 1  # the background checksum passed


# -- what an entry costs ------------------------------------------------------------------
def test_held_source_files_are_counted_apart_from_the_budget(
        sock_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [What an entry costs]: a held source file is the user's own: it costs no budget,
    so files larger than the whole budget are served warm; ``ls`` (``bytes +
    shared_bytes``), ``status`` (``cached_bytes``) and the budget count the same bytes, the
    cache's own, and ``held_bytes`` counts the files apart."""
    budget = 300_000  # less than one 1 MiB file: only the small segments count
    monkeypatch.setenv("OVERMIND_LAB_BUDGET", str(budget))
    client = Client()
    assert client.start()["budget_bytes"] == budget
    try:
        files = [save_weights(tmp_path / f"{name}.safetensors", 1.0) for name in ("a", "b")]
        for weights in files:
            assert load_file_child(weights, by_path=True)["outcome"] == "cold"
            wait_saved(client)
        for weights in files:
            assert load_file_child(weights, by_path=True) == {"outcome": "warm",
                                                              "sums": sums(1.0)}
        status, entries = wait_saved(client), client.entries()
        assert sorted(e["source"] for e in entries) == [str(f) for f in files]
        assert status["cached_bytes"] <= budget
        assert status["cached_bytes"] == sum(e["bytes"] + e["shared_bytes"] for e in entries)
        sizes = sum(f.stat().st_size for f in files)
        assert status["held_bytes"] == sizes == sum(e["held_bytes"] for e in entries)
        assert status["held_files"] == 2
        assert all(e["bytes"] < 64 << 10 for e in entries)
        shown = run_py("import sys; from overmind_lab.cli import main; sys.exit(main(['status']))",
                       env={"OVERMIND_LAB_SOCKET": str(sock_path)}).stdout
        assert "of your own files (2 held open, not in the budget)" in shown, shown
    finally:
        client.stop()


# -- held or copied: the source's page-cache folios --------------------------------------------
def save_many(path: Path, count: int, plus: float = 0.0) -> Path:
    """``count`` 4 MiB tensors, saved as ``save_pretrained`` saves them (safetensors' writer:
    small page-cache folios); tensor ``i`` is all ``i``. The same size whatever ``count``'s
    tensors hold."""
    import torch
    from safetensors.torch import save_file

    save_file({f"w{i:02}": torch.full((1024, 1024), i + plus) for i in range(count)}, str(path))
    return path


def rewrite_in_large_writes(path: Path, to: Path) -> Path:
    """The same bytes in a new file written in aligned 8 MiB writes (PMD-sized folios)."""
    data = path.read_bytes()
    with open(to, "wb", buffering=0) as f:
        for at in range(0, len(data), 8 << 20):
            f.write(data[at:at + (8 << 20)])
    return to


def many_sums(count: int, plus: float = 0.0) -> list[float]:
    return [(i + plus) * 1024 * 1024 for i in range(count)]


MAPS_CHILD = LOAD_FILE + """
with open("/proc/self/maps") as f:
    maps = f.read()
print(json.dumps({{"copy": ".copy" in maps, "source": {path!r} in maps}}))
"""


def served_from(path: Path, *, by_path: bool) -> dict[str, object]:
    """Which file a warm load of ``path`` maps: the daemon's copy, or the source."""
    return load_file_child(path, by_path=by_path, code=MAPS_CHILD)


HOLDER = """
import mmap, os, sys
fd = os.open({path!r}, os.O_RDONLY)
mm = mmap.mmap(fd, {nbytes}, prot=mmap.PROT_READ)
mm.madvise(22)  # MADV_POPULATE_READ: every page mapped, as a kernel that loaded it has them
print("mapped", flush=True)
sys.stdin.read()
"""


def wait_refolded(client: Client, timeout: float = 120) -> dict[str, object]:
    """Wait until no held file is in small folios any more (Note [Refolding a held source]):
    each status call is a client that leaves, after which the daemon refolds what is left."""
    deadline = time.monotonic() + timeout
    while True:
        status = client.status()
        if status.get("refolding") == 0 and status.get("refold_passes") == 0:
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.1)


def test_a_source_in_small_folios_is_refolded_in_place(daemon: Client, tmp_path: Path) -> None:
    """Note [Sources in small folios], Note [Refolding a held source]: a just-saved file is held,
    and its own page cache read again in PMD-sized folios, window by window; a window that a
    process maps (the first load's kernel) waits until it is gone. No copy is made: the disk
    holds the model once."""
    from overmind_lab._loading.sources import in_small_folios

    saved = save_many(tmp_path / "saved.safetensors", 32)  # 128 MiB
    written = rewrite_in_large_writes(saved, tmp_path / "written.safetensors")
    if in_small_folios(str(written)):
        pytest.skip("this file system keeps no large folios for buffered writes")
    assert in_small_folios(str(saved))
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER.format(path=str(saved), nbytes=64 << 20)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "mapped\n"
        assert load_file_child(saved, by_path=False) == {"outcome": "cold",
                                                         "sums": many_sums(32)}
        status = wait_saved(daemon)
        assert status["refolding"] == 1  # half of it mapped: waits
        assert load_file_child(saved, by_path=False) == {"outcome": "warm",
                                                         "sums": many_sums(32)}
    finally:
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.close()
        holder.wait()
        holder.stdout.close()
    status = wait_refolded(daemon)
    assert not in_small_folios(str(saved))
    assert list(cache_dir().glob("*.copy")) == []
    assert status["disk_bytes"] < 1 << 20 and status["held_bytes"] == saved.stat().st_size
    assert "refolded " in log_text(daemon.path)
    assert load_file_child(saved, by_path=False) == {"outcome": "warm", "sums": many_sums(32)}
    assert served_from(saved, by_path=False) == {"copy": False, "source": True}
    # Note [Background work yields]: refolds run in a thread at nice 19 (the pool's threads
    # stay), the daemon's main thread at its own.
    pid = int(status["pid"])
    nice = {int(t): int(Path(f"/proc/{pid}/task/{t}/stat").read_text().rpartition(")")[2]
                        .split()[16]) for t in os.listdir(f"/proc/{pid}/task")}
    assert nice[pid] == os.getpriority(os.PRIO_PROCESS, 0) and 19 in nice.values(), nice


@pytest.fixture
def refold_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """``OVERMIND_LAB_REFOLD=0`` for the daemon a later fixture starts: a copy serves a file
    in small folios (Note [A copy to serve])."""
    monkeypatch.setenv("OVERMIND_LAB_REFOLD", "0")


def test_with_refold_off_a_source_in_small_folios_is_served_from_a_copy(
        refold_off: None, daemon: Client, tmp_path: Path) -> None:
    """Note [Sources in small folios], Note [A copy to serve]: with refolds off, a just-saved
    file is held, and copied in PMD-sized folios, which warm loads map; the checks stay the
    source's: a change drops the entry and its copy. The same bytes written in large folios
    are not copied. The copy counts in the budget and on disk."""
    from overmind_lab._loading.sources import in_small_folios

    saved = save_many(tmp_path / "saved.safetensors", 32)  # 128 MiB
    written = rewrite_in_large_writes(saved, tmp_path / "written.safetensors")
    if in_small_folios(str(written)):
        pytest.skip("this file system keeps no large folios for buffered writes")
    assert in_small_folios(str(saved))
    # ``saved`` by name only (its key does not cover the file: only the daemon's checks can
    # tell that it changed), ``written`` by path
    for weights, by_path in ((saved, False), (written, True)):
        assert load_file_child(weights, by_path=by_path) == {"outcome": "cold",
                                                             "sums": many_sums(32)}
        wait_saved(daemon)
        assert load_file_child(weights, by_path=by_path) == {"outcome": "warm",
                                                             "sums": many_sums(32)}
    assert sum(f.stat().st_size for f in segment_files()) < 1 << 20  # both held
    [copy] = cache_dir().glob("*.copy")
    assert copy.stat().st_size == saved.stat().st_size and copy.read_bytes() == saved.read_bytes()
    assert not in_small_folios(str(copy))
    # Note [Background work yields]: the copy was made by a thread at nice 19 (the pool's
    # threads stay), the daemon's main thread stays at its own.
    pid = int(daemon.status()["pid"])
    nice = {int(t): int(Path(f"/proc/{pid}/task/{t}/stat").read_text().rpartition(")")[2]
                        .split()[16]) for t in os.listdir(f"/proc/{pid}/task")}
    assert nice[pid] == os.getpriority(os.PRIO_PROCESS, 0) and 19 in nice.values(), nice
    assert served_from(saved, by_path=False) == {"copy": True, "source": False}
    assert served_from(written, by_path=True) == {"copy": False, "source": True}
    assert log_text(daemon.path).count("from a copy in large folios") == 1
    status = daemon.status()
    assert status["disk_bytes"] >= saved.stat().st_size  # the copy; the held files apart
    assert status["cached_bytes"] >= saved.stat().st_size  # in the budget
    assert status["held_bytes"] == saved.stat().st_size + written.stat().st_size
    # A copy changed on disk is dropped at the next hit, which the source serves.
    copy.chmod(0o600)
    with open(copy, "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\xff\xff\xff\xff")
    assert load_file_child(saved, by_path=False) == {"outcome": "warm", "sums": many_sums(32)}
    assert "the copy of" in log_text(daemon.path) and not copy.exists()
    assert served_from(saved, by_path=False) == {"copy": False, "source": True}
    # (A store is when a copy is made: stored again, it has one again.)
    daemon.evict_all()
    assert load_file_child(saved, by_path=False)["outcome"] == "cold"
    wait_saved(daemon)
    [copy] = cache_dir().glob("*.copy")
    # Changed in place (same size, mtime set back): the entry goes, and its copy with it.
    old = saved.stat()
    fresh = save_many(tmp_path / "incoming.safetensors", 32, plus=0.5).read_bytes()
    with open(saved, "r+b") as f:
        f.write(fresh)
    restore_times(saved, old)
    assert load_file_child(saved, by_path=False) == {"outcome": "cold",
                                                     "sums": many_sums(32, plus=0.5)}
    assert not copy.exists()
    # A restarted daemon keeps the entries of held files, never a copy.
    wait_saved(daemon)
    assert kill_and_restart(daemon)["entries"] == 1
    assert list(cache_dir().glob("*.copy")) == []
    assert load_file_child(saved, by_path=False) == {"outcome": "warm",
                                                     "sums": many_sums(32, plus=0.5)}


def test_an_entry_evicted_while_its_copy_is_made_leaves_nothing(
        refold_off: None, daemon: Client, tmp_path: Path) -> None:
    """Whenever the eviction comes (before, during or after the copy), no copy stays."""
    from overmind_lab._loading.sources import in_small_folios

    saved = save_many(tmp_path / "saved.safetensors", 32)
    if not in_small_folios(str(saved)):
        pytest.skip("this file system keeps no small folios apart from large ones")
    for _ in range(3):
        assert load_file_child(saved, by_path=True)["outcome"] == "cold"
        daemon.evict_all()
        wait_saved(daemon)
        assert list(cache_dir().glob("*.copy")) == []
        assert daemon.status()["entries"] == 0


def test_a_source_in_small_folios_is_served_as_it_is_when_its_copy_exceeds_the_budget(
        refold_off: None, sock_path: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Copies fit in the budget beside what is cached (Note [What an entry costs])."""
    from overmind_lab._loading.sources import in_small_folios

    saved = save_many(tmp_path / "saved.safetensors", 32)  # 128 MiB
    if not in_small_folios(str(saved)):
        pytest.skip("this file system keeps no small folios apart from large ones")
    monkeypatch.setenv("OVERMIND_LAB_BUDGET", str(64 << 20))  # the entry fits, its copy not
    client = Client()
    try:
        client.start()
        assert load_file_child(saved, by_path=True)["outcome"] == "cold"
        wait_saved(client)
        assert load_file_child(saved, by_path=True)["outcome"] == "warm"
        assert list(cache_dir().glob("*.copy")) == []
        assert "no copy (it does not fit in the budget)" in log_text(sock_path)
    finally:
        client.stop()


def test_a_source_in_small_folios_is_served_as_it_is_when_the_disk_has_no_room(
        refold_off: None, sock_path: Path, small_fs: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from overmind_lab._loading.sources import in_small_folios

    saved = save_many(tmp_path / "saved.safetensors", 32)  # 128 MiB, the file system 16 MiB
    if not in_small_folios(str(saved)):
        pytest.skip("this file system keeps no small folios apart from large ones")
    monkeypatch.setenv("OVERMIND_LAB_CACHE_DIR", str(small_fs / "cache"))
    client = Client()
    try:
        assert client.start()["tier"] == "file"
        assert load_file_child(saved, by_path=True)["outcome"] == "cold"
        wait_saved(client)
        assert load_file_child(saved, by_path=True) == {"outcome": "warm",
                                                        "sums": many_sums(32)}
        assert list((small_fs / "cache").glob("*.copy")) == []
        assert "no copy (the disk has no room for it)" in log_text(sock_path)
    finally:
        client.stop()


# -- what an acknowledged store promises ----------------------------------------------------
def test_a_store_is_durable_once_saved_and_never_half_there_before(daemon: Client) -> None:
    """Note [What a store promises]: kill -9 right after the acknowledgement leaves the
    entry whole or absent; once ``unsaved`` is 0 it is there."""
    nbytes = 32 << 20
    first = sized_child(nbytes, "k")
    assert first["outcome"] == "cold"
    kill_and_restart(daemon)  # right after the child got its answer: maybe not finished
    after = sized_child(nbytes, "k")
    assert after["sum"] == first["sum"] and after["outcome"] in ("warm", "cold")
    assert list(cache_dir().glob("*.tmp")) == []
    wait_saved(daemon)
    kill_and_restart(daemon)
    assert sized_child(nbytes, "k") == {"outcome": "warm", "sum": first["sum"]}


HELD: dict[str, Any] = {}


def combine(path: str) -> dict[str, Any]:
    """A result that references a cached segment (``HELD["t"]``, from a warm load, not an
    argument: arguments that are cached objects enter by their key) before a source file
    (the safetensors file, mapped)."""
    from safetensors.torch import load_file

    return {"t": HELD["t"], "w": load_file(path)["a"]}


COMBINE = """
import json, sys
sys.path.insert(0, {here!r})
import overmind_lab
from tests.loaders import sized_load
from tests.test_daemon_integrity import HELD, combine
overmind_lab.load(sized_load, 1 << 16, "ab")
HELD["t"] = overmind_lab.load(sized_load, 1 << 16, "ab")  # warm: a cached segment's
with overmind_lab.record_loads() as events:
    both = overmind_lab.load(combine, {path!r})
print(json.dumps({{"outcome": events[-1].outcome, "t": float(both["t"].sum()),
                  "w": float(both["w"].double().sum())}}))
"""


def test_an_entry_with_a_reference_before_a_held_file_rebuilds_right(
        daemon: Client, tmp_path: Path) -> None:
    """Note [What an entry costs]: the held file is the entry's own (counted apart, as held),
    yet the segments keep the order the client numbered them in (``Entry.order``)."""
    weights = save_weights(tmp_path / "w.safetensors", 3.0)
    env = {**os.environ, "OVERMIND_LAB_BACKGROUND_STORE": "never"}
    code = COMBINE.format(here=HERE, path=str(weights))
    want = {"t": 2.0 * (1 << 14), "w": sums(3)[0]}
    assert last_json(run_py(code, env=env)) == {"outcome": "cold", **want}
    wait_saved(daemon)
    assert last_json(run_py(code, env=env)) == {"outcome": "warm", **want}
    kill_and_restart(daemon)  # the order is saved with the entry
    assert last_json(run_py(code, env=env)) == {"outcome": "warm", **want}
    entry = next(e for e in daemon.entries() if "combine" in e["name"])
    assert entry["held_bytes"] == weights.stat().st_size and entry["shared_bytes"] > 0
    assert entry["bytes"] < weights.stat().st_size
