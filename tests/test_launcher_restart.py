"""A restart through the launcher, as VS Code and jupyter_client's ``LocalProvisioner`` do it:
ask the kernel to shut down with ``restart: true``, wait for the launcher to exit, run the
kernelspec's argv again with the same connection file (Note [A standby for the launcher's
restart] in ``overmind_lab/_forked/claim.py``).

The restarted kernel must be the standby the zygote forked at the request only when the new
launch equals the old one, and then be wired as a fork would be: the new launcher's stdio,
``JPY_PARENT_PID`` and parent watch. A launch that differs (env, ports) gets a kernel of its
own, and no standby is left behind, also when no launch comes at all. Real launchers, kernels
and zygotes; every process started here is killed at the end (``_kill_all``).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from overmind_lab._common.zygote_client import ask
from overmind_lab._common.zygote_paths import ZygotePaths
from tests.test_warm_kernel_launcher import Launched, _env, _kill_all, _wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

#: Enough for ipykernel; colorsys, which no plain kernel imports, marks a forked one.
PRELOAD = "IPython,ipykernel,ipykernel.kernelapp,ipykernel.ipkernel,colorsys"
FACTS = ("import os, sys, json; print(json.dumps({'pid': os.getpid(), 'forked': 'colorsys' in "
         "sys.modules, 'parent': os.environ.get('JPY_PARENT_PID'), 'extra': os.environ.get("
         "'OLL_EXTRA'), 'out': list(os.fstat(1))[:2], 'err': list(os.fstat(2))[:2]}))")


@pytest.fixture(scope="module")
def lab() -> Iterator[Path]:
    """A private folder with a ready zygote, owned by this test process, that lets an unclaimed
    standby wait 3 s."""
    with tempfile.TemporaryDirectory(prefix="olr-", dir="/tmp") as d:
        try:
            env = env_of(Path(d))
            code = ("import os, sys\nfrom overmind_lab._common.zygote_paths import ZygotePaths\n"
                    "from overmind_lab._common.zygote_client import spawn\n"
                    "spawn(ZygotePaths.for_launch(sys.executable, os.environ), "
                    f"owners=[{os.getpid()}], env=dict(os.environ))\n")
            subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120,
                           cwd="/")
            sock = ZygotePaths.for_launch(sys.executable, env).socket
            _wait_until(sock.exists, f"the zygote's socket {sock}")
            yield Path(d)
        finally:
            _kill_all(Path(d))


def env_of(lab: Path, **extra: str) -> dict[str, str]:
    return _env(lab, OVERMIND_LAB_PRELOAD=PRELOAD, OVERMIND_LAB_RESTART_STANDBY_SECONDS="3",
                **extra)


def status(lab: Path) -> dict[str, Any]:
    reply = ask(ZygotePaths.for_launch(sys.executable, env_of(lab)).socket, {"op": "status"})
    assert reply.get("ok"), reply
    return dict(reply)


def start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[19])


def fd_identity(pid: int, fd: int) -> list[int]:
    st = os.stat(f"/proc/{pid}/fd/{fd}")
    return [st.st_mode, st.st_ino]


class Frontend:
    """One kernel as a frontend drives it: launchers run one after the other on one connection
    file."""

    def __init__(self, lab: Path, name: str, **extra: str) -> None:
        self.lab, self.name, self.env = lab, name, env_of(lab, **extra)
        self.k = self._warm()

    def _warm(self) -> Launched:
        """A launch whose kernel is forked (the first one of the folder starts the zygote)."""
        deadline = time.monotonic() + 300
        while True:
            k = Launched(self.lab, self.env, self.name)
            if k.json(FACTS)["forked"]:
                return k
            k.shutdown()
            k.close()
            assert time.monotonic() < deadline, "no zygote served a launch in 300 s"
            time.sleep(0.5)

    def restart(self, env: dict[str, str] | None = None,
                before_launch: Any = None) -> tuple[Launched, int]:
        """Restart as jupyter_client does; the new launch and the old kernel's pid."""
        old = self.k.json(FACTS)["pid"]
        self.k.kc.shutdown(restart=True)
        assert self.k.proc.wait(timeout=120) == 0
        self.k.close()
        if before_launch is not None:
            before_launch()
        self.k = self.launch(env)
        return self.k, old

    def launch(self, env: dict[str, str] | None = None) -> Launched:
        """The kernelspec's argv again, on the same connection file."""
        return Launched(self.lab, env or self.env, self.name,
                        connection_file=self.k.connection_file)

    def close(self) -> None:
        self.k.close()


@pytest.fixture
def frontend(lab: Path, request: pytest.FixtureRequest) -> Iterator[Frontend]:
    f = Frontend(lab, request.node.name[:40])
    try:
        yield f
    finally:
        f.close()


