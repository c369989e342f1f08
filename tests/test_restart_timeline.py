"""A warm kernel's restart: the timeline it writes (Note [Restart timeline]), its old kernel's
``atexit`` handlers, and the exit seen on the pidfd (Note [Exit on the pidfd]) without losing
jupyter_client's SIGTERM and SIGKILL for a kernel that does not exit.

The zygote and kernels as in ``test_warm_kernel.py`` (its helpers), with
``OVERMIND_LAB_TIMELINE`` in the launch environment from the start (it is part of the
zygote's identity, as every ``OVERMIND_LAB_`` variable).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from overmind_lab._common.zygote_client import TIMELINE_ENV, timeline
from tests.conftest import kill_and_wait
from tests.test_warm_kernel import (
    Kernel,
    _alive,
    _ppid,
    _wait_for,
    private_zygote_dir,
    ready_zygote,
)


def test_timeline_writes_a_json_line_only_when_asked(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.jsonl"
    monkeypatch.delenv(TIMELINE_ENV, raising=False)
    timeline("nothing")
    timeline("nothing either", {})
    assert not path.exists()
    timeline("from env", {TIMELINE_ENV: str(path)}, kernel=7)
    monkeypatch.setenv(TIMELINE_ENV, str(path))
    before = time.time()
    timeline("from os.environ")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["event"] for e in lines] == ["from env", "from os.environ"]
    assert lines[0]["kernel"] == 7 and lines[0]["pid"] == os.getpid()
    assert before <= lines[1]["t"] <= time.time()
    monkeypatch.setenv(TIMELINE_ENV, str(tmp_path / "no-such-dir" / "t.jsonl"))
    timeline("unwritable: ignored")


def test_a_standby_waits_as_long_as_its_request_says_within_bounds() -> None:
    """Note [A standby kept ready]: ``standby_wait`` in a fork request, bounded."""
    from overmind_lab._forked.become import MAX_STANDBY_SECONDS, STANDBY_SECONDS
    from overmind_lab._zygote.loop import _standby_wait

    assert _standby_wait({}) == STANDBY_SECONDS  # type: ignore[typeddict-item]
    for asked, waits in ((3600, 3600.0), (-5, 1.0), (10 * MAX_STANDBY_SECONDS, MAX_STANDBY_SECONDS),
                         (float("nan"), STANDBY_SECONDS), (True, STANDBY_SECONDS),
                         ("3600", STANDBY_SECONDS)):
        assert _standby_wait({"standby_wait": asked}) == waits, asked  # type: ignore[typeddict-item]


@pytest.fixture(scope="module")
def timed_zygote() -> Iterator[Path]:
    """A private zygote directory with its zygote; yields the timeline file."""
    if not sys.platform.startswith("linux"):
        pytest.skip("Linux only")
    with private_zygote_dir("olt-", files_env={TIMELINE_ENV: "timeline.jsonl"}) as d:
        first = Kernel()  # plain: it starts the zygote
        first.close()
        ready_zygote(d)
        yield d / "timeline.jsonl"


@pytest.fixture(autouse=True)
def standby_ahead(request: pytest.FixtureRequest,
                  monkeypatch: pytest.MonkeyPatch) -> float | None:
    """Note [A standby kept ready] off (these tests follow a standby forked at the restart),
    unless a test is marked ``standby_ahead(SECONDS)``."""
    from overmind_lab._jupyter_server.provisioner import WarmProvisioner

    marker = request.node.get_closest_marker("standby_ahead")
    seconds = marker.args[0] if marker else None
    monkeypatch.setattr(WarmProvisioner, "standby_ahead_s", seconds)
    return seconds


def _events_since(path: Path, t0: float) -> list[dict[str, Any]]:
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["t"] >= t0]


@pytest.mark.slow
def test_a_restart_runs_the_old_kernels_atexit_and_writes_its_timeline(
        timed_zygote: Path, tmp_path: Path) -> None:
    k = Kernel(cwd=str(tmp_path))
    try:
        assert k.warm, k.log_text()
        marker = tmp_path / "atexit-ran"
        k.run(f"import atexit; atexit.register(lambda: open({str(marker)!r}, 'w').write('ran'))")
        old = k.pid
        t0 = time.time()
        k.restart()
        assert k.warm and k.pid != old
        assert marker.read_text() == "ran"
        assert k.run("print(1 + 1)").strip() == "2"
        events = _events_since(timed_zygote, t0)
        first = {}
        for e in events:
            first.setdefault(e["event"], e)
        for name in ("provisioner.shutdown_requested", "provisioner.standby", "child.exit",
                     "provisioner.exit_seen", "provisioner.launch.start", "zygote.fork_request",
                     "zygote.forked", "child.become", "zygote.fork_reply", "child.standby",
                     "provisioner.standby_go", "child.go", "provisioner.launch.end",
                     "child.run_module"):
            assert name in first, (name, events)
        assert first["child.exit"]["pid"] == old
        # Note [A standby for the restart]: the new kernel was forked as the old one was asked
        # to shut down, and started its sockets once the launch told it to go
        assert first["zygote.fork_request"]["standby"] is True
        for name in ("child.become", "child.run_module", "child.standby", "child.go"):
            assert first[name]["pid"] == k.pid, (name, first[name])
        assert first["provisioner.standby_go"]["kernel"] == k.pid
        assert set(first["child.become"]["steps"]) >= {"inherit", "import_caches", "threads"}
        # Note [Ports bound at the fork]: shell, iopub, stdin and control
        assert len(first["child.go"]["ports"]) == 4, first["child.go"]
        # Note [Checked while the old kernel exits]: the zygote checked its files for this fork
        # after the restart was requested
        assert first["zygote.checked"]["checked_at"] is not None
        order = ["provisioner.shutdown_requested", "provisioner.standby", "zygote.forked",
                 "child.standby"]
        times = [first[name]["t"] for name in order]
        assert times == sorted(times), list(zip(order, times, strict=True))
        order = ["child.exit", "provisioner.exit_seen", "provisioner.launch.start",
                 "provisioner.standby_go", "child.go"]
        times = [first[name]["t"] for name in order]
        assert times == sorted(times), list(zip(order, times, strict=True))
    finally:
        k.close()


@pytest.mark.slow
def test_a_kernel_that_ignores_its_shutdown_and_sigterm_is_killed_on_restart(
        timed_zygote: Path, tmp_path: Path) -> None:
    k = Kernel(cwd=str(tmp_path))
    try:
        assert k.warm, k.log_text()
        k.km.shutdown_wait_time = 2.0  # SIGTERM after 1 s, SIGKILL after 2 s
        k.run("import atexit, signal, time\n"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "atexit.register(time.sleep, 3600)\n")
        old = k.pid
        t0 = time.monotonic()
        k.restart()
        took = time.monotonic() - t0
        assert k.warm and k.pid != old
        _wait_for(lambda: not _alive(old), 30, "the old kernel to be killed")
        assert 1.5 <= took < 60, took
        assert k.run("print(6 * 7)").strip() == "42"
    finally:
        k.close()


def _welcome(session: Any, sub: Any) -> dict[str, Any] | None:
    """The next ``iopub_welcome`` on ``sub`` (other messages skipped); None after 60 s of
    silence."""
    while sub.poll(60_000):
        _, frames = session.feed_identities(sub.recv_multipart())
        msg = session.deserialize(frames)
        if msg["header"]["msg_type"] == "iopub_welcome":
            return msg
    return None


@pytest.mark.slow
def test_every_iopub_subscriber_is_welcomed_and_the_zygotes_finalizers_stay_its_own(
        timed_zygote: Path, tmp_path: Path) -> None:
    """Note [Every subscriber welcomed]: a second and a third client each get their
    ``iopub_welcome`` (a plain ipykernel welcomes only the first subscription to a topic).
    Note [The zygote's finalizers]: the kernel runs its own ``weakref.finalize`` at exit, not
    the zygote's; and its ports were bound at the fork (Note [Ports bound at the fork])."""
    import zmq

    k = Kernel(cwd=str(tmp_path))
    subs: list[Any] = []
    try:
        assert k.warm, k.log_text()
        info = k.km.get_connection_info()
        for _ in range(2):  # the test's client already subscribed to every topic
            sub = zmq.Context.instance().socket(zmq.SUB)
            sub.linger = 0
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"tcp://{info['ip']}:{info['iopub_port']}")
            subs.append(sub)
            msg = _welcome(k.km.session, sub)
            assert msg is not None and msg["content"] == {"subscription": ""}
        counts = k.json(
            "import json, weakref\n"
            "_infos = list(weakref.finalize._registry.values())\n"
            "_torch = [i for i in _infos if i.func.__module__.startswith('torch')]\n"
            "print(json.dumps([sum(i.atexit for i in _torch), len(_torch)]))")
        assert counts[1] > 0 and counts[0] == 0, counts  # torch's, made in the zygote
        marker = tmp_path / "finalized"
        k.run("import weakref\n"
              "class _Held: pass\n"
              "_held = _Held()\n"
              f"weakref.finalize(_held, open({str(marker)!r}, 'w').write, 'ran')")
        t0 = time.time()
        k.restart()
        assert marker.read_text() == "ran"
        go = [e for e in _events_since(timed_zygote, t0) if e["event"] == "child.go"]
        assert go and go[-1]["ports"], go
    finally:
        for sub in subs:
            sub.close()
        k.close()


