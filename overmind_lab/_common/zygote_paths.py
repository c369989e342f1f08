"""Where zygotes live, and what makes one zygote different from another: the *identity*
(a hash of the interpreter, its environment and :data:`IMPORT_ENV_PREFIXES` variables, not the
preload set) names its socket in the per-user runtime directory.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

from overmind_lab._common.naming import ensure_private_dir, runtime_dir, socket_path
from overmind_lab._common.sizes import env_seconds
from overmind_lab._common.zygote_identity import (
    IMPORT_ENV_PREFIXES,
    SOCKET_ENV,
    TIMELINE_ENV,
    ZYGOTE_BOOT_WAIT_ENV,
    ZYGOTE_IDLE_ENV,
    ZYGOTE_PACKAGE_CHECK_ENV,
    environment,
    identity,
    import_env,
)

__all__ = ["IMPORT_ENV_PREFIXES", "import_env", "environment", "identity", "zygote_dir",
           "ZygotePaths", "ZYGOTE_IDLE_ENV", "zygote_idle_seconds", "ZYGOTE_BOOT_WAIT_ENV",
           "zygote_boot_wait_seconds", "ZYGOTE_PACKAGE_CHECK_ENV", "zygote_package_check_seconds",
           "zygote_processes", "TIMELINE_ENV", "ZYGOTE_ONLY_ENV"]

#: Set by overmind-lab itself in the zygote only; never part of the identity.
ZYGOTE_ONLY_ENV = ("OPENBLAS_NUM_THREADS", "PYTORCH_NVML_BASED_CUDA_CHECK")

#: Note [Idle zygote]: how long (s) a zygote with no owner nor kernel stays (``ZYGOTE_IDLE_ENV``),
#: so that a next run (nbconvert, papermill, a VS Code launcher) is forked, not plain.
DEFAULT_ZYGOTE_IDLE_S = 300.0
#: Note [Waiting for a booting zygote]: how long (s) a launch waits for a zygote importing now
#: (``ZYGOTE_BOOT_WAIT_ENV``).
DEFAULT_ZYGOTE_BOOT_WAIT_S = 30.0
#: Note [A zygote whose package is gone] (``_zygote/loop.py``): how often (s) a zygote checks that
#: the overmind-lab it runs is still installed (``ZYGOTE_PACKAGE_CHECK_ENV``).
DEFAULT_ZYGOTE_PACKAGE_CHECK_S = 10.0
#: Note [Restart timeline]: ``TIMELINE_ENV`` names a file to which the provisioner, the zygote and
#: a forked child append one JSON line per step of a launch (``benchmarks/_warm_kernel.py`` reads
#: it); unset: nothing. Not part of the identity. More in docs/notes.md.


def zygote_idle_seconds(env: Mapping[str, str] | None = None) -> float:
    """``$OVERMIND_LAB_ZYGOTE_IDLE`` in seconds (``0``: exit with the last owner), else
    :data:`DEFAULT_ZYGOTE_IDLE_S`."""
    return env_seconds(ZYGOTE_IDLE_ENV, DEFAULT_ZYGOTE_IDLE_S, env, zero=True)


def zygote_boot_wait_seconds(env: Mapping[str, str] | None = None) -> float:
    """``$OVERMIND_LAB_ZYGOTE_BOOT_WAIT`` in seconds (``0``: never wait), else
    :data:`DEFAULT_ZYGOTE_BOOT_WAIT_S`."""
    return env_seconds(ZYGOTE_BOOT_WAIT_ENV, DEFAULT_ZYGOTE_BOOT_WAIT_S, env, zero=True)


def zygote_package_check_seconds(env: Mapping[str, str] | None = None) -> float:
    """``$OVERMIND_LAB_ZYGOTE_PACKAGE_CHECK`` in seconds, else
    :data:`DEFAULT_ZYGOTE_PACKAGE_CHECK_S`."""
    return env_seconds(ZYGOTE_PACKAGE_CHECK_ENV, DEFAULT_ZYGOTE_PACKAGE_CHECK_S, env, zero=True)


def zygote_dir(env: Mapping[str, str] | None = None, create: bool = True) -> Path:
    """The directory of the zygote sockets, created (0700 when it is the per-user default) unless
    ``create`` is false."""
    env = os.environ if env is None else env
    override = env.get(SOCKET_ENV)
    if override:
        path = socket_path(override).parent
        if create:
            path.mkdir(parents=True, exist_ok=True)
        return path
    path = runtime_dir()
    if create:
        ensure_private_dir(path)
    return path


_ZYGOTE_ARGV = [b"-m", b"overmind_lab._zygote", b"--socket"]


def _proc_stat(pid: str) -> tuple[int, int]:
    """``(ppid, session id)`` of ``pid`` from ``/proc/<pid>/stat``."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rpartition(b")")[2].split()
    return int(fields[1]), int(fields[3])


