"""What the daemon notices while it runs: a held source file deleted or replaced (Note
[Sources let go] in the daemon's server), its socket path gone or taken (Note [A socket path
that moved] in its process module), its package uninstalled (Note [A daemon whose package is
gone]); and a cache directory that cannot be made (Note [A cache directory that cannot be
made]: the memory tier, not a refusal).

Real daemons, real model folders, real deletions. Every wait polls a condition with a
generous deadline (a loaded machine), never a duration.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import selectors
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from overmind_lab import Client, DaemonUnavailable, UnknownEntry
from tests import conftest
from tests.conftest import last_json, run_py, wait_for_exit
from tests.nobody import NOBODY, package_for_nobody, python_for_nobody
from tests.test_disk_cache import HERE, SIZED, cache_dir, log_text, sized_child, wait_saved
from tests.test_load import LOAD_UNET

pytestmark = pytest.mark.slow  # real model folders and daemons: `make test`

DEADLINE = 60.0
T = TypeVar("T")


def poll(what: str, probe: Callable[[], tuple[bool, T]], timeout: float = DEADLINE) -> T:
    """``probe()`` until it says done; its last value. Fails after ``timeout`` s with it."""
    deadline = time.monotonic() + timeout
    while True:
        done, value = probe()
        if done:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s; last {value!r}"
        time.sleep(0.1)


def save_unet(path: Path, seed: int = 0) -> Path:
    """A diffusers UNet of about 48 MiB (float32, random weights): big enough that the disk's
    free space shows its file coming back."""
    import torch
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(128, 256), cross_attention_dim=256, attention_head_dim=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), norm_num_groups=8,
    ).save_pretrained(path)
    return path


def open_files(pid: int) -> list[str]:
    """What the descriptors of ``pid`` name (``/proc/<pid>/fd``)."""
    names = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            names.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return names


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def daemons_on(path: Path) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"overmind_lab(\\._daemon)? serve --detach --socket {path}( |$)"],
                         capture_output=True, text=True)
    return sorted(int(p) for p in out.stdout.split())


def lock_is_free(path: Path) -> bool:
    """Whether nobody holds a ``flock`` on ``path`` (a lock file, the cache directory)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def answering(path: Path) -> tuple[bool, dict[str, Any]]:
    status = dict(Client(path).status())
    return bool(status.get("running")), status


# -- a held source file deleted or replaced ----------------------------------------------
def cached_and_held(daemon: Client, model: Path) -> tuple[int, Path, dict[str, Any]]:
    """Load ``model`` through the cache in a fresh process (its stored dtype: the daemon holds
    the weights file, the link tier); ``(daemon pid, weights, entry)``."""
    weights = next(model.glob("*.safetensors"))
    assert last_json(run_py(LOAD_UNET.format(path=str(model))))["outcome"] == "cold"
    wait_saved(daemon)  # the copy to serve, if the loader found small folios, made too
    [entry] = daemon.entries()
    assert "link" in entry["tier"], entry  # the weights are held, not copied into a segment
    pid = int(daemon.status()["pid"])
    assert str(weights) in open_files(pid)
    return pid, weights, dict(entry)


def let_go(daemon: Client, pid: int, weights: Path, free_before: int, size: int
           ) -> tuple[bool, dict[str, Any]]:
    """Whether the daemon let go of ``weights``: no descriptor of it or of a copy, no entry,
    and the disk's free space back by half its size at least (other writers on the disk)."""
    held = [n for n in open_files(pid) if n.startswith(str(weights)) or ".copy" in n]
    status = dict(daemon.status())
    gained = free_bytes(weights.parent.parent) - free_before
    state = {"held": held, "entries": status["entries"], "gained": gained, "status": status}
    return not held and status["entries"] == 0 and gained >= size // 2, state


def test_a_deleted_model_folder_is_let_go_within_seconds(daemon: Client,
                                                          tmp_path: Path) -> None:
    model = save_unet(tmp_path / "unet")
    pid, weights, entry = cached_and_held(daemon, model)
    size = weights.stat().st_blocks * 512
    assert size > 32 << 20
    free_before = free_bytes(tmp_path)
    shutil.rmtree(model)  # the user's clean-up: the daemon's descriptor kept it alive
    state = poll("the daemon letting go of the deleted weights",
                 lambda: let_go(daemon, pid, weights, free_before, size))
    status = state["status"]
    assert status["source_gone_entries"] == 1
    [gone] = status["source_gone_recent"]
    assert gone["why"] == "source deleted" and gone["key"] == entry["key"]
    assert gone["name"] == entry["name"] and gone["path"] == str(weights)
    assert list(cache_dir().glob("*.copy")) == []
    assert f"let go of entry {entry['key'][:12]}" in log_text(daemon.path)
    assert daemon.status()["pid"] == pid  # the same daemon serves on