@pytest.mark.slow
def test_a_standby_forked_for_another_launch_exits_and_the_launch_forks_its_own(
        timed_zygote: Path, tmp_path: Path) -> None:
    """Note [A standby for the restart]: a restart whose launch differs from the last one (here
    its environment: the server may pass another on each launch) is not the launch the standby
    was forked for. The standby exits without starting (no ``go``), and the launch forks a
    kernel of its own, which has the new environment."""
    k = Kernel(cwd=str(tmp_path))
    try:
        assert k.warm, k.log_text()
        old = k.pid
        launch_env = k.km._launch_args["env"]
        k.km._launch_args["env"] = {**launch_env, "OVERMIND_TEST_LAUNCH": "second"}
        t0 = time.time()
        k.restart()
        assert k.warm and k.pid != old, k.log_text()
        events = _events_since(timed_zygote, t0)
        [dropped] = [e for e in events if e["event"] == "provisioner.standby_dropped"]
        assert "differs" in dropped["reason"], dropped
        standby = dropped["kernel"]
        assert standby not in (old, k.pid)
        _wait_for(lambda: not _alive(standby), 30, "the dropped standby to exit")
        assert [e["pid"] for e in events if e["event"] == "child.standby"] in ([], [standby])
        assert [e["pid"] for e in events if e["event"] == "child.go"] == []
        forks = [e for e in events if e["event"] == "zygote.fork_request"]
        assert [e["standby"] for e in forks] == [True, False]
        assert k.run("import os; print(os.environ.get('OVERMIND_TEST_LAUNCH'))").strip() == \
            "second"
    finally:
        k.close()


