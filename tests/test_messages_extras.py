"""A feature whose extra is missing names it, as every entry point does (``_extras.py``):
``patch_all()`` in new venvs without torch, and with torch but neither diffusers nor
transformers.

The venvs are made as ``tests/test_install.py`` makes its bare one (Note [A venv that downloads
nothing]: this interpreter, only the named distributions of this environment), with this
checkout's ``overmind_lab`` beside them instead of a wheel: seconds, no build.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

import overmind_lab
from tests.test_install import _venv

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

PACKAGE = Path(overmind_lab.__file__).resolve().parent
#: What ``pip install overmind-lab`` brings without extras.
BARE = {"dill", "psutil"}


def _with_requirements(name: str, out: set[str]) -> set[str]:
    """``name`` and the distributions it requires (not for extras), as installed here."""
    if name in out:
        return out
    out.add(name)
    for req in importlib.metadata.requires(name) or ():
        if "extra ==" in req:
            continue
        dep = re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0]
        try:
            importlib.metadata.distribution(dep)
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional requirement of this platform or Python
        _with_requirements(dep, out)
    return out


def _venv_with(root: Path, keep: set[str]) -> Path:
    venv = _venv(root, keep)
    (venv / "deps" / "overmind_lab").symlink_to(PACKAGE)
    return venv / "bin" / "python"


def _run(python: Path, code: str, sock: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=sock.parent.parent, env={"PATH": "/usr/bin:/bin",
                                                       "OVERMIND_LAB_SOCKET": str(sock)})


PATCH = """
import overmind_lab
try:
    overmind_lab.patch_all({args})
except overmind_lab.MissingDependency as exc:
    print(type(exc).__name__, exc.name, isinstance(exc, ModuleNotFoundError))
    print(exc)
else:
    print("patched", overmind_lab.is_patched())
"""


def test_patch_all_without_torch_names_the_extra(tmp_path: Path) -> None:
    python = _venv_with(tmp_path / "bare", BARE)
    sock = tmp_path / "run" / "d.sock"
    proc = _run(python, PATCH.format(args=""), sock)
    assert proc.returncode == 0 and proc.stderr == "", proc
    assert proc.stdout.splitlines() == [
        "MissingDependency torch True",
        'overmind_lab.patch_all() needs torch, which is not installed here: '
        'pip install "overmind-lab[torch]"']
    # as a script runs it, uncaught: a nonzero exit whose last line names the extra
    plain = _run(python, "import overmind_lab\novermind_lab.patch_all()\n", sock)
    assert plain.returncode == 1 and plain.stderr.splitlines()[-1].endswith(
        'needs torch, which is not installed here: pip install "overmind-lab[torch]"'), plain
    assert not sock.parent.exists()  # no daemon was started, nothing was made


def test_patch_all_with_torch_alone_names_the_libraries_extras(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    python = _venv_with(tmp_path / "torch", _with_requirements("torch", set(BARE)))
    sock = tmp_path / "run" / "d.sock"
    proc = _run(python, PATCH.format(args=""), sock)
    assert proc.returncode == 0, proc
    assert proc.stdout.splitlines() == [
        "MissingDependency diffusers True",
        "overmind_lab.patch_all() needs diffusers or transformers, neither of which is "
        'installed here: pip install "overmind-lab[diffusers]" or "overmind-lab[transformers]"']
    one = _run(python, PATCH.format(args="diffusers=False"), sock)
    assert one.stdout.splitlines()[-1] == (
        'overmind_lab.patch_all() needs transformers, which is not installed here: '
        'pip install "overmind-lab[transformers]"'), one
    # asked to patch neither library, it needs neither
    none = _run(python, PATCH.format(args="diffusers=False, transformers=False"), sock)
    assert none.stdout.strip() == "patched True", none
    assert not sock.parent.exists()
