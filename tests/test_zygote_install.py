"""A zygote and the installation it imported from (issue 34, items 5, 7 and 8).

- Note [Installs the zygote sees]: in-process, what the snapshot notices in a site folder (a
  ``.pth``, a distribution, an editable finder, a user site created later, a change in the
  same timestamp tick) and what it leaves alone (``__pycache__``, the user's own folders); for
  real, ``pip install -e`` into a venv while its zygote runs: the next launch imports the new
  package (plain), the stale zygote exits, and its successor forks kernels that import it.
- Note [A zygote whose package is gone]: a zygote run from a copy of the package exits once
  the copy is removed; an idle one exits on its own (Note [Idle zygote]).
- Note [Stopping a zygote]: ``stop_zygotes`` stops every zygote of the directory, of every
  environment, and none of their kernels.
- ``overmind-lab kernel install`` where the Jupyter folder cannot be written: one line that
  says which folder and what to do, status 1, no traceback.

Every process started here (zygotes, launchers, kernels) names the test's private directory
on its command line and is killed at the end of its test, also on failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import overmind_lab
from overmind_lab._common.zygote_client import ask
from overmind_lab._common.zygote_paths import ZygotePaths, identity, zygote_processes
from overmind_lab._jupyter_server import kernelspec as spec
from overmind_lab._zygote import preload
from tests.conftest import pip_install_project, wait_for_exit
from tests.test_warm_kernel import _alive
from tests.test_warm_kernel_cli import _venv_sharing_this_one
from tests.test_warm_kernel_launcher import Launched

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

#: A zygote that boots in seconds and forks ipykernel (no torch).
KERNEL_PRELOAD = "IPython,ipykernel,ipykernel.kernelapp,ipykernel.ipkernel,colorsys"
SPAWN = ("import os, sys\n"
         "from overmind_lab._common.zygote_paths import ZygotePaths\n"
         "from overmind_lab._common.zygote_client import spawn\n"
         "owners = [int(p) for p in sys.argv[1:]]\n"
         "paths = ZygotePaths.for_launch(sys.executable, os.environ)\n"
         "spawn(paths, owners=owners, env=dict(os.environ))\n"
         "print(paths.socket)\n")


# -- processes ---------------------------------------------------------------------------

def _naming(directory: Path) -> list[int]:
    """Processes whose command line names ``directory``: the zygotes (and the kernels forked
    from them, which keep it), launchers and plain kernels started for it."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if str(directory).encode() in (entry / "cmdline").read_bytes():
                    out.append(int(entry.name))
    return out


@contextlib.contextmanager
def private_dir(prefix: str) -> Iterator[Path]:
    """A short private directory in /tmp (socket paths); every process naming it is killed
    when the block ends."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield d
    finally:
        for pid in _naming(d):  # started by this test: they name its private directory
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in _naming(d):
            wait_for_exit(pid, 120)
        shutil.rmtree(d, ignore_errors=True)


def _wait_until(predicate: Any, what: str, timeout: float = 300) -> Any:
    """``predicate()`` once it is true; fails after ``timeout`` s (a loaded machine's bound,
    not a latency the test expects)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


def _spawn(python: str, env: dict[str, str], owners: list[int]) -> Path:
    """Start a zygote for ``python`` as a launch would; its socket path (as that process
    sees its identity: the interpreter may add variables to its environment, LC_CTYPE)."""
    proc = subprocess.run([python, "-c", SPAWN, *map(str, owners)], env=env, check=True,
                          timeout=120, cwd="/", capture_output=True, text=True)
    return Path(proc.stdout.strip().splitlines()[-1])


def _status(sock: Path) -> dict[str, Any] | None:
    try:
        return dict(ask(sock, {"op": "status"}))
    except OSError:
        return None


def _serving(sock: Path, not_pid: int | None = None, timeout: float = 300) -> dict[str, Any]:
    """The status of the zygote serving on ``sock`` once there is one (not ``not_pid``)."""
    def ready() -> dict[str, Any] | None:
        status = _status(sock)
        if status and status.get("pid") != not_pid and not status.get("retiring"):
            return status
        return None

    return dict(_wait_until(ready, f"a zygote on {sock}", timeout))