def zygote_processes(directory: Path) -> list[int]:
    """The pids of this uid's zygotes whose socket lies in ``directory``: booting, serving or
    retiring, of every Python environment, found by their command line (``python -m
    overmind_lab._zygote --socket DIRECTORY/zygote-....sock ...``, as ``spawn`` starts them).

    Note [Telling a zygote from its kernels]: a forked kernel keeps the zygote's command line (it
    never execs). It is no zygote when its parent is one (a child before it became a kernel),
    nor when it leads its own session (``become`` calls ``setsid``; a kernel whose zygote is gone
    has another parent): ``spawn``'s shell leads the zygote's session, so a zygote never does."""
    want = os.path.realpath(directory)
    uid = os.getuid()
    found: dict[int, int] = {}  # pid -> ppid
    try:
        entries = list(os.scandir("/proc"))
    except OSError:
        return []
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            ppid, sid = _proc_stat(entry.name)
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not readable
        pid = int(entry.name)
        for i in range(1, len(argv) - len(_ZYGOTE_ARGV)):
            if argv[i:i + len(_ZYGOTE_ARGV)] == _ZYGOTE_ARGV:
                sock = os.fsdecode(argv[i + len(_ZYGOTE_ARGV)])
                name = os.path.basename(sock)
                if (sid != pid and name.startswith("zygote-") and name.endswith(".sock")
                        and os.path.realpath(os.path.dirname(sock)) == want):
                    found[pid] = ppid
                break
    return sorted(pid for pid, ppid in found.items() if ppid not in found)


class ZygotePaths:
    """The files of one zygote identity inside the zygote directory."""

    def __init__(self, directory: Path, ident: str) -> None:
        self.directory = directory
        self.ident = ident
        base = directory / f"zygote-{ident}"
        self.socket = base.with_suffix(".sock")
        self.boot_lock = base.with_suffix(".boot")   # held while a zygote imports
        self.log = base.with_suffix(".log")
        self.learned = base.with_suffix(".learned.json")
        self.state = base.with_suffix(".state.json")  # pid, preload set, forks (for status)

    @classmethod
    def for_launch(cls, interpreter: str, env: Mapping[str, str]) -> ZygotePaths:
        return cls(zygote_dir(env), identity(interpreter, env))

    def booting(self) -> list[int]:
        """The pids of live zygotes importing for this identity now (each binds ``<socket>.<pid>``
        while it boots: Note [Replacing a zygote])."""
        pids = []
        for tmp in self.directory.glob(f"{self.socket.name}.*"):
            suffix = tmp.name.rpartition(".")[2]
            if suffix.isdigit() and os.path.exists(f"/proc/{suffix}"):
                pids.append(int(suffix))
        return pids

    def wait_while_booting(self, timeout: float) -> bool:
        """Whether the socket exists, after waiting up to ``timeout`` s while a zygote boots.

        Note [Waiting for a booting zygote]: waiting costs only the imports a plain kernel would
        do anyway; not waiting starts a second zygote and a plain kernel. More in docs/notes.md."""
        deadline = time.monotonic() + timeout
        while not self.socket.exists():
            if time.monotonic() >= deadline or not self.booting():
                return False
            time.sleep(0.05)
        return True
