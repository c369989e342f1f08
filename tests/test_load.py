"""overmind_lab.load across real processes, against a real daemon."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import overmind_lab
from overmind_lab import Client, OvermindWarning
from tests.conftest import last_json, run_py, save_tiny_unet
from tests.loaders import LOAD_GATE_ENV

# A child that loads the tiny UNet through the cache and describes what it got.
LOAD_UNET = """
import json, sys, os, hashlib, torch, overmind_lab
from diffusers import UNet2DConditionModel
from overmind_lab._loading.segments import find_mapping
with overmind_lab.record_loads() as events:
    unet = overmind_lab.load(UNet2DConditionModel.from_pretrained, {path!r})
sd = unet.state_dict()
digest = hashlib.sha256()
for name, t in sd.items():
    digest.update(name.encode()); digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
mapped = [find_mapping(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) is not None
          for t in sd.values()]
print(json.dumps({{"outcome": events[-1].outcome, "digest": digest.hexdigest(),
                  "all_mapped": all(mapped), "pid": os.getpid(),
                  "type": type(unet).__name__, "training": unet.training}}))
"""


def plain_digest(path: Path) -> str:
    proc = run_py(f"""
        import json, hashlib, torch
        from diffusers import UNet2DConditionModel
        sd = UNet2DConditionModel.from_pretrained({str(path)!r}).state_dict()
        digest = hashlib.sha256()
        for name, t in sd.items():
            digest.update(name.encode()); digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
        print(json.dumps(digest.hexdigest()))
    """)
    return str(last_json(proc))


@pytest.mark.slow
def test_stored_by_one_process_loaded_bit_equal_by_another_without_copy(
        daemon: Client, tiny_unet_dir: Path) -> None:
    first = last_json(run_py(LOAD_UNET.format(path=str(tiny_unet_dir))))
    second = last_json(run_py(LOAD_UNET.format(path=str(tiny_unet_dir))))
    assert first["outcome"] == "cold"
    assert second["outcome"] == "warm"
    assert first["digest"] == second["digest"] == plain_digest(tiny_unet_dir)
    # the warm one's tensors are the cache's mappings; the first load returned the loader's
    # own object (Note [Never worse than plain])
    assert second["all_mapped"] and not first["all_mapped"]
    assert second["type"] == "UNet2DConditionModel" and second["training"] is False
    [entry] = daemon.entries()
    assert entry["hits"] == 1 and entry["tensors"] > 10
    assert entry["name"] == f"UNet2DConditionModel.from_pretrained({str(tiny_unet_dir)!r})"


# A fresh process's first warm hit, watching what it imports and which dataclasses it defines.
FIRST_HIT = """
import dataclasses, json, sys, torch
from diffusers import UNet2DConditionModel
defined = []
real = dataclasses._process_class
def spy(cls, *args, **kwargs):
    defined.append(f"{{cls.__module__}}.{{cls.__qualname__}}")
    return real(cls, *args, **kwargs)
dataclasses._process_class = spy
import builtins
compiled = []  # source compiled at run time while one of our modules' body runs
def watch(name):
    real = getattr(builtins, name)
    def spy(source, *args, **kwargs):
        frame = sys._getframe(1)
        while isinstance(source, str) and frame is not None:
            module = frame.f_globals.get("__name__", "")
            if frame.f_code.co_name == "<module>" and module.startswith("overmind_lab"):
                compiled.append(f"{{module}}:{{frame.f_lineno}}")
                break
            frame = frame.f_back
        return real(source, *args, **kwargs)
    setattr(builtins, name, spy)
for name in ("compile", "exec", "eval"):
    watch(name)
before = set(sys.modules)  # the package's start-up thread imports the hit path (Note [The first
import overmind_lab        # call's work, earlier]): what it and the first load import
with overmind_lab.record_loads() as events:
    overmind_lab.load(UNet2DConditionModel.from_pretrained, {path!r})
print(json.dumps({{"outcome": events[-1].outcome, "defined": defined, "compiled": compiled,
                  "imported": sorted(set(sys.modules) - before)}}))