@pytest.mark.slow
def test_restarting_a_dead_kernel_gives_one_that_stays(timed_zygote: Path,
                                                       tmp_path: Path) -> None:
    """Note [A shutdown request nobody read]: the restart of a kernel that died (the button a
    user presses after a crash) sends it a ``shutdown_request`` nobody reads; the new kernel,
    on the same ports at once, must not get it. It answers two cells, and it never exited."""
    k = Kernel(cwd=str(tmp_path))
    try:
        assert k.warm, k.log_text()
        # jupyter_client's linger is 100 ms, and whether one of the socket's reconnects falls
        # into it is chance: 5 s make the unread request reach the new kernel every time
        k.km._connect_control_socket()
        k.km._control_socket.linger = 5000
        kill_and_wait(k.pid)
        t0 = time.time()
        k.restart()
        assert k.warm, k.log_text()
        assert k.run("print(6 * 7)").strip() == "42"
        assert k.run("import os; print(os.getpid())").strip() == str(k.pid)
        exits = [e for e in _events_since(timed_zygote, t0) if e["event"] == "child.exit"]
        assert exits == [], exits
    finally:
        k.close()


def _standby_pid(path: Path, t0: float) -> int | None:
    """The first kernel the zygote forked since ``t0`` (a restart's standby), if any yet."""
    replies = [e for e in _events_since(path, t0) if e["event"] == "zygote.fork_reply"]
    return replies[0]["kernel"] if replies else None


