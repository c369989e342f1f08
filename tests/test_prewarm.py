"""``import overmind_lab``'s start-up thread: Note [The first call's work, earlier] in
``_loading/prewarm.py``. Each case runs in a fresh interpreter, as a user's process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from overmind_lab._loading.prewarm import wanted
from tests.conftest import last_json, run_py

# A fresh process: import the package, wait for its thread, then make a first key and report what
# that key scanned and imported itself.
FIRST_KEY = """
import json, sys
import overmind_lab
from overmind_lab._loading import prewarm
prewarm.wait(60)
from overmind_lab._loading import keys, user_code
scans = (keys._installed_versions, keys._attention_packages, user_code._roots)
misses = [f.cache_info().misses for f in scans]
before = set(sys.modules)
{between}
keys.make_key(json.loads, ("{{}}",), {{}})  # a library function: its module file is looked up
print(json.dumps({{
    "warmed": misses,
    "scanned": [f.cache_info().misses - m for f, m in zip(scans, misses)],
    "imported": sorted(m for m in set(sys.modules) - before if m.startswith("overmind_lab")),
    "diffusers": keys._installed_versions().get("diffusers"),
}}))
"""


def _first_key(between: str = "", env: dict[str, str] | None = None) -> dict[str, object]:
    return last_json(run_py(FIRST_KEY.format(between=between), env=env))  # type: ignore[no-any-return]


def test_the_first_key_finds_its_imports_and_scans_done() -> None:
    out = _first_key()
    assert out["warmed"] == [1, 1, 1]  # the thread scanned once each
    assert out["scanned"] == [0, 0, 0]  # and the first key reused it
    assert out["imported"] == []


def test_without_the_thread_the_first_key_does_the_work() -> None:
    out = _first_key(env={"OVERMIND_LAB_PREWARM": "0"})
    assert out["warmed"] == [0, 0, 0]
    assert out["scanned"] == [1, 1, 1]


def _fake_dist(folder: Path) -> None:
    (folder / "diffusers-99.0.dist-info").mkdir(parents=True)


@pytest.mark.parametrize("how", ["new folder on sys.path", "install into a folder on sys.path"])
def test_an_install_after_the_scan_is_seen_by_the_first_key(tmp_path: Path, how: str) -> None:
    """A package installed between ``import overmind_lab`` and the first load is in that load's
    key, as without the thread: the scans are made again."""
    site = tmp_path / "site"
    site.mkdir()
    if how == "new folder on sys.path":
        between = f"import pathlib; pathlib.Path({str(site)!r}, 'diffusers-99.0.dist-info').mkdir()\n" \
                  f"sys.path.insert(0, {str(site)!r})"
        out = _first_key(between)
    else:  # on the path from the start, empty when the thread scanned
        between = f"import pathlib; pathlib.Path({str(site)!r}, 'diffusers-99.0.dist-info').mkdir()"
        out = _first_key(between, env={"PYTHONPATH": str(site)})
    assert out["diffusers"] == "99.0"


# A finder appended to sys.meta_path between the scans and the first key (transformers' alias
# finder does it as diffusers imports): Note [A finder added since the scans] in ``keys``.
FINDER = """
import importlib.machinery
class Finder:
    def find_spec(self, name, path=None, target=None):
        if name == {finds!r}:
            return importlib.machinery.ModuleSpec(name, None)
        return None
sys.meta_path.append(Finder())
"""


# The folder scans' results, kept (the same objects) or made again (new ones): cache_clear()
# also resets an lru_cache's counts, so the counts cannot tell.
SAME_SCANS = """
kept = (keys._installed_versions(), user_code._roots())
keys.make_key(json.loads, ("{}",), {})
assert keys._installed_versions() is kept[0] and user_code._roots() is kept[1], "made again"
"""


def test_a_finder_added_after_the_scans_keeps_the_folder_scans() -> None:
    _first_key(FINDER.format(finds="no_such_module") + SAME_SCANS)


def test_a_finder_that_finds_an_attention_package_is_seen_by_the_first_key() -> None:
    _first_key(FINDER.format(finds="flash_attn") + "assert 'flash_attn' not in "
               "keys._attention_packages()" + SAME_SCANS +
               "assert 'flash_attn' in keys._attention_packages()")


def test_a_path_change_after_the_scans_makes_them_again(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="made again"):
        _first_key(f"sys.path.append({str(tmp_path)!r})" + SAME_SCANS)


def test_a_scan_before_an_install_is_what_it_was() -> None:
    """The other direction of the test above: nothing changed, nothing rescanned, and the
    version is the installed one."""
    out = _first_key()
    assert out["diffusers"] not in (None, "99.0")


@pytest.mark.parametrize(("argv", "expected"), [
    (["python", "-c", "import overmind_lab"], True),
    (["python", "notebook_script.py"], True),
    (["python", "-m", "ipykernel_launcher", "-f", "x.json"], True),
    (["python", "-X", "importtime", "-m", "ipykernel_launcher"], True),
    (["python", "-m", "overmind_lab", "serve"], False),
    (["python", "-m", "overmind_lab._zygote", "--socket", "s"], False),
    (["python", "-u", "-m", "overmind_lab._launcher", "-f", "x.json"], False),
    (["/venv/bin/python", "/venv/bin/overmind-lab", "serve"], False),
])
def test_our_own_processes_start_no_thread(argv: list[str], expected: bool,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OVERMIND_LAB_PREWARM", raising=False)
    assert wanted(argv) is expected
    monkeypatch.setenv("OVERMIND_LAB_PREWARM", "0")
    assert wanted(argv) is False


# Note [A fork while the thread imports]: forks at drawn moments of the thread's work, each in a
# fresh process. The parent's fork must not wait for the thread nor print anything; each child must
# import what the thread was importing (a hang is a timeout: the child's own alarm), log, and make
# a key whose scans equal a process's that never had the thread.
FORK_AT = """
import json, os, signal, sys, time
import overmind_lab
from overmind_lab._loading import prewarm
import logging  # as torch would, the thread's turn: Note [The thread waits its turn]
prewarm.go()
start = time.perf_counter()
time.sleep({delay})
thread_alive = prewarm._thread is not None and prewarm._thread.is_alive()
pid = os.fork()
if pid == 0:
    signal.alarm(120)
    import logging
    from overmind_lab._loading import keys, load, user_code
    logging.getLogger("probe").warning("child logs")
    info = keys.make_key(json.loads, ("{{}}",), {{}})
    versions = keys._installed_versions()
    sys.stdout.write(json.dumps({{"child": True, "diffusers": versions.get("diffusers"),
                                 "key": bool(info.key)}}) + "\\n")
    sys.stdout.flush()
    os._exit(0)
