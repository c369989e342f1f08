"""The cache on disk: segment files, the memfd tier, the saved index, restarts, corruption.

Real daemons on temporary sockets, each with its own cache directory (``sock_path``
sets ``OVERMIND_LAB_CACHE_DIR``), real child processes, real model directories.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from overmind_lab import Client, DaemonUnavailable
from overmind_lab._daemon.store import Store
from overmind_lab._loading.client import UNSETTLED
from tests.conftest import last_json, run_py, save_tiny_unet, wait_for_exit
from tests.test_load import LOAD_UNET, plain_digest

pytestmark = pytest.mark.slow  # minutes in all: `make test`, not `make test-fast`

HERE = str(Path(__file__).resolve().parent.parent)

# A child that loads ``sized_load(nbytes, tag)`` through the cache.
SIZED = """
import json, sys
sys.path.insert(0, {here!r})
import overmind_lab
from tests.loaders import sized_load
with overmind_lab.record_loads() as events:
    t = overmind_lab.load(sized_load, {nbytes}, {tag!r})
print(json.dumps({{"outcome": events[-1].outcome, "sum": float(t.sum())}}))
"""


def sized_child(nbytes: int, tag: str, **kw: object) -> dict[str, object]:
    return dict(last_json(run_py(SIZED.format(here=HERE, nbytes=nbytes, tag=tag), **kw)))


def cache_dir() -> Path:
    return Path(os.environ["OVERMIND_LAB_CACHE_DIR"])


def log_text(sock_path: Path) -> str:
    log = sock_path.with_name(sock_path.name + ".log")
    return log.read_text() if log.exists() else ""


def wait_saved(client: Client, timeout: float = 30) -> dict[str, object]:
    """Wait until every segment is finished on disk, the index is saved, copies of held
    files are made (Note [A copy to serve]) and no refold runs (Note [Refolding a held
    source])."""
    status = client.wait_settled(timeout)
    assert not any(status.get(k) for k in UNSETTLED), status
    return dict(status)


def kill_and_restart(client: Client) -> dict[str, object]:
    pid = int(client.status()["pid"])
    os.kill(pid, signal.SIGKILL)
    # Until all of its threads are gone (and with them its listening socket), which a
    # pidfd tells: the event, with a loaded machine's deadline.
    wait_for_exit(pid, 120, f"the daemon {pid} (after SIGKILL)")
    return client.start()


def segment_files() -> list[Path]:
    return sorted(cache_dir().glob("*.seg"))


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- segments in files ------------------------------------------------------------------
def test_segments_are_read_only_files_in_a_private_directory(daemon: Client) -> None:
    assert sized_child(64 * 1024, "a")["outcome"] == "cold"
    status = wait_saved(daemon)
    assert status["tier"] == "file" and status["cache_dir"] == str(cache_dir())
    assert cache_dir().stat().st_mode & 0o777 == 0o700
    [seg] = segment_files()
    assert seg.stat().st_mode & 0o777 == 0o400
    assert (cache_dir() / "index").exists()
    assert status["disk_bytes"] >= 64 * 1024
    assert 0 < int(status["resident_bytes"]) <= int(status["disk_bytes"])
    assert sized_child(64 * 1024, "a")["outcome"] == "warm"


def test_in_place_write_changes_neither_the_file_nor_another_process(
        daemon: Client, tiny_unet_dir: Path) -> None:
    assert last_json(run_py(LOAD_UNET.format(path=str(tiny_unet_dir))))["outcome"] == "cold"
    wait_saved(daemon)
    [seg] = segment_files()
    before = sha(seg)
    writer = last_json(run_py(f"""
        import json, torch, overmind_lab
        from diffusers import UNet2DConditionModel
        with overmind_lab.record_loads() as events:
            unet = overmind_lab.load(UNet2DConditionModel.from_pretrained, {str(tiny_unet_dir)!r})
        with torch.no_grad():
            for p in unet.parameters():
                p.mul_(0).add_(7)
        print(json.dumps([events[-1].outcome, float(next(unet.parameters()).flatten()[0])]))
    """))
    assert writer == ["warm", 7.0]
    assert sha(seg) == before
    other = last_json(run_py(LOAD_UNET.format(path=str(tiny_unet_dir))))
    assert other["outcome"] == "warm" and other["digest"] == plain_digest(tiny_unet_dir)


def test_a_cache_dir_on_tmpfs_falls_back_to_memfd(sock_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm (tmpfs) on this machine")
    with tempfile.TemporaryDirectory(prefix="olt-", dir="/dev/shm") as d:
        monkeypatch.setenv("OVERMIND_LAB_CACHE_DIR", str(Path(d) / "cache"))
        client = Client()
        status = client.start()
        assert status["tier"] == "memfd"
        assert "tmpfs" in status["tier_reason"]
        assert sized_child(64 * 1024, "t")["outcome"] == "cold"
        assert sized_child(64 * 1024, "t")["outcome"] == "warm"
        assert list((Path(d) / "cache").iterdir()) == []
        assert log_text(sock_path).count("memfd tier") == 1
        client.stop()


@pytest.mark.parametrize("problem", ["mode", "owner"])
def test_an_unsafe_cache_dir_is_refused(sock_path: Path, tmp_path: Path, problem: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "cache"
    bad.mkdir(mode=0o700)
    if problem == "mode":
        bad.chmod(0o755)
        expected = "has mode 0755"
    else:
        if os.getuid() != 0:
            pytest.skip("needs root to make a directory owned by another uid")
        os.chown(bad, 65534, 65534)
        expected = "is owned by uid 65534"
    monkeypatch.setenv("OVERMIND_LAB_CACHE_DIR", str(bad))
    proc = subprocess.run([sys.executable, "-m", "overmind_lab", "serve"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and expected in proc.stderr, proc.stderr
    with pytest.raises(DaemonUnavailable, match=expected):
        Client().start()


# -- the saved index --------------------------------------------------------------------
def test_after_kill_9_a_new_daemon_serves_saved_entries_warm(
        daemon: Client, tiny_unet_dir: Path) -> None:
    first = last_json(run_py(LOAD_UNET.format(path=str(tiny_unet_dir))))
    assert first["outcome"] == "cold"
    wait_saved(daemon)
    [entry] = daemon.entries()
    status = kill_and_restart(daemon)
    assert status["entries"] == 1
    again = last_json(run_py(LOAD_UNET.format(path=str(tiny_unet_dir))))
    assert again["outcome"] == "warm" and again["digest"] == first["digest"]
    [after] = daemon.entries()
    assert after["key"] == entry["key"] and after["hits"] == 1
    assert after["cold_seconds"] == entry["cold_seconds"]


def test_a_changed_source_is_dropped_with_a_reason(daemon: Client, tmp_path: Path) -> None:
    model = save_tiny_unet(tmp_path / "unet")
    assert last_json(run_py(LOAD_UNET.format(path=str(model))))["outcome"] == "cold"
    wait_saved(daemon)
    daemon.stop()
    weights = next(model.glob("*.safetensors"))
    os.utime(weights, ns=(time.time_ns(), time.time_ns()))
    assert daemon.start()["entries"] == 0
    text = log_text(daemon.path)
    # The weights file is held by the daemon: its mtime (and ctime) changed.
    assert "dropped a saved entry" in text and f"the source file {weights} was changed" in text
    assert segment_files() == []


def test_changed_library_versions_are_dropped_with_a_reason(daemon: Client) -> None:
    import torch

    assert sized_child(64 * 1024, "v")["outcome"] == "cold"
    wait_saved(daemon)
    daemon.stop()
    store = Store(cache_dir())  # the daemon is gone: rewrite its index as an upgrade would
    body = store.load_index()
    assert body is not None
    [record] = body["entries"]
    assert record["validate"]["versions"]["torch"] == torch.__version__
    record["validate"]["versions"]["torch"] = "1.0.0"
    store.save_index(body)
    store.close()
    assert daemon.start()["entries"] == 0
    assert f"torch changed from 1.0.0 to {torch.__version__.split('+')[0]}" in \
        log_text(daemon.path).replace("+cpu", "")


def _corrupt(path: Path, how: str) -> None:
    path.chmod(0o600)
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:
        path.write_bytes(os.urandom(len(data)))


@pytest.mark.parametrize("how", ["truncated", "random"])
@pytest.mark.parametrize("which", ["segment", "index"])
def test_a_corrupt_file_is_rejected_and_the_load_is_cold(daemon: Client, which: str,
                                                         how: str) -> None:
    assert sized_child(256 * 1024, "c")["outcome"] == "cold"
    wait_saved(daemon)
    daemon.stop()
    _corrupt(segment_files()[0] if which == "segment" else cache_dir() / "index", how)
    assert daemon.start()["entries"] == 0
    text = log_text(daemon.path)
    if which == "index":
        assert "discarded the saved index, the cache starts cold" in text
    else:
        assert "dropped a saved entry" in text
        assert ("truncated" in text) if how == "truncated" else ("no valid trailer" in text)
    assert segment_files() == []  # nothing half-valid is kept
    assert sized_child(256 * 1024, "c") == {"outcome": "cold", "sum": 256 * 1024 / 4}
    assert daemon.status()["running"]


def test_changed_bytes_under_a_valid_trailer_are_caught_before_use(daemon: Client) -> None:
    assert sized_child(256 * 1024, "b")["outcome"] == "cold"
    wait_saved(daemon)
    daemon.stop()
    [seg] = segment_files()
    seg.chmod(0o600)
    with open(seg, "r+b") as f:
        f.seek(1000)
        f.write(b"\x7f" * 16)
    daemon.start()
    assert sized_child(256 * 1024, "b")["outcome"] == "cold"
    assert "does not match its checksum" in log_text(daemon.path)


def test_leftovers_of_a_crash_mid_store_are_deleted(daemon: Client) -> None:
    assert sized_child(64 * 1024, "k")["outcome"] == "cold"
    wait_saved(daemon)
    daemon.stop()
    (cache_dir() / "0123456789abcdef.tmp").write_bytes(b"half a segment")
    (cache_dir() / "fedcba9876543210.seg").write_bytes(b"x" * 8192)  # in no index
    (cache_dir() / "index.tmp").write_bytes(b"half an index")
    assert daemon.start()["entries"] == 1
    assert sorted(p.name for p in cache_dir().iterdir()) == sorted(
        ["index", segment_files()[0].name])
    assert sized_child(64 * 1024, "k")["outcome"] == "warm"


# -- budget and eviction ----------------------------------------------------------------
def test_evict_deletes_files_and_evict_all_leaves_the_directory_empty(
        daemon: Client) -> None:
    for tag in ("x", "yy"):
        assert sized_child(64 * 1024, tag)["outcome"] == "cold"
    wait_saved(daemon)
    assert len(segment_files()) == 2
    daemon.evict(daemon.entries()[0]["key"])
    wait_saved(daemon)
    assert len(segment_files()) == 1
    proc = subprocess.run([sys.executable, "-m", "overmind_lab", "evict", "--all"],
                          capture_output=True, text=True, timeout=60, check=True)
    assert "evicted 1 entry" in proc.stdout
    wait_saved(daemon)
    assert list(cache_dir().iterdir()) == []


def test_a_full_disk_falls_back_to_memory_and_leaves_nothing_half_written(
        sock_path: Path, small_fs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = small_fs / "cache"
    monkeypatch.setenv("OVERMIND_LAB_CACHE_DIR", str(cache))
    client = Client()
    try:
        assert client.start()["tier"] == "file"
        small = sized_child(1 << 20, "fits")
        big = sized_child(40 << 20, "too-big")  # more than the whole file system
        assert small["outcome"] == big["outcome"] == "cold"
        assert big["sum"] == (40 << 20) / 4 * len("too-big")
        assert sized_child(40 << 20, "too-big")["outcome"] == "warm"
        wait_saved(client)
        names = sorted(p.name for p in cache.iterdir())
        assert len(names) == 2 and "index" in names  # the small segment and the index
        assert not [n for n in names if n.endswith(".tmp")]
        assert "short of space" in log_text(sock_path)
    finally:
        client.stop()


def test_status_reports_the_tier_disk_and_resident_bytes(daemon: Client) -> None:
    sized_child(512 * 1024, "r")
    status = wait_saved(daemon)
    out = subprocess.run([sys.executable, "-m", "overmind_lab", "status"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "disk" in out and "resident" in out and str(cache_dir()) in out
    assert json.loads(subprocess.run(
        [sys.executable, "-m", "overmind_lab", "status", "--json"], capture_output=True,
        text=True, timeout=60, check=True).stdout)["tier"] == "file"
    assert int(status["disk_bytes"]) >= 512 * 1024



# -- source files referenced, not copied ------------------------------------------------
def test_unchanged_safetensors_regions_are_referenced_by_holding_the_source_file(
        daemon: Client, tmp_path: Path) -> None:
    """Note [Source files are held, not linked] (daemon store): the weights are not
    copied, the daemon holds the file open; it makes no hard link, which would move the
    file's ctime and change the next load's key (Note [File signatures])."""
    model = save_tiny_unet(tmp_path / "unet")
    weights = next(model.glob("*.safetensors"))
    before = weights.stat()
    first = last_json(run_py(LOAD_UNET.format(path=str(model))))
    assert first["outcome"] == "cold"
    status = wait_saved(daemon)
    after = weights.stat()
    assert (after.st_nlink, after.st_ctime_ns) == (before.st_nlink, before.st_ctime_ns)
    assert list(cache_dir().glob("*.src")) == []
    second = last_json(run_py(LOAD_UNET.format(path=str(model))))
    assert second["outcome"] == "warm" and second["all_mapped"]
    assert first["digest"] == second["digest"] == plain_digest(model)
    [entry] = daemon.entries()
    # Note [What an entry costs]: the held file is the entry's own, counted apart as held.
    assert entry["shared_bytes"] == 0
    assert entry["held_bytes"] == status["held_bytes"] == weights.stat().st_size
    assert status["cached_bytes"] == entry["bytes"] < weights.stat().st_size
    assert sum(f.stat().st_size for f in segment_files()) < weights.stat().st_size
    weights.unlink()  # the daemon's descriptor keeps the data while it runs...
    assert kill_and_restart(daemon)["entries"] == 0  # ...but the source is gone: dropped
    assert "dropped a saved entry" in log_text(daemon.path)


HOLD_NAMED = """
import json, sys, os
sys.path.insert(0, {here!r})
import torch, overmind_lab
from tests.loaders import load_named_file
with overmind_lab.record_loads() as events:
    sd = overmind_lab.load(load_named_file, "weights")