def _logs(directory: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in directory.glob("zygote-*.log"))


@contextlib.contextmanager
def launched(directory: Path, python: str, env: dict[str, str], name: str
             ) -> Iterator[Launched]:
    k = Launched(directory, env, name, python=python, ready_timeout=300)
    try:
        yield k
    finally:
        k.close()


# -- Note [Installs the zygote sees], in-process ------------------------------------------

@pytest.fixture
def site_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``ROOT/lib/site-packages`` on ``sys.path``, with ``old.pth`` (which names ``ROOT/src``,
    absent) and the distribution ``old-1.0``."""
    site = tmp_path / "lib" / "site-packages"
    (site / "old-1.0.dist-info").mkdir(parents=True)
    (site / "old-1.0.dist-info" / "METADATA").write_text("Name: old\nVersion: 1.0\n")
    (site / "old.pth").write_text("../../src\n")
    monkeypatch.syspath_prepend(str(site))
    return site


def _only(snap: preload.Snapshot, root: Path) -> preload.Snapshot:
    """``snap`` without what lies outside ``root`` (the real installation may change
    meanwhile: another test run installing into the shared venv)."""
    def keep(path: str) -> bool:
        return path.startswith(str(root))

    return preload.Snapshot(
        folders={k: v for k, v in snap.folders.items() if keep(k)},
        listings={k: v for k, v in snap.listings.items() if keep(k)},
        racy={k for k in snap.racy if keep(k)},
        records={k: v for k, v in snap.records.items() if keep(k)},
        named={k: v for k, v in snap.named.items() if keep(k)})


def _write_metadata(site: Path) -> None:
    (site / "old-1.0.dist-info" / "METADATA").write_text("Name: old\nVersion: 1.0.post1\n")


CHANGES = {
    "a new .pth": (lambda s: (s / "new.pth").write_text("/nowhere\n"), "added new.pth"),
    "a removed .pth": (lambda s: (s / "old.pth").unlink(), "removed old.pth"),
    "a .pth edited in place": (lambda s: (s / "old.pth").write_text("../../src\n/x\n"),
                               "old.pth changed"),
    "a new distribution": (lambda s: (s / "new-2.0.dist-info").mkdir(),
                           "added new-2.0.dist-info"),
    "a distribution's metadata rewritten": (_write_metadata, "METADATA changed"),
    "a removed distribution": (lambda s: shutil.rmtree(s / "old-1.0.dist-info"),
                               "removed old-1.0.dist-info"),
    "an editable finder": (lambda s: (s / "__editable___new_0_1_finder.py").write_text(""),
                           "added __editable___new_0_1_finder.py"),
    "a new top-level module": (lambda s: (s / "newmod.py").write_text(""), "added newmod.py"),
    "the folder a .pth names created": (lambda s: (s.parents[1] / "src").mkdir(),
                                        "names, was created"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_the_snapshot_sees_a_change_of_the_installation(site_dir: Path, change: str) -> None:
    root = site_dir.parents[1]
    snap = _only(preload.install_snapshot(), root)
    assert str(site_dir) in snap.folders
    assert str(root / "src") in snap.named
    assert preload.install_change(snap) is None
    make, expected = CHANGES[change]
    make(site_dir)
    why = preload.install_change(snap)
    assert why is not None and expected in why, why
    assert "since the zygote started" in why


def test_bytecode_caches_and_the_users_own_folders_are_no_change(
        site_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    project = tmp_path / "project"  # an editable project's root: the user's code
    project.mkdir()
    (project / "mine.py").write_text("")
    monkeypatch.syspath_prepend(str(project))
    snap = _only(preload.install_snapshot(), tmp_path)
    assert str(project) not in snap.folders and str(site_dir) in snap.folders
    (project / "notebook.ipynb").write_text("{}")  # saved beside the user's module
    (site_dir / "__pycache__").mkdir()  # an import wrote bytecode
    assert preload.install_change(snap) is None
    (site_dir / "late.pth").write_text("")  # a change after the one taken as it is
    assert "added late.pth" in (preload.install_change(snap) or "")


def test_a_change_in_the_snapshots_timestamp_tick_is_seen(
        site_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [Installs the zygote sees]: the folder's mtime, read after its listing, already
    shows an entry made between the two; as if made in the same tick after the ``stat``, the
    mtime alone would never tell. The entries of a folder that recent are compared."""
    monkeypatch.setattr(preload, "_RACY_NS", 3600 * 10**9)  # recent, however slow this runs
    (site_dir / "late.pth").write_text("")
    listing = preload._listing

    def before_late(folder: str) -> frozenset[str] | None:
        names = listing(folder)
        return names - {"late.pth"} if names and folder == str(site_dir) else names

    monkeypatch.setattr(preload, "_listing", before_late)
    snap = _only(preload.install_snapshot(), site_dir.parents[1])
    monkeypatch.setattr(preload, "_listing", listing)
    assert str(site_dir) in snap.racy
    assert preload._stat(str(site_dir)) == snap.folders[str(site_dir)]  # the mtime is silent
    assert "added late.pth" in (preload.install_change(snap) or "")


