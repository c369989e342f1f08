"""The zygote reports a kernel's exit while it waits for another child to start.

A launcher's restart makes the zygote fork a standby (Note [A standby for the launcher's
restart]) just as the old kernel exits; the old launcher exits only once the zygote reported
that exit (``WarmKernel._read_exit`` waits 1 s), and jupyter_client launches the new one at its
next 100 ms poll after that. So ``_await_ready`` reaps the kernels that exit while it waits. Here
a real exited child, a real socket pair as its launcher's connection, and a ready pipe that is
written only once the exit report arrived: without the reaping, the wait runs out.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from pathlib import Path

import pytest

from overmind_lab._common.protocol import Channel
from overmind_lab._zygote import loop

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def test_a_kernel_that_exits_while_another_starts_is_reported_at_once() -> None:
    launcher, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:  # the old kernel
        os._exit(7)
    pidfd = os.pidfd_open(pid)
    state = loop._State(paths=None, listener=None, inode=0, snap=None,  # type: ignore[arg-type]
                        preloaded=[], failed=[], refusal=None, thread_targets={},
                        import_env={})
    state.children[pidfd] = loop._Child(pid, pidfd, zygote_end)
    ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
    reports: list[object] = []

    def new_child_starts_after_the_report() -> None:
        try:
            frame, _ = Channel(launcher, 60).recv()
            reports.append(frame.get("exit"))
        finally:
            os.write(ready_w, b"ok")
            os.close(ready_w)

    thread = threading.Thread(target=new_child_starts_after_the_report)
    thread.start()
    try:
        assert loop._await_ready(state, ready_r) is None
    finally:
        thread.join(120)
        launcher.close()
    assert reports == [7]
    assert not state.children  # reaped: its pidfd closed, the zygote's end of its connection too
    assert not Path(f"/proc/{pid}").exists()