print(json.dumps({{"outcome": events[-1].outcome, "sum": float(sd["w"].double().sum())}}),
      flush=True)
sys.stdin.readline()
print(json.dumps({{"sum": float(sd["w"].double().sum())}}), flush=True)
"""


def test_a_source_rewritten_in_place_makes_the_entry_stale(
        daemon: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from safetensors.torch import save_file

    weights = tmp_path / "w.safetensors"
    save_file({"w": torch.ones(256, 1024)}, str(weights))
    monkeypatch.setenv("OVERMIND_LAB_TEST_FILE", str(weights))
    code = HOLD_NAMED.format(here=HERE)
    holders = []
    for outcome in ("cold", "warm"):
        proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, cwd="/")
        holders.append(proc)
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline()) == {"outcome": outcome,
                                                      "sum": 256.0 * 1024}
    try:
        wait_saved(daemon)
        before = weights.stat().st_size
        with open(weights, "r+b") as f:  # same inode: the hazard of Note [Referenced source files]
            f.seek(before - 4 * 1024)
            f.write(torch.full((1024,), 2.0).numpy().tobytes())
        # The daemon never reads the file; it sees the change in (size, mtime_ns) and the
        # next load is cold, with the new bytes.
        fresh = last_json(run_py(code.replace("sys.stdin.readline()", "")
                                 .rsplit("print", 1)[0]))
        assert fresh == {"outcome": "cold", "sum": 256.0 * 1024 + 1024}
        assert "was changed in place" in log_text(daemon.path)
        # What holders see: the file's new bytes in pages they never wrote, exactly as
        # after a plain safetensors load of that file.
        for proc in holders:
            out, _ = proc.communicate("go\n", timeout=60)
            assert json.loads(out.strip().splitlines()[-1]) == {"sum": 256.0 * 1024 + 1024}
        os.truncate(weights, 100)  # a truncation cannot crash the daemon either
        assert daemon.status()["running"]
        bad = run_py(code.replace("sys.stdin.readline()", ""), check=False)
        assert bad.returncode != 0 and "safetensor" in bad.stderr.lower()
        assert daemon.status()["running"]
    finally:
        for proc in holders:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def test_a_model_resaved_by_save_pretrained_while_two_processes_hold_it(
        daemon: Client, tmp_path: Path) -> None:
    model = save_tiny_unet(tmp_path / "unet", seed=0)
    holder_code = LOAD_UNET.format(path=str(model)) + "sys.stdout.flush()\n" + HOLD_DIGEST
    first = last_json(run_py(LOAD_UNET.format(path=str(model))))
    holders = [subprocess.Popen([sys.executable, "-c", holder_code], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, cwd="/")
               for _ in range(2)]
    try:
        for proc in holders:
            assert proc.stdout is not None
            assert json.loads(proc.stdout.readline())["outcome"] == "warm"
        save_tiny_unet(model, seed=1)  # a new inode: the link keeps the old one
        resaved = last_json(run_py(LOAD_UNET.format(path=str(model))))
        assert resaved["outcome"] == "cold" and resaved["digest"] == plain_digest(model)
        assert resaved["digest"] != first["digest"]
        # The holders keep the old values, bit for bit, as after plain loads.
        for proc in holders:
            out, _ = proc.communicate("go\n", timeout=60)
            assert json.loads(out.strip().splitlines()[-1]) == first["digest"]
        assert daemon.status()["running"]
    finally:
        for proc in holders:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


HOLD_DIGEST = """
sys.stdin.readline()
digest = hashlib.sha256()
for name, t in unet.state_dict().items():
    digest.update(name.encode()); digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
print(json.dumps(digest.hexdigest()), flush=True)
"""