def test_a_folder_old_enough_is_checked_by_its_stat_alone(
        site_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preload, "_RACY_NS", 0)
    snap = _only(preload.install_snapshot(), site_dir.parents[1])
    assert not snap.racy
    calls: list[str] = []
    listing = preload._listing
    monkeypatch.setattr(preload, "_listing", lambda f: calls.append(f) or listing(f))
    assert preload.install_change(snap) is None
    assert calls == []  # one stat per folder, no listing


def test_a_user_site_created_after_the_snapshot_is_a_change(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``pip install --user`` may create the user site: ``site`` of a fresh interpreter reads
    its ``.pth`` files (where the user site is enabled)."""
    import site

    user_site = tmp_path / "home" / ".local" / "lib" / "site-packages"
    monkeypatch.setattr(site, "ENABLE_USER_SITE", True)
    monkeypatch.setattr(site, "USER_SITE", str(user_site))
    snap = _only(preload.install_snapshot(), tmp_path)
    assert snap.folders == {str(user_site): None}
    assert preload.install_change(snap) is None
    user_site.mkdir(parents=True)
    assert f"{user_site} was created" in (preload.install_change(snap) or "")


# -- an install while a real zygote runs --------------------------------------------------

PROBE = """
import importlib.util, json, os
spec = importlib.util.find_spec({name!r})
print(json.dumps([os.getpid(), os.getppid(), __import__({name!r}).VALUE if spec else None]))
"""


@pytest.fixture(scope="module")
def other_venv(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A venv of this interpreter whose ``site`` also reads the shared venv's site folder:
    what is installed into it changes no other test's zygote."""
    return str(_venv_sharing_this_one(tmp_path_factory.mktemp("zygote-install") / "venv"))


@pytest.mark.slow
def test_pip_install_e_while_the_zygote_runs_gives_kernels_that_import_it(
        other_venv: str, tmp_path: Path) -> None:
    """Issue 34, item 5: before, warm kernels raised ModuleNotFoundError for a package
    installed since the zygote started (its ``.pth`` is read at interpreter start), until the
    zygote was renewed by hand."""
    name = f"olz_fresh_{os.getpid()}"
    project = tmp_path / "project"
    (project / name).mkdir(parents=True)
    (project / name / "__init__.py").write_text("VALUE = 7\n")
    probe = PROBE.format(name=name)
    venv_root = Path(other_venv).parents[1]
    with private_dir("olzi-") as run:
        env = {**os.environ, "OVERMIND_LAB_SOCKET": str(run / "d.sock"),
               "OVERMIND_LAB_PRELOAD": KERNEL_PRELOAD,
               # the replacement's owner is the launch that started it: it must outlive it
               "OVERMIND_LAB_ZYGOTE_IDLE": "600"}
        sock = _spawn(other_venv, env, owners=[os.getpid()])
        first = _serving(sock)
        assert first["python"] == other_venv
        with launched(run, other_venv, env, "before") as k:
            pid, parent, value = k.json(probe)
            assert parent == first["pid"], k.errors()  # forked
            assert value is None
            k.shutdown()

        site_dir = pip_install_project(project, name, venv_root, editable=True)
        assert list(site_dir.glob("*.pth")) != []

        with launched(run, other_venv, env, "after") as k:
            pid, parent, value = k.json(probe)
            assert value == 7, k.errors()
            # Served plain: the zygote found the installation changed, retired, and the
            # launch started its successor.
            assert pid == k.proc.pid and parent != first["pid"]
            assert "the zygote is stale" in k.errors() and str(site_dir) in k.errors()
            wait_for_exit(first["pid"], 120, "the stale zygote")
            second = _serving(sock, not_pid=first["pid"])
            with launched(run, other_venv, env, "renewed") as warm:
                pid, parent, value = warm.json(probe)
                assert parent == second["pid"], warm.errors()  # forked, and imports it
                assert value == 7
                warm.shutdown()
            k.shutdown()
        assert f"stale: {site_dir} changed since the zygote started" in _logs(run)


# -- Note [A zygote whose package is gone], Note [Idle zygote] -----------------------------

def _package_copy(folder: Path) -> Path:
    """A copy of the ``overmind_lab`` package in ``folder``, for ``PYTHONPATH``."""
    shutil.copytree(Path(overmind_lab.__file__).resolve().parent, folder / "overmind_lab",
                    ignore=shutil.ignore_patterns("labextension", "__pycache__"))
    return folder


def test_a_zygote_whose_package_was_removed_exits(tmp_path: Path) -> None:
    """Issue 34, item 8: ``pip uninstall overmind-lab`` leaves no zygote behind. The base
    interpreter runs it (the shared venv's editable finder would import the checkout first)."""
    python = os.path.realpath(sys._base_executable)
    with private_dir("olzg-") as run:
        copy = _package_copy(run / "pkg")
        env = {**os.environ, "PYTHONPATH": str(copy), "OVERMIND_LAB_SOCKET": str(run / "d.sock"),
               "OVERMIND_LAB_PRELOAD": "json", "OVERMIND_LAB_ZYGOTE_IDLE": "600",
               "OVERMIND_LAB_ZYGOTE_PACKAGE_CHECK": "0.2"}
        sock = _spawn(python, env, owners=[os.getpid()])  # owned: no idle exit
        pid = _serving(sock)["pid"]
        assert zygote_processes(run) == [pid]
        shutil.rmtree(copy / "overmind_lab")
        wait_for_exit(pid, 120, "the zygote whose package was removed")
        assert not sock.exists()
        assert (f"its overmind-lab was uninstalled or replaced: {copy}/overmind_lab/"
                "__init__.py was removed") in _logs(run)


def test_a_zygote_without_owner_nor_kernel_exits_after_its_idle_time(tmp_path: Path) -> None:
    with private_dir("olzd-") as run:
        env = {**os.environ, "OVERMIND_LAB_SOCKET": str(run / "d.sock"),
               "OVERMIND_LAB_PRELOAD": "json", "OVERMIND_LAB_ZYGOTE_IDLE": "1"}
        owner = subprocess.Popen(["sleep", "600"])
        try:
            sock = _spawn(sys.executable, env, owners=[owner.pid])
            pid = _serving(sock)["pid"]
        finally:
            owner.kill()
            owner.wait()
        wait_for_exit(pid, 120, "the idle zygote")
        assert "no owner and no kernel for" in _logs(run)


# -- Note [Stopping a zygote] --------------------------------------------------------------

def test_stop_zygotes_stops_every_environments_zygote_and_no_kernel(other_venv: str) -> None:
    with private_dir("olzs-") as run:
        env = {**os.environ, "OVERMIND_LAB_SOCKET": str(run / "d.sock"),
               "OVERMIND_LAB_PRELOAD": KERNEL_PRELOAD}
        socks = [_spawn(python, env, owners=[os.getpid()])
                 for python in (sys.executable, other_venv)]
        assert len(set(socks)) == 2
        pids = sorted(_serving(s)["pid"] for s in socks)
        with launched(run, sys.executable, env, "kernel") as k:
            kernel, parent = k.json("import json, os; print(json.dumps([os.getpid(), "
                                    "os.getppid()]))")
            assert parent in pids, k.errors()
            assert zygote_processes(run) == pids  # the kernel keeps a zygote's command line
            assert spec.stop_zygotes(run) == pids
            assert not any(_alive(p) for p in pids)
            assert not [s for s in socks if s.exists()]
            assert _alive(kernel)  # kernels run on
            assert k.json("print('[1, 2, 3]')") == [1, 2, 3]
            k.kc.shutdown()
            wait_for_exit(kernel, 120, "the kernel")
        assert spec.stop_zygotes(run) == []
        assert _logs(run).count("stopped by SIGTERM") == 2


def test_a_zygote_refuses_a_kernel_of_another_environment(other_venv: str) -> None:
    """Note [Environments share an interpreter]: a zygote started by this venv's process for a
    kernelspec of another venv (a server of one environment, a kernelspec of another) has this
    venv's packages: it must not fork that kernel."""
    from overmind_lab._common.zygote_client import WarmUnavailable, request_fork, spawn

    with private_dir("olze-") as run:
        env = {**os.environ, "OVERMIND_LAB_SOCKET": str(run / "d.sock"),
               "OVERMIND_LAB_PRELOAD": "json"}
        paths = ZygotePaths(run, identity(other_venv, env))
        spawn(paths, owners=[os.getpid()], env=env)  # runs sys.executable
        assert _serving(paths.socket)["python"] == sys.executable
        stdio = [os.open(os.devnull, os.O_RDWR) for _ in range(3)]
        try:
            with pytest.raises(WarmUnavailable, match="Python environment"):
                request_fork([other_venv, "-m", "ipykernel_launcher", "-f", str(run / "k.json")],
                             env, "/", stdio, False)
        finally:
            for fd in stdio:
                os.close(fd)


# -- kernel install where the Jupyter folder cannot be written ------------------------------

def _kernel_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "overmind_lab", "kernel", *args],
                          env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120, cwd="/")


