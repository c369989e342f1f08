"""Note [A hit from the disk] (``_loading/from_disk.py``): with no daemon listening, a load serves
the entry the last daemon saved, after the checks a restored daemon makes, and starts a daemon
meanwhile; anything missing, changed or planted is no hit, and the load waits for a new daemon as
before. Real daemons on temporary sockets, real child processes, real model directories."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from overmind_lab import Client
from overmind_lab._daemon.store import Store
from overmind_lab._loading.from_disk import saved_hit
from tests.conftest import last_json, run_py, save_tiny_unet, wait_for_exit
from tests.test_disk_cache import cache_dir, segment_files, wait_saved
from tests.test_load import plain_digest

pytestmark = pytest.mark.slow

# The load, then what it was: its outcome, the result's digest, the daemon start it counted, what
# it warned; then the daemon it started (``start`` waits for one being started) and the entry's
# hits as that daemon counts them (a hit served from the disk is no hit of any daemon's), and its
# warm times once the load's report reached it (sent by the thread that started the daemon).
LOAD_WITHOUT_DAEMON = """
import hashlib, json, os, time, warnings, torch, overmind_lab
from diffusers import UNet2DConditionModel
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with overmind_lab.record_loads() as events:
        unet = overmind_lab.load(UNet2DConditionModel.from_pretrained, {path!r})
digest = hashlib.sha256()
for name, t in unet.state_dict().items():
    digest.update(name.encode()); digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
status = overmind_lab.Client().start()
[entry] = overmind_lab.Client().entries()
while {wait_report} and not entry["warm_seconds"]:  # the report comes on its own connection
    time.sleep(0.01)
    [entry] = overmind_lab.Client().entries()
print(json.dumps({{"outcome": events[-1].outcome, "digest": digest.hexdigest(),
                  "daemon_seconds": events[-1].daemon_seconds,
                  "warnings": [str(w.message) for w in caught],
                  "daemon": status["pid"], "hits": entry["hits"],
                  "warm_seconds": entry["warm_seconds"]}}))
