"""Large first loads are stored by a forked process (Note [Storing in a forked process])."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import overmind_lab
from overmind_lab import Client, OvermindWarning
from overmind_lab._loading import background
from tests.conftest import last_json, run_py
from tests.loaders import PICKLE_GATE_ENV, counting_module, unpicklable_module

HERE = str(Path(__file__).resolve().parent.parent)


@pytest.fixture
def always(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every CPU result is stored in the background, however small. At teardown, no
    store of the test is left running (even when the test failed half-way)."""
    monkeypatch.setenv(background.BACKGROUND_ENV, "always")
    yield
    for store in background.pending_stores():
        with contextlib.suppress(ProcessLookupError):
            os.kill(store.pid, signal.SIGKILL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        overmind_lab.wait_for_stores(timeout=60)


def own_session(pid: int, timeout: float = 120) -> bool:
    """Whether ``pid`` leads a session of its own (its first act after the fork)."""
    deadline = time.monotonic() + timeout
    while os.getsid(pid) != pid and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.getsid(pid) == pid


def wait_for_entries(client: Client, n: int, timeout: float = 60) -> list[dict[str, object]]:
    deadline = time.monotonic() + timeout
    while len(entries := client.entries()) < n:
        assert time.monotonic() < deadline, entries
        time.sleep(0.05)
    return entries  # type: ignore[return-value]


def test_which_results_are_stored_in_the_background(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(background.BACKGROUND_ENV, raising=False)
    big = torch.nn.utils.skip_init(torch.nn.Linear, 4096, 4096, bias=False)  # 64 MiB
    small = torch.nn.utils.skip_init(torch.nn.Linear, 16, 16)

    class Pipeline:  # a diffusers pipeline names its modules in ``components``
        components = {"unet": big, "scheduler": object()}

    assert background.cpu_tensor_bytes(big) == 64 << 20
    assert background.cpu_tensor_bytes(Pipeline()) == 64 << 20
    assert background.wanted(big) and background.wanted(Pipeline())
    assert not background.wanted(small)
    assert not background.wanted({"weight": big.weight})  # not a module: its store is small
    on_meta = torch.nn.Linear(4096, 4096, device="meta")  # not on the CPU: no fork
    assert background.cpu_tensor_bytes(on_meta) is None and not background.wanted(on_meta)
    monkeypatch.setenv(background.BACKGROUND_ENV, "never")
    assert not background.wanted(big)
    monkeypatch.setenv(background.BACKGROUND_ENV, "always")
    assert background.wanted(small) and not background.wanted(on_meta)


def test_a_change_right_after_the_load_does_not_reach_the_cache(
        daemon: Client, always: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gate = tmp_path / "gate"  # the store pickles once it exists
    monkeypatch.setenv(PICKLE_GATE_ENV, str(gate))
    with overmind_lab.record_loads() as events:
        model = overmind_lab.load(counting_module, 4096)
    assert events[-1].outcome == "cold" and overmind_lab.key_of(model) == events[-1].key
    assert events[-1].summary().endswith("(being cached in the background)")
    [store] = background.pending_stores()
    assert own_session(store.pid)  # interrupts and a kernel's killpg do not reach it
    assert daemon.entries() == []  # the load returned while the child is still pickling
    with torch.no_grad():
        model.weight.fill_(7.0)  # e.g. load_state_dict, right after the load
    gate.touch()
    [done] = overmind_lab.wait_for_stores(timeout=120)
    assert done is store and done.error is None
    [entry] = daemon.entries()
    assert entry["key"] == events[-1].key
    with overmind_lab.record_loads() as events:
        again = overmind_lab.load(counting_module, 4096)
    assert events[-1].outcome == "warm"
    assert torch.equal(again.weight, torch.arange(4096, dtype=torch.float32))  # as loaded
    assert float(model.weight.detach()[0]) == 7.0  # and the caller's change is its own


def test_a_killed_store_leaves_nothing_and_the_next_load_is_cold(
        daemon: Client, always: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(PICKLE_GATE_ENV, str(tmp_path / "gate"))  # never opened: killed first
    overmind_lab.load(counting_module, 2048)
    [store] = background.pending_stores()
    with pytest.warns(OvermindWarning, match=r"could not be cached: .*\(signal 9\)"):
        os.kill(store.pid, signal.SIGKILL)
        [done] = overmind_lab.wait_for_stores(timeout=60)
    assert done.error is not None and not done.not_cacheable
    assert daemon.entries() == []
    monkeypatch.delenv(PICKLE_GATE_ENV)
    monkeypatch.setenv(background.BACKGROUND_ENV, "never")
    with overmind_lab.record_loads() as events:  # the key was released: no wait
        overmind_lab.load(counting_module, 2048)
    assert [e.outcome for e in events] == ["cold"]
    [entry] = daemon.entries()
    assert entry["hits"] == 0


def test_a_store_that_fails_in_the_background_warns_and_caches_nothing(
        daemon: Client, always: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gate = tmp_path / "gate"  # the store pickles (and fails) once it exists: still pending
    monkeypatch.setenv(PICKLE_GATE_ENV, str(gate))
    with pytest.warns(OvermindWarning, match="not cached: .*cannot pickle 'generator'"):
        model = overmind_lab.load(unpicklable_module, 1024)
        [store] = background.pending_stores()
        gate.touch()
        [done] = overmind_lab.wait_for_stores(timeout=60)
    assert done is store and done.not_cacheable
    assert torch.equal(model.weight, torch.arange(1024, dtype=torch.float32))
    assert daemon.entries() == []


def test_a_script_that_ends_right_after_a_load_leaves_it_stored(
        daemon: Client, always: None, tmp_path: Path) -> None:
    gate = tmp_path / "gate"  # its store pickles once this exists
    proc = run_py(f"""
        import json, sys, overmind_lab
        sys.path.insert(0, {HERE!r})
        from tests.loaders import counting_module
        with overmind_lab.record_loads() as events:
            model = overmind_lab.load(counting_module, 8192)
        print(json.dumps({{"outcome": events[-1].outcome, "sum": float(model.weight.detach().sum())}}))
    """, env={PICKLE_GATE_ENV: str(gate)})
    # The script's output pipes closed when it exited: the storing child does not hold
    # them (run_py would have waited for it), and it goes on after its parent is gone.
    assert last_json(proc) == {"outcome": "cold", "sum": float(sum(range(8192)))}
    assert daemon.entries() == []
    gate.touch()
    [entry] = wait_for_entries(daemon, 1, timeout=120)
    assert entry["hits"] == 0
    with overmind_lab.record_loads() as events:
        warm = overmind_lab.load(counting_module, 8192)
    assert events[-1].outcome == "warm"
    assert torch.equal(warm.weight, torch.arange(8192, dtype=torch.float32))
