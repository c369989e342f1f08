"""The ``rest-entries`` case: ``GET <base_url>/overmind-lab/api/v1/entries`` with 100 entries.

The sidebar polls this route, so it must answer quickly with a well-filled cache (target:
median <= 50 ms with 100 entries). Steps, all against the benchmark's daemon:

1. one child process (``python -m benchmarks._rest ENTRIES``) stores that many
   small entries: ``overmind_lab.load(make_entry, i)`` for each ``i`` (a tiny tensor dict;
   :func:`make_entry` is importable by name, so each ``i`` is its own entry);
2. a real ``jupyter server`` with the ``overmind_lab._jupyter_server`` extension is started with
   ``OVERMIND_LAB_SOCKET`` in its environment, on a free port, with a random token;
3. after a few warm-up requests, sequential ``GET`` requests (``urllib.request``, one
   connection each, no proxy) are timed from sending to the end of the body, and every
   answer is checked to list all the entries.

The server is always stopped (its whole process group), whatever happens. This module
imports torch only inside :func:`make_entry`, in the child.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._server import JupyterServer

__all__ = ["ENTRIES", "LIMIT_SECONDS", "make_entry", "run_rest_entries"]

#: Entries in the cache while the route is timed, and the target for the median answer.
ENTRIES = 100
LIMIT_SECONDS = 0.050
WARMUP = 3
REQUESTS = 50
BASE_URL = "/bench/"
_EXTENSION = "--ServerApp.jpserver_extensions={'overmind_lab._jupyter_server': True}"


def make_entry(i: int) -> dict[str, Any]:
    """A small tensor dict, different for every ``i`` (one cache entry per ``i``)."""
    import torch

    return {"weight": torch.full((64,), float(i)), "bias": torch.arange(8, dtype=torch.float32) + i}


def _populate(count: int) -> None:
    # imported before the first load: importing torch inside it seeds its generator, which
    # that load would be taken to draw random numbers (and left uncached)
    import torch  # noqa: F401

    import overmind_lab

    for i in range(count):
        overmind_lab.load(make_entry, i)


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100)."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def _count(body: bytes) -> int:
    data = json.loads(body)
    entries = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise RuntimeError(f"GET entries did not answer {{'entries': [...]}}: {body[:200]!r}")
    return len(entries)


def run_rest_entries(env: dict[str, str], evict_all: Callable[[], object],
                     count_entries: Callable[[], int], progress: Callable[[str], None],
                     log_dir: Path, timeout: float, entries: int = ENTRIES,
                     requests: int = REQUESTS, warmup: int = WARMUP) -> dict[str, Any]:
    """Fill the cache with *entries* small entries and time ``GET entries`` through a
    real Jupyter server; returns the case's results (raises on failure)."""
    out: dict[str, Any] = {"entries": entries, "requests": requests, "warmup": warmup,
                           "limit_seconds": LIMIT_SECONDS, "base_url": BASE_URL}
    evict_all()
    progress(f"rest-entries: storing {entries} small entries in one process")
    t0 = time.perf_counter()
    with open(log_dir / "rest-entries-populate.log", "ab") as log:
        proc = subprocess.run([sys.executable, "-m", "benchmarks._rest", str(entries)],
                              stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                              timeout=timeout, check=False)
    out["populate_seconds"] = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"storing the entries failed (exit {proc.returncode}); "
                           f"see {log_dir / 'rest-entries-populate.log'}")
    stored = count_entries()
    out["daemon_entries"] = stored
    if stored != entries:
        raise RuntimeError(f"the daemon holds {stored} entries after storing {entries}")

    server = JupyterServer(env, log_dir / "rest-entries-server.log", base_url=BASE_URL,
                           extra_args=(_EXTENSION,))
    try:
        out["server_start_seconds"] = server.start()
        progress(f"rest-entries: jupyter server up on port {server.port} "
                 f"in {out['server_start_seconds']:.1f} s")
        path = "overmind-lab/api/v1/entries"
        for _ in range(warmup):
            _, body = server.get(path)
            _count(body)
        times: list[float] = []
        counts: set[int] = set()
        for _ in range(requests):
            seconds, body = server.get(path)
            times.append(seconds)
            counts.add(_count(body))
            out["response_bytes"] = len(body)
    finally:
        server.stop()
    out["seconds"] = times
    out["entries_seen"] = sorted(counts)
    if counts != {entries}:
        raise RuntimeError(f"GET entries listed {sorted(counts)} entries, expected {entries}")
    out["stats"] = {"median": statistics.median(times), "p90": _percentile(times, 90),
                    "max": max(times), "min": min(times), "mean": statistics.fmean(times),
                    "n": len(times)}
    out["passed"] = out["stats"]["median"] <= LIMIT_SECONDS
    return out


if __name__ == "__main__":
    # import by the real name, so the cache keys name benchmarks._rest:make_entry
    from benchmarks._rest import _populate as populate

    populate(int(sys.argv[1]) if len(sys.argv) > 1 else ENTRIES)