@pytest.mark.slow
def test_a_standby_killed_before_the_launch_is_replaced_by_a_fork(
        timed_zygote: Path, tmp_path: Path) -> None:
    """Note [A standby for the restart]: a standby that died before its launch (killed here,
    between jupyter_client's shutdown and its start, the two halves of a restart) cannot be
    told to go; the launch forks a kernel of its own."""
    k = Kernel(cwd=str(tmp_path))
    try:
        assert k.warm, k.log_text()
        old = k.pid
        t0 = time.time()
        k.km.shutdown_kernel(now=False, restart=True)
        standby = _wait_for(lambda: _standby_pid(timed_zygote, t0), 60, "the standby's fork")
        kill_and_wait(standby)
        k.km.start_kernel(**k.km._launch_args)
        k.kc.wait_for_ready(timeout=120)
        assert k.warm and k.pid not in (old, standby), k.log_text()
        events = _events_since(timed_zygote, t0)
        [dropped] = [e for e in events if e["event"] == "provisioner.standby_dropped"]
        assert dropped["kernel"] == standby and "exited" in dropped["reason"], dropped
        assert k.run("print(6 * 7)").strip() == "42"
    finally:
        k.close()


@pytest.mark.slow
def test_restarts_with_the_standby_killed_at_each_point_always_end_with_a_working_kernel(
        timed_zygote: Path, tmp_path: Path) -> None:
    """A fault loop (Note [A standby for the restart]): restarts in a seeded random order of
    no fault, the standby SIGKILLed before its launch (the launch forks its own), and the new
    kernel SIGKILLed right after its launch (dead at birth, as a crashing kernel: the next
    restart brings a working one). No standby outlives the loop."""
    import random

    rng = random.Random(24)
    faults = ["none", "before_launch", "after_go"] * 2
    rng.shuffle(faults)
    k = Kernel(cwd=str(tmp_path))
    standbys: set[int] = set()
    t_start = time.time()
    try:
        assert k.warm, k.log_text()
        for n, fault in enumerate(faults):
            old = k.pid
            t0 = time.time()
            k.km.shutdown_kernel(now=False, restart=True)
            standby = _wait_for(lambda t0=t0: _standby_pid(timed_zygote, t0), 60,
                                "the standby's fork")
            standbys.add(standby)
            if fault == "before_launch":
                kill_and_wait(standby)
            k.km.start_kernel(**k.km._launch_args)
            if fault == "after_go":
                assert k.pid == standby, (n, fault, k.log_text())
                kill_and_wait(standby)
                _wait_for(lambda: not k.km.is_alive(), 30, "the killed kernel to be seen dead")
                k.restart()  # a dead kernel's restart: its standby comes from the zygote too
            else:
                k.kc.wait_for_ready(timeout=120)
            if fault == "none":
                assert k.warm and k.pid == standby, (n, fault, k.log_text())
            else:
                assert k.warm and k.pid not in (old, standby), (n, fault, k.log_text())
            assert k.run(f"print({n} * 7)").strip() == str(n * 7), (n, fault)
        for e in _events_since(timed_zygote, t_start):
            if e["event"] == "zygote.fork_reply":
                standbys.add(e["kernel"])
        _wait_for(lambda: not [p for p in standbys if p != k.pid and _alive(p)], 30,
                  "every standby but the kernel's to exit")
    finally:
        k.close()


def _kept_ready(path: Path, t0: float, kernel: int) -> int:
    """Note [A standby kept ready]: wait until the standby forked after ``kernel``'s launch
    waits at its sockets; its pid."""
    def ready() -> int | None:
        events = _events_since(path, t0)
        forked = [e["kernel"] for e in events if e["event"] == "zygote.fork_reply"
                  and e["kernel"] != kernel]
        waiting = {e["pid"] for e in events if e["event"] == "child.standby"}
        return next((pid for pid in forked if pid in waiting), None)

    return _wait_for(ready, 60, "the standby kept ready")