_, status = os.waitpid(pid, 0)
print(json.dumps({{"status": status, "alive": thread_alive}}))
"""


def test_a_fork_at_any_moment_of_the_thread_prints_nothing_and_children_work() -> None:
    import random

    rng = random.Random(34)
    alive = 0
    plain = run_py("import json, overmind_lab\nfrom overmind_lab._loading import keys\n"
                   "print(json.dumps(keys._installed_versions().get('diffusers')))",
                   env={"OVERMIND_LAB_PREWARM": "0"})
    for seed in range(16):
        delay = 0 if seed < 4 else rng.uniform(0, 0.05)
        proc = run_py(FORK_AT.format(delay=delay))
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        child, parent = (json.loads(line) for line in lines)
        assert parent["status"] == 0, proc
        assert child["key"] and child["diffusers"] == json.loads(plain.stdout.strip())
        assert proc.stderr.strip().splitlines() == ["child logs"], proc.stderr
        alive += parent["alive"]
    assert alive > 0  # some forks did come while the thread worked


def test_the_thread_waits_for_logging_and_its_turn() -> None:
    """Note [The thread waits its turn]: in a process that has not imported ``logging``, the thread
    does nothing however long it waits (``patch_all`` let it go); once another thread imported
    ``logging`` it does its work."""
    proc = run_py("""
        import json, sys, time
        import overmind_lab
        from overmind_lab._loading import prewarm
        overmind_lab.patch_all()
        assert "logging" not in sys.modules
        prewarm._never.acquire(timeout=5 * prewarm.HOLD_SECONDS + 0.2)
        before = "overmind_lab._loading.load" in sys.modules
        import logging
        prewarm._thread.join(60)
        print(json.dumps({"before": before, "after": "overmind_lab._loading.load" in sys.modules,
                          "alive": prewarm._thread.is_alive()}))
    """, env={"OVERMIND_LAB_START_AHEAD": "0"})
    assert last_json(proc) == {"before": False, "after": True, "alive": False}


def test_the_thread_registers_no_fork_hooks_that_pair_before_and_after() -> None:
    """Note [A fork while the thread imports], 1: a module the thread imports must not register a
    ``before`` or ``after_in_parent`` hook (it would be half-run by a fork in the middle)."""
    proc = run_py("""
        import json, os, threading
        regs = []
        real = os.register_at_fork
        def register(**hooks):
            regs.append([threading.current_thread().name, sorted(hooks)])
            return real(**hooks)
        os.register_at_fork = register
        import overmind_lab
        from overmind_lab._loading import prewarm
        prewarm.wait(60)
        print(json.dumps(regs))
    """)
    regs = last_json(proc)
    assert [name for name, hooks in regs if name == "overmind-lab-prewarm"]  # it does register
    assert not [hooks for name, hooks in regs if name == "overmind-lab-prewarm"
                and ("before" in hooks or "after_in_parent" in hooks)], regs


def test_importlib_is_whole_before_the_thread_starts(tmp_path: Path) -> None:
    """Note [A package half imported by another thread]: the thread starts only once
    ``importlib`` and ``importlib.util`` are imported, so the user's imports beside it never see
    ``importlib`` half run. The package is imported as a wheel's would be: a copy on
    ``PYTHONPATH`` with ``-S`` (the editable install's finder imports ``importlib.util`` itself,
    before the package), in an interpreter that has imported neither."""
    import overmind_lab

    shutil.copytree(Path(overmind_lab.__file__).resolve().parent, tmp_path / "overmind_lab",
                    ignore=shutil.ignore_patterns("labextension", "__pycache__", "*.so"))
    code = """
import json, sys, threading
before = [name in sys.modules for name in ("importlib", "importlib.util")]
seen = []
start = threading.Thread.start
def recording(self):
    seen.append([name in sys.modules for name in ("importlib", "importlib.util")])
    return start(self)
threading.Thread.start = recording
import overmind_lab
from overmind_lab._loading import prewarm
prewarm.wait()
print(json.dumps({"file": overmind_lab.__file__, "before": before, "seen": seen}))
"""
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "OVERMIND_LAB_PREWARM": "1"}
    out = subprocess.run([sys.executable, "-S", "-c", code], env=env, cwd="/", check=True,
                         capture_output=True, text=True, timeout=120)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["file"].startswith(str(tmp_path)) and result["before"] == [False, False]
    assert result["seen"] == [[True, True]], result