def test_the_restarted_kernel_is_the_standby_wired_to_the_new_launcher(
        lab: Path, frontend: Frontend) -> None:
    claimed = status(lab)["standbys_claimed"]
    k, old = frontend.restart()
    facts = k.json(FACTS)
    assert facts["forked"] and facts["pid"] not in (old, k.proc.pid)
    assert status(lab)["standbys_claimed"] == claimed + 1
    # forked before this launcher started: the standby of the restart request
    assert start_time(facts["pid"]) <= start_time(k.proc.pid)
    # wired as a fork for this launcher would be
    assert facts["parent"] == str(k.proc.pid)
    assert facts["out"] == fd_identity(k.proc.pid, 1)
    assert facts["err"] == fd_identity(k.proc.pid, 2)
    k.json("import os; os.write(2, b'from the restarted kernel\\n'); print('null')")
    _wait_until(lambda: "from the restarted kernel" in k.errors(), "the kernel's stderr")
    # and it goes on restarting the same way
    k2, _ = frontend.restart()
    assert k2.json(FACTS)["forked"]
    assert status(lab)["standbys_claimed"] == claimed + 2


def test_a_killed_launcher_takes_its_claimed_standby_with_it(lab: Path,
                                                               frontend: Frontend) -> None:
    claimed = status(lab)["standbys_claimed"]
    k, _ = frontend.restart()
    pid = k.json(FACTS)["pid"]
    assert status(lab)["standbys_claimed"] == claimed + 1
    pidfd = os.pidfd_open(pid)
    try:
        k.proc.kill()
        k.proc.wait(timeout=60)
        # the parent watch began at the claim; the deadline is a loaded machine's
        exited = select.select([pidfd], [], [], 120)[0]
    finally:
        os.close(pidfd)
    assert exited, f"kernel {pid} still runs 120 s after its launcher's SIGKILL"


def test_a_launch_with_another_environment_gets_a_kernel_of_its_own(
        lab: Path, frontend: Frontend) -> None:
    claimed = status(lab)["standbys_claimed"]
    k, _ = frontend.restart(env_of(lab, OLL_EXTRA="changed"))
    facts = k.json(FACTS)
    assert facts["forked"] and facts["extra"] == "changed"
    assert status(lab)["standbys_claimed"] == claimed
    assert status(lab)["standbys"] == 0  # the standby was let go at the launch
    assert start_time(facts["pid"]) >= start_time(k.proc.pid)


def test_new_ports_at_the_restart_get_a_kernel_of_its_own(
        lab: Path, request: pytest.FixtureRequest) -> None:
    """The file is rewritten once the standby read it (it waits at its sockets): a standby that
    read the new file would rightly be claimed, as it then listens where the file says."""
    from jupyter_client.connect import write_connection_file

    timeline = lab / "ports-timeline.jsonl"
    f = Frontend(lab, request.node.name[:40], OVERMIND_LAB_TIMELINE=str(timeline))
    try:
        claimed = status(lab)["standbys_claimed"]
        since = time.time()

        def new_ports() -> None:
            _wait_until(lambda: event_after(timeline, since, "child.standby") is not None,
                        "the standby at its sockets")
            Path(f.k.connection_file).unlink()
            write_connection_file(fname=f.k.connection_file, ip="127.0.0.1",
                                  key=os.urandom(16).hex().encode())

        k, _ = f.restart(before_launch=new_ports)  # its client reads the new file
        assert k.json(FACTS)["forked"]
        assert status(lab)["standbys_claimed"] == claimed
        assert status(lab)["standbys"] == 0
    finally:
        f.close()


def test_an_unclaimed_standby_exits_by_itself(lab: Path, request: pytest.FixtureRequest) -> None:
    timeline = lab / "timeline.jsonl"
    f = Frontend(lab, request.node.name[:40], OVERMIND_LAB_TIMELINE=str(timeline))
    try:
        since = time.time()
        f.k.kc.shutdown(restart=True)  # ... and no launch follows
        assert f.k.proc.wait(timeout=120) == 0
        # the kernel's exit came after the zygote's acknowledgement: the fork is logged by now,
        # or follows the acknowledgement at once
        _wait_until(lambda: standby_of(timeline, since) is not None, "the standby's fork")
        pid = standby_of(timeline, since)
        assert pid is not None
        # it waits 3 s (OVERMIND_LAB_RESTART_STANDBY_SECONDS), then exits and is reaped
        _wait_until(lambda: not Path(f"/proc/{pid}").exists(), f"standby {pid}'s exit", 120)
        assert status(lab)["standbys"] == 0
        claimed = status(lab)["standbys_claimed"]
        f.k.close()
        f.k = f.launch()  # a later launch is forked anew
        assert f.k.json(FACTS)["forked"]
        assert status(lab)["standbys_claimed"] == claimed
    finally:
        f.close()


def event_after(timeline: Path, since: float, name: str,
                after: str | None = None) -> dict[str, Any] | None:
    """The first event ``name`` at ``since`` or later (and after an event ``after``, if given)."""
    seen = after is None
    with contextlib.suppress(FileNotFoundError):
        for line in timeline.read_text().splitlines():
            event = json.loads(line)
            if event["t"] < since:
                continue
            if seen and event["event"] == name:
                return dict(event)
            seen = seen or event["event"] == after
    return None


def standby_of(timeline: Path, since: float) -> int | None:
    """The pid of the standby forked after ``zygote.restart_standby`` at ``since`` or later."""
    event = event_after(timeline, since, "zygote.forked", after="zygote.restart_standby")
    return None if event is None else int(event["kernel"])