@pytest.mark.slow
@pytest.mark.standby_ahead(0.0)
def test_a_standby_kept_ready_is_the_restarted_kernel(timed_zygote: Path,
                                                      tmp_path: Path) -> None:
    """Note [A standby kept ready]: forked after the launch, it waits; the restart checks the
    zygote's files and the config folders, tells it to go, and forks nothing. It is a new
    kernel: the old one's atexit ran, its variables are gone, the next restart has one too."""
    t0 = time.time()
    k = Kernel(cwd=str(tmp_path))
    try:
        assert k.warm, k.log_text()
        standby = _kept_ready(timed_zygote, t0, k.pid)
        marker = tmp_path / "atexit-ran"
        k.run(f"x = 1; import atexit; atexit.register(lambda: open({str(marker)!r}, 'w')"
              ".write('ran'))")
        old = k.pid
        t1 = time.time()
        k.restart()
        assert k.warm and k.pid == standby and k.pid != old, _events_since(timed_zygote, t1)
        assert marker.read_text() == "ran"
        assert k.run("print('x' in globals(), 6 * 7)").strip() == "False 42"
        events = _events_since(timed_zygote, t1)
        names = [e["event"] for e in events]
        assert "provisioner.standby_go" in names, events
        assert "provisioner.standby_dropped" not in names, events
        # the only fork since is the restarted kernel's own standby kept ready
        forks = [e for e in events if e["event"] == "zygote.fork_request"]
        assert all(e["standby"] for e in forks), forks
        # and the restarted kernel has one kept ready in its turn
        assert _kept_ready(timed_zygote, t1, k.pid) not in (old, standby)
    finally:
        k.close()


@pytest.mark.slow
@pytest.mark.standby_ahead(0.0)
def test_a_standby_kept_ready_is_dropped_when_a_config_file_changed(
        timed_zygote: Path, tmp_path: Path) -> None:
    """Note [A standby kept ready]: a config file written after its fork is read by the
    restarted kernel, which is then forked anew; the standby exits unstarted."""
    ipython = tmp_path / "ipython"
    (ipython / "profile_default").mkdir(parents=True)
    t0 = time.time()
    k = Kernel(cwd=str(tmp_path), env={"IPYTHONDIR": str(ipython)})
    try:
        assert k.warm, k.log_text()
        standby = _kept_ready(timed_zygote, t0, k.pid)
        (ipython / "profile_default" / "ipython_kernel_config.py").write_text(
            "c.IPKernelApp.exec_lines = ['configured = 42']\n")
        t1 = time.time()
        k.restart()
        assert k.warm and k.pid != standby, k.log_text()
        assert k.run("print(configured)").strip() == "42"
        [dropped] = [e for e in _events_since(timed_zygote, t1)
                     if e["event"] == "provisioner.standby_dropped"]
        assert dropped["kernel"] == standby and "config" in dropped["reason"], dropped
        _wait_for(lambda: not _alive(standby), 30, "the dropped standby to exit")
    finally:
        k.close()


@pytest.mark.slow
@pytest.mark.standby_ahead(0.0)
def test_a_server_keeps_one_standby_ready_the_last_launched_kernels(
        timed_zygote: Path, tmp_path: Path) -> None:
    t0 = time.time()
    first = Kernel(cwd=str(tmp_path))
    second = None
    try:
        standby = _kept_ready(timed_zygote, t0, first.pid)
        t1 = time.time()
        second = Kernel(cwd=str(tmp_path))
        assert _kept_ready(timed_zygote, t1, second.pid) != standby
        _wait_for(lambda: not _alive(standby), 30, "the first kernel's standby to exit")
        old = first.pid
        first.restart()  # as without a standby kept ready: one forked at the restart
        assert first.warm and first.pid not in (old, standby), first.log_text()
        assert first.run("print(6 * 7)").strip() == "42"
    finally:
        first.close()
        if second is not None:
            second.close()


@pytest.mark.slow
@pytest.mark.standby_ahead(0.0)
def test_a_standby_kept_ready_exits_with_its_kernel(timed_zygote: Path,
                                                    tmp_path: Path) -> None:
    t0 = time.time()
    k = Kernel(cwd=str(tmp_path))
    try:
        assert k.warm, k.log_text()
        standby = _kept_ready(timed_zygote, t0, k.pid)
    finally:
        k.close()
    _wait_for(lambda: not _alive(standby), 30, "the standby to exit with its kernel")