def test_kernel_install_into_an_unwritable_data_dir_says_what_to_do(tmp_path: Path) -> None:
    """Issue 34, item 7: a home whose Jupyter data folder cannot be created (here it would lie
    under a regular file: ENOTDIR, as a read-only home gives EACCES or EROFS)."""
    blocker = tmp_path / "home-file"
    blocker.write_text("")
    data = blocker / "jupyter"
    proc = _kernel_cli("install", "--user", env={"JUPYTER_DATA_DIR": str(data)})
    assert proc.returncode == 1, proc
    assert "Traceback" not in proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("overmind-lab: cannot install the kernelspec 'overmind-lab-warm' "
                           f"into {data}/kernels/overmind-lab-warm: Not a directory")
    assert "JUPYTER_DATA_DIR" in line and "--sys-prefix" in line and "--prefix PATH" in line
    with pytest.raises(spec.KernelspecNotWritable) as raised:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("JUPYTER_DATA_DIR", str(data))
            spec.install(user=True)
    assert isinstance(raised.value, overmind_lab.OvermindError)
    proc = _kernel_cli("install", "--prefix", str(blocker / "prefix"), env={})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc
    assert "--user" in proc.stderr and str(blocker / "prefix") in proc.stderr


def test_kernel_install_prefix_puts_the_kernelspec_under_it(tmp_path: Path) -> None:
    proc = _kernel_cli("install", "--prefix", str(tmp_path), "--json", env={})
    assert proc.returncode == 0, proc.stderr
    installed = Path(json.loads(proc.stdout)["installed"])
    assert installed == tmp_path / "share" / "jupyter" / "kernels" / "overmind-lab-warm"
    assert json.loads((installed / "kernel.json").read_text())["argv"][0] == sys.executable