"""


def _stored(daemon: Client, model: Path) -> str:
    """The model loaded cold in a child, saved on disk; its key."""
    assert last_json(run_py(LOAD_WITHOUT_DAEMON.replace(
        "status = overmind_lab.Client().start()", "status = {{'pid': 0}}").format(
            path=str(model), wait_report=False)))["outcome"] == "cold"
    wait_saved(daemon)
    [entry] = daemon.entries()
    return str(entry["key"])


def _kill(daemon: Client) -> int:
    pid = int(daemon.status()["pid"])
    os.kill(pid, signal.SIGKILL)
    wait_for_exit(pid, 120, f"the daemon {pid} (after SIGKILL)")
    return pid


def test_after_kill_9_the_load_serves_the_saved_entry_and_starts_a_daemon(
        daemon: Client, tmp_path: Path) -> None:
    model = save_tiny_unet(tmp_path / "unet")
    _stored(daemon, model)
    dead = _kill(daemon)
    assert daemon.path.exists()  # the dead daemon's socket: connections refused
    out = last_json(run_py(LOAD_WITHOUT_DAEMON.format(path=str(model), wait_report=True)))
    assert out["outcome"] == "warm" and out["digest"] == plain_digest(model)
    assert out["daemon_seconds"] is None  # it waited for no daemon
    assert out["hits"] == 0  # served from the disk: no daemon counted it
    assert len(out["warm_seconds"]) == 1  # but the new daemon got its warm time
    assert out["daemon"] not in (0, dead)
    assert [w for w in out["warnings"] if "had died; a new one was started" in w]
    # the daemon it started serves the next load itself
    again = last_json(run_py(LOAD_WITHOUT_DAEMON.format(path=str(model), wait_report=True)))
    assert again["outcome"] == "warm" and again["hits"] == 1 and again["daemon"] == out["daemon"]
    assert len(again["warm_seconds"]) == 2
    assert again["warnings"] == []


def test_with_no_daemon_at_all_the_saved_entry_is_served(daemon: Client,
                                                         tmp_path: Path) -> None:
    model = save_tiny_unet(tmp_path / "unet")
    _stored(daemon, model)
    assert daemon.stop()
    assert not daemon.path.exists()
    out = last_json(run_py(LOAD_WITHOUT_DAEMON.format(path=str(model), wait_report=True)))
    assert out["outcome"] == "warm" and out["hits"] == 0
    assert out["digest"] == plain_digest(model) and out["warnings"] == []


def _index(change: Callable[[dict[str, object]], None]) -> None:
    store = Store(cache_dir())  # no daemon: rewrite its index as a change on disk would
    try:
        body = store.load_index()
        assert body is not None
        change(body)
        store.save_index(body)
    finally:
        store.close()


def _changed_versions(body: dict[str, object]) -> None:
    [record] = body["entries"]  # type: ignore[misc]
    record["validate"]["versions"]["torch"] = "1.0.0"


def _plant(path: Path, data: bytes) -> None:
    path.chmod(0o600)
    path.write_bytes(data)


def _segment_written(model: Path) -> None:
    """A segment file written to, its trailer intact: its identity is not the recorded one."""
    [seg] = segment_files()
    _plant(seg, b"\x7f" + seg.read_bytes()[1:])


def _segment_truncated(model: Path) -> None:
    [seg] = segment_files()
    _plant(seg, seg.read_bytes()[:4096])


def _index_a_link(model: Path) -> None:
    index = cache_dir() / "index"
    (cache_dir() / "elsewhere").write_bytes(index.read_bytes())
    index.unlink()
    index.symlink_to(cache_dir() / "elsewhere")


def _weights_replaced(model: Path) -> None:
    """Saved again: another file renamed over the one the entry holds."""
    weights = next(model.glob("*.safetensors"))
    copy = weights.with_suffix(".copy")
    copy.write_bytes(weights.read_bytes())
    os.replace(copy, weights)


def _config_changed(model: Path) -> None:
    config = model / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "x": 1}))


HOSTILE: dict[str, Callable[[Path], None]] = {
    "segment written": _segment_written,
    "segment truncated": _segment_truncated,
    "index garbage": lambda model: _plant(cache_dir() / "index", os.urandom(300)),
    "index a symlink": _index_a_link,
    "cache dir others can read": lambda model: cache_dir().chmod(0o755),
    "weights touched": lambda model: os.utime(next(model.glob("*.safetensors"))),
    "weights replaced": _weights_replaced,
    "config changed": _config_changed,
    "library upgraded": lambda model: _index(_changed_versions),
}


@pytest.mark.parametrize("change", sorted(HOSTILE))
def test_a_changed_or_planted_file_is_no_hit_from_the_disk(daemon: Client, tmp_path: Path,
                                                          change: str) -> None:
    model = save_tiny_unet(tmp_path / "unet")
    key = _stored(daemon, model)
    assert daemon.stop()
    found = saved_hit(key)
    assert found is not None, "the saved entry, unchanged, is served from the disk"
    entry, fds = found
    assert entry["key"] == key and len(fds) == len(entry["segments"]) >= 1
    for fd in fds:
        os.close(fd)
    assert saved_hit("0" * 64) is None  # no such key
    HOSTILE[change](model)
    try:
        assert saved_hit(key) is None
    finally:
        cache_dir().chmod(0o700)
    if change == "cache dir others can read":
        return  # a daemon refuses it too (test_disk_cache: an unsafe cache dir is refused)
    # the load goes to a daemon as before (cold where that daemon dropped the entry too)
    out = last_json(run_py(LOAD_WITHOUT_DAEMON.format(path=str(model), wait_report=False)))
    assert out["outcome"] in ("cold", "warm") and out["digest"] == plain_digest(model)
    assert out["daemon_seconds"] is not None  # it waited for the daemon it started
