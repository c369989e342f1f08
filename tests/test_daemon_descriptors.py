"""The daemon under a low descriptor limit: Note [Descriptor budget] (``_daemon/index.py``)
and Note [Accept never dies] (``_daemon/server.py``).

Found by the fuzzer in CI: thousands of small entries, each segment holding a descriptor,
ran the daemon out of them; ``accept`` failed with EMFILE, the accept loop ended, and the
daemon kept its socket while answering nobody: every later load waited for its timeout
and fell back, and ``stop`` could not reach it. Here a real daemon is started with a low
hard ``RLIMIT_NOFILE`` (which it cannot raise), and a real child stores many entries; then
more connections than it has descriptors are held open against it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from overmind_lab import Client
from tests.conftest import last_json, run_py

#: The daemon's hard and soft descriptor limit: its segment bound is the floor, 16.
LIMIT = 150


def start_limited(sock_path: Path) -> int:
    """Start a daemon on ``sock_path`` whose descriptor limit is ``LIMIT``; its pid."""
    code = (f"import resource; resource.setrlimit(resource.RLIMIT_NOFILE, ({LIMIT}, {LIMIT}))\n"
            "from overmind_lab import Client\n"
            f"print(Client({str(sock_path)!r}).start()[\"pid\"])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    return int(proc.stdout.split()[-1])


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


STORE_MANY = """
import json, torch, warnings, overmind_lab
warnings.simplefilter("ignore")
def make(i):
    return {"w": torch.full((4,), float(i))}
outcomes = {}
for rounds in range(2):
    for i in range(N):
        with overmind_lab.record_loads() as events:
            got = overmind_lab.load(make, i)
        assert float(got["w"][0]) == i
        outcomes[events[-1].outcome] = outcomes.get(events[-1].outcome, 0) + 1
print(json.dumps(outcomes))
"""


def test_many_entries_stay_within_the_descriptor_limit(sock_path: Path) -> None:
    pid = start_limited(sock_path)
    n = 3 * LIMIT  # far more segments than descriptors
    outcomes = last_json(run_py(STORE_MANY.replace("N)", f"{n})"), timeout=600,
                                env={"OVERMIND_LAB_BACKGROUND_STORE": "never"}))
    # Every load went through the daemon; the oldest entries were evicted to stay within
    # the bound, so the second round is cold again for them, never a fallback.
    assert set(outcomes) <= {"cold", "warm"}, outcomes
    assert sum(outcomes.values()) == 2 * n
    assert open_fds(pid) < LIMIT
    status = Client(sock_path).status()
    assert 0 < int(status["entries"]) <= 16
    assert Client(sock_path).stop()


def test_the_daemon_answers_again_after_running_out_of_descriptors(sock_path: Path) -> None:
    pid = start_limited(sock_path)
    log = sock_path.with_name(sock_path.name + ".log")
    held: list[socket.socket] = []
    try:
        # More connections than the daemon has descriptors: it accepts until EMFILE.
        for _ in range(LIMIT + 20):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(sock_path))
            held.append(sock)
        deadline = time.monotonic() + 120  # an event (a log line), a generous deadline
        while "accept failed" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "accept failed" in log.read_text(), log.read_text()[-2000:]
    finally:
        for sock in held:
            sock.close()
    # It accepts again: the status answers (the backlog of closed connections first).
    status = Client(sock_path).status()
    assert status["running"] and status["pid"] == pid
    assert "accepting connections again" in log.read_text()
    assert Client(sock_path).stop()
