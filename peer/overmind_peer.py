"""pytest plugin for `make peer-test`: every patched ``from_pretrained`` is called twice.

Loaded with ``-p overmind_peer``. At configure time it starts a private daemon on a
temporary socket and calls ``overmind_lab.patch_all()``; at unconfigure (also after a
failure or an interrupt) it stops that daemon. Every outermost ``overmind_lab.load`` (which
each patched ``from_pretrained`` calls) is made twice: the first call loads cold and stores,
then the random generators (torch CPU, numpy's global state, ``random``) are put back to
their state before the first call, and the second call, a warm hit, is what the test sees.

``--peer-verify`` (or ``OVERMIND_PEER_VERIFY=1``) sets ``OVERMIND_LAB_VERIFY=1``, so that
each warm hit is also compared with a plain load; ``VerifyMismatch`` warnings are counted.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest

import overmind_lab
from overmind_lab import Client

_counts = {"calls": 0, "hits": 0, "mismatches": 0}
# Per test file (one per model): {"calls": n, "hits": n, "mismatches": n}
_per_file: dict[str, dict[str, int]] = {}
_local = threading.local()
_daemon: dict[str, Any] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--peer-verify", action="store_true",
                     help="turn on overmind-lab's verify mode for every warm hit")


def _count(name: str) -> None:
    _counts[name] += 1
    per = _per_file.setdefault(getattr(_local, "file", "?"), dict.fromkeys(_counts, 0))
    per[name] += 1


def pytest_runtest_protocol(item: pytest.Item) -> None:
    _local.file = Path(str(item.fspath)).name


def _rng_state() -> tuple[Any, Any, Any]:
    import numpy as np
    import torch

    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def _set_rng_state(state: tuple[Any, Any, Any]) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(state[0])
    np.random.set_state(state[1])
    random.setstate(state[2])


def _doubled(real_load: Any) -> Any:
    def load(fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        # Note [Outermost calls only]
        # A loader may call other patched loaders inside (a pipeline loading its parts);
        # those run plainly inside the outer call, as with the real cache. Doubling them
        # too would draw random numbers twice within one outer call.
        if getattr(_local, "depth", 0):
            return real_load(fn, *args, **kwargs)
        _local.depth = 1
        try:
            state = _rng_state()
            real_load(fn, *args, **kwargs)  # cold: stores; an exception propagates as is
            _set_rng_state(state)
            _count("calls")
            with overmind_lab.record_loads() as events:
                result = real_load(fn, *args, **kwargs)
            if any(e.outcome == "warm" for e in events):
                _count("hits")
            return result
        finally:
            _local.depth = 0

    return load


def pytest_configure(config: pytest.Config) -> None:
    verify = config.getoption("--peer-verify") or os.environ.get("OVERMIND_PEER_VERIFY") == "1"
    if verify:
        os.environ["OVERMIND_LAB_VERIFY"] = "1"
    mismatch = getattr(overmind_lab, "VerifyMismatch", None)
    if mismatch is not None:
        # Every mismatch is shown and counted, not only the first one at a location.
        config.addinivalue_line("filterwarnings", "always::overmind_lab.VerifyMismatch")
    tmp = tempfile.TemporaryDirectory(prefix="omp-", dir="/tmp")
    sock = Path(tmp.name) / "d.sock"
    os.environ["OVERMIND_LAB_SOCKET"] = str(sock)
    # Its own cache directory too, removed with the socket at the end: the user's default
    # (~/.cache/overmind-lab) must not collect the suite's entries.
    os.environ["OVERMIND_LAB_CACHE_DIR"] = str(Path(tmp.name) / "cache")
    client = Client(sock)
    _daemon.update(tmp=tmp, client=client, verify=verify)
    client.start()
    real_load = overmind_lab.load  # resolves the lazy attribute first
    overmind_lab.load = _doubled(real_load)  # the patched wrappers look it up per call
    _daemon["real_load"] = real_load
    overmind_lab.patch_all()


def pytest_warning_recorded(warning_message: Any, when: str, nodeid: str,
                            location: Any) -> None:
    mismatch = getattr(overmind_lab, "VerifyMismatch", None)
    if mismatch is not None and issubclass(warning_message.category, mismatch):
        _count("mismatches")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    verify = _daemon.get("verify")
    if not verify:
        mode = "verify off"
    elif getattr(overmind_lab, "VerifyMismatch", None) is None:
        mode = "verify requested, but this overmind_lab has no verify mode"
    else:
        mode = f"verify on, {_counts['mismatches']} VerifyMismatch warnings"
    terminalreporter.write_line(
        f"overmind-peer: {_counts['hits']} warm hits of {_counts['calls']} doubled "
        f"from_pretrained calls ({mode})")


def pytest_unconfigure(config: pytest.Config) -> None:
    stats = os.environ.get("OVERMIND_PEER_STATS")
    if stats:
        Path(stats).write_text(json.dumps({"total": _counts, "files": _per_file}, indent=1))
    if "real_load" in _daemon:
        overmind_lab.load = _daemon.pop("real_load")
    overmind_lab.unpatch_all()
    client = _daemon.pop("client", None)
    if client is not None:
        client.stop()
    tmp = _daemon.pop("tmp", None)
    if tmp is not None:
        tmp.cleanup()