"""


@pytest.mark.slow
def test_a_first_warm_hit_imports_only_the_hit_path(daemon: Client, tiny_unet_dir: Path) -> None:
    """Note [A first call's imports]: the store-only modules stay out, and no module on the way
    defines a dataclass (~0.4 ms each, paid by every fresh process's first load) or anything else
    that compiles source as the module runs (a ``TypedDict``'s annotations, a namedtuple)."""
    run_py(LOAD_UNET.format(path=str(tiny_unet_dir)))  # cold: stores
    first = last_json(run_py(FIRST_HIT.format(path=str(tiny_unet_dir))))
    assert first["outcome"] == "warm"
    ours = [m for m in first["imported"] if m.startswith("overmind_lab")]
    assert "overmind_lab._loading.load" in ours  # the spy saw the machinery's import
    for store_only in ("_loading.sources", "_loading.background", "_native"):
        assert f"overmind_lab.{store_only}" not in ours
    assert [d for d in first["defined"] if d.startswith("overmind_lab")] == []
    assert first["compiled"] == []


@pytest.mark.slow
def test_in_place_write_is_invisible_to_other_processes(daemon: Client,
                                                        tiny_unet_dir: Path) -> None:
    writer = run_py(f"""
        import json, torch, overmind_lab
        from diffusers import UNet2DConditionModel
        unet = overmind_lab.load(UNet2DConditionModel.from_pretrained, {str(tiny_unet_dir)!r})
        with torch.no_grad():
            for p in unet.parameters():
                p.mul_(0).add_(7)
        again = overmind_lab.load(UNet2DConditionModel.from_pretrained, {str(tiny_unet_dir)!r})
        print(json.dumps([float(next(unet.parameters()).flatten()[0]),
                          float(next(again.parameters()).flatten()[0])]))
    """)
    mine, again_in_same_process = last_json(writer)
    assert mine == 7.0
    assert again_in_same_process != 7.0
    other = last_json(run_py(LOAD_UNET.format(path=str(tiny_unet_dir))))
    assert other["outcome"] == "warm"
    assert other["digest"] == plain_digest(tiny_unet_dir)


def test_exception_of_the_original_reaches_the_caller_and_nothing_is_cached(
        daemon: Client) -> None:
    class Boom(Exception):
        pass

    def loader() -> None:
        raise Boom("no such model")

    with pytest.raises(Boom, match="no such model"):
        overmind_lab.load(loader)
    assert daemon.entries() == []
    with pytest.raises(Boom):  # the lease was released: the next caller loads again
        overmind_lab.load(loader)


def make_generator_holder() -> object:
    return {"weights": torch.ones(3), "stream": (i for i in range(3))}


def test_unpicklable_result_is_returned_uncached_with_a_warning(daemon: Client) -> None:
    with pytest.warns(OvermindWarning, match="not cached.*cannot pickle 'generator'"):
        result = overmind_lab.load(make_generator_holder)
    assert torch.equal(result["weights"], torch.ones(3))  # type: ignore[index]
    assert daemon.entries() == []


def make_with_lambda() -> object:
    return {"f": lambda x: x + 1, "t": torch.arange(4)}


def test_lambdas_go_through_dill(daemon: Client) -> None:
    overmind_lab.load(make_with_lambda)
    with overmind_lab.record_loads() as events:
        again = overmind_lab.load(make_with_lambda)
    assert events[-1].outcome == "warm"
    assert again["f"](1) == 2 and torch.equal(again["t"], torch.arange(4))  # type: ignore[index]


@pytest.mark.slow
def test_resaved_model_directory_is_loaded_fresh(daemon: Client, tmp_path: Path) -> None:
    path = save_tiny_unet(tmp_path / "unet", seed=1)
    first = last_json(run_py(LOAD_UNET.format(path=str(path))))
    time.sleep(0.01)
    save_tiny_unet(path, seed=2)  # same names and sizes, new weights and mtimes
    second = last_json(run_py(LOAD_UNET.format(path=str(path))))
    assert second["outcome"] == "cold"
    assert second["digest"] != first["digest"]
    assert second["digest"] == plain_digest(path)
    # Note [Sources let go]: the first entry held the file the re-save replaced; the daemon lets
    # it go within seconds (its key, which names the old inode, could never hit again)
    deadline = time.monotonic() + 120
    while len(daemon.entries()) != 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(daemon.entries()) == 1
    assert daemon.status()["source_gone_entries"] == 1


COUNTED_LOADER = """
import json, os, sys, time, torch, overmind_lab
sys.path.insert(0, {here!r})
from tests.loaders import counted_load
with overmind_lab.record_loads() as events:
    value = overmind_lab.load(counted_load, {delay!r}, {counter!r})
print(json.dumps({{"outcome": events[-1].outcome, "sum": float(value["w"].sum())}}))
"""


@pytest.mark.slow
def test_four_processes_asking_at_once_call_the_original_once(daemon: Client,
                                                              tmp_path: Path) -> None:
    counter = tmp_path / "calls"
    here = str(Path(__file__).resolve().parent.parent)
    code = textwrap.dedent(COUNTED_LOADER.format(here=here, counter=str(counter), delay=2.0))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd="/") for _ in range(4)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    outcomes = sorted(last_json(subprocess.CompletedProcess([], 0, o, e))["outcome"]
                      for o, e in outs)
    assert outcomes == ["cold", "warm", "warm", "warm"], outs
    assert counter.read_text() == "x"


#: Prepended to a child's code: prints "waiting" once the daemon answers its lookup with
#: ``{wait: true}`` (another process holds the key's lease), so that a test acts on that
#: event instead of sleeping.
ANNOUNCE_WAIT = """
import overmind_lab._loading.client as _client
_recv = _client._recv
def _announcing_recv(chan):
    reply, fds = _recv(chan)
    if reply.get("wait"):
        print("waiting", flush=True)
    return reply, fds
_client._recv = _announcing_recv
"""


def test_waiter_takes_over_when_the_loader_is_killed(daemon: Client, tmp_path: Path) -> None:
    counter = tmp_path / "calls"
    here = str(Path(__file__).resolve().parent.parent)
    # the same call (the same key) in both: the loader is held inside it by a gate that
    # never opens, and holds the lease until the test kills it
    code = textwrap.dedent(COUNTED_LOADER.format(here=here, counter=str(counter), delay=0.0))
    loader = subprocess.Popen([sys.executable, "-c", code], cwd="/",
                              env={**os.environ, LOAD_GATE_ENV: str(tmp_path / "never")},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    waiter = None
    try:
        deadline = time.monotonic() + 120
        while not counter.exists():  # the loader is inside the original function
            assert time.monotonic() < deadline and loader.poll() is None
            time.sleep(0.05)
        waiter = subprocess.Popen([sys.executable, "-c", ANNOUNCE_WAIT + code],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  cwd="/")
        assert waiter.stdout is not None
        # the daemon told it to wait on the loader's lease (an event, not a sleep)
        assert waiter.stdout.readline().strip() == "waiting", waiter.communicate(timeout=120)
        assert loader.poll() is None  # still inside its load
        loader.send_signal(signal.SIGKILL)
        loader.wait()
        out, err = waiter.communicate(timeout=120)
    finally:
        for proc in (loader, waiter):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert waiter.returncode == 0, err
    assert last_json(subprocess.CompletedProcess([], 0, out, err))["outcome"] == "cold"
    assert counter.read_text() == "xx"
    assert len(daemon.entries()) == 1


HOLDER = """
import json, sys, time, torch, overmind_lab
sys.path.insert(0, {here!r})
from tests.loaders import counted_load
overmind_lab.load(counted_load, 0.0, {counter!r})  # a first load returns the loader's object
value = overmind_lab.load(counted_load, 0.0, {counter!r})  # a hit maps the entry: a holder
print("loaded", flush=True)
sys.stdin.readline()          # wait until the test has done its damage
print(json.dumps(float(value["w"].sum())), flush=True)
"""


def start_holder(here: str, counter: Path) -> subprocess.Popen[str]:
    code = textwrap.dedent(HOLDER.format(here=here, counter=str(counter)))
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd="/")
    assert proc.stdout is not None and proc.stdout.readline().strip() == "loaded"
    return proc


def finish_holder(proc: subprocess.Popen[str]) -> float:
    out, _ = proc.communicate("go\n", timeout=60)
    assert proc.returncode == 0
    return float(out.strip().splitlines()[-1])


def test_evicting_a_held_entry_leaves_the_holder_working(daemon: Client,
                                                         tmp_path: Path) -> None:
    here = str(Path(__file__).resolve().parent.parent)
    holder = start_holder(here, tmp_path / "calls")
    [entry] = daemon.entries()
    assert entry["holders"] == [holder.pid]
    assert daemon.evict(entry["key"][:8]) == [entry["key"]]
    assert daemon.entries() == []
    assert daemon.status()["evicted_mapped_bytes"] >= 4096 * 4
    assert finish_holder(holder) == 4096.0 * 3
    deadline = time.monotonic() + 120  # the daemon rescans mappings at most once a second
    while daemon.status()["evicted_mapped_bytes"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert daemon.status()["evicted_mapped_bytes"] == 0


@pytest.mark.slow
def test_killing_the_storer_or_a_holder_loses_nothing(daemon: Client, tmp_path: Path) -> None:
    here = str(Path(__file__).resolve().parent.parent)
    counter = tmp_path / "calls"
    storer = start_holder(here, counter)
    holder = start_holder(here, counter)
    storer.kill()
    storer.communicate()
    assert finish_holder(holder) == 4096.0 * 3
    code = COUNTED_LOADER.format(here=here, counter=str(counter), delay=0.0)
    assert last_json(run_py(code))["outcome"] == "warm"
    assert counter.read_text() == "x"


def test_killing_the_daemon_leaves_holders_working_and_saved_entries_warm(
        daemon: Client, tmp_path: Path) -> None:
    here = str(Path(__file__).resolve().parent.parent)
    counter = tmp_path / "calls"
    holder = start_holder(here, counter)
    deadline = time.monotonic() + 120  # the entry's file is finished and the index saved
    while daemon.status()["unsaved"]:
        assert time.monotonic() < deadline, daemon.status()
        time.sleep(0.05)
    os.kill(daemon.status()["pid"], signal.SIGKILL)
    assert finish_holder(holder) == 4096.0 * 3
    # The next load restarts a daemon (the dead one left a stale socket), says so once,
    # and is warm: the entry was saved on disk (tests/test_disk_cache.py has the rest).
    code = COUNTED_LOADER.format(here=here, counter=str(counter), delay=0.0)
    proc = run_py("import warnings\nwarnings.simplefilter('always')\n" + code)
    assert last_json(proc)["outcome"] == "warm"
    assert counter.read_text() == "x"
    assert proc.stderr.count("OvermindWarning") == 1
    assert "had died; a new one was started" in proc.stderr
    assert daemon.status()["running"]


def test_unreachable_daemon_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    # A socket path whose directory cannot be created: no daemon can ever start there.
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("OVERMIND_LAB_SOCKET", str(blocker / "d.sock"))
    with pytest.warns(OvermindWarning, match="cache is unavailable") as record:
        first = overmind_lab.load(make_with_lambda)
        second = overmind_lab.load(make_with_lambda)
    assert len(record) == 1
    assert first["f"](1) == 2 and second["f"](2) == 3  # type: ignore[index]


def test_component_passed_in_is_the_same_object_and_not_stored_again(
        daemon: Client) -> None:
    from tests.loaders import base_weights, wrap

    base = overmind_lab.load(base_weights)
    assert overmind_lab.key_of(base) is not None
    with overmind_lab.record_loads() as events:
        cold = overmind_lab.load(wrap, base, 1024)
        warm = overmind_lab.load(wrap, base, 1024)
    assert [e.outcome for e in events] == ["cold", "warm"]
    assert cold["component"] is base and warm["component"] is base  # type: ignore[index]
    outer, inner = daemon.entries()  # most recently used first
    assert outer["callable"] == "tests.loaders.wrap"
    assert outer["bytes"] < 64 * 1024  # its own 4 KiB and the stream, not the component
    assert daemon.status()["cached_bytes"] == inner["bytes"] + outer["bytes"]


def test_tensors_of_a_cached_object_are_referenced_not_copied(daemon: Client) -> None:
    from tests.loaders import base_weights, borrow

    overmind_lab.load(base_weights)  # a first load returns the loader's own tensors,
    base = overmind_lab.load(base_weights)  # a hit the entry's mapped ones (provenance)
    whole = overmind_lab.load(borrow, base, 1024)
    outer, inner = daemon.entries()
    assert outer["shared_bytes"] == inner["bytes"] >= 256 * 256 * 4  # the component's segment
    assert outer["bytes"] < 64 * 1024
    assert daemon.status()["cached_bytes"] == inner["bytes"] + outer["bytes"]
    assert torch.equal(whole["weight"], base.weight)  # type: ignore[index]
    # A tensor changed in place is not the cached one any more: its bytes are stored.
    with torch.no_grad():
        base.weight[0, 0] = -1.0
    changed = overmind_lab.load(borrow, base, 2048)
    assert float(changed["weight"].detach()[0, 0]) == -1.0  # type: ignore[index]
    newest = daemon.entries()[0]
    assert newest["shared_bytes"] == 0 and newest["bytes"] > 256 * 256 * 4


def test_tokenizer_round_trip_is_exact(daemon: Client, tmp_path: Path) -> None:
    from transformers import CLIPTokenizer

    from benchmarks.models import build_tokenizer

    build_tokenizer(tmp_path / "tok")
    plain = CLIPTokenizer.from_pretrained(tmp_path / "tok")
    overmind_lab.load(CLIPTokenizer.from_pretrained, str(tmp_path / "tok"))
    with overmind_lab.record_loads() as events:
        warm = overmind_lab.load(CLIPTokenizer.from_pretrained, str(tmp_path / "tok"))
    assert events[-1].outcome == "warm"
    assert warm.backend_tokenizer.to_str() == plain.backend_tokenizer.to_str()
    text = "a photo of an astronaut riding a horse on mars <|endoftext|>"
    assert warm(text).input_ids == plain(text).input_ids


def _mapped_segments() -> int:
    """Mappings of segments: memfds (``overmind-lab:<id>``) or files of the cache dir."""
    cache = os.path.realpath(os.environ["OVERMIND_LAB_CACHE_DIR"]) + "/"
    with open("/proc/self/maps") as f:
        return sum("overmind-lab:" in line or cache in line for line in f)


def test_dropping_a_loaded_object_unmaps_its_segment(daemon: Client) -> None:
    import gc

    from tests.loaders import sized_load

    before = _mapped_segments()
    cold = overmind_lab.load(sized_load, 1 << 20, "unmap")  # the loader's own tensor
    warm = overmind_lab.load(sized_load, 1 << 20, "unmap")
    again = overmind_lab.load(sized_load, 1 << 20, "unmap")
    assert _mapped_segments() == before + 2  # one mapping per hit
    del cold, warm, again
    gc.collect()
    assert _mapped_segments() == before  # memory goes back when the tensors go


class _Cycle:
    def __init__(self) -> None:
        self.me = self


_during: dict[str, int] = {}
_doomed: list[_Cycle] = []


def load_watching_the_collector(name: str) -> dict[str, torch.Tensor]:
    import gc

    _during[name] = gc.get_freeze_count()
    _doomed.clear()  # a cycle made before the load becomes garbage during it
    return {"w": torch.arange(6)}


def test_the_loader_runs_with_older_objects_frozen_and_gives_them_back(daemon: Client) -> None:
    """Note [The collector's schedule]: a collection during a cold load walks the load's own
    objects; after it, the older ones are collected as before (none left frozen)."""
    import gc
    import weakref

    assert gc.get_freeze_count() == 0
    _doomed.append(_Cycle())
    gone = weakref.ref(_doomed[0])
    overmind_lab.load(load_watching_the_collector, "thawed")
    assert _during["thawed"] > 1000  # the interpreter's and pytest's objects, at least
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert gone() is None  # the cycle dropped while frozen was collected after all


def test_a_heap_frozen_by_its_owner_stays_frozen(daemon: Client) -> None:
    """A warm kernel's heap is frozen by its zygote (copy-on-write): a load leaves it so."""
    import gc
    import threading

    # an earlier hit's prefault thread (Note [Pages mapped behind the load]) frees what it held
    # as it ends: frozen objects, had they been frozen here, and the count would move under us
    for thread in threading.enumerate():
        if thread.name == "overmind-lab-prefault":
            thread.join()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        overmind_lab.load(load_watching_the_collector, "kept")
        assert _during["kept"] == frozen
        assert gc.get_freeze_count() >= frozen
    finally:
        gc.unfreeze()