@pytest.mark.slow
@pytest.mark.standby_ahead(0.0)
def test_restarts_with_the_standby_kept_ready_killed_at_each_point_end_with_a_working_kernel(
        timed_zygote: Path, tmp_path: Path) -> None:
    """The fault loop above with standbys kept ready (Note [A standby kept ready]): killed
    while it waits, the restart forks a kernel of its own; killed right after its go, the
    next restart brings a working one; each restarted kernel gets a standby in its turn."""
    import random

    rng = random.Random(27)
    faults = ["none", "before_restart", "after_go"] * 2
    rng.shuffle(faults)
    t_launch = time.time()
    k = Kernel(cwd=str(tmp_path))
    standbys: set[int] = set()
    try:
        assert k.warm, k.log_text()
        for n, fault in enumerate(faults):
            old = k.pid
            standby = _kept_ready(timed_zygote, t_launch, old)
            standbys.add(standby)
            if fault == "before_restart":
                kill_and_wait(standby)
            t_launch = time.time()
            k.restart()
            if fault == "after_go":
                assert k.pid == standby, (n, fault, k.log_text())
                kill_and_wait(standby)
                _wait_for(lambda: not k.km.is_alive(), 30, "the killed kernel to be seen dead")
                t_launch = time.time()
                k.restart()
            if fault == "none":
                assert k.warm and k.pid == standby, (n, fault, k.log_text())
            else:
                assert k.warm and k.pid not in (old, standby), (n, fault, k.log_text())
            assert k.run(f"print({n} * 7)").strip() == str(n * 7), (n, fault)
    finally:
        k.close()
    _wait_for(lambda: not [p for p in standbys if _alive(p)], 30, "every standby to exit")


@pytest.mark.slow
@pytest.mark.standby_ahead(0.0)
def test_a_standby_kept_ready_by_a_replaced_zygote_is_not_used(timed_zygote: Path,
                                                               tmp_path: Path) -> None:
    """Note [A standby kept ready]: the restart's check asks the zygote on the socket, the
    replacement once one was started (``overmind-lab kernel restart-zygote``, or a stale zygote
    seen by another launch): its answer does not cover the standby of the one it replaced."""
    from overmind_lab._jupyter_server.kernelspec import restart_zygotes

    t0 = time.time()
    k = Kernel(cwd=str(tmp_path))
    try:
        assert k.warm, k.log_text()
        standby = _kept_ready(timed_zygote, t0, k.pid)
        replaced = _ppid(standby)
        assert restart_zygotes(timed_zygote.parent) == [replaced]
        fresh = ready_zygote(timed_zygote.parent, not_pid=replaced)["pid"]
        t1 = time.time()
        k.restart()
        assert k.warm and k.pid != standby and _ppid(k.pid) == fresh, k.log_text()
        [dropped] = [e for e in _events_since(timed_zygote, t1)
                     if e["event"] == "provisioner.standby_dropped"]
        assert dropped["kernel"] == standby and "replaced" in dropped["reason"], dropped
        assert k.run("print(6 * 7)").strip() == "42"
    finally:
        k.close()


@pytest.mark.slow
@pytest.mark.standby_ahead(0.0)
def test_a_file_changed_before_the_restart_request_makes_the_restart_plain(
        timed_zygote: Path, tmp_path: Path) -> None:
    """Note [Checked while the old kernel exits]: the early check still sees an edit made
    while the old kernel ran, also with a standby kept ready (Note [A standby kept ready])
    forked before the edit (last in this module: it retires the module's zygote)."""
    import threadpoolctl

    t0 = time.time()
    k = Kernel(cwd=str(tmp_path))
    path = Path(threadpoolctl.__file__)
    st = path.stat()
    try:
        assert k.warm, k.log_text()
        standby = _kept_ready(timed_zygote, t0, k.pid)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        k.restart()
        # the check retired the zygote (its socket gone): the launch is plain and starts a
        # fresh zygote for the next one
        assert not k.warm, k.log_text()
        assert k.run("print(6 * 7)").strip() == "42"
        _wait_for(lambda: not _alive(standby), 30, "the stale standby to exit")
    finally:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        k.close()