def test_weights_replaced_by_a_rename_are_let_go(daemon: Client, tmp_path: Path) -> None:
    model = save_unet(tmp_path / "unet")
    pid, weights, entry = cached_and_held(daemon, model)
    size = weights.stat().st_blocks * 512
    fresh = next(save_unet(tmp_path / "download", seed=1).glob("*.safetensors"))
    free_before = free_bytes(tmp_path)
    os.replace(fresh, weights)  # a re-download: a new inode at the path, the old one unlinked
    state = poll("the daemon letting go of the replaced weights",
                 lambda: let_go(daemon, pid, weights, free_before, size))
    [gone] = state["status"]["source_gone_recent"]
    assert gone["why"] == "source replaced" and gone["key"] == entry["key"]
    # The new file is cached afresh, and held in its turn.
    again = last_json(run_py(LOAD_UNET.format(path=str(model))))
    assert again["outcome"] == "cold"
    assert str(weights) in open_files(pid)


# -- the socket path ---------------------------------------------------------------------
def test_a_removed_cache_directory_ends_its_daemon(daemon: Client) -> None:
    """``rm -rf ~/.cache/overmind-lab`` while the daemon runs: it stops and lets its files go
    (the next load starts a daemon on a fresh directory), rather than serving deleted files."""
    assert sized_child(4 * 1024 * 1024, "c")["outcome"] == "cold"
    wait_saved(daemon)
    pid = int(daemon.status()["pid"])
    assert any(n.startswith(str(cache_dir())) for n in open_files(pid))
    shutil.rmtree(cache_dir())
    wait_for_exit(pid, what="the daemon whose cache directory was removed")
    again = sized_child(4 * 1024 * 1024, "c")
    assert again["outcome"] == "cold" and again["sum"] == float(4 * 1024 * 1024 // 4)
    assert int(daemon.status()["pid"]) != pid and cache_dir().is_dir()


@pytest.fixture
def nested_sock(sock_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A socket path in a folder of its own (``run/``), the cache directory outside it: the
    folder can go as a runtime folder does. The daemons on it are stopped at the end."""
    path = sock_path.parent / "run" / "d.sock"
    conftest._SOCKETS.append(path)  # the session's check for leaked daemons looks here too
    monkeypatch.setenv("OVERMIND_LAB_SOCKET", str(path))
    try:
        yield path
    finally:
        with contextlib.suppress(DaemonUnavailable):
            Client(path).stop()
        for pid in daemons_on(path):  # one that no longer answers on the path
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            wait_for_exit(pid, DEADLINE, f"the daemon {pid} (SIGTERM)")
        log = path.with_name(path.name + ".log")
        if log.exists():
            print(f"--- daemon log {log} ---\n{log.read_text(errors='replace')[-6000:]}",
                  file=sys.stderr)


def test_a_deleted_socket_file_is_bound_again_by_the_same_daemon(daemon: Client,
                                                                  sock_path: Path) -> None:
    pid = daemon.status()["pid"]
    sock_path.unlink()  # a tmp cleaner
    status = poll("the daemon answering on its path again", lambda: answering(sock_path))
    assert status["pid"] == pid
    assert stat.S_ISSOCK(sock_path.lstat().st_mode)
    assert stat.S_IMODE(sock_path.lstat().st_mode) & 0o077 == 0
    assert "binding it again" in log_text(sock_path)
    assert daemons_on(sock_path) == [pid]


def test_a_deleted_runtime_folder_is_made_again_by_the_same_daemon(nested_sock: Path) -> None:
    client = Client(nested_sock)
    first = client.start()
    assert first["tier"] == "file"
    assert sized_child(64 * 1024, "w")["outcome"] == "cold"
    shutil.rmtree(nested_sock.parent)  # socket, lock and log
    status = poll("the daemon answering in its folder again", lambda: answering(nested_sock))
    assert status["pid"] == first["pid"] and status["tier"] == "file"
    assert stat.S_IMODE(nested_sock.parent.stat().st_mode) == 0o700
    assert not lock_is_free(nested_sock.with_name("d.sock.lock"))  # held again
    assert "listening on" in log_text(nested_sock)  # its log, written again where it was
    assert sized_child(64 * 1024, "w")["outcome"] == "warm"
    assert daemons_on(nested_sock) == [first["pid"]]


def test_a_client_racing_a_deleted_folder_ends_with_one_daemon_on_the_cache(
        nested_sock: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The folder goes and a client comes before the daemon looks: it starts a successor.
    Whichever takes the new lock keeps the name; the other goes (the daemon) or says "already
    running" (the successor). A successor waits for the cache directory (Note [A successor
    waits for the cache directory]): at the end one daemon, on the file tier."""
    monkeypatch.setenv("OVERMIND_LAB_DAEMON_SOCKET_CHECK", "2")  # the client usually first
    monkeypatch.setenv("OVERMIND_LAB_CACHE_DIR_WAIT", str(DEADLINE))  # a loaded machine
    first = Client(nested_sock).start()
    assert sized_child(64 * 1024, "r")["outcome"] == "cold"
    wait_saved(Client(nested_sock))
    shutil.rmtree(nested_sock.parent)

    def started() -> tuple[bool, object]:
        try:
            return True, Client(nested_sock).start()
        except DaemonUnavailable as exc:  # "already running", not yet bound again: retry
            return False, str(exc)

    poll("a daemon on the path", started)
    pids = poll("one daemon on the path", lambda: (len(d := daemons_on(nested_sock)) == 1, d))
    status = poll("it answering", lambda: answering(nested_sock))
    assert status["pid"] == pids[0] and status["tier"] == "file", status
    if pids[0] != first["pid"]:
        wait_for_exit(first["pid"], DEADLINE, "the first daemon")
    assert sized_child(64 * 1024, "r")["outcome"] == "warm"  # the cache on disk, kept


def test_a_daemon_whose_path_another_socket_took_exits_and_frees_its_lock(
        nested_sock: Path) -> None:
    first = Client(nested_sock).start()
    # Bound elsewhere and renamed over the path: the path never goes missing, so the daemon
    # cannot bind it again first (a delete then a bind would race its check).
    other = socket.socket(socket.AF_UNIX)
    try:
        aside = nested_sock.with_name("other.sock")
        other.bind(str(aside))
        other.listen()
        os.rename(aside, nested_sock)
        taken = nested_sock.lstat()
        wait_for_exit(first["pid"], DEADLINE, "the daemon whose path was taken")
        text = log_text(nested_sock)
        assert "names another socket" in text and "stopped" in text
        assert lock_is_free(nested_sock.with_name("d.sock.lock"))
        assert lock_is_free(cache_dir())  # the cache directory's lock, released
        now = nested_sock.lstat()  # the other's file is left alone
        assert (now.st_dev, now.st_ino) == (taken.st_dev, taken.st_ino)
        assert daemons_on(nested_sock) == []
    finally:
        other.close()
        with contextlib.suppress(FileNotFoundError):
            nested_sock.unlink()


# -- the package uninstalled -------------------------------------------------------------
def serve_from(copy: Path, sock_path: Path, env: dict[str, str]) -> None:
    """Start a daemon that runs the ``overmind_lab`` in ``copy``: ``-S``, since the editable
    install's finder (a ``.pth`` in site-packages) would take the import before PYTHONPATH;
    the daemon needs only the standard library."""
    subprocess.run([sys.executable, "-S", "-m", "overmind_lab", "serve", "--detach",
                    "--socket", str(sock_path)], env=env, cwd="/", check=True,
                   timeout=DEADLINE, capture_output=True)


def test_a_daemon_whose_package_is_removed_exits(sock_path: Path, tmp_path: Path) -> None:
    import overmind_lab

    copy = tmp_path / "site"
    shutil.copytree(Path(overmind_lab.__file__).resolve().parent, copy / "overmind_lab",
                    ignore=shutil.ignore_patterns("labextension", "__pycache__", "*.so"))
    env = {**os.environ, "PYTHONPATH": str(copy), "OVERMIND_LAB_DAEMON_PACKAGE_CHECK": "0.5"}
    serve_from(copy, sock_path, env)
    pid = int(poll("the daemon answering", lambda: answering(sock_path))["pid"])
    # It runs the copy, which no distribution owns: only its deletion counts.
    line = f"runs from {copy / 'overmind_lab'} (checkout)"
    poll("its first package check", lambda: (line in log_text(sock_path), None))
    shutil.rmtree(copy)  # what `pip uninstall` does to an installed package's files
    wait_for_exit(pid, DEADLINE, "the daemon whose package is gone")
    text = log_text(sock_path)
    assert "is gone (uninstalled?)" in text and "stopped" in text
    assert not sock_path.exists()  # a clean stop: Note [Removing our own socket]
    assert lock_is_free(sock_path.with_name("d.sock.lock"))


def test_a_checkout_edited_in_place_keeps_its_daemon(sock_path: Path, tmp_path: Path) -> None:
    """Note [A daemon whose package is gone]: a checkout on PYTHONPATH is gone only when its
    files are; an editor's save (a new inode for ``__init__.py``) keeps the daemon."""
    import overmind_lab

    copy = tmp_path / "checkout"
    shutil.copytree(Path(overmind_lab.__file__).resolve().parent, copy / "overmind_lab",
                    ignore=shutil.ignore_patterns("labextension", "__pycache__", "*.so"))
    env = {**os.environ, "PYTHONPATH": str(copy), "OVERMIND_LAB_DAEMON_PACKAGE_CHECK": "0.2"}
    serve_from(copy, sock_path, env)
    pid = poll("the daemon answering", lambda: answering(sock_path))["pid"]
    init = copy / "overmind_lab" / "__init__.py"
    edited = init.with_name("__init__.py.new")
    edited.write_text(init.read_text() + "\n# edited\n")
    os.replace(edited, init)
    poll("its first package check", lambda: ("(checkout)" in log_text(sock_path), None))
    time.sleep(2.0)  # some checks more (or none, on a loaded machine: then this proves less)
    assert Client(sock_path).status()["pid"] == pid
    assert "stopping" not in log_text(sock_path)


# -- a cache directory that cannot be made -----------------------------------------------
def memory_tier_with_one_warning(sock_path: Path, why: str) -> None:
    status = Client().start()
    assert status["tier"] == "memfd" and why in status["tier_reason"], status
    assert "cannot be created" in status["tier_reason"]
    cold = run_py(SIZED.format(here=HERE, nbytes=64 * 1024, tag="m"))
    assert last_json(cold)["outcome"] == "cold"
    # the loading process is told once (the daemon's log is not where a notebook user looks)
    assert cold.stderr.count("cached models are kept in memory") == 1, cold.stderr
    assert why in cold.stderr
    warm = run_py(SIZED.format(here=HERE, nbytes=64 * 1024, tag="m"))
    assert last_json(warm)["outcome"] == "warm" and "kept in memory" not in warm.stderr
    assert log_text(sock_path).count("memfd tier") == 1


def test_a_cache_dir_under_a_file_falls_back_to_memory(sock_path: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("OVERMIND_LAB_CACHE_DIR", str(tmp_path / "file" / "cache"))
    memory_tier_with_one_warning(sock_path, "Not a directory")


@pytest.fixture
def read_only_folder(tmp_path: Path) -> Iterator[Path]:
    """A folder on a read-only bind mount (root only)."""
    if os.getuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    src, ro = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    ro.mkdir()
    done = subprocess.run(["mount", "--bind", "-o", "ro", str(src), str(ro)],
                          capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {done.stderr.strip()}")
    try:
        if os.access(ro, os.W_OK) and not _read_only(ro):
            subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True,
                           timeout=60)
        yield ro
    finally:
        subprocess.run(["umount", str(ro)], check=True, timeout=60)


def _read_only(folder: Path) -> bool:
    try:
        (folder / "probe").mkdir()
    except OSError:
        return True
    (folder / "probe").rmdir()
    return False


def test_a_cache_dir_on_a_read_only_home_falls_back_to_memory(
        sock_path: Path, read_only_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OVERMIND_LAB_CACHE_DIR", str(read_only_folder / ".cache" / "ovl"))
    memory_tier_with_one_warning(sock_path, "Read-only file system")


def test_an_unsafe_cache_dir_is_still_refused(sock_path: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "cache").symlink_to(target)
    monkeypatch.setenv("OVERMIND_LAB_CACHE_DIR", str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-m", "overmind_lab", "serve"],
                          capture_output=True, text=True, timeout=DEADLINE)
    assert proc.returncode == 2 and "is not a directory" in proc.stderr, proc.stderr


@pytest.mark.skipif(os.getuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to run a daemon as another uid")
def test_a_daemon_of_another_user_in_a_root_folder_uses_memory() -> None:
    python = python_for_nobody()
    if python is None:
        pytest.skip("uid 65534 can run no Python interpreter on this machine")
    with package_for_nobody() as copy, \
            tempfile.TemporaryDirectory(prefix="olt-root-", dir="/tmp") as root_only:
        os.chmod(root_only, 0o755)  # root's, readable by all, writable by root alone
        run = Path(copy) / "run"
        run.mkdir(mode=0o700)
        os.chown(run, 65534, 65534)
        sock = run / "d.sock"
        env = {**os.environ, "PYTHONPATH": copy, "HOME": root_only,
               "OVERMIND_LAB_CACHE_DIR": str(Path(root_only) / "cache")}
        # In the foreground, its log on stderr: this test owns the process.
        proc = subprocess.Popen([*NOBODY, python, "-m", "overmind_lab", "serve", "--socket",
                                 str(sock)], env=env, cwd="/", stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            log = read_until(proc, "serving on")
            assert proc.poll() is None, log
            assert "segments live in memory (memfd tier)" in log, log
            assert "cannot be created (Permission denied)" in log, log
            assert not (Path(root_only) / "cache").exists()
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # stops as `stop` does
            rest = proc.communicate(timeout=DEADLINE)[1]
        assert proc.returncode == 0, rest


def read_until(proc: subprocess.Popen[str], text: str) -> str:
    """``proc``'s stderr up to the line holding ``text`` (or its end, or the deadline)."""
    assert proc.stderr is not None
    seen = []
    deadline = time.monotonic() + DEADLINE
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stderr, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(timeout=1.0):
                continue
            line = proc.stderr.readline()
            if not line:
                break
            seen.append(line)
            if text in line:
                break
    return "".join(seen)


# Note: a refresh worker of the test below waits at start-up, in a ``sitecustomize`` on the
# loading process's path (which a refresh worker takes as its PYTHONPATH), until the test
# opens the gate: the test then changes the model while the refresh is known to be running.
GATED_START = """
import os, sys, time
if "overmind_lab._loading.refresh_worker" in sys.orig_argv:
    gate = os.path.join(os.path.dirname(os.path.abspath(__file__)), "open")
    while not os.path.exists(gate):
        time.sleep(0.05)
"""


def test_an_entry_being_refreshed_is_not_let_go_under_it(daemon: Client,
                                                         tmp_path: Path) -> None:
    """The user re-saves a model while its refresh runs: the watch of held files lets go of
    a control entry whose file changed too, but leaves the refreshing one to its refresh,
    which replaces it (never neither listed); evict of a let-go key says why it went."""
    gate = tmp_path / "gate"
    gate.mkdir()
    (gate / "sitecustomize.py").write_text(GATED_START)
    env = {"PYTHONPATH": str(gate)}
    refreshed, control = save_unet(tmp_path / "refreshed"), save_unet(tmp_path / "control")
    for model in (refreshed, control):
        assert last_json(run_py(LOAD_UNET.format(path=str(model)), env=env))["outcome"] == "cold"
    wait_saved(daemon)
    entries = [dict(e) for e in daemon.entries()]
    [old] = [e for e in entries if "refreshed'" in e["name"]]
    [other] = [e for e in entries if "control'" in e["name"]]
    assert all("link" in e["tier"] for e in (old, other)), entries
    assert daemon.refresh(old["key"])["refresh"]["state"] == "running"
    save_unet(refreshed, seed=1)
    save_unet(control, seed=1)

    def control_let_go() -> tuple[bool, list[dict[str, Any]]]:
        entries = [dict(e) for e in daemon.entries()]
        return other["key"] not in {e["key"] for e in entries}, entries

    entries = poll("the watch letting go of the control entry", control_let_go)
    assert [(e["key"], e["refresh"]["state"]) for e in entries] == [(old["key"], "running")]
    with pytest.raises(UnknownEntry, match="was let go .*source (changed|replaced)"):
        daemon.evict(other["key"])

    (gate / "open").touch()

    def settled() -> tuple[bool, list[dict[str, Any]]]:
        entries = [dict(e) for e in daemon.entries()]
        assert entries, "neither the old entry nor its replacement is listed"
        return all(e["refresh"]["state"] != "running" for e in entries), entries

    [fresh] = poll("the refresh replacing the entry", settled, timeout=180.0)
    assert fresh["key"] != old["key"]
    assert fresh["refresh"]["state"] == "done", fresh["refresh"]
    assert fresh["refresh"]["previous"] == old["key"]
    status = daemon.status()
    assert status["source_gone_entries"] == 1
    assert [g["key"] for g in status["source_gone_recent"]] == [other["key"]]
