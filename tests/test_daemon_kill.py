"""kill -9 at random points of a store: of the daemon, of the storing client.

Fault injection, as SQLite's crash tests do: the moment of the kill is drawn at random
(seeded, printed: ``OVERMIND_LAB_KILL_SEED`` replays a run; ``OVERMIND_LAB_KILL_TRIALS``
sets how many), and what is checked holds whatever the moment: every load returns the
right bytes, no ``.tmp`` is left once the daemon settled, and the entry is then whole
(warm, right bytes) or absent (cold). Note [What a store promises] (daemon server).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from overmind_lab import Client
from tests.conftest import wait_for_exit
from tests.test_disk_cache import HERE, SIZED, cache_dir, log_text, sized_child, wait_saved

pytestmark = pytest.mark.slow  # minutes in all: `make test`, not `make test-fast`

NBYTES = 24 << 20
TRIALS = int(os.environ.get("OVERMIND_LAB_KILL_TRIALS", "3"))


@pytest.fixture
def rng() -> random.Random:
    seed = int(os.environ.get("OVERMIND_LAB_KILL_SEED", random.randrange(1 << 30)))
    print(f"OVERMIND_LAB_KILL_SEED={seed}")
    return random.Random(seed)


def expected(tag: str) -> float:
    return float(NBYTES // 4 * len(tag))


def start_child(tag: str) -> subprocess.Popen[str]:
    env = {**os.environ, "OVERMIND_LAB_BACKGROUND_STORE": "never"}
    return subprocess.Popen([sys.executable, "-c", SIZED.format(here=HERE, nbytes=NBYTES,
                                                                 tag=tag)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd="/")


def run_for_a_while(child: subprocess.Popen[str], rng: random.Random) -> float:
    """Let ``child`` run up to a random 0-1.5 s (less if it ends first): the point of the
    store where the test strikes. Returns the delay drawn."""
    delay = rng.uniform(0.0, 1.5)
    try:
        child.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        pass
    return delay


def settle(client: Client, tag: str) -> None:
    """After the kill: the daemon runs, the entry is whole or absent, nothing half-written."""
    client.start()
    again = sized_child(NBYTES, tag, env={**os.environ,
                                          "OVERMIND_LAB_BACKGROUND_STORE": "never"})
    assert again["sum"] == expected(tag) and again["outcome"] in ("warm", "cold"), again
    wait_saved(client)
    assert list(cache_dir().glob("*.tmp")) == []
    last = sized_child(NBYTES, tag)
    assert last["outcome"] == "warm", (again, last, log_text(client.path)[-4000:])


def test_kill_9_of_the_daemon_at_random_points_of_a_store(daemon: Client,
                                                           rng: random.Random) -> None:
    for trial in range(TRIALS):
        tag = "d" * (trial + 1)
        pid = int(daemon.status()["pid"])
        child = start_child(tag)
        try:
            delay = run_for_a_while(child, rng)
            os.kill(pid, signal.SIGKILL)
            wait_for_exit(pid)
            out, err = child.communicate(timeout=180)
        finally:
            if child.poll() is None:
                child.kill()
                child.communicate()
        assert child.returncode == 0, err  # the cache is never why a load fails
        result = json.loads(out.strip().splitlines()[-1])
        assert result["sum"] == expected(tag), (delay, result)
        settle(daemon, tag)


def test_kill_9_of_the_storing_client_at_random_points(daemon: Client,
                                                        rng: random.Random) -> None:
    for trial in range(TRIALS):
        tag = "c" * (trial + 1)
        child = start_child(tag)
        try:
            run_for_a_while(child, rng)
            child.kill()
        finally:
            child.communicate(timeout=60)
        settle(daemon, tag)
        assert Path(f"/proc/{daemon.status()['pid']}").exists()
